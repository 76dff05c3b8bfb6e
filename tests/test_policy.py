"""The planning rules as examples: given a problem on a target, the plan takes this form, these tiles and this
split.  Planning needs no GPU (policy reads the chip's facts off the Target)."""
from __future__ import annotations

import pytest

from convdsl import policy, stream
from convdsl.kernels.compile import triton_version
from convdsl.kernels.elementwise_launches import sum_partials_launch
from convdsl.kernels.launch import reduction_steps
from convdsl.passes.plan import plan_kernel
from convdsl.problem import ConvProblem, Epilogue
from convdsl.targets import CUDA_MAX_GRID, Target, TargetError
from convdsl.tuning.knobs import Knobs

HOPPER = Target("cuda", "sm_90")
AMPERE = Target("cuda", "sm_80")
CPU = Target("cpu", "host")
# the CUDA plans take the Triton kernels only where Triton is installed (else the linalg form, saying so)
needs_triton = pytest.mark.skipif(triton_version() is None, reason="triton is not installed")


# --- the target's facts ------------------------------------------------------------------------------------

def test_cuda_facts_live_on_the_target():
    assert (HOPPER.arch_number, AMPERE.arch_number, Target("cuda", "sm_90a").arch_number) == (90, 80, 90)
    # Hopper's kernels ship as sm_90a cubins; older chips' as PTX 8.0 for the driver to JIT
    assert HOPPER.ptx_version is None and AMPERE.ptx_version == 80 == Target("cuda", "sm_89").ptx_version
    assert HOPPER.has_tma and HOPPER.has_wgmma and not AMPERE.has_tma and not AMPERE.has_wgmma
    assert AMPERE.has_cp_async and not Target("cuda", "sm_75").has_cp_async
    # a newer chip has TMA but not Hopper's wgmma
    assert Target("cuda", "sm_100").has_tma and not Target("cuda", "sm_100").has_wgmma
    assert HOPPER.max_grid == AMPERE.max_grid == CUDA_MAX_GRID == (2**31 - 1, 65535, 65535)
    assert HOPPER.registers == (65536, 255)
    assert HOPPER.tma_im2col_corners(4) == (-128, 127) and HOPPER.tma_most_stride == 8
    assert not (CPU.has_tma or CPU.has_wgmma or CPU.has_cp_async)
    with pytest.raises(TargetError, match="max_grid is a CUDA target's fact; target is cpu:host"):
        CPU.max_grid


def test_the_split_k_sum_spreads_over_the_programs_the_target_says():
    # two per SM of an H100/H200 on every CUDA arch: the sum's constants do not depend on the arch planned for
    assert HOPPER.sum_programs == AMPERE.sum_programs == Target("cuda", "sm_89").sum_programs == 264
    shape = (4, 1, 64, 1, 3, 3, 64)
    for target in (HOPPER, AMPERE):
        assert policy.split_k_sum(RESNET_WGRAD, shape, "k", target) == \
            sum_partials_launch(RESNET_WGRAD, shape, "k", 264)
    # 36864 weights over 264 programs: blocks of 128 columns; over 4096 programs they would be 16 wide
    assert dict(sum_partials_launch(RESNET_WGRAD, shape, "k", 264).constants)["BLOCK_E"] == 128
    assert dict(sum_partials_launch(RESNET_WGRAD, shape, "k", 4096).constants)["BLOCK_E"] == 16
    with pytest.raises(TargetError, match="sum_programs is a CUDA target's fact"):
        CPU.sum_programs


# --- the rules as examples: given a problem on a target, the plan's form, tiles and split -----------------------

def _conv(op: str, **changes) -> ConvProblem:
    fields = dict(op=op, dims=2, groups=1, batch=32, in_channels=64, out_channels=64, input=(56, 56), filter=(3, 3),
                  stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16", name="k")
    fields.update(changes)
    return ConvProblem(**fields)


RESNET_WGRAD = _conv("grad_weight")  # ResNet-50's 64-channel 3x3 at 56x56, batch 32
STRIDED_DGRAD = _conv("grad_input", in_channels=128, out_channels=128, input=(28, 28), stride=(2, 2))
WIDE_FORWARD = _conv("forward", in_channels=256, out_channels=256, input=(14, 14))
DEPTHWISE_WGRAD = _conv("grad_weight", groups=64, in_channels=1, out_channels=1, batch=2, input=(14, 14))
DEPTHWISE_DGRAD = DEPTHWISE_WGRAD.with_(op="grad_input")
FEW_CHANNEL_WGRAD = _conv("grad_weight", groups=16, in_channels=4, out_channels=4, batch=2, input=(14, 14))
F32_WGRAD = _conv("grad_weight", dtype="f32", batch=2, input=(14, 14))


def _module(p: ConvProblem, target: Target) -> tuple[str, str, str, int]:
    """(form, tiles, kernel, split-K partials) of the module's plan (0: no partials)."""
    plan = plan_kernel(p, target, policy.knobs_for(p, target, None))
    ext = plan.extern
    return plan.form, ext.tiles.label(), ext.launches[0].kernel, (ext.partials_shape or (0,))[0]


def _stream(p: ConvProblem, target: Target) -> tuple[str, str, int]:
    """(kernel, tiles with the split it resolved, partials) of the stream path's plan."""
    k = stream.planned_stream_kernel(p, target, policy.knobs_for(p, target, None))
    return k.launches[0].launch.kernel, k.tiles, (k.partials_shape or (0,))[0]


@needs_triton
@pytest.mark.parametrize("p, target, want", [
    # grad_weight: the cp.async GEMM kernel, its split-K filling the SMs' resident slots in whole waves
    (RESNET_WGRAD, HOPPER, ("extern", "t64x64x64w4s4", "grad_weight_partials", 44)),
    (RESNET_WGRAD, AMPERE, ("extern", "t64x64x64w4s4", "grad_weight_partials", 24)),  # fewer SMs, fewer chunks
    (F32_WGRAD, HOPPER, ("extern", "t64x64x32w4s3", "grad_weight_partials", 1)),
    # strided grad_input: every stride phase in one launch; forward on the same kernel
    (STRIDED_DGRAD, HOPPER, ("extern", "t128x128x64w8s3", "grad_input_phases", 0)),
    (WIDE_FORWARD, AMPERE, ("extern", "t128x128x64w8s3", "grad_input_phases", 0)),
    # depthwise: direct sums, grad_weight a segment of dY rows per chunk
    (DEPTHWISE_WGRAD, HOPPER, ("extern", "t8x32x1w1s1", "grad_weight_depthwise_rows", 28)),
    (DEPTHWISE_DGRAD, HOPPER, ("extern", "t32x64x1w1s1", "grad_input_direct", 0)),
    # few channels per group in NHWGC: 8 groups packed per GEMM
    (FEW_CHANNEL_WGRAD, HOPPER, ("extern", "t32x128x64w4s4p8", "grad_weight_partials", 1)),
])
def test_cuda_module_plans(p, target, want):
    assert _module(p, target) == want


@needs_triton
@pytest.mark.parametrize("p, target, want", [
    # Hopper's stream path: the TMA kernels, with their own tiles and split-K (fewer, longer chunks)
    (RESNET_WGRAD, HOPPER, ("grad_weight_tma", "t64x64x128w4s3k28", 28)),
    (WIDE_FORWARD, HOPPER, ("forward_tma", "t128x128x64w4s4", 0)),
    (F32_WGRAD, HOPPER, ("grad_weight_tma", "t64x64x128w4s3k5", 5)),  # f32 as bf16 parts on the 16-bit kernel
    # sm_80: the module's kernels
    (RESNET_WGRAD, AMPERE, ("grad_weight_partials", "t64x64x64w4s4", 24)),
    (WIDE_FORWARD, AMPERE, ("grad_input_phases", "t128x128x64w8s3", 0)),
])
def test_cuda_stream_plans(p, target, want):
    assert _stream(p, target) == want


@pytest.mark.parametrize("p, form, row_chunks", [
    # GEMMs with channels: a window gather and a named matmul; grad_weight's reduction split along output rows
    (RESNET_WGRAD, "im2col", 2),
    (STRIDED_DGRAD, "im2col", 1),
    (F32_WGRAD, "im2col", 1),
    # depthwise and few channels per group in NHWGC: IREE's named depthwise convolution
    (DEPTHWISE_WGRAD, "depthwise-named", 1),
    (DEPTHWISE_DGRAD, "depthwise-named", 1),
    (FEW_CHANNEL_WGRAD, "depthwise-named", 1),
    # few channels per group in GNHWC: the gather form
    (FEW_CHANNEL_WGRAD.with_(layout="GNHWC"), "gather", 1),
])
def test_cpu_plans(p, form, row_chunks):
    plan = plan_kernel(p, CPU)
    assert (plan.form, plan.row_chunks) == (form, row_chunks)


def test_cp_async_gemms_whose_128_tiles_leave_most_sms_idle_take_64_by_64():
    # r2plus1d_18's late layers on the cp.async kernel (N = 8, 7x7 maps, 921 channels): 128 x 128 tiles gave 16 to
    # 56 programs on 132 SMs; 64 x 64 ran 0.44-0.59x the time (docs/decisions.md#layer-fit)
    dgrad = ConvProblem(op="grad_input", dims=3, groups=1, batch=8, in_channels=256, out_channels=921,
                        input=(2, 14, 14), filter=(1, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(0, 1, 1),
                        pad_hi=(0, 1, 1), layout="NHWGC", dtype="bf16", name="k")
    forward = dgrad.with_(op="forward", in_channels=921, out_channels=512, input=(2, 7, 7), filter=(3, 1, 1),
                          stride=(2, 1, 1), pad_lo=(1, 0, 0), pad_hi=(1, 0, 0))
    for p in (dgrad, forward):
        tiles = (policy.default_grad_input_tiles(p, HOPPER) if p.op == "grad_input"
                 else policy.default_forward_tiles(p, HOPPER))
        assert (tiles.block_m, tiles.block_n, tiles.warps) == (64, 64, 4), p.describe()
    # the stride phases count: 4 phases of 7 x 2 tiles are 56 programs; at batch 64 there are enough
    assert policy.default_grad_input_tiles(dgrad.with_(batch=64), HOPPER).block_m == 128
    assert policy.default_forward_tiles(forward.with_(batch=64), HOPPER).block_m == 128


def test_gemms_of_at_most_64_rows_take_64_by_32_tiles():
    # squeeze-excitation's 1x1 convolutions on 1x1 maps (RegNetY, MobileNetV3, EfficientNet at batch 64): 0.66-1.04x
    # the time of the tiles before, 0.90x geomean over the 42 such problems of the 11 models
    # (docs/decisions.md#layer-fit)
    squeeze = ConvProblem(op="forward", dims=2, groups=1, batch=64, in_channels=320, out_channels=80, input=(1, 1),
                          filter=(1, 1), stride=(1, 1), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0),
                          layout="NHWGC", dtype="bf16", name="k")
    for p in (squeeze, squeeze.with_(op="grad_input", in_channels=80, out_channels=320)):
        tiles = (policy.default_grad_input_tiles(p, HOPPER) if p.op == "grad_input"
                 else policy.default_forward_tiles(p, HOPPER))
        assert (tiles.block_m, tiles.block_n, tiles.warps) == (64, 32, 4), p.describe()
    # more rows, or f32: the tiles as before
    assert policy.default_forward_tiles(squeeze.with_(batch=128), HOPPER).block_m == 128
    assert policy.default_forward_tiles(squeeze.with_(dtype="f32"), HOPPER).block_m == 128


def test_depthwise_direct_programs_take_the_channel_block_that_fits():
    # 16-bit depthwise forwards and grad_inputs, blocks measured on the 91 channels-last depthwise layers of the
    # models and the suite (docs/decisions.md#depthwise-channels): 144 channels in blocks of 64 (three one-warp
    # programs a row, not two of two warps with 112 channels masked), 72 in one block of 128, 7-wide filters a
    # channel a thread; 960 keeps 128 (blocks of 64 save a warp in 16 and ran 1.23x the time)
    def tiles(groups: int, width: int = 3, dtype: str = "bf16", op: str = "forward"):
        p = ConvProblem(op=op, dims=2, groups=groups, batch=64, in_channels=1, out_channels=1, input=(56, 56),
                        filter=(width, width), stride=(1, 1), dilation=(1, 1), pad_lo=(width // 2,) * 2,
                        pad_hi=(width // 2,) * 2, layout="NHWGC", dtype=dtype, name="dw")
        tiles = policy.direct_grad_input_tiles(p)
        return tiles.block_n, tiles.warps

    assert tiles(144) == tiles(144, op="grad_input") == tiles(192) == (64, 1)
    assert tiles(72) == tiles(96) == tiles(960) == tiles(384) == (128, 2)
    assert tiles(64) == (64, 1) and tiles(32) == tiles(16) == (32, 1)
    assert tiles(768, width=7) == tiles(96, width=7) == (32, 1) and tiles(960, width=5) == (128, 2)
    # f32: the rule as it was (by channel count only)
    assert tiles(144, dtype="f32") == (128, 2) and tiles(72, dtype="f32") == (64, 1)


def test_grad_weights_summing_few_steps_per_program_take_eight_warps():
    # r2plus1d_18's (3,1,1) grad_weight over 921 channels: 7 reduction steps a program, where 8 warps and 3 stages
    # ran 0.54-0.69x the time of 4 warps and 4 stages; every such grad_weight of the 11 models measured gained, and
    # with more steps some lost (docs/decisions.md#grad-weight-fit)
    short = ConvProblem(op="grad_weight", dims=3, groups=1, batch=8, in_channels=921, out_channels=512,
                        input=(1, 7, 7), filter=(3, 1, 1), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 0, 0),
                        pad_hi=(1, 0, 0), layout="NHWGC", dtype="bf16", name="k")

    def steps_per_program(p, tiles):
        return -(-policy.grad_weight_split(p, tiles, HOPPER)[1] // tiles.block_k)

    tiles = policy.default_grad_weight_tiles(short, HOPPER)
    assert (tiles.block_m, tiles.block_n, tiles.warps, tiles.stages) == (128, 128, 8, 3)
    assert steps_per_program(short, tiles) <= policy.FEW_STEPS_EIGHT_WARPS
    long = short.with_(in_channels=230, out_channels=128, input=(4, 28, 28))
    tiles = policy.default_grad_weight_tiles(long, HOPPER)
    assert (tiles.warps, tiles.stages) == (4, 4) and steps_per_program(long, tiles) > policy.FEW_STEPS_EIGHT_WARPS
    # one tap and f32 keep their tiles
    assert policy.default_grad_weight_tiles(short.with_(filter=(1, 1, 1), pad_lo=(0, 0, 0), pad_hi=(0, 0, 0)),
                                            HOPPER).warps == 4
    assert policy.default_grad_weight_tiles(short.with_(dtype="f32"), HOPPER).block_n == 64


@needs_triton
@pytest.mark.parametrize("p, target, why", [
    (RESNET_WGRAD, Target("cuda", "sm_75"), "sm_80 or newer"),
    (RESNET_WGRAD.with_(dynamic_batch=True), HOPPER, "batch = ?"),
    (RESNET_WGRAD.with_(op="forward", epilogue=Epilogue("bilinear", 1.0, 1.0)), HOPPER, "bilinear"),
])
def test_cuda_kernels_that_keep_the_linalg_form_say_why(p, target, why):
    plan = plan_kernel(p, target)
    assert plan.form != "extern" and why in plan.linalg_reason
    assert why in stream.unsupported_reason(p, target)


# --- overriding a rule (probes plan variants through this, not mock.patch) ----------------------------------

@needs_triton
def test_overrides_replace_a_rule_for_every_planner_and_restore_it():
    assert _module(RESNET_WGRAD, AMPERE)[3] == 24 and stream.plan(RESNET_WGRAD, AMPERE).stream.partials_shape[0] == 24
    with policy.overrides(grad_weight_parts=lambda p, tiles, target: 3):
        # the cached plans of the rule's own split are not served
        assert _module(RESNET_WGRAD, AMPERE)[3] == 3
        assert stream.plan(RESNET_WGRAD, AMPERE).stream.partials_shape[0] == 3
    assert _module(RESNET_WGRAD, AMPERE)[3] == 24 and stream.plan(RESNET_WGRAD, AMPERE).stream.partials_shape[0] == 24
    with policy.overrides(tma_grad_weight_parts=lambda p, tiles, target: 4):
        assert _stream(RESNET_WGRAD, HOPPER) == ("grad_weight_tma", "t64x64x128w4s3k4", 4)
    assert _stream(RESNET_WGRAD, HOPPER)[2] == 28
    with pytest.raises(ValueError, match="expected names of convdsl/policy's rules, got no_such_rule"):
        with policy.overrides(no_such_rule=lambda: 0):
            pass


@needs_triton
def test_overrides_reach_the_rule_in_every_module_that_reads_it():
    # reduction_split is defined in policy/common.py and read by cuda.py's grad_weight_split (the cp.async kernel)
    # and by hopper.py's tma_grad_weight_split (the TMA kernel): one override changes both plans
    def one_chunk(p, tiles, parts, target, kernel="grad_weight kernel"):
        return 1, reduction_steps(p, tiles) * tiles.block_k

    assert _module(RESNET_WGRAD, AMPERE)[3] == 24 and _stream(RESNET_WGRAD, HOPPER)[2] == 28
    with policy.overrides(reduction_split=one_chunk):
        assert policy.cuda.reduction_split is policy.hopper.reduction_split is policy.reduction_split is one_chunk
        assert _module(RESNET_WGRAD, AMPERE)[3] == 1
        assert _stream(RESNET_WGRAD, HOPPER)[2] == 1
    assert policy.hopper.reduction_split is policy.common.reduction_split is not one_chunk
    assert _module(RESNET_WGRAD, AMPERE)[3] == 24 and _stream(RESNET_WGRAD, HOPPER)[2] == 28
    # a rule of cuda.py that hopper.py reads: the TMA plan of a one-pass TF32 grad_input names the weight copy
    # the cp.async kernel would read (weight_copy_axes)
    tf32_dgrad = _conv("grad_input", dtype="f32", compute="tf32")
    assert policy.tma_stream_launch(tf32_dgrad, HOPPER, Knobs()).weight_axes == ("g", "t0", "t1", "c", "k")
    with policy.overrides(weight_copy_axes=lambda p: ("k", "g", "t0", "t1", "c")):
        assert policy.tma_stream_launch(tf32_dgrad, HOPPER, Knobs()).weight_axes == ("k", "g", "t0", "t1", "c")
    assert policy.tma_stream_launch(tf32_dgrad, HOPPER, Knobs()).weight_axes == ("g", "t0", "t1", "c", "k")
