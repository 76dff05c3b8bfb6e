"""The CPU forms "im2col" (window gather + named matmul) and "depthwise-named" (named depthwise convolution):
which kernels take them, that their IR holds the named ops IREE's fast CPU paths need, and their results against
the float64 reference."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from iree.compiler import ir
from iree.compiler.dialects import func

from convdsl import policy
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.passes import gemm, lower, lower_to_mlir
from convdsl.passes.explain import describe_plan
from convdsl.passes.ir import tensor_type
from convdsl.passes.plan import plan_kernel
from convdsl.problem import ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

from test_lowering_cpu import draw_window

CPU = Target("cpu", "host")


def conv(op: str, **changes) -> ConvProblem:
    fields = dict(op=op, dims=2, groups=1, batch=2, in_channels=8, out_channels=6, input=(9, 9), filter=(3, 3),
                  stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), layout="NHWGC",
                  weight_layout="GKYXC", dtype="f32", name="k")
    fields.update(changes)
    return ConvProblem(**fields)


def depthwise(op: str = "grad_input", **changes) -> ConvProblem:
    return conv(op, **{"groups": 16, "in_channels": 1, "out_channels": 1, **changes})


def function_text(mlir: str, name: str) -> str:
    start = mlir.index(f"func.func @{name}(")
    end = mlir.find("func.func @", start + 1)
    return mlir[start:] if end < 0 else mlir[start:end]


def check(p: ConvProblem) -> None:
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    inputs = random_inputs(p, seed=1)
    got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
    assert got.shape == p.result_shape
    err = relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))
    assert err <= tolerance(p), f"{p.describe()}: relative error {err:.3e} > {tolerance(p):.0e}"


# --- which form -------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight", "transposed"])
def test_cpu_kernels_with_channels_take_im2col(op):
    assert plan_kernel(conv(op), CPU).form == "im2col"
    assert plan_kernel(conv(op, groups=4), CPU).form == "im2col"


def test_im2col_is_cpu_only_and_leaves_other_kernels_alone():
    for target in (Target("cuda", "sm_80"), Target("rocm", "gfx942")):
        assert not policy.cpu_im2col(conv("grad_input"), target)
        assert not policy.cpu_depthwise_named(depthwise(), target)
    assert plan_kernel(conv("forward", dynamic_batch=True), CPU).form == "implicit-gemm"  # batch = ?
    assert plan_kernel(conv("grad_weight", dynamic_batch=True), CPU).form == "implicit-gemm"
    assert plan_kernel(conv("forward", groups=8, in_channels=2, out_channels=2), CPU).form == "gather"
    assert plan_kernel(conv("forward"), CPU).row_chunks == 1  # row chunks split grad_weight's reduction only
    assert plan_kernel(conv("grad_input", groups=8, in_channels=2, out_channels=2), CPU).form == "gather"
    assert plan_kernel(depthwise("grad_weight"), CPU).form != "im2col"


def test_depthwise_grad_input_takes_the_named_op_in_nhwgc_only():
    assert plan_kernel(depthwise(), CPU).form == "depthwise-named"
    assert plan_kernel(depthwise(layout="GNHWC"), CPU).form != "depthwise-named"


# --- the IR ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, groups, named", [
    ("forward", 1, "linalg.matmul"), ("forward", 4, "linalg.batch_matmul"),
    ("grad_input", 1, "linalg.matmul"), ("grad_input", 4, "linalg.batch_matmul"),
    ("grad_weight", 1, "linalg.matmul"), ("grad_weight", 4, "linalg.batch_matmul"),
])
def test_im2col_ir_is_a_named_matmul_and_parallel_gathers(op, groups, named):
    text = function_text(lower_to_mlir([conv(op, groups=groups, stride=(2, 2))], CPU), "k")
    assert f"{named} " in text
    assert "reduction" not in text  # every generic is a gather or a copy: the GEMM is the named op's


def test_depthwise_ir_is_the_named_depthwise_convolution():
    text = function_text(lower_to_mlir([depthwise(stride=(2, 2))], CPU), "k")
    assert text.count("linalg.depthwise_conv_2d_nhwc_hwc ") == 4  # one per stride phase
    assert "reduction" not in text


# --- results against the float64 reference ----------------------------------------------------------

@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight"])
@pytest.mark.parametrize("layout, weight_layout, groups", [
    ("NHWGC", "GKYXC", 1), ("NHWGC", "GKCYX", 3), ("GNHWC", "GKYXC", 3), ("NGCHW", "GKCYX", 1), ("NGCHW", "GKYXC", 3),
])
@pytest.mark.parametrize("stride", [(1, 1), (2, 1)])
def test_im2col_every_layout(op, layout, weight_layout, groups, stride):
    check(conv(op, layout=layout, weight_layout=weight_layout, groups=groups, stride=stride))


@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight", "transposed"])
@pytest.mark.parametrize("changes", [
    dict(dims=1, input=(11,), filter=(3,), stride=(2,), dilation=(1,), pad_lo=(0,), pad_hi=(1,)),
    dict(dims=3, input=(5, 6, 4), filter=(3, 3, 2), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 0),
         pad_hi=(1, 1, 1)),
    dict(dilation=(2, 2), pad_lo=(2, 1), pad_hi=(0, 2), stride=(2, 2)),
    dict(filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0)),
    dict(filter=(4, 4), stride=(2, 2)),
    dict(dtype="bf16", groups=2),
    dict(epilogue=Epilogue("scale", -1.25), stride=(2, 2)),
])
def test_im2col_shapes_and_dtypes(op, changes):
    check(conv(op, **changes))


@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight"])
@pytest.mark.parametrize("stride", [(1, 1), (2, 2)])
def test_im2col_bilinear_epilogue(op, stride):
    check(conv(op, stride=stride, epilogue=Epilogue("bilinear", 0.5, -0.75)))


@pytest.mark.parametrize("changes", [
    {}, dict(stride=(2, 2)), dict(filter=(7, 7), pad_lo=(3, 3), pad_hi=(3, 3)),
    dict(dilation=(2, 2), pad_lo=(2, 2), pad_hi=(2, 2), stride=(2, 1)),
    dict(dims=1, input=(11,), filter=(3,), stride=(2,), dilation=(1,), pad_lo=(1,), pad_hi=(0,)),
    dict(dims=3, input=(5, 6, 7), filter=(3, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
         pad_hi=(1, 1, 1)),
    dict(dtype="bf16"), dict(epilogue=Epilogue("bilinear", 1.5, -0.5), stride=(2, 2)),
    # phases whose innermost output is widened to 8 (7; stride 2: phases of 5 and 4 -> 8, 4; 3D 5; 1D 7 with
    # dilation)
    dict(input=(6, 7)), dict(input=(9, 9), stride=(2, 2), pad_lo=(1, 0), pad_hi=(0, 1)),
    dict(dims=3, input=(3, 4, 5), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
         pad_hi=(1, 1, 1)),
    dict(dims=1, input=(7,), filter=(3,), stride=(1,), dilation=(2,), pad_lo=(2,), pad_hi=(2,)),
])
def test_depthwise_named_grad_input(changes):
    check(depthwise(**changes))


def test_depthwise_named_grad_input_widens_the_innermost_output():
    # a 7-wide phase of a 3x3 filter computes 8 positions (docs/decisions.md#cpu-depthwise-width), dY's border
    # reaching the extra one; 14 wide, or a 5x5 filter, as they are
    p = depthwise(input=(7, 7))
    text = function_text(lower_to_mlir([p], CPU), "k")
    assert f"tensor<{p.batch}x7x8x{p.groups}xf32>" in text
    assert plan_kernel(p, CPU).dy_pad_hi == (1, 2) and plan_kernel(p, CPU).depthwise_widths == (8,)
    # stride 2: phases 5 and 4 wide (3 taps and fewer), the 5-wide ones computed 8 wide
    strided = plan_kernel(depthwise(input=(9, 9), stride=(2, 2), pad_lo=(1, 0), pad_hi=(0, 1)), CPU)
    assert sorted(strided.depthwise_widths) == [4, 4, 8, 8]
    assert "innermost output computed 8 wide, 7 kept" in describe_plan(plan_kernel(p, CPU))  # convdsl explain
    assert plan_kernel(depthwise(input=(8, 8)), CPU).dy_pad_hi == (1, 1)
    assert plan_kernel(depthwise(input=(14, 14)), CPU).dy_pad_hi == (1, 1)
    assert plan_kernel(depthwise(input=(7, 7), filter=(5, 5), pad_lo=(2, 2), pad_hi=(2, 2)), CPU).dy_pad_hi == (2, 2)
    check(p)
    check(depthwise("transposed", input=(7, 7)))


def test_depthwise_named_transposed():
    check(depthwise("transposed", stride=(2, 2)))


# --- depthwise grad_weight: one named depthwise convolution per image -----------------------------------

def test_depthwise_grad_weight_takes_the_named_op_where_intended():
    for dims, changes in [(1, dict(dims=1, input=(11,), filter=(3,), stride=(1,), dilation=(1,), pad_lo=(1,),
                                   pad_hi=(1,))), (2, {}), (3, dict(dims=3, input=(5, 6, 7), filter=(3, 3, 3),
                                                                    stride=(1, 1, 1), dilation=(1, 1, 1),
                                                                    pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)))]:
        plan = plan_kernel(depthwise("grad_weight", **changes), CPU)
        assert plan.form == "depthwise-named" and plan.split is None and plan.pad_form == "fuse", dims
    # elsewhere the rules are unchanged: other layouts, batch = ?, GPUs, grouped kernels with channels, forward
    assert plan_kernel(depthwise("grad_weight", layout="GNHWC"), CPU).form == "gather"
    assert plan_kernel(depthwise("grad_weight", layout="NGCHW"), CPU).form == "gather"
    assert plan_kernel(depthwise("grad_weight", dynamic_batch=True), CPU).form != "depthwise-named"
    for target in (Target("cuda", "sm_80"), Target("rocm", "gfx942")):
        assert not policy.cpu_depthwise_named(depthwise("grad_weight"), target)
    assert plan_kernel(conv("grad_weight", groups=4), CPU).form == "im2col"
    assert plan_kernel(depthwise("forward"), CPU).form == "depthwise"
    # only this form pads with a fused tensor.pad on the CPU
    assert plan_kernel(depthwise("grad_input"), CPU).pad_form == "insert"
    assert plan_kernel(conv("grad_weight"), CPU).pad_form == "insert"


def test_depthwise_grad_weight_ir_is_one_named_convolution_per_image():
    text = function_text(lower_to_mlir([depthwise("grad_weight", batch=3, stride=(2, 2))], CPU), "k")
    assert text.count("linalg.depthwise_conv_2d_nhwc_hwc ") == 3  # batch 3: unrolled
    assert "tensor.pad" in text and "reduction" not in text and "scf.for" not in text
    # up to UNROLLED_MOST_IMAGES images unrolled; past it, a loop over steps of IMAGES_PER_STEP images, then the rest
    most = lower.UNROLLED_MOST_IMAGES
    text = function_text(lower_to_mlir([depthwise("grad_weight", batch=most)], CPU), "k")
    assert "scf.for" not in text and text.count("linalg.depthwise_conv_2d_nhwc_hwc ") == most
    step = lower.IMAGES_PER_STEP
    text = function_text(lower_to_mlir([depthwise("grad_weight", batch=most + 2)], CPU), "k")
    assert "scf.for" in text
    assert text.count("linalg.depthwise_conv_2d_nhwc_hwc ") == step + (most + 2) % step


def test_a_module_failing_with_fused_borders_is_compiled_again_without(monkeypatch, caplog):
    from iree.compiler.tools import CompilerToolError
    from convdsl.backends.iree import FUSE_PAD_FLAG
    import iree.compiler as ireec

    seen = []

    def compile_str(mlir, extra_args):
        seen.append(list(extra_args))
        if FUSE_PAD_FLAG in extra_args:
            raise CompilerToolError(subprocess.CompletedProcess(["iree-compile"], 1, b"", b"error: failed"))
        return b"vmfb"

    monkeypatch.setattr(ireec, "compile_str", compile_str)
    with caplog.at_level("WARNING", logger="convdsl.iree"):
        assert compile_mlir(lower_to_mlir([depthwise("grad_weight")], CPU), CPU) == b"vmfb"
    assert [FUSE_PAD_FLAG in flags for flags in seen] == [True, False]
    assert "compiled again with them as copies of their own" in caplog.text


def test_cpu_module_with_tensor_pad_gets_the_fuse_flag(monkeypatch):
    from convdsl.backends.iree import FUSE_PAD_FLAG
    import iree.compiler as ireec

    seen = []
    monkeypatch.setattr(ireec, "compile_str", lambda mlir, extra_args: seen.append(list(extra_args)) or b"vmfb")
    compile_mlir(lower_to_mlir([depthwise("grad_weight")], CPU), CPU)
    compile_mlir(lower_to_mlir([conv("grad_weight")], CPU), CPU)
    assert FUSE_PAD_FLAG in seen[0] and FUSE_PAD_FLAG not in seen[1]


_1D = dict(dims=1, input=(13,), filter=(3,), stride=(1,), dilation=(1,), pad_lo=(1,), pad_hi=(1,))
_3D = dict(dims=3, input=(5, 6, 7), filter=(3, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
           pad_hi=(1, 0, 1))


@pytest.mark.parametrize("changes", [
    {}, dict(batch=1), dict(stride=(2, 2)), dict(stride=(2, 1), pad_lo=(0, 2), pad_hi=(1, 0)),
    dict(dilation=(2, 2), pad_lo=(2, 2), pad_hi=(2, 2), stride=(2, 1)),
    dict(filter=(7, 7), pad_lo=(3, 3), pad_hi=(3, 3)), dict(filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0)),
    # innermost taps widened to 8 under a dY 14 or more wide (5 with dilation and stride; 6 in 1D; 5 in 3D)
    dict(filter=(3, 5), dilation=(1, 2), stride=(2, 2), pad_lo=(1, 4), pad_hi=(0, 3), input=(9, 30)),
    dict(_1D, input=(17,), filter=(6,), pad_lo=(2,), pad_hi=(3,)),
    dict(_3D, input=(3, 4, 29), filter=(2, 3, 5), pad_lo=(0, 1, 2), pad_hi=(1, 1, 2)),
    # IREE's CPU codegen fails on this one's fused border (benchmarks/iree-upstream.md): compiled without fusing it
    dict(batch=1, groups=9, input=(3, 2), filter=(1, 3), pad_lo=(0, 0), pad_hi=(0, 1)),
    dict(pad_lo=(0, 0), pad_hi=(0, 0), input=(10, 9)),  # no border; the last input row never read
    dict(batch=9, stride=(2, 2)),  # the loop over steps of images, then the rest
    _1D, dict(_1D, stride=(2,), dilation=(2,), pad_lo=(2,), pad_hi=(0,)), _3D, dict(_3D, batch=1),
    dict(dtype="bf16"), dict(weight_layout="GKCYX", stride=(2, 2)),
    dict(epilogue=Epilogue("bilinear", 1.5, -0.5), stride=(2, 2)), dict(epilogue=Epilogue("scale", -1.25)),
])
def test_depthwise_named_grad_weight(changes):
    p = depthwise("grad_weight", **changes)
    assert plan_kernel(p, CPU).form == "depthwise-named"
    check(p)


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_depthwise_named_grad_weight_index_algebra(data):
    # random 1D/2D depthwise grad_weights (stride, dilation, borders on either side, cropped tails) against the
    # float64 reference: the named op's strides = dilation, dilations = stride and the images' borders
    p = depthwise("grad_weight", batch=data.draw(st.integers(1, 3)), groups=data.draw(st.integers(2, 20)),
                  **draw_window(data, most_taps=7))
    assert plan_kernel(p, CPU).form == "depthwise-named"
    check(p)


def test_depthwise_named_widths_follow_the_measured_rule():
    # IREE's CPU depthwise convolution vectorises a small output width 2 (3-tap filters) or 4 (filters of 14 taps and
    # more) at a time, and ran 3-20x slower where the width was not a multiple of that (docs/decisions.md#cpu-depthwise-width)
    for (width, filter_width), computed in [((7, 28), 8), ((5, 14), 8), ((6, 56), 8), ((8, 28), 8), ((9, 28), 9),
                                            ((3, 56), 3), ((7, 3), 8), ((5, 3), 8), ((6, 3), 6), ((14, 3), 14),
                                            ((7, 5), 7), ((7, 7), 7), ((7, 13), 7)]:
        assert policy.cpu_depthwise_width(width, filter_width) == computed, (width, filter_width)


def test_depthwise_named_grad_weight_widens_7_taps_under_a_wide_dy():
    p = depthwise("grad_weight", input=(14, 16), filter=(7, 7), pad_lo=(3, 3), pad_hi=(3, 3))
    assert plan_kernel(p, CPU).depthwise_taps == 8  # dY is 16 wide
    assert "innermost taps computed 8 wide, 7 kept" in describe_plan(plan_kernel(p, CPU))  # convdsl explain
    text = function_text(lower_to_mlir([p], CPU), "k")
    assert f"tensor<1x7x8x{p.groups}xf32>" in text and f"tensor<1x7x7x{p.groups}xf32>" not in text
    check(p)
    assert plan_kernel(depthwise("grad_weight", filter=(7, 7), pad_lo=(3, 3), pad_hi=(3, 3)), CPU).depthwise_taps == 7
    assert plan_kernel(depthwise("grad_weight"), CPU).depthwise_taps == 3


# --- few channels per group: one depthwise convolution per image and output channel --------------------------

def grouped(**changes) -> ConvProblem:
    return conv("grad_weight", **{"groups": 8, "in_channels": 2, "out_channels": 3, **changes})


def test_few_channel_grad_weight_takes_the_named_op_padded_to_the_fast_channel_count():
    plan = plan_kernel(grouped(), CPU)
    assert plan.form == "depthwise-named" and plan.pad_form == "fuse" and plan.split is None
    assert plan.depthwise_channels == policy.CPU_DEPTHWISE_CHANNELS  # 16 channels and zeros up to it
    wide = plan_kernel(grouped(groups=100), CPU)  # 200 channels: no zeros added
    assert wide.form == "depthwise-named" and wide.depthwise_channels == 200
    assert plan_kernel(depthwise("grad_weight"), CPU).depthwise_channels == 16  # depthwise: as it was
    assert plan_kernel(grouped(**_1D), CPU).depthwise_channels == 16  # padded in 2D only
    # elsewhere the rules are unchanged: other layouts, batch = ?, GPUs, grad_input, more channels per group
    assert plan_kernel(grouped(layout="GNHWC"), CPU).form == "gather"
    assert plan_kernel(grouped(dynamic_batch=True), CPU).form != "depthwise-named"
    assert plan_kernel(conv("grad_input", groups=8, in_channels=2, out_channels=2), CPU).form == "gather"
    assert plan_kernel(grouped(in_channels=4, out_channels=8), CPU).form == "im2col"
    for target in (Target("cuda", "sm_80"), Target("rocm", "gfx942")):
        assert not policy.cpu_depthwise_named(grouped(), target)


def test_few_channel_grad_weight_ir_is_one_convolution_per_image_and_output_channel():
    text = function_text(lower_to_mlir([grouped(batch=3)], CPU), "k")
    assert text.count("linalg.depthwise_conv_2d_nhwc_hwc ") == 3 * 3  # 3 images x K = 3
    assert "x144xf32" in text and "reduction" not in text


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_few_channel_grad_weight_convolves_16_bit_operands_widened_to_f32(dtype):
    # IREE's CPU depthwise convolution ran 2-5x slower on 16-bit operands: X and dY are widened first
    text = function_text(lower_to_mlir([grouped(batch=3, dtype=dtype)], CPU), "k")
    convolutions = [ln for ln in text.splitlines() if "linalg.depthwise_conv_2d_nhwc_hwc " in ln]
    assert len(convolutions) == 9 and "arith.extf" in text
    assert not any(f"x{dtype}" in ln for ln in convolutions)
    # depthwise kernels keep their operands (IREE fuses the widening into the convolution and fails there)
    text = function_text(lower_to_mlir([depthwise("grad_weight", batch=3, dtype=dtype)], CPU), "k")
    assert all(f"x{dtype}" in ln for ln in text.splitlines() if "linalg.depthwise_conv_2d_nhwc_hwc " in ln)


@pytest.mark.parametrize("changes", [
    {}, dict(batch=1), dict(stride=(2, 2)), dict(dilation=(2, 2), pad_lo=(2, 2), pad_hi=(2, 2), stride=(2, 1)),
    dict(stride=(2, 1), pad_lo=(0, 2), pad_hi=(1, 0)), dict(groups=32, in_channels=4, out_channels=4),
    dict(in_channels=1, out_channels=4), dict(in_channels=4, out_channels=1), dict(groups=80),
    dict(batch=9, stride=(2, 2)), _1D, _3D, dict(dtype="bf16"), dict(dtype="f16"), dict(_1D, dtype="f16"),
    dict(_3D, dtype="f16"), dict(weight_layout="GKCYX"),
    dict(epilogue=Epilogue("bilinear", 1.5, -0.5)),
])
def test_few_channel_grad_weight(changes):
    p = grouped(**changes)
    assert plan_kernel(p, CPU).form == "depthwise-named"
    check(p)


# --- im2col grad_weight split along its first output dimension (policy.cpu_im2col_row_chunks) --------------

def split_wgrad(**changes) -> ConvProblem:
    # 8 x 6 x 9 = 432 weights over 2 x 64 x 32 = 4096 positions: small against the reduction, so it splits
    return conv("grad_weight", **{"input": (64, 32), **changes})


def test_im2col_grad_weight_splits_where_the_weight_is_small_against_the_reduction():
    p = split_wgrad()
    chunks = policy.cpu_im2col_row_chunks(p)
    assert chunks > 1 and p.output[0] % chunks == 0
    assert (p.output[0] // chunks) * p.output[1] >= policy.CPU_SPLIT_POSITIONS
    assert p.batch * chunks <= policy.CPU_SPLIT_MOST
    assert plan_kernel(p, CPU).row_chunks == chunks
    # a weight as large as the reduction, a dynamic batch: one GEMM over every position
    assert policy.cpu_im2col_row_chunks(split_wgrad(input=(9, 9))) == 1
    assert policy.cpu_im2col_row_chunks(split_wgrad(dynamic_batch=True)) == 1
    text = function_text(lower_to_mlir([p], CPU), p.name)
    assert "linalg.batch_matmul" in text and "linalg.matmul" not in text


@pytest.mark.parametrize("changes", [
    {}, dict(stride=(2, 1), input=(128, 32)), dict(dilation=(2, 2), pad_lo=(2, 0), pad_hi=(1, 2)),
    dict(layout="NGCHW", weight_layout="GKCYX"), dict(layout="GNHWC", groups=2, in_channels=8, out_channels=8),
    dict(dims=1, input=(1024,), filter=(3,), stride=(1,), dilation=(1,), pad_lo=(1,), pad_hi=(1,)),
    dict(dims=3, input=(16, 8, 8), filter=(3, 3, 1), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 0),
         pad_hi=(1, 1, 0)),
    dict(dtype="bf16"), dict(epilogue=Epilogue("scale", -1.25)), dict(epilogue=Epilogue("bilinear", 0.5, -0.75)),
])
def test_im2col_grad_weight_split(changes):
    p = split_wgrad(**changes)
    assert plan_kernel(p, CPU).row_chunks > 1, p.describe()
    check(p)


# --- the window gather as one slice copy per tap (passes/gemm.gather_tap_slices) -----------------------------

def _gather_module(shape, strides, dilations, taps, outputs, split: int, slices: bool) -> tuple[str, list[int]]:
    """A function gathering X[n, o*s + t*d, c] (2D, NHWC) into [n, (h, r) | o0, o1, t0, t1, c], through the slice
    form or the generic one."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        f32 = ir.F32Type.get()
        rows = outputs[0] // split
        positions = (["h", "r"] if split > 1 else ["o0"]) + ["o1"]
        names = ["n", *positions, "t0", "t1", "c"]
        sizes = [shape[0], *([split, rows] if split > 1 else [outputs[0]]), outputs[1], *taps, shape[3]]
        space = gemm.parallel_space(names)
        row = space["h"] * rows + space["r"] if split > 1 else space["o0"]
        exprs = {"n": space["n"], "c": space["c"],
                 "sp0": row * strides[0] + space["t0"] * dilations[0],
                 "sp1": space["o1"] * strides[1] + space["t1"] * dilations[1]}
        with ir.InsertionPoint(module.body):
            @func.FuncOp.from_py_func(tensor_type(shape, f32), name="g")
            def g(x):
                taps_arg = ["t0", "t1"] if slices else ()
                return gemm.gather(x, ["n", "sp0", "sp1", "c"], exprs, space, sizes, taps=taps_arg)
        return str(module), sizes


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_tap_slices_gather_the_window_the_generic_gathers(data):

    """For fixed taps (t0, t1) the gather reads X[n, o0*s0 + t0*d0, o1*s1 + t1*d1, c]: a strided slice from
    (t0*d0, t1*d1) with strides (s0, s1).  The slice form must copy exactly what that index map reads, with the
    first output axis whole or split as h*R + r."""
    strides = [data.draw(st.integers(1, 3)) for _ in range(2)]
    dilations = [data.draw(st.integers(1, 2)) for _ in range(2)]
    taps = [data.draw(st.integers(1, 3)) for _ in range(2)]
    split = data.draw(st.sampled_from([1, 2, 3]))
    outputs = [split * data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))]
    shape = [data.draw(st.integers(1, 2)), *[(o - 1) * s + (t - 1) * d + 1 + data.draw(st.integers(0, 2))
                                            for o, s, t, d in zip(outputs, strides, taps, dilations)],
             data.draw(st.integers(gemm.LEAST_SLICE_RUN, gemm.LEAST_SLICE_RUN + 3))]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = np.empty([shape[0], *outputs, *taps, shape[3]], np.float32)
    for t0 in range(taps[0]):
        for t1 in range(taps[1]):
            rows = slice(t0 * dilations[0], t0 * dilations[0] + (outputs[0] - 1) * strides[0] + 1, strides[0])
            cols = slice(t1 * dilations[1], t1 * dilations[1] + (outputs[1] - 1) * strides[1] + 1, strides[1])
            want[:, :, :, t0, t1, :] = x[:, rows, cols, :]
    text, _ = _gather_module(shape, strides, dilations, taps, outputs, split, slices=True)
    assert "linalg.generic" not in text and text.count("tensor.insert_slice") == taps[0] * taps[1]
    # the generic reads exactly the window (linalg verifies its input against the loops), as the lowering's does
    window = [(o - 1) * s + (t - 1) * d + 1 for o, s, t, d in zip(outputs, strides, taps, dilations)]
    generic_text, _ = _gather_module([shape[0], *window, shape[3]], strides, dilations, taps, outputs, split,
                                     slices=False)
    assert "linalg.generic" in generic_text and "tensor.insert_slice" not in generic_text
    for module_text, source in ((text, x), (generic_text, np.ascontiguousarray(x[:, :window[0], :window[1]]))):
        got = LoadedModule(compile_mlir(module_text, CPU), CPU).call("g", source)
        np.testing.assert_array_equal(got.reshape(want.shape), want)


# channels enough for the slice form on both sides (gemm.LEAST_SLICE_RUN)
WIDE = dict(in_channels=16, out_channels=16)


SLICED = [
    {}, dict(stride=(2, 2)), dict(dilation=(2, 1), pad_lo=(2, 1), pad_hi=(1, 0), stride=(1, 2)),
    dict(weight_layout="GKCYX"), dict(layout="GNHWC", groups=2),
    dict(dims=1, input=(11,), filter=(3,), stride=(2,), dilation=(1,), pad_lo=(1,), pad_hi=(0,)),
    dict(dims=3, input=(5, 6, 4), filter=(3, 3, 2), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 0),
         pad_hi=(1, 1, 1)),
]


# the generic's gathers instead: grad_weight's GKCYX columns (the test below)
def _sliced(op: str, changes: dict) -> bool:
    return not (op == "grad_weight" and "weight_layout" in changes)  # its GKCYX columns end in a tap


@pytest.mark.parametrize("op, changes", [(op, c) for op in ("grad_input", "grad_weight", "transposed") for c in SLICED
                                         if _sliced(op, c)])
def test_im2col_tap_slices(op, changes):
    p = conv(op, **{**WIDE, **changes})
    # slice inserts besides the zero border's one (the count per tap is test_tap_slices_gather_the_window's)
    assert function_text(lower_to_mlir([p], CPU), "k").count("tensor.insert_slice") >= 3, p.describe()
    check(p)


@pytest.mark.parametrize("op", ["grad_input", "grad_weight"])
def test_tap_slices_leave_transposing_gathers_to_the_generic(op):
    # one slice per tap of the 3x3 filter where the window's axes come in the gather's order (and the zero border)
    assert function_text(lower_to_mlir([conv(op, **WIDE)], CPU), "k").count("tensor.insert_slice") == 10
    # channels before the spatial axes (NGCHW), or groups after them while the GEMM wants them first (grouped
    # NHWGC): the window reaches the gather's order only by a transpose, which the generic does; so do channel
    # runs shorter than LEAST_SLICE_RUN
    others = [conv(op, layout="NGCHW", weight_layout="GKYXC", **WIDE), conv(op, groups=3, **WIDE), conv(op)]
    if op == "grad_weight":  # columns (c, taps): the innermost loop is a tap; split into row chunks
        split = conv(op, input=(128, 64), **WIDE)
        assert plan_kernel(split, CPU).row_chunks > 1
        others += [conv(op, weight_layout="GKCYX", **WIDE), split]
    for p in others:
        text = function_text(lower_to_mlir([p], CPU), "k")
        assert text.count("tensor.insert_slice") == 1 and "linalg.generic" in text, p.describe()


def test_tap_slices_take_at_most_their_limit():
    many = conv("grad_weight", filter=(9, 9), pad_lo=(4, 4), pad_hi=(4, 4), input=(12, 12))
    assert 81 > gemm.MOST_TAP_SLICES
    text = function_text(lower_to_mlir([many], CPU), "k")
    assert text.count("tensor.extract_slice") < 81


def test_data_tiling_is_off_only_for_modules_of_window_gathered_forwards_and_grad_inputs():
    on = "--iree-opt-data-tiling"
    assert policy.cpu_data_tiling([conv("grad_weight")], CPU)
    assert policy.cpu_data_tiling([conv("grad_input", filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0))], CPU)  # a matmul
    assert policy.cpu_data_tiling([conv("grad_input"), conv("grad_weight", name="w")], CPU)  # one module, one flag
    assert not policy.cpu_data_tiling([conv("grad_input"), conv("transposed", name="t", stride=(2, 2))], CPU)
    assert not policy.cpu_data_tiling([conv("forward"), conv("grad_input", name="d")], CPU)
    wide = policy.CPU_UNPACKED_MOST_COLUMNS + 1  # a wide weight's GEMM gains more from packing than it costs
    assert policy.cpu_data_tiling([conv("grad_input", in_channels=wide)], CPU)
    # forward's GEMM columns are its K output channels, grad_input's its C input channels
    assert policy.cpu_data_tiling([conv("forward", out_channels=wide)], CPU)
    assert not policy.cpu_data_tiling([conv("forward", in_channels=wide)], CPU)
    assert policy.cpu_data_tiling([conv("forward", filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0))], CPU)
    assert not policy.cpu_data_tiling([conv("grad_input")], Target("cuda", "sm_80"))
    assert on in CPU.compile_flags() and on not in CPU.compile_flags(data_tiling=False)
