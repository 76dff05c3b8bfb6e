"""Compile-only: a representative kernel of every op class for CUDA sm_80, sm_89 (sm_90) and ROCm gfx942, gfx90a and
gfx1100."""
from __future__ import annotations

import pytest

from convdsl.backends.iree import compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem, Epilogue
from convdsl.targets import Target
from convdsl.tuning import Knobs

BASE = ConvProblem(
    op="grad_input", dims=2, groups=2, batch=4, in_channels=16, out_channels=32, input=(14, 14), filter=(3, 3),
    stride=(2, 2), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16", name="k",
)
KERNELS = {
    "grad_input_strided": BASE,
    "grad_input_dilated_3d_bf16": BASE.with_(dims=3, input=(6, 6, 6), filter=(3, 3, 3), stride=(1, 1, 1),
                                              dilation=(2, 2, 2), pad_lo=(2, 2, 2), pad_hi=(2, 2, 2), dtype="bf16",
                                              layout="NGCHW", weight_layout="GKCYX"),
    "transposed": BASE.with_(op="transposed"),
    "grad_weight_split_k": BASE.with_(op="grad_weight", split_k=3, out_dtype="f32"),
    "grad_weight_1d_gnhwc": BASE.with_(op="grad_weight", dims=1, input=(28,), filter=(3,), stride=(1,),
                                       dilation=(1,), pad_lo=(1,), pad_hi=(1,), layout="GNHWC"),
    "grad_weight_fp8": BASE.with_(op="grad_weight", compute=("bf8", "fp8")),
    "grad_weight_bilinear": BASE.with_(op="grad_weight", epilogue=Epilogue("bilinear", 0.5, 2.0), dtype="f32"),
    "forward": BASE.with_(op="forward"),
    "depthwise_grad_input": BASE.with_(groups=16, in_channels=1, out_channels=1),
    "depthwise_grad_weight": BASE.with_(op="grad_weight", groups=16, in_channels=1, out_channels=1),
}
TARGETS = [Target("cuda", "sm_80"), Target("cuda", "sm_89"), Target("rocm", "gfx942"), Target("rocm", "gfx90a"),
           Target("rocm", "gfx1100")]


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_every_op_class_compiles(target):
    problems = [p.with_(name=name) for name, p in KERNELS.items()]
    vmfb = compile_mlir(lower_to_mlir(problems, target), target)
    # the module parses (no device needed for that) and exports one function per kernel
    import iree.runtime as rt

    module = rt.VmModule.copy_buffer(rt.VmInstance(), vmfb)
    assert set(KERNELS) <= set(module.function_names)


def test_fp8_is_native_only_where_iree_lowers_it():
    rocm = lower_to_mlir([KERNELS["grad_weight_fp8"]], Target("rocm", "gfx942"))
    cuda = lower_to_mlir([KERNELS["grad_weight_fp8"]], Target("cuda", "sm_89"))
    assert "f8E5M2FNUZ" in rocm and "f8E4M3FNUZ" in rocm
    assert "f8E" not in cuda and "math.roundeven" in cuda  # emulated: fp8 values held in f16
    for arch in ("gfx90a", "gfx1100"):  # no fp8 MFMA on CDNA2, no fp8 WMMA on RDNA3: emulated too
        rocm = lower_to_mlir([KERNELS["grad_weight_fp8"]], Target("rocm", arch))
        assert "f8E" not in rocm and "math.roundeven" in rocm


def test_sm90_is_described_in_the_module_and_compiles_to_sm90_ptx():
    # IREE 3.13 cannot name sm_90 on the command line; the target goes into the module instead
    target = Target("cuda", "sm_90")
    assert not any(f.startswith("--iree-cuda-target") for f in target.compile_flags())
    forward = KERNELS["forward"].with_(name="forward")
    mlir = lower_to_mlir([forward], target, knobs={"forward": Knobs(extern=False)})  # IREE's own code generation
    vmfb = compile_mlir(mlir, target)
    assert b".target sm_90" in vmfb


@pytest.mark.parametrize("name", ["grad_input_dilated_3d_bf16", "grad_weight_split_k"])
@pytest.mark.parametrize("form", ["fuse", "gather"])
def test_every_pad_form_compiles_for_cuda(name, form):
    p = KERNELS[name].with_(name="k")
    assert compile_mlir(lower_to_mlir([p], TARGETS[0], knobs={"k": Knobs(pad=form)}), TARGETS[0])


def test_auto_compiles_for_the_cuda_device_present(monkeypatch):
    import convdsl.module as module
    from convdsl.module import resolve_target
    from convdsl.targets import arch_for_capability, native_cuda_arch

    # the compute capability decides: Hopper gets sm_90 (wgmma cubins, its tuned tiles), Ada sm_89, Ampere
    # sm_80; older or newer chips get the portable default (newer ones cannot run sm_90a cubins)
    assert [arch_for_capability(*cc) for cc in ((9, 0), (8, 9), (8, 6), (8, 0), (7, 5), (10, 0))] == \
        ["sm_90", "sm_89", "sm_80", "sm_80", None, None]
    monkeypatch.setattr(module, "cuda_available", lambda: True)
    monkeypatch.setattr(module, "native_cuda_arch", lambda: "sm_90")
    assert resolve_target("auto") == Target("cuda", "sm_90")
    assert resolve_target("auto", "sm_89") == Target("cuda", "sm_89")  # an explicit arch wins
    assert resolve_target("cuda") == Target("cuda", "sm_80")  # an explicit backend keeps the portable default
    monkeypatch.setattr(module, "native_cuda_arch", lambda: None)
    assert resolve_target("auto") == Target("cuda", "sm_80")
    monkeypatch.setattr(module, "cuda_available", lambda: False)
    assert resolve_target("auto") == Target("cpu", "host")
    assert native_cuda_arch() in (None, "sm_80", "sm_89", "sm_90")  # here: the machine's own answer


@pytest.mark.parametrize("in_channels, out_channels, crashes", [(8, 8, True), (8, 16, True), (16, 8, False)])
def test_rocm_3d_f32_grad_input_compiles_past_the_buffer_fat_pointer_crash(in_channels, out_channels, crashes, caplog):
    # IREE 3.13's gfx942 code generation crashes in LLVM's AMDGPU buffer fat pointer lowering on these shapes
    # (benchmarks/iree-upstream.md); compile_mlir compiles such a module again with buffer instructions off and says so
    import iree.runtime as rt
    from convdsl.backends.iree import NO_BUFFER_INSTRUCTIONS_FLAG

    p = BASE.with_(dims=3, groups=1, batch=2, in_channels=in_channels, out_channels=out_channels, input=(6, 6, 6),
                   filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1),
                   dtype="f32")
    target = Target("rocm", "gfx942")
    with caplog.at_level("WARNING", logger="convdsl.iree"):
        vmfb = compile_mlir(lower_to_mlir([p], target), target)
    assert "k" in rt.VmModule.copy_buffer(rt.VmInstance(), vmfb).function_names
    assert any(NO_BUFFER_INSTRUCTIONS_FLAG in r.getMessage() for r in caplog.records) == crashes
