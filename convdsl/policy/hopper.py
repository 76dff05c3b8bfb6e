"""Hopper's TMA kernels (sm_90; kernels/tma.py, kernels/halo.py), which the stream runner launches: which kernel
takes a problem (TMA im2col forward, the halo kernel, the strided grad_input's phases, the 16-bit, split and
flat-plane grad_weights) and its tiles, programs, split-K chunks and promoted sums."""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import NamedTuple, Optional

from ..algebra import grad_input_phases
from ..kernels.compile import gluon_tma_im2col
from ..kernels.elementwise_launches import SPLIT_PRODUCTS, pad_planes_launch, round_fp8_launch, split_bf16_launch
from ..kernels.launch import (ELEMENT, ELEMENT_BYTES, Launch, TmaMap, flat_elements, flat_planes,
                              grad_input_phases_tiles, halo_grid, im2col_box, output_tiles, phases_window,
                              reduction_steps)
from ..kernels.tiles import TileConfig, matrix_block
from ..kernels.tma_launches import (forward_halo_launch, forward_tma_launch, grad_input_phases_tma_launch,
                                    grad_weight_flat_tma_launch, grad_weight_tma_launch)
from ..problem import ConvProblem
from ..targets import Target
from ..tuning.knobs import Knobs
from .common import FAST_WEIGHT_LAYOUT, even_chunks, honoured_split, reduction_split
from .cuda import weight_copy_axes


# --- what every TMA kernel needs ------------------------------------------------------------------------

def _tma_common_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """What every TMA kernel needs: Hopper, 16-bit exact products, NHWGC, a fixed batch, the im2col box in range,
    and Gluon's TMA im2col in the installed Triton (which kernels take one tap: each kernel's own rule)."""
    if not (target.has_tma and target.has_wgmma):
        return f"TMA im2col with wgmma is Hopper's (sm_90); target is {target.arch}"
    fp8 = p.op in ("forward", "grad_weight") and p.dtype in ("f16", "bf16") and p.fp8_compute
    if not (p.dtype in ("f16", "bf16") and p.compute is None) and not (p.dtype == "f32" and p.tf32) and not fp8:
        return ("the TMA kernels compute in f16/bf16 with exact products, f32 in one-pass TF32, or forward and "
                "grad_weight in fp8 compute")
    if p.layout != "NHWGC" or p.dynamic_batch:
        return "the TMA kernels read NHWGC activations of a fixed batch"
    lower, upper = im2col_box(p)
    low, high = target.tma_im2col_corners(p.dims + 2)
    if any(not low <= v <= high for v in (*lower, *upper)) or max(p.stride) > target.tma_most_stride:
        return f"padding or stride past TMA im2col's range (corners {low}..{high}, strides up to {target.tma_most_stride})"
    if max(t * d for t, d in zip(p.filter, p.dilation)) >= 2**15:
        return "tap offsets past 16 bits"
    if not gluon_tma_im2col():
        return "the installed Triton has no Gluon TMA im2col copies (Triton 3.9 has)"
    return None


# a wide tile's (two warp groups on 128 x 256) rate of products against 128 x 128's: 1.07 to 1.18 measured (ResNet-50's
# 512-channel 7x7 forward, one wave either way; CK 17's forward, 10 waves against 20; docs/decisions.md#tma-wide)
WIDE_TILE_GAIN = 1.15


def tma_grad_weight_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """128 x 128 where K and C allow, else 64; 64 pixels a step, 4 stages, 4 warps (docs/decisions.md#tma-forward).
    64 x 64 tiles take 128 pixels a step in 3 stages: their long reductions gained 15-30% (#tma-wgrad-3d).
    3D 128 x 128 tiles: two product warp groups and a copy warp of their own (tma_grad_weight_specialised), 4
    stages: CK 11's 3D grad_weight 2.14 -> 1.45 ms (#tma-wgrad-specialised).  3D with 64 channels C and K: 64 x 128
    tiles of two taps (#tma-wgrad-taps).  128 x 256 tiles (two product warp
    groups, specialised, 4 stages) where C is a multiple of 256, so that a tile holds whole C tiles of one tap, and
    their least estimated time, products WIDE_TILE_GAIN faster, beats the 128-column tile's: wav2vec2's 1D
    grad_weight 0.073 -> 0.063 ms, a 3D 256-channel one 0.180 -> 0.167 (#tma-wgrad-specialised)."""
    block_m, block_n = (128 if p.out_channels % 128 == 0 else 64), (128 if p.in_channels % 128 == 0 else 64)
    if block_m == block_n == 64 and p.dims == 3 and p.in_channels == 64:
        # two taps a tile, each dY box shared by both: U-Net's 3D grad_weight 0.270 -> 0.238 ms; in 2D (ResNet-50's
        # 64-channel 3x3) 0.035 -> 0.041 (docs/decisions.md#tma-wgrad-taps)
        return TileConfig(64, 128, 128, warps=4, stages=3)
    if block_m == block_n == 64:
        return TileConfig(64, 64, 128, warps=4, stages=3)
    if block_m == block_n == 128 and p.dims == 3:
        tiles = TileConfig(128, 128, 64, warps=8, stages=4)
    else:
        tiles = TileConfig(block_m, block_n, 64, warps=4, stages=4)
    wide = TileConfig(128, 256, 64, warps=8, stages=4)
    if block_m == 128 and p.in_channels % 256 == 0:
        steps = reduction_steps(p, tiles)
        if (_least_time(p, wide, target, steps, 2, WIDE_TILE_GAIN)[1]
                < _least_time(p, tiles, target, steps, 2, 1.0)[1]):
            return wide
    return tiles


def tma_grad_weight_specialised(tiles: TileConfig) -> bool:
    """Whether the TMA grad_weight issues its copies from a warp of its own: with two product warp groups.  Where
    the product warps issue them, every step's copies wait at a barrier of all the warps for the stage's last
    product (70% of the issue stalls by ncu on CK 11's 3D grad_weight); one warp group loses nothing by it
    (docs/decisions.md#tma-wgrad-specialised)."""
    return tiles.warps == 8


# rows of the reduction wgmma sums before the TMA grad_weight adds them in f32 (promoted sums)
PROMOTED_ROWS = 512
# f32 registers a thread may give each of the two accumulators of promoted sums
PROMOTED_ACCUMULATOR_MOST = 64


def tma_grad_weight_promote(p: ConvProblem, tiles: TileConfig) -> int:
    """Steps wgmma sums at a time before the TMA grad_weight adds them in f32 (0: wgmma's accumulator
    throughout): PROMOTED_ROWS rows of the reduction for f32-accurate splits (exact f32 as bf16x6, compute =
    "bf16x3"), never for one-pass TF32 or 16-bit operands.  wgmma's own long sums drift from f32's: bf16x6 was 15x
    further from cuDNN's f32 result than three-pass TF32 on CK 11's 3D grad_weight, and as close with its runs
    summed in f32, at 1.8x three-pass TF32's speed (docs/decisions.md#promoted-sums)."""
    if p.dtype != "f32" or p.tf32:
        return 0
    return max(1, PROMOTED_ROWS // tiles.block_k)


def promoted_tiles(tiles: TileConfig) -> TileConfig:
    """Tiles whose two accumulators (wgmma's runs and their f32 sum) fit: at most PROMOTED_ACCUMULATOR_MOST
    registers a thread each; wider ones become 128 x 128 over two product warp groups (the 128 x 256 and the
    one-warp-group 128 x 128 tiles, where K and C are multiples of 128)."""
    if tiles.block_m * tiles.block_n // (32 * tiles.warps) <= PROMOTED_ACCUMULATOR_MOST:
        return tiles
    return TileConfig(128, 128, 64, warps=8, stages=4)


def tma_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The TMA grad_weight's split-K chunks S asked for: the problem's split_k, else the tiles' split (a knob), else
    the S of least estimated time, waves x chunk steps of products at the SM's peak plus S f32 partials of the
    weight written and read back at the memory's peak.  Each program stores a [BLOCK_M, BLOCK_N] f32 tile through shared
    memory, so fewer are resident than for the cp.async kernel, and fewer, longer chunks than grad_weight_parts
    gives won: ResNet-50's 512-channel 3x3 at 7x7 0.065 -> 0.041 ms (docs/decisions.md#tma-forward)."""
    return p.split_k or tiles.split or _least_time_parts(p, tiles, target, reduction_steps(p, tiles), 2, 1.0)


def tma_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK positions) of the TMA grad_weight: tma_grad_weight_parts cut into whole reduction steps."""
    return reduction_split(p, tiles, tma_grad_weight_parts(p, tiles, target), target, "TMA grad_weight kernel")


def _least_time_parts(p: ConvProblem, tiles: TileConfig, target: Target, steps: int, element_bytes: int,
                      rate: float) -> int:
    return _least_time(p, tiles, target, steps, element_bytes, rate)[0]


def _least_time(p: ConvProblem, tiles: TileConfig, target: Target, steps: int, element_bytes: int,
                rate: float) -> tuple[int, float]:
    # the split-K chunks S of least estimated time, and that time in seconds.  `rate`: the products' share of
    # the matrix peak (TF32 runs at half the 16-bit rate)
    gpu = target.gpu
    shared = (tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * element_bytes
              + tiles.block_m * tiles.block_n * 4)
    slots = gpu.sm_count * max(1, min(gpu.shared_per_sm // (shared + gpu.shared_reserved_per_block),
                                      gpu.warps_per_sm // tiles.warps))
    tiles_out = output_tiles(p, tiles)
    step_s = 2 * tiles.block_m * tiles.block_n * tiles.block_k / (rate * gpu.matrix_flops / gpu.sm_count)
    partial_s = 2 * 4 * math.prod(p.w_shape) / gpu.memory_bandwidth

    def estimate(s: int) -> float:
        chunk = -(-steps // s)
        chunks = -(-steps // chunk)
        return -(-tiles_out * chunks // slots) * chunk * step_s + chunks * partial_s

    best = min(range(1, min(256, steps) + 1), key=estimate)
    return best, estimate(best)


# --- one-pass TF32 grad_weight on flat planes (kernels/tma.grad_weight_flat_tma) ----------------------

# the copies of X and dY it makes, most bytes (a fraction of an 80 GB GPU's memory)
FLAT_PLANES_MOST_BYTES = 8 << 30


def tma_flat_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """128 x 128 where K and C allow (the rule's case), else 64; a 128-byte row of positions a step (32 of f32,
    128 of fp8), 4 stages, 8 warps: two warp groups measured up to 7% faster than one
    (docs/decisions.md#tf32-flat, #fp8-flat)."""
    return TileConfig(128 if p.out_channels % 128 == 0 else 64, 128 if p.in_channels % 128 == 0 else 64,
                      128 // ELEMENT_BYTES[flat_elements(p)[0]], warps=8, stages=4)


def tma_flat_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The flat kernel's split-K chunks asked for: the problem's split_k, else the tiles', else as
    tma_grad_weight_parts estimates them, over its own steps (images x position blocks) at TF32's rate (half the
    16-bit one) or fp8's (twice)."""
    steps = p.batch * flat_planes(p, tiles.block_k).blocks
    element_bytes = ELEMENT_BYTES[flat_elements(p)[0]]
    return p.split_k or tiles.split or _least_time_parts(p, tiles, target, steps, element_bytes,
                                                         2.0 / element_bytes)


def tma_flat_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK steps) of the flat kernel: tma_flat_grad_weight_parts cut into whole steps (images x position
    blocks)."""
    steps = p.batch * flat_planes(p, tiles.block_k).blocks
    most = target.max_grid[2]  # the chunks are the grid's z
    return honoured_split(p, even_chunks(steps, tma_flat_grad_weight_parts(p, tiles, target), most), most,
                          "flat-plane TMA grad_weight kernel", f"{steps} steps of images x position blocks")


def tma_fp8_promote(p: ConvProblem, tiles: TileConfig) -> int:
    """fp8 on the TMA kernels: the reduction elements whose products wgmma sums in its own accumulator, which
    keeps fewer bits than f32, before they join the f32 sum (0: all of them).  One step's: CK 11's fp8
    grad_weight 4.2e-3 -> 2.2e-4 relative error (the f16 kernel's), for 1-6% more time (docs/decisions.md#fp8-flat)."""
    return tiles.block_k if p.fp8_compute else 0


def tma_flat_grad_weight_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a grad_weight in one-pass TF32 or fp8 compute does not run on the flat-plane TMA kernel (None: it
    does)."""
    if p.op != "grad_weight":
        return "not grad_weight"
    if not (target.has_tma and target.has_wgmma):
        return f"TMA with TF32 or fp8 wgmma is Hopper's (sm_90); target is {target.arch}"
    if not (p.dtype == "f32" and p.tf32 or p.fp8_compute) or p.out_dtype is not None:
        return "the flat-plane kernel is grad_weight in one-pass TF32 (f32) or fp8 compute"
    if any(s != 1 for s in p.stride) or min(p.pad_lo) < 0 or min(p.pad_hi) < 0:
        return "a tap is one shift of the flat positions with stride 1 and no negative padding only"
    if p.dynamic_batch:
        return "the flat-plane kernel is planned for a fixed batch"
    if p.in_channels % 128 or p.out_channels % 128:
        # with 64-channel tiles its copies cost more than they save: ResNet-50's 64-channel 3x3 grad_weight
        # 0.24 -> 0.31 ms, U-Net's 3D one 1.71 -> 1.84 ms on an H100 (docs/decisions.md#tf32-flat)
        return "the flat-plane kernel takes K and C in whole 128-channel tiles"
    if math.prod(p.filter) == 1:
        return "one tap: the positions need no shift, the cp.async kernel reads them as they are"
    tiles = tma_flat_grad_weight_tiles(p)
    planes = flat_planes(p, tiles.block_k)
    copies = ELEMENT_BYTES[flat_elements(p)[0]] * sum(math.prod(pad_planes_launch(p, planes, name, "k")[1])
                                                     for name in ("x", "dy"))
    if copies > FLAT_PLANES_MOST_BYTES:
        return f"its copies of X and dY would take {copies / 2**30:.1f} GiB"
    if max(planes.x_length, planes.dy_length) + max(t * d for t, d in zip(p.filter, p.dilation)) * \
            max(planes.plane[0] * planes.plane[1], 1) >= 2**31:
        return "flat positions past 32 bits"
    if not gluon_tma_im2col():
        return "the installed Triton has no Gluon TMA copies (Triton 3.9 has)"
    return None


# a 16-bit 1x1 grad_weight takes the TMA kernel with more rows (K) than this: with one 128-row tile its tile rule
# splits the reduction many ways on narrow columns and loses to the cp.async kernel's one-tap GEMM, with more it
# wins on long reductions (docs/decisions.md#grad-weight-fit)
TMA_ONE_TAP_LEAST_ROWS = 128


def tma_grad_weight_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why grad_weight does not run on the TMA kernel (None: it does)."""
    if p.op != "grad_weight":
        return "not grad_weight"
    if math.prod(p.filter) == 1 and not (p.groups == 1 and p.dtype in ("bf16", "f16")
                                         and p.out_channels > TMA_ONE_TAP_LEAST_ROWS):
        return (f"one tap with at most {TMA_ONE_TAP_LEAST_ROWS} rows, grouped or not 16-bit: the cp.async kernel's "
                "one-tap GEMM")
    reason = _tma_common_reason(p, target)
    if reason is not None:
        return reason
    if p.dtype == "f32":
        # TF32 wgmma reads K-major operands only, and this kernel's are position-major (tma_flat_grad_weight_reason)
        return "f32 in one-pass TF32: the flat-plane kernel's, or the cp.async kernel's"
    if p.in_channels % 64 or p.out_channels % 64:
        return "the TMA grad_weight's tiles take K and C in whole 64-channel blocks"
    return None


def tma_split_grad_weight(p: ConvProblem, target: Target) -> Optional[tuple[ConvProblem, str]]:
    """An f32 grad_weight as the 16-bit TMA grad_weight over bf16 parts of X and dY stacked along N
    (elementwise_launches.SPLIT_PRODUCTS): one-pass TF32 (compute = "tf32", PyTorch's default) and compute =
    "bf16x3" as three products per product, exact f32 as six (bf16x6, leaving out terms of about 2^-24 of a product,
    f32's own rounding); the stacked problem and the split, or None where the TMA kernel does not take it.  On the
    16-bit kernel with its copy warp it is faster than the TF32 kernels, whose operands TF32 wgmma must read
    K-major: CK 11's 3D TF32 grad_weight 7.39 -> 5.24 ms (cuDNN in TF32 5.56); exact f32 18.9 -> 10.6 ms against
    three-pass TF32, with wgmma's sums added in f32 every run of steps (tma_grad_weight_promote), as close to the
    exact result.  Stride 1 only: the split copies all of X, s^dims times the positions a strided problem's products
    read (ResNet-50's stride-2 3x3 0.158 -> 0.196 ms) (docs/decisions.md#bf16x3-grad-weight-tma, #promoted-sums)."""
    if p.op != "grad_weight" or p.dtype != "f32" or p.dynamic_batch or any(s != 1 for s in p.stride) \
            or not (p.tf32 or p.bf16x3 or p.compute is None) or math.prod(p.filter) == 1:
        return None  # f32 1x1s keep the one-tap GEMM: only 16-bit 1x1s were measured on the TMA kernel
    split = "bf16x6" if p.compute is None else "bf16x3"
    stacked = p.with_(batch=len(SPLIT_PRODUCTS[split]) * p.batch, dtype="bf16", compute=None, out_dtype=None)
    return (stacked, split) if tma_grad_weight_reason(stacked, target) is None else None


def _weight_rows(p: ConvProblem) -> bool:
    """Is the weight a [G*K, taps*C] matrix in memory?  GKYXC is; a 1x1 GKCYX weight is the same memory."""
    return p.weight_layout == FAST_WEIGHT_LAYOUT or math.prod(p.filter) == 1


def tma_forward_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why forward does not run on the TMA im2col kernel (None: it does).  The kernel's descriptors are made at
    call time and passed by value, which the stream runner does and an IREE module's dispatch cannot: modules
    keep the cp.async kernels (docs/decisions.md#tma-forward)."""
    if p.op != "forward" or p.out_dtype is not None:
        return "the TMA kernel computes forward in the input's dtype"
    if math.prod(p.filter) == 1 and (any(s != 1 for s in p.stride) or p.dtype not in ("f16", "bf16")
                                     or p.compute is not None):
        # a stride-1 16-bit 1x1 is a plain GEMM the persistent TMA kernel runs faster than the cp.async one-tap loop
        # (docs/decisions.md#tma-1x1); strided, f32 and fp8 ones were not measured there
        return "one tap, strided or not 16-bit: the cp.async kernel's one-tap loop"
    reason = _tma_common_reason(p, target)
    if reason is not None:
        return reason
    if not _weight_rows(p):
        return "the TMA kernel reads GKYXC weights"
    if p.epilogue.kind != "none":
        return "the TMA kernel has no epilogue"
    tiles = tma_forward_tiles(p, target)
    if p.in_channels % tiles.block_k or p.out_channels % 8:
        return (f"the TMA kernel reads channels in whole {tiles.block_k}-element steps (C a multiple of "
                f"{tiles.block_k}, K of 8)")
    if p.groups > 1 and p.out_channels % tiles.block_n:
        return "with several groups the TMA kernel's column tiles must not cross into the next group"
    return None


def tma_forward_slower(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a forward the TMA kernel can take (tma_forward_reason) runs faster on the cp.async kernel (None: it
    does not): 16 channels a step over several taps, and few output tiles over a long reduction, which the
    cp.async kernel splits (policy.output_split) (docs/decisions.md#tma-forward-fit)."""
    if p.dtype not in ("f16", "bf16") or p.fp8_compute:
        return None
    tiles = tma_forward_tiles(p, target)
    if tiles.block_k == 16 and math.prod(p.filter) > 1:
        return "16 channels a step over several taps: the cp.async kernel's masked 64-channel steps run faster"
    if 2 * _forward_tiles_count(p, tiles) < target.gpu.sm_count \
            and math.prod(p.filter) * -(-p.in_channels // tiles.block_k) >= FEW_TILES_SPLIT_STEPS:
        return "few output tiles over a long reduction: the cp.async kernel's split-K runs faster"
    return None


def _forward_tiles_count(p: ConvProblem, tiles: TileConfig) -> int:
    return -(-p.batch * math.prod(p.output) // tiles.block_m) * -(-p.out_channels // tiles.block_n) * p.groups


# one-pass TF32 forward with at most 64 columns: reduction steps a tile from which 256-row tiles pay
TF32_NARROW_STEPS = 32
# reduction steps (taps x channel steps) from which a forward whose tiles leave more than half the SMs idle runs
# on the cp.async kernel's split-K: 162 steps ran 0.023 ms split against 0.035-0.049 on TMA tiles, 81 steps
# 0.032 against 0.021 (docs/decisions.md#tma-forward-fit)
FEW_TILES_SPLIT_STEPS = 128


def tma_forward_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """128 rows, columns as wide as K up to 128 (a wider tile than K doubles the products for nothing), 128
    bytes of channels a step where C allows (64 of 16-bit, 32 of f32), 4 stages and 4 warps
    (docs/decisions.md#tma-forward, #tf32-flat).  16-bit with K >= 256: 128 x 256 tiles of two warp groups (3
    stages to fit) where the waves they take, each WIDE_TILE_GAIN faster per product, beat 128 x 128's: they
    lose where the wide tiles leave SMs idle (ResNet-50's 512-channel 7x7 layers: 50 tiles on 132 SMs)
    (docs/decisions.md#tma-wide).  16-bit with K <= 64 over C >= 128: 256 x 64 tiles of two warp groups
    (docs/decisions.md#tma-narrow); one-pass TF32 likewise where a tile's reduction takes TF32_NARROW_STEPS steps
    or more (#tf32-grad-input-tma).  16-bit, fitted to the problem (#tma-forward-fit): 256 x 64 where 64-wide
    columns cover 128 < K < 256 with fewer wasted than 128-wide ones, over more than one tap; 64 rows where 128-row
    tiles leave more than half the SMs without one."""
    # 128 bytes of channels a step where C allows; fp8 wgmma takes at least 32 bytes a product
    steps = (32, 16, 8) if p.dtype == "f32" else (128, 64, 32) if p.fp8_compute else (64, 32, 16)
    block_k = next((b for b in steps if p.in_channels % b == 0), steps[-1])
    narrow = TileConfig(128, 64 if p.out_channels <= 64 else 128, block_k, warps=4, stages=4)
    sixteen_bit = p.dtype in ("f16", "bf16") and not p.fp8_compute
    if sixteen_bit and p.groups == 1 and p.out_channels <= 32 and not (block_k == 16 and p.in_channels >= 128):
        # K <= 32 (DenseNet's growth layers): 32-wide columns, not 64 computed for 32; over C >= 128 in steps of 16
        # channels the 256 x 64 tiles below stayed faster (docs/decisions.md#layer-fit)
        narrow = replace(narrow, block_n=32)
    elif sixteen_bit and p.groups == 1 and p.out_channels <= 64 and p.in_channels >= 128:
        # 64 columns over a reduction of 128 channels a tap or more: 256 rows in two warp groups, CK 15's 3D
        # grad_input 12% faster; over 64 channels a tap no change (docs/decisions.md#tma-narrow)
        return replace(narrow, block_m=256, warps=8)
    if p.dtype == "f32" and p.groups == 1 and p.out_channels <= 64 \
            and math.prod(p.filter) * (p.in_channels // block_k) >= TF32_NARROW_STEPS:
        # one-pass TF32, 64 columns over a long reduction: 256 rows in two warp groups, CK 15's and U-Net's 3D
        # grad_inputs (108 and 54 steps) 13% and 9% faster, ResNet-50's 3x3 (18) 4% slower
        # (docs/decisions.md#tf32-grad-input-tma)
        return replace(narrow, block_m=256, warps=8)
    if sixteen_bit and p.groups == 1 and 128 < p.out_channels < 256 and p.out_channels % 128 <= 64 \
            and math.prod(p.filter) > 1:
        # K = 144: 64-wide columns compute 192 where 128-wide ones compute 256; two warp groups of 128 rows
        # (docs/decisions.md#tma-forward-fit)
        narrow = replace(narrow, block_m=256, block_n=64, warps=8)
    if sixteen_bit and narrow.block_m == 128 and 2 * _forward_tiles_count(p, narrow) < target.gpu.sm_count:
        # 128-row tiles leave more than half the SMs without one: 64 rows, twice the tiles
        # (docs/decisions.md#tma-forward-fit)
        return replace(narrow, block_m=64)
    if p.dtype == "f32" or p.out_channels < 256 or (p.groups > 1 and p.out_channels % 256):
        return narrow
    rows = -(-p.batch * math.prod(p.output) // 128) * p.groups
    sms = target.gpu.sm_count

    def waves(columns: int) -> int:
        return -(-rows * -(-p.out_channels // columns) // sms)

    if waves(256) * 2 / WIDE_TILE_GAIN < waves(128):
        return replace(narrow, block_n=256, warps=8, stages=3)
    return narrow


def tma_forward_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    """Shared memory of the persistent TMA forward kernel (kernels/tma.forward_tma_persistent): its ring of
    copies (a window and a weight tile a stage, fp8 compute in fp8), the result tile it stores from, and a
    barrier per stage with room for alignment."""
    operand = 1 if p.fp8_compute else ELEMENT_BYTES[ELEMENT[p.dtype]]
    ring = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * operand
    return ring + tiles.block_m * tiles.block_n * ELEMENT_BYTES[ELEMENT[p.dtype]] + 8 * tiles.stages + 128


def tma_forward_programs(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """Programs of the TMA forward kernel (and of the stride-1 grad_inputs it runs): as many as the SMs hold at
    once (two where two fit their shared memory), each taking tiles in turn, so that a tile's copies are in
    flight while the tile before it finishes and stores; 0 (a program per tile) where the tiles are no more than
    that, and in one-pass TF32, which ran 2-7% slower persistent (docs/decisions.md#tma-persistent)."""
    if p.dtype == "f32":
        return 0
    gpu = target.gpu
    per_sm = min(2, gpu.shared_per_sm // (tma_forward_shared_bytes(p, tiles) + gpu.shared_reserved_per_block))
    programs = gpu.sm_count * max(per_sm, 1)
    count = -(-p.batch * math.prod(p.output) // tiles.block_m) * -(-p.out_channels // tiles.block_n) * p.groups
    return programs if count > programs else 0


def grad_input_as_forward(p: ConvProblem) -> Optional[ConvProblem]:
    """Stride-1 grad_input (and transposed) as a forward convolution over dY, or None where p has a stride.

    dX[n, i, c] = sum over taps t, channels k of dY[n, i + lo - t*d, k] * W[k, t, c]; with t' = F - 1 - t this is
    sum over t', k of dY[n, i - lo' + t'*d, k] * W'[c, t', k], a forward convolution of dY with padding
    lo' = d*(F-1) - lo (hi' likewise), C and K swapped, and the weight flipped along its taps with K innermost:
    W'[g, c, t', k] = W[g, k, F-1-t', c], which the TMA kernel reads from W itself (GKYXC: tap F-1-t' of its
    [G*K, taps*C] matrix; kernels/tma.py's FLIPPED).  Its output size is I."""
    if p.op not in ("grad_input", "transposed") or any(s != 1 for s in p.stride):
        return None
    lo = tuple(d * (f - 1) - v for d, f, v in zip(p.dilation, p.filter, p.pad_lo))
    hi = tuple(d * (f - 1) - v for d, f, v in zip(p.dilation, p.filter, p.pad_hi))
    if min(lo + hi) < 0:  # padding wider than the filter's reach: reads past dY on both sides
        return None
    return p.with_(op="forward", in_channels=p.out_channels, out_channels=p.in_channels, input=p.output, pad_lo=lo,
                   pad_hi=hi, weight_layout=FAST_WEIGHT_LAYOUT)


def phases_forward(p: ConvProblem) -> ConvProblem:
    """The forward of dY the TMA phases kernel runs for a strided grad_input's phases, as the tile and program
    rules see it (tma_launches.grad_input_phases_tma_launch): dY's channels in, dX's out, the most taps of any
    phase over a window of QM positions per dimension (launch.phases_window)."""
    most, lom = phases_window(p)
    phases = grad_input_phases(p)
    taps = tuple(max(ph.dims[i].J for ph in phases) for i in range(p.dims))
    step = tuple(ph.o_step for ph in phases[0].dims)
    hi = tuple(max(0, q - o - lo + d * (j - 1)) for q, o, lo, d, j in zip(most, p.output, lom, step, taps))
    return p.with_(op="forward", in_channels=p.out_channels, out_channels=p.in_channels, input=p.output, filter=taps,
                   stride=(1,) * p.dims, dilation=step, pad_lo=lom, pad_hi=hi, weight_layout=FAST_WEIGHT_LAYOUT)


def tma_grad_input_phases_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a strided grad_input does not run its stride phases on the TMA kernel (kernels/tma.grad_input_phases_tma;
    None: it does).  Measured against the cp.async phases kernel in docs/decisions.md#tma-phases."""
    if p.op not in ("grad_input", "transposed") or all(s == 1 for s in p.stride) or p.out_dtype is not None:
        return "the TMA phases kernel runs strided grad_inputs in the operands' dtype"
    if p.dtype not in ("f16", "bf16") or p.compute is not None:
        return "the TMA phases kernel reads the weight in N-major tiles, which only 16-bit wgmma takes"
    if not _weight_rows(p):
        return "the TMA kernel reads GKYXC weights"
    if p.epilogue.kind != "none":
        return "the TMA kernel has no epilogue"
    phases = grad_input_phases(p)
    if len(phases) < math.prod(p.stride) or any(ph.empty for ph in phases):
        return "a stride phase without taps or positions (the cp.async phases kernel writes its zeros)"
    q = phases_forward(p)
    reason = _tma_common_reason(q, target)
    if reason is not None:
        return reason
    most, lom = phases_window(p)
    low, high = target.tma_im2col_corners(p.dims + 2)
    if any(not low <= v <= high for v in (*(-v for v in lom), *(m - o - v for m, o, v in zip(most, p.output, lom)))):
        return f"the phases' window past TMA im2col's range (corners {low}..{high})"
    tiles = tma_grad_input_phases_tiles(p)
    if p.out_channels % tiles.block_k or p.in_channels % 8:
        return (f"the TMA kernel reads channels in whole {tiles.block_k}-element steps (dY's channels a multiple of "
                f"{tiles.block_k}, dX's of 8)")
    if p.groups > 1 and p.in_channels % tiles.block_n:
        return "with several groups the TMA kernel's column tiles must not cross into the next group"
    programs = tma_grad_input_phases_programs(p, tiles, target)
    if grad_input_phases_tiles(p, tiles) <= programs:
        # what a persistent program gains is the overlap of its tiles; with a tile a program the cp.async kernel's
        # smaller programs ran faster (DCGAN's 4x4 grad_input: docs/decisions.md#tma-phases)
        return f"no more tiles than programs ({programs}): the cp.async phases kernel"
    return None


def tma_grad_input_phases_tiles(p: ConvProblem) -> TileConfig:
    """The TMA phases kernel's tiles: 128 rows x 128 columns in 3 stages, two programs an SM (one program's stores
    overlap the other's products), or 128 x 64 in 4 stages where dX has at most 64 channels (two an SM as well);
    128 bytes of dY's channels a step, 4 warps.  128 x 128 in 4 stages (one program an SM), and the forward's wide
    (128 x 256) and narrow (256 x 64) tiles of two warp groups, ran slower (docs/decisions.md#tma-phases)."""
    block_k = next((b for b in (64, 32, 16) if p.out_channels % b == 0), 16)
    if p.in_channels <= 64:
        return TileConfig(128, 64, block_k, warps=4, stages=4)
    return TileConfig(128, 128, block_k, warps=4, stages=3)


# shared memory the phases kernel's store takes besides its ring: convert_layout's staging of the result tile to
# 16-byte rows a thread, which Triton does in slabs of 8 KiB (sm_90 binaries of 128 x 64 and 128 x 128 tiles)
PHASES_STORE_SCRATCH = 8192


def tma_grad_input_phases_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    """Shared memory of the TMA phases kernel: its ring of copies (a window of dY and a weight tile a stage), the
    store's staging, and a barrier per stage with room for alignment."""
    operand = ELEMENT_BYTES[ELEMENT[p.dtype]]
    ring = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * operand
    return ring + PHASES_STORE_SCRATCH + 8 * tiles.stages + 128


def tma_grad_input_phases_programs(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """Programs of the TMA phases kernel: as many as the SMs hold at once (two where two fit), each taking tiles of
    all the phases in turn."""
    gpu = target.gpu
    per_sm = gpu.shared_per_sm // (tma_grad_input_phases_shared_bytes(p, tiles) + gpu.shared_reserved_per_block)
    return gpu.sm_count * min(2, max(per_sm, 1))


# shared memory the halo kernel may take for its ring of windows and weight tiles (the rest: Triton's scratch)
HALO_SHARED_BYTES = 200 * 1024
# the least share of the halo kernel's sweeps that computes output for it to run (halo_forward_efficiency), where
# the TMA kernel's tiles compute no dead columns (fewer columns of K than its tile: in proportion)
HALO_LEAST_EFFICIENCY = 0.75


def halo_tiles(p: ConvProblem) -> TileConfig:
    """The halo kernel's tiles: 128 rows in two warp groups, columns as wide as K (at least 16, at most 64) for
    each of F0 output planes, a tap's C channels a step; 4 weight stages where they fit beside the windows, else 3
    (docs/decisions.md#halo-grad-input)."""
    tiles = TileConfig(128, matrix_block(p.out_channels, 64), p.in_channels, warps=8, stages=4)
    return tiles if _halo_shared_bytes(p, tiles) <= HALO_SHARED_BYTES else replace(tiles, stages=3)


def _halo_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    # the ring of windows and the three filter planes' rings of weight tiles
    rows = halo_grid(p, tiles.block_m).ring_rows
    return (rows * p.in_channels + tiles.stages * 3 * p.in_channels * tiles.block_n) * ELEMENT_BYTES[ELEMENT[p.dtype]]


def halo_forward_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a stride-1 forward (or a grad_input as one, grad_input_as_forward) does not run on the halo kernel
    (kernels/halo.forward_halo; None: it does)."""
    if p.op != "forward" or p.dims != 3 or p.groups != 1 or p.dtype not in ("f16", "bf16") or p.fp8_compute:
        return "the halo kernel computes 16-bit dense 3D forwards"
    reason = _tma_common_reason(p, target)  # Hopper's wgmma and TMA, NHWGC of a fixed batch, Gluon
    if reason is not None:
        return reason
    if any(s != 1 for s in p.stride) or p.dilation[0] != 1 or p.filter[0] != 3:
        return "the halo kernel sweeps output planes at stride 1 with three filter planes in flight"
    if p.out_channels > 64 or p.out_channels % 8 or p.in_channels not in (16, 32, 64):
        return "the halo kernel takes C of 16, 32 or 64 channels (its window's column blocks) and K up to 64"
    if not _weight_rows(p) or p.epilogue.kind != "none" or p.out_dtype is not None:
        return "the halo kernel reads GKZYXC weights and has no epilogue"
    if _halo_shared_bytes(p, halo_tiles(p)) > HALO_SHARED_BYTES:
        return "the halo kernel's windows do not fit in shared memory"
    if p.batch * math.prod(p.input) * p.in_channels >= 2**31 or p.batch * math.prod(p.output) * p.out_channels >= 2**31:
        return "the halo kernel addresses X and Y with 32-bit offsets"
    efficiency = halo_forward_efficiency(p, target)
    # against the TMA im2col kernel, whose tiles spend their columns' products on K of them; the halo kernel was
    # measured against its tiles of 64 columns or more (its 32-column tiles, #layer-fit, were not measured on 3D)
    least = HALO_LEAST_EFFICIENCY * min(1.0, p.out_channels / max(64, tma_forward_tiles(p, target).block_n))
    if efficiency < least:
        # short sweeps, partial waves or padded rows: the TMA im2col kernel wins (a video layer of 16 planes at
        # 0.66 ran 5% slower on it; docs/decisions.md#halo-grad-input)
        return f"the halo kernel would compute output in {efficiency:.0%} of its sweeps (at least {least:.0%})"
    return None


def _halo_plane_waves(p: ConvProblem, target: Target, split: int) -> int:
    # the halo kernel's time in plane sweeps: waves of programs, each sweeping its range and F0 - 1 planes more
    columns = p.batch * halo_grid(p, halo_tiles(p).block_m).row_tiles
    return -(-columns * split // target.gpu.sm_count) * (-(-p.output[0] // split) + p.filter[0] - 1)


def halo_forward_split(p: ConvProblem, target: Target) -> int:
    """Output-plane ranges per (image, row tile) of the halo kernel: each range sweeps F0 - 1 planes more than it
    has tiles, so the fewest ranges whose programs fill the SMs' waves best."""
    return min(range(1, p.output[0] + 1), key=lambda s: (_halo_plane_waves(p, target, s), s))


def halo_forward_efficiency(p: ConvProblem, target: Target) -> float:
    """The share of the halo kernel's sweeps that computes output: plane sweeps of whole waves against the output
    planes spread over the SMs, times the valid rows of the padded grid's row tiles."""
    block_m = halo_tiles(p).block_m
    grid = halo_grid(p, block_m)
    columns = p.batch * grid.row_tiles
    waves = _halo_plane_waves(p, target, halo_forward_split(p, target))
    rows = p.output[1] * p.output[2] / (grid.row_tiles * block_m)
    return p.output[0] * columns / (waves * target.gpu.sm_count) * rows


class TmaPlan(NamedTuple):
    """A TMA kernel for the stream runner: its launch and maps, whether it reads the weight flipped
    (grad_input_as_forward), grad_weight's partials shape (else ()), the tiles the rule chose (grad_weight's with
    the split-K chunks it resolved), the copies its
    operands are staged through first (per operand in order: the copy's launch and its shape; empty: the operands
    as they come), and the axis order of the weight copy it reads (weight_copy_axes; empty: the weight itself)."""

    launch: Launch
    maps: tuple[TmaMap, ...]
    flipped: bool
    partials: tuple[int, ...]
    tiles: TileConfig
    staging: tuple[tuple[Launch, tuple[int, ...]], ...] = ()
    weight_axes: tuple[str, ...] = ()


def _halo_plan(p: ConvProblem, target: Target, base: str, flipped: bool) -> TmaPlan:
    # a stride-1 forward, or a grad_input as one over the flipped weight, each input plane copied into shared
    # memory once per row tile (docs/decisions.md#halo-grad-input)
    tiles = halo_tiles(p)
    return TmaPlan(*forward_halo_launch(p, tiles, base, halo_forward_split(p, target), flipped=flipped), flipped, (),
                   tiles)


def tma_stream_launch(p: ConvProblem, target: Target, knobs: Knobs) -> Optional[TmaPlan]:
    """The TMA plan of p for the stream runner; None where the kernel keeps its cp.async form (tma_forward_reason,
    tma_forward_slower, tma_grad_input_phases_reason, tma_grad_weight_reason, tma_flat_grad_weight_reason).
    Tiles in the knobs (the tuning database's, or a sweep's) are the cp.async kernel's: the TMA kernels take their
    own rules' tiles, and a sweep of cp.async tiles plans without them (passes/plan.plan_kernel's `tma`)."""
    if knobs.extern is False:
        return None
    base = re.sub(r"\W", "_", p.name)
    if halo_forward_reason(p, target) is None:
        return _halo_plan(p, target, base, flipped=False)
    if tma_forward_reason(p, target) is None and tma_forward_slower(p, target) is None:
        tiles = tma_forward_tiles(p, target)
        # fp8 compute: X and W rounded into fp8 copies first, which the kernel reads with fp8 wgmma
        staging = tuple((round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}", as_fp8=True), shape)
                        for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute))
                        ) if p.fp8_compute else ()
        return TmaPlan(*forward_tma_launch(p, tiles, base, promote=tma_fp8_promote(p, tiles),
                                           programs=tma_forward_programs(p, tiles, target)), False, (), tiles, staging)
    q = grad_input_as_forward(p)
    # f32 and fp8 keep their cp.async grad_input: the flipped weight tiles are N-major, which TF32 and fp8 wgmma
    # cannot read
    if q is not None and _weight_rows(p) and p.dtype != "f32" and not p.fp8_compute \
            and tma_forward_reason(q, target) is None:
        if halo_forward_reason(q, target) is None:
            return _halo_plan(q, target, base, flipped=True)
        if tma_forward_slower(q, target) is None:
            tiles = tma_forward_tiles(q, target)
            programs = tma_forward_programs(q, tiles, target)
            return TmaPlan(*forward_tma_launch(q, tiles, base, flipped=True, programs=programs), True, (), tiles)
    # one-pass TF32 reads B K-major only: the same forward over the weight's K-innermost copy, which the cp.async
    # kernel reads too (weight_copy_axes), its taps taken in reverse: CK 15's 3D grad_input 3.33 -> 3.07 ms (cuDNN
    # 2.76), U-Net's 0.640 -> 0.527 (docs/decisions.md#tf32-grad-input-tma)
    if q is not None and p.tf32 and p.weight_layout == FAST_WEIGHT_LAYOUT and tma_forward_reason(q, target) is None:
        tiles = tma_forward_tiles(q, target)
        return TmaPlan(*forward_tma_launch(q, tiles, base, reversed_copy=True), True, (), tiles,
                       weight_axes=weight_copy_axes(p))
    if tma_grad_input_phases_reason(p, target) is None:
        tiles = tma_grad_input_phases_tiles(p)
        programs = tma_grad_input_phases_programs(p, tiles, target)
        return TmaPlan(*grad_input_phases_tma_launch(p, tiles, base, programs), False, (), tiles)
    split = tma_split_grad_weight(p, target)
    if split is not None:  # X's parts as operand A, dY's as B, one stacked block per product
        stacked, how = split
        tiles = tma_grad_weight_tiles(stacked, target)
        if tma_grad_weight_promote(p, tiles):
            tiles = promoted_tiles(tiles)
        split = tma_grad_weight_split(stacked, tiles, target)
        launch, maps, partials = grad_weight_tma_launch(stacked, tiles, base, split,
                                                        specialised=tma_grad_weight_specialised(tiles),
                                                        promote=tma_grad_weight_promote(p, tiles))
        staging = ((split_bf16_launch(math.prod(p.x_shape), how, 0, f"{base}_0"), stacked.x_shape),
                   (split_bf16_launch(math.prod(p.y_shape), how, 1, f"{base}_1"), stacked.y_shape))
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]), staging)
    if tma_grad_weight_reason(p, target) is None:
        tiles = tma_grad_weight_tiles(p, target)
        split = tma_grad_weight_split(p, tiles, target)
        launch, maps, partials = grad_weight_tma_launch(p, tiles, base, split,
                                                        specialised=tma_grad_weight_specialised(tiles))
        # fp8 compute: X and dY rounded to their fp8 grids in f16 copies, the 16-bit products then exact
        # (docs/decisions.md#fp8-grad-weight-tma)
        staging = tuple((round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}"), shape)
                        for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute))
                        ) if p.fp8_compute else ()
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]), staging)
    if tma_flat_grad_weight_reason(p, target) is None:
        tiles = tma_flat_grad_weight_tiles(p)
        split = tma_flat_grad_weight_split(p, tiles, target)
        launch, maps, partials, planes = grad_weight_flat_tma_launch(p, tiles, base, split, tma_fp8_promote(p, tiles))
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]),
                       tuple(pad_planes_launch(p, planes, name, base) for name in ("x", "dy")))
    return None
