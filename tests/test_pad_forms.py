"""The zero-border forms (plan.PAD_FORMS) and the interleaving of stride phases into dX.

Each form must give the same numbers (checked on llvm-cpu against the float64 reference), emit the IR
it names, and be chosen by the rule measured on an H200 unless the tuning database says otherwise.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from convdsl.backends.iree import FUSE_PAD_FLAG, LoadedModule, compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.passes.ir import MIN_GATHER_ROW
from convdsl.passes.plan import plan_kernel
from convdsl.policy import PAD_FORMS, default_pad_form
from convdsl.problem import ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs, parse_label

CPU = Target("cpu", "host")
CUDA = Target("cuda", "sm_80")


def _problem(op: str, **kw) -> ConvProblem:
    base = dict(name="k", op=op, dims=2, groups=2, batch=2, in_channels=MIN_GATHER_ROW,
                out_channels=MIN_GATHER_ROW,
                input=(9, 8), filter=(3, 2), stride=(2, 1), dilation=(1, 2), pad_lo=(1, 0), pad_hi=(2, 1),
                layout="NHWGC", weight_layout="GKYXC", dtype="f32")
    base.update(kw)
    return ConvProblem(**base)


def _run(p: ConvProblem, form: str) -> float:
    mlir = lower_to_mlir([p], CPU, knobs={p.name: Knobs(pad=form)})
    # the insert form places the argument into zeros (the CPU's window gathers insert slices of their own)
    marker = {"fuse": "tensor.pad", "insert": "tensor.insert_slice %arg"}.get(form)
    assert marker is None or marker in mlir, f"{form}: no {marker} in the IR"
    if form == "gather":
        assert "tensor.pad" not in mlir and "tensor.insert_slice %arg" not in mlir
    module = LoadedModule(compile_mlir(mlir, CPU), CPU)
    inputs = random_inputs(p, seed=3)
    got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
    return relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))


@pytest.mark.parametrize("form", sorted(PAD_FORMS))
@pytest.mark.parametrize("op", ["forward", "grad_input", "transposed", "grad_weight"])
@pytest.mark.parametrize("layout", ["NHWGC", "GNHWC"])
def test_every_pad_form_is_exact(form, op, layout):
    p = _problem(op, layout=layout)
    err = _run(p, form)
    assert err <= tolerance(p), f"{form} {p.describe()}: relative error {err:.3e}"


@pytest.mark.parametrize("form", sorted(PAD_FORMS))
def test_pad_forms_with_a_bilinear_epilogue_and_3d_strides(form):
    p = _problem("grad_input", dims=3, input=(5, 6, 7), filter=(3, 2, 3), stride=(2, 3, 2), dilation=(1, 1, 2),
                 pad_lo=(1, 1, 2), pad_hi=(1, 0, 2), dtype="f16", epilogue=Epilogue("bilinear", 0.5, 1.5))
    err = _run(p, form)
    assert err <= tolerance(p), f"{form} {p.describe()}: relative error {err:.3e}"


def test_each_form_emits_its_ir():
    p = _problem("grad_weight")
    fuse = lower_to_mlir([p], CPU, knobs={"k": Knobs(pad="fuse")})
    gather = lower_to_mlir([p], CPU, knobs={"k": Knobs(pad="gather")})
    insert = lower_to_mlir([p], CPU, knobs={"k": Knobs(pad="insert")})
    assert "tensor.pad" in fuse and "tensor.insert_slice" not in fuse
    assert "tensor.pad" not in gather and "tensor.insert_slice" not in gather and "tensor.extract %" in gather
    assert "tensor.insert_slice" in insert and "tensor.pad" not in insert


def test_gather_falls_back_to_insert_on_a_short_contiguous_axis():
    # 3 channels on the contiguous axis (a ResNet stem) do not vectorise: measured slower than the copy
    p = _problem("grad_weight", in_channels=3)
    assert "tensor.insert_slice" in lower_to_mlir([p], CPU, knobs={"k": Knobs(pad="gather")})


def test_strided_grad_input_has_no_strided_insert_slice():
    # the phases are interleaved by one generic: no insert_slice with a non-unit stride remains
    for op in ("grad_input", "transposed"):
        mlir = lower_to_mlir([_problem(op, stride=(2, 3))], CPU, knobs={"k": Knobs(pad="gather")})
        strided = [m for m in re.findall(r"tensor\.insert_slice[^\n]*\] \[([0-9, ]+)\] :", mlir)
                   if set(m.replace(" ", "").split(",")) != {"1"}]
        assert not strided, strided
        assert "arith.remui" in mlir and "arith.divui" in mlir


def test_default_pad_form_rule():
    f16_dgrad = _problem("grad_input", stride=(1, 1), dtype="f16")
    assert default_pad_form(f16_dgrad, CPU) == "insert"
    assert default_pad_form(f16_dgrad, CUDA) == "fuse"
    assert default_pad_form(_problem("grad_input", stride=(1, 1), dtype="f32"), CUDA) == "gather"
    assert default_pad_form(_problem("grad_input", dtype="f16"), CUDA) == "gather"  # strided
    assert default_pad_form(_problem("grad_weight", dtype="bf16"), CUDA) == "gather"
    assert plan_kernel(f16_dgrad, CUDA, Knobs(extern=False)).pad_form in ("fuse", "gather", "insert")
    assert plan_kernel(f16_dgrad, CUDA, Knobs(pad="insert", extern=False)).pad_form == "insert"
    with pytest.raises(ValueError, match="pad: expected one of"):
        plan_kernel(f16_dgrad, CUDA, Knobs(pad="zeros"))


def test_pad_knob_round_trips_and_keeps_iree_config():
    k = parse_label("n2-m2-wfuse")
    assert k == Knobs(n_scale=2, m_scale=2, pad="fuse") and k.label() == "n2-m2-wfuse"
    assert Knobs(pad="gather").config_default and not Knobs(pad="gather").is_default
    with pytest.raises(ValueError, match="w<insert|gather|fuse>"):
        parse_label("wzeros")


def test_fuse_flag_is_added_only_for_a_gpu_module_with_tensor_pad(monkeypatch):
    seen = []

    def fake_compile_str(mlir, extra_args):
        seen.append(list(extra_args))
        return b"vmfb"

    import iree.compiler as ireec

    p = _problem("grad_weight", dtype="f16")
    fused, gathered = (lower_to_mlir([p], CUDA, knobs={"k": Knobs(pad=form, extern=False)})
                       for form in ("fuse", "gather"))
    monkeypatch.setattr(ireec, "compile_str", fake_compile_str)
    compile_mlir(fused, CUDA)
    compile_mlir(gathered, CUDA)
    assert FUSE_PAD_FLAG in seen[0] and FUSE_PAD_FLAG not in seen[1]
