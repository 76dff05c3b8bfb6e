"""CPU grad_input (and transposed) of non-overlapping windows, stride = filter (issue 45): ConvNeXt's downsampling
layers, Conv2d(384, 768, 2, stride=2) and Conv2d(192, 384, 2, stride=2), whose grad_input in the stride-phase form
(four 1-tap GEMMs, each over a strided slice of W) failed in iree-compile with data tiling ("exceeded stack
allocation limit of 32768 bytes ... Got 197120 bytes").  They now take one matmul over dY and W as they lie and a
depth-to-space transpose (policy.cpu_depth_to_space, passes/lower._grad_input_depth_to_space)."""
from __future__ import annotations

import numpy as np
import pytest

from convdsl import policy
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")


def conv(op: str = "grad_input", **changes) -> ConvProblem:
    fields = dict(op=op, dims=2, groups=1, batch=1, in_channels=384, out_channels=768, input=(4, 4), filter=(2, 2),
                  stride=(2, 2), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0), layout="NHWGC",
                  weight_layout="GKYXC", dtype="f32", name="k")
    fields.update(changes)
    return ConvProblem(**fields)


def check_module(problems: list[ConvProblem], data_tiling: bool = True) -> None:
    module = LoadedModule(compile_mlir(lower_to_mlir(problems, CPU), CPU, data_tiling=data_tiling), CPU)
    for i, p in enumerate(problems):
        inputs = random_inputs(p, seed=i)
        got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
        assert got.shape == p.result_shape
        err = relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))
        assert err <= tolerance(p), f"{p.describe()}: relative error {err:.3e} > {tolerance(p):.0e}"


def test_rule_takes_non_overlapping_windows_only():
    assert policy.cpu_depth_to_space(conv(), CPU)
    assert policy.cpu_depth_to_space(conv("transposed"), CPU)
    assert policy.cpu_depth_to_space(conv(in_channels=32, out_channels=48, filter=(3, 3), stride=(3, 3), input=(9, 9),
                                          pad_lo=(1, 1), pad_hi=(1, 1)), CPU)
    assert not policy.cpu_depth_to_space(conv(filter=(3, 3), pad_lo=(1, 1), pad_hi=(1, 1)), CPU)  # overlapping
    assert not policy.cpu_depth_to_space(conv(filter=(1, 1), stride=(1, 1)), CPU)  # 1x1: already one GEMM
    assert not policy.cpu_depth_to_space(conv(filter=(2, 2), stride=(2, 1)), CPU)
    assert not policy.cpu_depth_to_space(conv("forward"), CPU)
    assert not policy.cpu_depth_to_space(conv("grad_weight"), CPU)
    assert not policy.cpu_depth_to_space(conv(), Target("cuda", "sm_90"))


def test_one_matmul_over_the_weight_as_it_lies():
    mlir = lower_to_mlir([conv()], CPU)
    body = mlir[mlir.index("func.func @k("):mlir.index("func.func @k$into")]
    assert body.count("linalg.matmul") == 1
    assert "tensor.extract %" not in body  # no phase-weight gather, no interleave
    assert "tensor<4x768xf32>, tensor<768x1536xf32>" in body  # dY [(n, q), k] x W [k, (j, c)]


# ConvNeXt's downsampling layers (at batch 1), their ConvTranspose2d twins, both layouts, f32 and bf16, in modules
# compiled with data tiling (as a step with a grad_weight or more than 128 channels is)
ISSUE_45 = [dict(in_channels=384, out_channels=768, input=(4, 4)), dict(in_channels=384, out_channels=768,
            input=(16, 16)), dict(in_channels=192, out_channels=384, input=(8, 8))]


@pytest.mark.parametrize("layout", ["NHWGC", "NGCHW"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_issue_45_problems_compile_and_match_the_reference(layout, dtype):
    weight_layout = "GKYXC" if layout == "NHWGC" else "GKCYX"
    problems = [conv(op, name=f"{op}{i}", layout=layout, weight_layout=weight_layout, dtype=dtype, **shape)
                for i, shape in enumerate(ISSUE_45) for op in ("grad_input", "transposed")]
    assert all(policy.cpu_depth_to_space(p, CPU) for p in problems)
    check_module(problems)


EDGES = [
    dict(in_channels=24, out_channels=40, input=(9, 9), filter=(3, 3), stride=(3, 3), pad_lo=(1, 0), pad_hi=(1, 0)),
    dict(in_channels=24, out_channels=40, input=(7, 8), batch=3),  # a row past the last window: zeros
    dict(in_channels=16, out_channels=24, groups=3, layout="GNHWC", input=(8, 8), pad_lo=(1, 1), pad_hi=(1, 1)),
    dict(in_channels=16, out_channels=24, groups=2, layout="NHWGC", input=(6, 6)),
    dict(in_channels=16, out_channels=24, groups=2, layout="NGCHW", weight_layout="GKCYX", input=(6, 6)),
    dict(in_channels=20, out_channels=12, layout="NGCHW", weight_layout="GKCYX", input=(8, 6), filter=(4, 2),
         stride=(4, 2), dtype="bf16"),
    dict(dims=1, in_channels=24, out_channels=40, input=(9,), filter=(3,), stride=(3,), pad_lo=(0,), pad_hi=(0,),
         dilation=(1,)),
    dict(dims=3, in_channels=16, out_channels=24, input=(4, 4, 4), filter=(2, 2, 2), stride=(2, 2, 2),
         pad_lo=(0, 0, 0), pad_hi=(0, 0, 0), dilation=(1, 1, 1)),
    dict(in_channels=24, out_channels=40, input=(6, 6), epilogue=Epilogue("bilinear", 1.5, -0.5)),
]


@pytest.mark.parametrize("data_tiling", [True, False])
def test_borders_groups_layouts_dims(data_tiling):
    problems = [conv(op, name=f"{op}{i}", **edge)
                for i, edge in enumerate(EDGES) for op in ("grad_input", "transposed")]
    assert all(policy.cpu_depth_to_space(p, CPU) for p in problems)
    check_module(problems, data_tiling)
