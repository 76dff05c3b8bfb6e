"""The Triton GEMM cores on CUDA (sm_80 and newer; kernels/igemm.py): whether a kernel takes them, their tiles,
packed groups, split-K chunks and operand precision, the weight and activation copies around them, and their
launches for IREE modules and the stream runner alike."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace
from typing import Optional, Union

from ..kernels.compile import triton_version
from ..kernels.elementwise_launches import sum_partials_launch
from ..kernels.igemm_launches import (forward_direct_launch, forward_launch, grad_input_direct_launch,
                                      grad_input_launch, grad_weight_depthwise_launch, grad_weight_launch,
                                      output_split_shape)
from ..kernels.launch import (Launch, depthwise_channel_blocks, geometry, output_tiles, packable, packed_sizes, pad3,
                              reduction_steps, tiles_within_images)
from ..kernels.tiles import MATRIX_BLOCK, TileConfig, matrix_block, parse_tiles
from ..problem import ConvProblem, weight_axes
from ..targets import Target
from ..tuning.knobs import Knobs
from .common import FAST_WEIGHT_LAYOUT, even_chunks, gather_applies, honoured_split, reduction_split


def unsupported_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why this kernel keeps the linalg form on this target (None: the Triton GEMM core applies)."""
    if target.backend != "cuda":
        return f"the external kernels are CUDA kernels; target is {target.backend}"
    if not target.has_cp_async:
        return f"the kernels need sm_80 or newer (cp.async, bf16 mma); target is {target.arch}"
    if p.dynamic_batch:
        return "batch = ?: the kernels are specialised to every size"
    if p.epilogue.kind == "bilinear":
        return "the bilinear epilogue's tensor is added by the linalg form"
    if not p.depthwise and gather_applies(p) and default_pack(p) == 1:
        return "few channels per group in a layout whose groups cannot be packed: the gather form is used"
    if triton_version() is None:
        return "triton is not installed"
    # tensors of any size (64-bit offsets where needed: launch.needs_wide), within CUDA's grid limits: the plan
    # itself says, planned once (extern_launches reads the same plan)
    planned = launches_or_reason(p, None, target, None, ())
    return planned if isinstance(planned, str) else None


def extern_choice(problem: ConvProblem, target: Target, knobs: Knobs) -> tuple[bool, Optional[TileConfig], str]:
    """(use, tiles, reason): whether the Triton GEMM cores are used, with which tiles (None: the kernel's
    defaults), else why not.  The rule (unsupported_reason) decides unless the knobs' `extern` says otherwise."""
    reason = unsupported_reason(problem, target) if target.backend == "cuda" else "cpu"
    use = reason is None
    if knobs.extern is not None:
        if knobs.extern and reason is not None:
            raise ValueError(f"extern: kernel {problem.name} cannot use the external kernels: {reason}")
        use = knobs.extern
        if not use:
            reason = "extern = false (tuned or asked for)"
    tiles = parse_tiles(knobs.tiles) if knobs.tiles is not None else None
    return use, tiles, ("" if use else reason or "")


# space-to-depth: the regrouped channels, most (a few-channel strided forward; the stem's 3 x 2 x 2 = 12)
SPACE_TO_DEPTH_MOST_CHANNELS = 16


def space_to_depth_forward(p: ConvProblem) -> Optional[ConvProblem]:
    """A few-channel strided forward (an RGB stem) as a stride-1 forward over X and W regrouped space-to-depth,
    or None where p is not one.

    With stride s per dimension, input position i = o*s + t - lo (dilation 1) splits as t = t'*s + r with
    0 <= r < s: i = (o + t')*s + r - lo.  So X'[n, j, (r, c)] = X[n, j*s + r - lo, c] (0 outside X) and
    W'[k, t', (r, c)] = W[k, t'*s + r, c] (0 for taps past F) give Y[n, o, k] = sum over t', (r, c) of
    X'[n, o + t', (r, c)] * W'[k, t', (r, c)]: a stride-1 convolution with C*s channels, ceil(F/s) taps and
    no padding over an input of O + ceil(F/s) - 1 positions.  ResNet-50's stem (C = 3, 7x7 stride 2) becomes
    12 channels and 4x4 taps, whose reduction steps read 12 contiguous channels a tap instead of 3
    (docs/decisions.md#stem-space-to-depth).  The regrouping is two copies on the stream path
    (kernels/elementwise_launches.space_to_depth_launch)."""
    if (p.op != "forward" or p.groups != 1 or all(s == 1 for s in p.stride) or any(d != 1 for d in p.dilation)
            or p.in_channels * math.prod(p.stride) > SPACE_TO_DEPTH_MOST_CHANNELS or p.layout != "NHWGC"
            or p.dynamic_batch or p.dtype not in ("f16", "bf16") or p.compute is not None
            or p.epilogue.kind != "none"
            or min(p.pad_lo) < 0 or min(p.pad_hi) < 0 or max(p.batch, p.out_channels) > 65535):
        return None
    taps = tuple(-(-f // s) for f, s in zip(p.filter, p.stride))
    return p.with_(in_channels=p.in_channels * math.prod(p.stride), filter=taps,
                   input=tuple(o + t - 1 for o, t in zip(p.output, taps)), stride=(1,) * p.dims,
                   pad_lo=(0,) * p.dims, pad_hi=(0,) * p.dims, weight_layout=FAST_WEIGHT_LAYOUT)


def relayout_ngchw(p: ConvProblem, knobs: Knobs) -> bool:
    """NGCHW with the Triton kernels: run them on NHWGC copies of the activations (the knobs' `relayout` may
    ask for NGCHW read in place through its strides instead).  The copies win: channels strided by D*H*W
    defeat the tiles' vector loads (docs/decisions.md#ngchw-copies)."""
    return knobs.relayout if knobs.relayout is not None else True


def dot_precision(p: ConvProblem) -> str:
    """Triton's dot precision for the GEMM cores (one-pass TF32 where allowed)."""
    # f32: three-pass TF32 on the tensor cores (about f32's accuracy; error measured against the f64
    # reference in the GPU tests); compute = "bf16x3": three bf16 products, as the linalg form does;
    # compute = "tf32": one-pass TF32 (cuDNN's default for f32 convolutions), a third of the products, its
    # operands stored the wrong way for TF32 wgmma rounded in registers (docs/decisions.md#tf32-staged)
    if p.dtype != "f32":
        return "ieee"  # 16-bit operands: exact products, f32 accumulation
    if p.bf16x3:
        return "bf16x3"
    return "tf32" if p.tf32 else "tf32x3"


def default_pack(p: ConvProblem) -> int:
    """Groups per GEMM for grouped kernels with few channels (C or K under 32, depthwise excepted: it has
    its own kernels): enough that the packed C and K reach 32, as far as the group count divides, in layouts
    where consecutive groups' channels are adjacent (packable) (docs/decisions.md#packed-groups)."""
    small = min(p.in_channels, p.out_channels)
    if p.groups == 1 or p.depthwise or small >= 32 or not packable(p):
        return 1
    pack = 1
    while pack * small < 32 and p.groups % (2 * pack) == 0:
        pack *= 2
    return pack


def direct_grad_input(p: ConvProblem) -> bool:
    """Depthwise grad_input: direct sums (docs/decisions.md#depthwise-direct)."""
    return p.op in ("grad_input", "transposed") and p.depthwise


def direct_forward(p: ConvProblem) -> bool:
    """Depthwise forward: direct sums (forward_direct), as depthwise grad_input takes them: one product per tap
    and channel leaves a GEMM's matrix units idle (docs/decisions.md#depthwise-direct)."""
    return p.op == "forward" and p.depthwise


# _dense_16bit_tiles: rows from which 128 x 256 tiles beat 128 x 128 on multi-tap filters, measured on an H100
# (ResNet-50's 3x3 GEMMs at 14x14: 12544 rows, 29 against 35 us; at 7x7: 3136 rows, 52 against 40 us)
DENSE_WIDE_ROWS = 8192


def _dense_16bit_tiles(p: ConvProblem, rows: int, columns: int, reduction: int, phases: int, target: Target
                       ) -> Optional[TileConfig]:
    """forward's and grad_input's tiles for one dense 16-bit GEMM (one group, no packing, no fp8 compute) with at
    least 128 columns, as a CUDA-graph sweep of ResNet-50's step chose them (docs/decisions.md#step-tiles):
    a reduction of one step (64) takes 128 x 64 tiles (the kernel is bound by its loads and stores); filters of
    several taps with 256 columns or more and at least DENSE_WIDE_ROWS rows take 128 x 256 (measured faster
    there, though fewer programs than SMs); the rest 128 x 128 (256-wide tiles leave most SMs idle on the 7x7
    maps), or 64 x 64 where 128 x 128 tiles over the `phases` stride phases leave more than half the SMs without
    one.  None outside that domain."""
    if p.dtype not in ("f16", "bf16") or p.compute is not None or p.groups != 1 or columns < 128:
        return None
    if reduction <= 64:
        return TileConfig(128, 64, 64, warps=4, stages=4)
    if math.prod(p.filter) > 1 and columns >= 256 and rows >= DENSE_WIDE_ROWS:
        return TileConfig(128, 256, 64, warps=8, stages=3)
    if 2 * -(-rows // 128) * -(-columns // 128) * phases < target.gpu.sm_count:
        # 128 x 128 tiles that leave more than half the SMs without one (video models' late layers, N = 8): 64 x 64
        # tiles, four times the programs (docs/decisions.md#layer-fit)
        return TileConfig(64, 64, 64, warps=4, stages=4)
    return TileConfig(128, 128, 64, warps=8, stages=3)


# forward and grad_input GEMMs of at most this many rows (positions) outside the dense rule take 64 x 32 tiles
TINY_ROWS = 64


def default_grad_input_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """Tiles for shapes the tuning database does not hold: dense 16-bit GEMMs as _dense_16bit_tiles says (rows:
    the positions of one stride phase), else columns as wide as C up to 256 (f32: 128), three stages for the widest;
    few-channel groups packed (default_pack) (docs/decisions.md#default-tiles); 16-bit GEMMs of at most TINY_ROWS
    rows 64 x 32 (#layer-fit)."""
    taps = math.prod(p.filter)
    dense = _dense_16bit_tiles(p, p.batch * math.prod(p.input) // math.prod(p.stride), p.in_channels,
                               p.out_channels * taps, math.prod(p.stride), target)
    if dense is not None and default_pack(p) == 1:
        return dense
    pack = default_pack(p)
    _, c, k = packed_sizes(p, pack)
    wide = p.dtype == "f32"
    # f32 columns up to 128: a 128 x 256 f32 tile with 4 warps spills its accumulator (docs/decisions.md#f32-tiles)
    block_n = matrix_block(c, 128 if wide else 256)
    block_k = matrix_block(k, 32 if wide else 64)
    if p.dtype in ("f16", "bf16") and pack == 1 and p.groups == 1 and p.compute is None \
            and p.batch * math.prod(p.input) // math.prod(p.stride) <= TINY_ROWS:
        # a GEMM of at most 64 rows (squeeze-excitation's 1x1 maps): 64 x 32 tiles (docs/decisions.md#layer-fit)
        return TileConfig(64, 32, block_k, warps=4, stages=4)
    # one-pass TF32 keeps 4 warps on wide columns (CK 15's 3D forward shapes: 2.46 against 2.71 ms with 8,
    # docs/decisions.md#tf32-staged)
    return TileConfig(128, block_n, block_k, warps=8 if block_n >= 128 and not p.tf32 else 4,
                      stages=3 if wide or block_n >= 128 else 4, pack=pack)


def default_forward_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """Forward runs on grad_input's GEMM kernel with the channels' roles swapped (columns K, reduction C x taps):
    dense 16-bit GEMMs with C >= 64 as _dense_16bit_tiles says (docs/decisions.md#step-tiles), else grad_input's
    tiles of the swapped problem."""
    swapped = default_grad_input_tiles(p.with_(in_channels=p.out_channels, out_channels=p.in_channels), target)
    if swapped.pack == 1 and p.in_channels < MATRIX_BLOCK and math.prod(p.filter) > 1:
        # few input channels (an RGB stem): the reduction over (taps, C) flattened (launch.flat_reduction),
        # up to 64 of them per step, 64 rows (docs/decisions.md#flat-reduction)
        return replace(swapped, block_m=64, block_k=matrix_block(p.in_channels * math.prod(p.filter), 64),
                       warps=4, stages=3)
    dense = _dense_16bit_tiles(p, p.batch * math.prod(p.output), p.out_channels,
                               p.in_channels * math.prod(p.filter), 1, target)
    if dense is None or swapped.pack != 1 or p.in_channels < 64:
        return swapped
    return dense


# the channel blocks of a depthwise direct program, (channels, warps): two channels a thread in the first
DIRECT_CHANNEL_BLOCKS = ((128, 2), (64, 1), (32, 1))
# a 16-bit depthwise layer of 128+ channels leaves 128-channel blocks only for a block that saves this share of the
# warps a row takes (docs/decisions.md#depthwise-channels)
DIRECT_WARPS_SAVED = 0.2


def direct_grad_input_tiles(p: ConvProblem) -> TileConfig:
    """grad_input_direct and forward_direct: chunks of at most block_m positions along the innermost dimension x
    block_n channels over the warps (block_k unused) (docs/decisions.md#depthwise-tiles; chosen on grad_input, the
    forward kernel's loads and sums are alike).  16-bit: the block fitted to the channels
    (docs/decisions.md#depthwise-channels)."""
    block_n = 128 if p.groups >= 128 else 64 if p.groups >= 64 else 32
    if p.dtype in ("f16", "bf16") and p.groups >= 32:
        block_n = _direct_channel_block(p.groups, p.filter[-1])
    return TileConfig(32, block_n, 1, warps=max(1, block_n // 64), stages=1)


def _direct_channel_block(channels: int, width: int) -> int:
    """The channels a depthwise direct program takes: 32 (a channel a thread) for filters 7 or more wide, whose
    window of sums the threads then hold once; else the block of fewest warps a row, then fewest masked channels,
    then the largest (the fewest programs), with 128 kept unless the other saves DIRECT_WARPS_SAVED of its warps."""
    if width >= 7:
        return 32

    def cost(block: tuple[int, int]) -> tuple[int, int, int]:
        programs = -(-channels // block[0])
        return programs * block[1], programs * block[0] - channels, -block[0]

    best = min(DIRECT_CHANNEL_BLOCKS, key=cost)
    widest = DIRECT_CHANNEL_BLOCKS[0]
    if channels >= widest[0] and cost(best)[0] > (1 - DIRECT_WARPS_SAVED) * cost(widest)[0]:
        return widest[0]
    return best[0]


# a 16-bit cp.async grad_weight over several taps whose programs each sum at most this many reduction steps (after
# the split) takes 8 warps and 3 stages: its time is the pipeline's fill and the f32 tile's store, which 8 warps
# halve per thread (docs/decisions.md#grad-weight-fit)
FEW_STEPS_EIGHT_WARPS = 10


def default_grad_weight_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """Rows (K) as tall as K up to 128, 128 columns (taps x C); f32 with 64 columns and 4 warps, which
    pays most for f32 (docs/decisions.md#default-tiles); few-channel groups packed (default_pack).  Dense 16-bit
    GEMMs: 4 warps and 4 stages, 64 x 64 tiles below 128 rows (docs/decisions.md#step-tiles); 8 warps and 3
    stages over several taps where each program sums few reduction steps (FEW_STEPS_EIGHT_WARPS)."""
    pack = default_pack(p)
    _, _, k = packed_sizes(p, pack)
    block_m = matrix_block(k, 128)
    if p.dtype == "f32":
        return TileConfig(block_m, 64, 32, warps=4, stages=3, pack=pack)
    if pack == 1 and p.groups == 1 and p.compute is None:
        if block_m < 128:
            return TileConfig(64, 64, 64, warps=4, stages=4)
        tiles = TileConfig(128, 128, 64, warps=4, stages=4)
        if p.dtype in ("bf16", "f16") and math.prod(p.filter) > 1 \
                and grad_weight_split(p, tiles, target)[1] <= FEW_STEPS_EIGHT_WARPS * tiles.block_k:
            return TileConfig(128, 128, 64, warps=8, stages=3)
        return tiles
    return TileConfig(block_m, 128, 64, warps=8 if block_m >= 128 else 4, stages=3 if block_m >= 128 else 4,
                      pack=pack)


def resident_programs(tiles: TileConfig, element_bytes: int, target: Target) -> int:
    """Programs of a GEMM kernel resident on one SM at once, as its pipeline's shared memory (stages x (A + B)
    tiles; as ncu reported for these kernels) and its warps allow (registers are not known before compiling)."""
    gpu = target.gpu
    shared = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * element_bytes
    return max(1, min(gpu.shared_per_sm // (shared + gpu.shared_reserved_per_block),
                      gpu.warps_per_sm // tiles.warps))


def fullest_split(tiles_out: int, slots: int, most: int) -> int:
    """The fewest chunks S <= most (the longest chunks) whose tiles_out x S programs keep the slots within 2% as
    busy as the best S does."""
    fill = {s: last_wave_fill(tiles_out * s, slots) for s in range(1, most + 1)}
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= best - 0.02)


def last_wave_fill(programs: int, slots: int) -> float:
    """The share of the resident slots the programs keep busy over their waves: 1.0 when they come in whole
    waves (a last wave of a few programs leaves the GPU idle: docs/decisions.md#split-k-waves)."""
    waves = -(-programs // slots)
    return programs / (waves * slots)


def grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The split-K chunks S asked for: the problem's split_k (the user's), else the tiles' split (a knob: tuned or
    a candidate's), else the fewest chunks whose programs fill the GPU's resident slots best (last_wave_fill), at
    most 256 chunks of at least 8 reduction steps (each chunk adds a weight-sized f32 partial to write and sum)."""
    parts = p.split_k or tiles.split
    if not parts:
        slots = target.gpu.sm_count * resident_programs(tiles, 4 if p.dtype == "f32" else 2, target)
        parts = fullest_split(output_tiles(p, tiles), slots, max(1, min(256, reduction_steps(p, tiles) // 8)))
    return parts


def grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK positions) of grad_weight's split-K: grad_weight_parts cut into whole reduction steps."""
    return reduction_split(p, tiles, grad_weight_parts(p, tiles, target), target, "grad_weight GEMM kernel")


# grad_weight_depthwise's filters with more taps than this spread their tap rows across threads (a thread
# holding every tap of ConvNeXt's 7x7 needed 254 registers)
TAPS_PER_THREAD_MOST = 16


def tap_rows(p: ConvProblem) -> int:
    """grad_weight_depthwise's TAP_ROWS: 1 (every tap in each thread) for small filters, else the filter's rows
    (f0, f1) padded to a power of two (one thread per tap row and channel) (docs/decisions.md#depthwise-tiles)."""
    f = pad3(p.filter, 1)
    if f[0] * f[1] * f[2] <= TAPS_PER_THREAD_MOST:
        return 1
    return 1 << (f[0] * f[1] - 1).bit_length()


def depthwise_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """grad_weight_depthwise: chunks of at most block_m positions along the innermost dimension (unrolled, cut
    evenly: depthwise_chunk) x block_n channels, one element of the [TAP_ROWS, block_n] tensors per thread.
    (docs/decisions.md#depthwise-tiles)."""
    rows = tap_rows(p)
    return TileConfig(8 if rows == 1 else 32, 32, 1, warps=min(16, rows), stages=1)


def depthwise_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The chunks of dY rows asked for: the problem's split_k, else tiles.split, else programs for 16 warps per SM
    (bound by memory and latency: many loads in flight, and the partials few enough for one linalg sum)."""
    blocks = depthwise_channel_blocks(p, tiles)
    return p.split_k or tiles.split or 16 * target.gpu.sm_count // (blocks * tiles.warps)


def depthwise_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int, bool]:
    """(S, run, slide) of grad_weight_depthwise: S chunks of `run` dY rows each, about depthwise_grad_weight_parts
    of them.  slide (slides_along_rows): the chunks are segments of `run` rows o1 within each plane (n, o0), as
    many per plane as the parts ask, cut evenly; else runs of the N x O0 x O1 rows (even_chunks).  A split_k the
    segments cannot give takes the runs; one neither can give is refused (a ValueError)."""
    out3 = pad3(p.output, 1)
    rows = p.batch * out3[0] * out3[1]
    asked = depthwise_grad_weight_parts(p, tiles, target)
    most = target.max_grid[1]  # the chunks are the grid's y
    if slides_along_rows(p):
        planes = p.batch * out3[0]
        per_plane = min(out3[1], -(-max(1, min(rows, asked, most)) // planes))
        seg = -(-out3[1] // per_plane)
        parts = planes * -(-out3[1] // seg)  # no segment empty
        if p.split_k is None or parts == p.split_k:
            return parts, seg, True
    parts, rows_per = honoured_split(p, even_chunks(rows, asked, most), most, "depthwise grad_weight kernel",
                                     f"the {rows} rows of dY (N x O0 x O1)")
    return parts, rows_per, False


def slides_along_rows(p: ConvProblem) -> bool:
    """grad_weight_depthwise_rows applies: every tap in each thread (tap_rows 1), and consecutive dY rows o1
    share X rows (stride and dilation 1 along that dimension, at least two filter rows)."""
    g = geometry(p)
    return tap_rows(p) == 1 and g["S"][1] == 1 and g["D"][1] == 1 and g["F"][1] >= 2


def dy_read_in_place(p: ConvProblem, tiles: TileConfig) -> bool:
    """NGCHW grad_weight: whether the GEMM kernel reads dY in place, with only X copied channels-last.
    X must be copied: its taps shift it along NGCHW's contiguous axis, which no vector load can follow.
    dY is not shifted: where its reduction tiles lie within images, each is contiguous (the kernel's DY_IMAGE
    addressing), so it needs no copy."""
    return (p.op == "grad_weight" and p.layout == "NGCHW" and not (p.depthwise and tiles.pack == 1)
            and tiles_within_images(p, tiles))


def kernel_tiles(p: ConvProblem, tiles: Optional[TileConfig], target: Target) -> TileConfig:
    """The tiles plan_launches uses for p: `tiles`, else the defaults of the kernel p runs on."""
    if tiles is not None:
        return tiles
    if direct_forward(p):
        return direct_grad_input_tiles(p)
    if p.op == "forward":
        return default_forward_tiles(p, target)
    if p.op == "grad_weight":
        return depthwise_grad_weight_tiles(p) if p.depthwise else default_grad_weight_tiles(p, target)
    return direct_grad_input_tiles(p) if direct_grad_input(p) else default_grad_input_tiles(p, target)


LaunchPlan = tuple[TileConfig, tuple[Launch, ...], tuple[int, ...]]


def plan_launches(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str] = None,
                  weight_axes: tuple[str, ...] = ()) -> LaunchPlan:
    """(tiles, launches, f32 partials' shape for grad_weight) of one kernel, symbols named after it;
    tiles None: the defaults of the kernel it uses (kernel_tiles).  x_layout: grad_weight's GEMM kernel reads
    a copy of X in that layout (dy_read_in_place).  weight_axes: the GEMM kernel reads a copy of the weight with
    its axes in this order (weight_copy_axes).  A ValueError where the kernels cannot take p
    (launches_or_reason says why)."""
    planned = launches_or_reason(p, tiles, target, x_layout, weight_axes)
    if isinstance(planned, str):
        raise ValueError(planned)
    return planned


@functools.lru_cache(maxsize=1024)
def launches_or_reason(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str],
                       weight_axes: tuple[str, ...]) -> Union[LaunchPlan, str]:
    """plan_launches' plan, or why the kernels cannot take p (a grid past CUDA's limits, a split_k they cannot
    cut, tiles that do not fit): a pure function of frozen arguments, so each kernel is planned once however many
    rules ask (unsupported_reason, extern_launches, the stream path)."""
    try:
        return _plan_launches(p, tiles, target, x_layout, weight_axes)
    except ValueError as err:
        return str(err)


def _plan_launches(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str],
                   weight_axes: tuple[str, ...]) -> LaunchPlan:
    base = re.sub(r"\W", "_", p.name)
    packed = tiles is not None and tiles.pack > 1  # depthwise too, as packed GEMMs, where tiles ask for it
    if x_layout and (p.op != "grad_weight" or (p.depthwise and not packed)):
        raise ValueError(f"x_layout: only grad_weight's GEMM kernel reads a copy of X ({p.name})")
    tiles = kernel_tiles(p, tiles, target)
    if p.op == "grad_weight" and p.depthwise and not packed:
        launch, partials = grad_weight_depthwise_launch(p, tiles, base, *depthwise_grad_weight_split(p, tiles, target),
                                                        tap_rows(p))
        return tiles, (launch,), partials
    if p.op == "grad_weight":
        launch, partials = grad_weight_launch(p, tiles, base, grad_weight_split(p, tiles, target), dot_precision(p),
                                              x_layout)
        return tiles, (launch,), partials
    if direct_forward(p) and not packed:
        return tiles, (forward_direct_launch(p, tiles, base),), ()
    if p.op == "forward":
        return tiles, (forward_launch(p, tiles, base, dot_precision(p), weight_axes),), ()
    if direct_grad_input(p) and not packed:
        return tiles, (grad_input_direct_launch(p, tiles, base),), ()
    return tiles, (grad_input_launch(p, tiles, base, dot_precision(p), weight_axes),), ()


def weight_copy_axes(p: ConvProblem) -> tuple[str, ...]:
    """The axis order (problem.weight_axes' names) of the weight copy the GEMM kernels read, or () where they read
    the weight as it lies (forward, grad_input and transposed read the weight; grad_weight writes it).  The copy
    is the weight's size, once per call:
      - grad_input and transposed in one-pass TF32: K innermost (GYXCK, GCYXK).  Their GEMM reduces over K, and
        TF32 wgmma reads shared memory K-major only; K-strided weight tiles were rounded in registers on the way
        (launch.tf32_staged), which halved the kernel's speed (docs/decisions.md#tf32-staged);
      - GKCYX weights: a GKYXC copy.  In GKCYX a tile's reduction channels lie a filter's taps apart and its
        columns C*taps apart, so every element is a load of its own: 1.25 ms against 0.19 for cuDNN on CK's
        NGCHW forward shape (docs/decisions.md#weight-copy).  Where the filter has one tap or a group one
        channel the two layouts coincide."""
    axes = weight_axes(p)
    if p.op in ("grad_input", "transposed") and dot_precision(p) == "tf32" and not p.depthwise:  # depthwise: no GEMM
        return tuple(a for a in axes if a != "k") + ("k",)
    if p.weight_layout != FAST_WEIGHT_LAYOUT and p.op != "grad_weight" and math.prod(p.filter) > 1 \
            and p.in_channels > 1:
        return tuple(weight_axes(p.with_(weight_layout=FAST_WEIGHT_LAYOUT)))
    return ()


@dataclass(frozen=True)
class ExternLaunches:
    """The Triton launches of one kernel and what surrounds them: the tiles, the launches (one per kernel:
    grad_input covers all its stride phases in one), the shape of grad_weight's f32 split-K partials
    [S, G, K, taps(3D), C], and the NGCHW activations (by argument name) that are copied to NHWGC for the
    launches (`problem` is then the NHWGC problem the launches were planned for, where every activation
    is copied; the result is copied back)."""

    problem: ConvProblem
    tiles: TileConfig
    launches: tuple[Launch, ...]
    partials_shape: tuple[int, ...] = ()
    copied_channels_last: tuple[str, ...] = ()
    # the launches read a copy of the weight with its axes in this order (weight_copy_axes; empty: none)
    weight_axes: tuple[str, ...] = ()


def extern_launches(problem: ConvProblem, target: Target, knobs: Knobs) -> Optional[ExternLaunches]:
    """The Triton GEMM cores' launches for `problem` on `target` with `knobs`, or None where the kernel keeps
    the linalg form (extern_choice says why)."""
    use, tiles, _ = extern_choice(problem, target, knobs)
    if not use:
        return None
    copy_axes = weight_copy_axes(problem)
    if problem.layout == "NGCHW" and relayout_ngchw(problem, knobs):
        # the kernels on NHWGC copies of the activations (contiguous channels)
        inner = problem.with_(layout="NHWGC")
        tiles = kernel_tiles(inner, tiles, target)
        if dy_read_in_place(problem, tiles):
            # grad_weight: only X copied; dY is read where it lies (one copy fewer)
            _, launches, partials = plan_launches(problem, tiles, target, x_layout=inner.layout)
            return ExternLaunches(problem, tiles, launches, partials, copied_channels_last=("x",))
        _, launches, partials = plan_launches(inner, tiles, target, weight_axes=copy_axes)
        copied = tuple(n for n, s in zip(problem.arg_names, problem.arg_shapes) if s != problem.w_shape)
        return ExternLaunches(inner, tiles, launches, partials, copied_channels_last=copied, weight_axes=copy_axes)
    tiles, launches, partials = plan_launches(problem, tiles, target, weight_axes=copy_axes)
    return ExternLaunches(problem, tiles, launches, partials, weight_axes=copy_axes)


def split_k_sum(p: ConvProblem, partials_shape: tuple[int, ...], base: str, target: Target) -> Launch:
    """The stream runner's sum of split-K f32 partials (kernels/elementwise.sum_partials: grad_weight's, or a split
    forward's / grad_input's), spread over the programs the target's sum aims for (Target.sum_programs)."""
    return sum_partials_launch(p, partials_shape, base, target.sum_programs)


# forward / grad_input split-K on the stream path: reductions of at least OUTPUT_SPLIT_LEAST_REDUCTION steps (shorter
# ones finish before a result-sized f32 partial per chunk is written and summed), chunks of at least
# OUTPUT_SPLIT_LEAST_STEPS, at most OUTPUT_SPLIT_MOST of them
OUTPUT_SPLIT_LEAST_REDUCTION = 32
OUTPUT_SPLIT_LEAST_STEPS = 4
OUTPUT_SPLIT_MOST = 16


def output_split(p: ConvProblem, ext: ExternLaunches, target: Target) -> int:
    """Split-K chunks S for a forward's or grad_input's GEMM kernel (grad_input_phases, one stride phase): the
    tiles' split where a knob sets it, else where the output tiles leave more than half the SMs without a program
    (few rows and columns over a long reduction, as video models' late layers have; docs/decisions.md#output-split-k)
    over at least OUTPUT_SPLIT_LEAST_REDUCTION steps, as many chunks as fill the resident slots once, each of at
    least OUTPUT_SPLIT_LEAST_STEPS steps.  1: no split (NGCHW copies, fp8 rounding and stride phases keep one
    pass)."""
    (launch,) = ext.launches
    if launch.kernel != "grad_input_phases" or ext.copied_channels_last or p.fp8_compute:
        return 1
    c = dict(launch.constants)
    if c["PHASES"] != 1:
        return 1
    if ext.tiles.split:
        return ext.tiles.split
    taps = math.prod(j[0] for j in c["J"])
    steps = -(-(taps * c["K"]) // c["BLOCK_K"]) if c["FLAT"] else taps * -(-c["K"] // c["BLOCK_K"])
    programs = launch.grid[0] * launch.grid[1]
    if 2 * programs > target.gpu.sm_count or steps < OUTPUT_SPLIT_LEAST_REDUCTION:
        return 1
    slots = target.gpu.sm_count * resident_programs(ext.tiles, 4 if p.dtype == "f32" else 2, target)
    return max(1, min(OUTPUT_SPLIT_MOST, steps // OUTPUT_SPLIT_LEAST_STEPS, slots // programs))


def split_output_launches(p: ConvProblem, ext: ExternLaunches, target: Target) -> ExternLaunches:
    """The stream kernel's launches of a forward or grad_input: ext's, or its GEMM launch split-K (output_split)
    with f32 partials for split_k_sum.  The module keeps ext's launches (its lowering sums grad_weight's partials
    only)."""
    split = output_split(p, ext, target)
    if split == 1:
        return ext
    base = re.sub(r"\W", "_", p.name)
    build = forward_launch if p.op == "forward" else grad_input_launch
    launch = build(ext.problem, ext.tiles, base, dot_precision(p), ext.weight_axes, split=split)
    return replace(ext, launches=(launch,), partials_shape=output_split_shape(p, split))
