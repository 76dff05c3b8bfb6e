"""A CUDA module's few-channel strided forward (ResNet's stem) runs as the stride-1 forward over X and W regrouped
space-to-depth (passes/lower._space_to_depth, docs/decisions.md#stem-space-to-depth).  The regrouping is checked
on the CPU, where it runs as IREE compiles it: the stride-1 forward of the regrouped operands is the strided
forward of the originals, in float64."""
from __future__ import annotations

import numpy as np
import pytest
from iree.compiler import ir
from iree.compiler.dialects import func

from convdsl import policy
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.compiler import plan
from convdsl.passes.ir import element_type, tensor_type
from convdsl.passes.lower import _space_to_depth
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference
from convdsl.targets import Target

STEM = ConvProblem(op="forward", dims=2, groups=1, batch=2, in_channels=3, out_channels=8, input=(15, 14),
                   filter=(7, 7), stride=(2, 2), dilation=(1, 1), pad_lo=(3, 3), pad_hi=(3, 3), dtype="f16",
                   name="stem")
CASES = {
    "resnet_stem": STEM,
    "gkcyx_uneven_padding": STEM.with_(weight_layout="GKCYX", pad_lo=(3, 2), pad_hi=(1, 3), filter=(7, 5)),
    "1d_stride_4": STEM.with_(dims=1, input=(33,), filter=(9,), stride=(4,), dilation=(1,), pad_lo=(4,),
                              pad_hi=(2,)),
    "3d": STEM.with_(dims=3, input=(5, 9, 8), filter=(3, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1),
                     pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_the_regrouped_stride_1_forward_is_the_strided_forward(name: str):
    p = CASES[name]
    q = policy.space_to_depth_forward(p)
    assert q is not None and all(s == 1 for s in q.stride)
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        elem = element_type(p.dtype)
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("regroup", ([tensor_type(p.x_shape, elem), tensor_type(p.w_shape, elem)],
                                         [tensor_type(q.x_shape, elem), tensor_type(q.w_shape, elem)]))
            with ir.InsertionPoint(fn.add_entry_block()):
                func.ReturnOp(_space_to_depth(p, q, *fn.arguments))
        mlir = str(module)
    cpu = Target("cpu", "host")
    x, w = random_inputs(p, seed=11)
    x_regrouped, w_regrouped = LoadedModule(compile_mlir(mlir, cpu), cpu).module["regroup"](x, w)
    got = reference(q, np.asarray(x_regrouped), np.asarray(w_regrouped))
    np.testing.assert_allclose(got, reference(p, x, w), rtol=1e-12, atol=1e-12)  # the same products, reordered


def test_a_cuda_module_plans_the_stem_regrouped():
    regrouped = plan(STEM.with_(batch=8, input=(224, 224)), Target("cuda", "sm_90"))
    assert regrouped.space_to_depth is not None
    assert regrouped.extern is regrouped.space_to_depth.extern  # the launches compiled are the regrouped forward's
    assert plan(STEM.with_(in_channels=64), Target("cuda", "sm_90")).space_to_depth is None
