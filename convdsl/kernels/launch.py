"""From a ConvProblem and its decided tiles to Triton launches (kernel, compile-time constants, grid), and
their binaries.  The mechanics only: which kernel, which tiles, how many split-K chunks and which precision
are decided in convdsl/policy.py and arrive here as arguments.

A `Launch` is everything a kernel binary depends on, frozen and hashable: `compile_launch` turns it into
a cubin (sm_90: Hopper's wgmma needs the arch-specific sm_90a, which runs on H100/H200 only) or PTX
(other archs: the driver JIT-compiles it for the chip it runs on), with the facts IREE's external
dispatch needs (threads per block, dynamic shared memory, kernel parameter count).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..algebra import Phase, dy_padding, grad_input_phases
from ..problem import FP8_FORMATS, ConvProblem, weight_axes
from ..targets import CUDA_MAX_GRID, Target
from .tiles import TileConfig, matrix_block

# Kernel parameters Triton appends after the declared ones (global and profile scratch pointers).
# IREE passes bindings, then 32-bit constants; the two extra slots are filled with constants that the
# kernel never reads, which compile_launch checks (scratch sizes 0).
TRITON_TRAILING_PARAMS = 2
POINTER_ALIGNMENT = 16
ELEMENT = {"f16": "fp16", "bf16": "bf16", "f32": "fp32"}


@dataclass(frozen=True)
class Launch:
    kernel: str  # a @triton.jit function of convdsl/kernels/igemm.py (or elementwise.py: ELEMENTWISE_KERNELS)
    name: str  # the exported symbol (unique within a module)
    pointer_types: tuple[str, ...]  # Triton element types of the bindings, in kernel order
    constants: tuple[tuple[str, object], ...]
    grid: tuple[int, int, int]
    warps: int
    stages: int


@dataclass(frozen=True)
class Binary:
    name: str
    data: bytes
    kind: str  # "cubin" or "ptx"
    threads: int
    shared_bytes: int
    params: int  # kernel parameters in the binary's entry point


# --- 32- or 64-bit offsets ------------------------------------------------------------------------

# The kernels compute an element offset before masking it, so lanes past a tensor's end form offsets up to a
# tile beyond it: 32-bit offsets are kept for tensors under 2^30 elements (half the int32 range as headroom),
# 64-bit ones beyond (WIDE).  The 64-bit form costs integer throughput the small problems need not pay
# (benchmarks/wide_offsets.py).
WIDE_ELEMENTS = 2**30


def needs_wide(p: ConvProblem, workspace_elements: int = 0) -> bool:
    """Whether a launch for p indexes some tensor of WIDE_ELEMENTS or more: X, dY, W, or a workspace (grad_weight's
    f32 split-K partials) of `workspace_elements`."""
    return max(math.prod(p.x_shape), math.prod(p.y_shape), math.prod(p.w_shape), workspace_elements) >= WIDE_ELEMENTS


def check_grid(name: str, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The grid, or a ValueError where it exceeds CUDA's limits (targets.CUDA_MAX_GRID; policy.unsupported_reason
    refuses such problems first: this guards the launch functions' own arithmetic)."""
    if any(n > most for n, most in zip(grid, CUDA_MAX_GRID)):
        raise ValueError(f"launch {name}: grid {grid} exceeds CUDA's {CUDA_MAX_GRID}")
    return grid


# --- canonical 3D strides --------------------------------------------------------------------

def pad3(values: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    return tuple([fill] * (3 - len(values)) + list(values))  # type: ignore[return-value]


def activation_strides(p: ConvProblem, spatial: tuple[int, ...], channels: int) -> tuple[int, ...]:
    """Element strides (n, g, channel, s0, s1, s2) of an activation in p's layout, spatial padded to 3D."""
    sp = pad3(spatial, 1)
    g, n = p.groups, p.batch
    if p.layout == "NGCHW":
        s2, s1, s0 = 1, sp[2], sp[2] * sp[1]
        ch = math.prod(sp)
        return (g * channels * ch, channels * ch, ch, s0, s1, s2)
    if p.layout == "NHWGC":
        ch, gs = 1, channels
        s2 = g * channels
        s1, s0 = s2 * sp[2], s2 * sp[2] * sp[1]
        return (s0 * sp[0], gs, ch, s0, s1, s2)
    # GNHWC
    s2 = channels
    s1, s0 = s2 * sp[2], s2 * sp[2] * sp[1]
    return (s0 * sp[0], n * s0 * sp[0], 1, s0, s1, s2)


def weight_strides(p: ConvProblem, axes: Sequence[str] = ()) -> tuple[int, ...]:
    """Element strides (g, k, c, y0, y1, y2) of the weight stored with its axes in `axes` order, outermost first
    (problem.weight_axes names them; empty: p's weight layout), taps padded to 3D."""
    sizes = {"g": p.groups, "k": p.out_channels, "c": p.in_channels,
             **{f"t{i}": f for i, f in enumerate(p.filter)}}
    strides, step = {}, 1
    for axis in reversed(list(axes or weight_axes(p))):
        strides[axis], step = step, step * sizes[axis]
    taps = [strides[f"t{i}"] for i in range(p.dims)]
    sizes_3d = pad3(p.filter, 1)
    # a padded leading tap axis has one position (any stride serves): the next one's stride times its size
    while len(taps) < 3:
        taps.insert(0, taps[0] * sizes_3d[3 - len(taps)])
    return (strides["g"], strides["k"], strides["c"], *taps)


def operand_element(p: ConvProblem) -> str:
    """Element type the kernels read: fp8/bf8 compute arrives rounded to its grid and stored in f16 (every
    e4m3 and e5m2 value is exact in f16), the same products as fp8 matrix instructions with f32 sums.
    Rounding inside the kernel gained nothing (docs/decisions.md#fp8-rounding-outside)."""
    return "fp16" if p.fp8_compute else ELEMENT[p.dtype]


def tf32_staged(precision: str, reduction_stride: int) -> bool:
    """Whether a GEMM operand is rounded to TF32 in registers before the matrix product (the kernels' ROUND_A /
    ROUND_B): in one-pass TF32, where its elements are not contiguous along the reduction.  TF32 wgmma reads
    shared memory K-major only; such an operand Triton otherwise copied with 4-byte cp.async
    (docs/decisions.md#tf32-staged)."""
    return precision == "tf32" and reduction_stride != 1


# --- packed groups ---------------------------------------------------------------------------

def packable(p: ConvProblem) -> bool:
    """Packed groups read C*PACK (K*PACK) channels with one channel stride: the group stride of X, dX and
    dY must be the channel stride times C (K), as in NHWGC and NGCHW, not GNHWC."""
    x_str = activation_strides(p, p.input, p.in_channels)
    dy_str = activation_strides(p, p.output, p.out_channels)
    return x_str[1] == p.in_channels * x_str[2] and dy_str[1] == p.out_channels * dy_str[2]


def packed_sizes(p: ConvProblem, pack: int) -> tuple[int, int, int]:
    """(groups, C, K) of the packed GEMMs: G / PACK GEMMs of PACK*C columns and PACK*K reductions."""
    if pack > 1 and (p.groups % pack or not packable(p)):
        why = (f"{p.groups} groups are not a multiple of it" if p.groups % pack else
               f"layout {p.layout} does not keep consecutive groups' channels adjacent")
        raise ValueError(f"tiles: pack {pack} for kernel {p.name}: {why}")
    return p.groups // pack, pack * p.in_channels, pack * p.out_channels


def _pack_strides(strides: tuple[int, ...], pack: int) -> tuple[int, ...]:
    """(n, g, channel, s0, s1, s2) of a packed view: a packed group spans PACK groups."""
    return (strides[0], strides[1] * pack, *strides[2:])


# --- grad_input ------------------------------------------------------------------------------

def grad_input_launch(p: ConvProblem, tiles: TileConfig, base: str, precision: str,
                      weight_axes: Sequence[str] = ()) -> Launch:
    """One launch for every stride phase (all-zero phases too: their programs store zeros): phase p's programs
    write the dX positions i = r + s*q of its residue r; together they write every element of dX once.
    Phases are ordered by taps, heaviest first, so that the short ones fill the last wave.  One launch rather
    than a dispatch per phase, because phases tied into one dX made IREE copy dX into the caller's buffer
    afterwards (docs/decisions.md#one-launch-for-all-phases).  precision: Triton's dot precision.  weight_axes: the
    axis order of the weight copy the launch reads (policy.weight_copy_axes; empty: p's weight layout)."""
    tiles.check_matrix()
    phases = sorted(grad_input_phases(p), key=lambda ph: -math.prod(d.J for d in ph.dims))
    groups, c, k = packed_sizes(p, tiles.pack)
    dy_str = _pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    dx_str = _pack_strides(activation_strides(p, p.input, p.in_channels), tiles.pack)
    w_str = weight_strides(p, weight_axes)  # the kernel finds each sub-group's weight block itself
    padded = [_pad_phase(ph) for ph in phases]
    # per phase: its tiles over rows (n, q...) times column tiles; FIRST[p] is its first program
    first = [0]
    for ph in phases:
        rows = p.batch * math.prod(ph.sizes)
        first.append(first[-1] + -(-rows // tiles.block_m) * -(-c // tiles.block_n))
    # per dimension d, a tuple over the phases: Q[d][p] ...
    per_phase = {name: tuple(tuple(pd[d][key] for pd in padded) for d in range(3))
                 for name, key in (("Q", "Q"), ("J", "J"), ("R", "r"), ("OFF", "off"), ("OSTEP", "o_step"),
                                   ("Y0", "y0"), ("TSTEP", "tap_step"))}
    consts = dict(
        C=c, K=k, N=p.batch, O=pad3(p.output, 1), S=pad3(p.stride, 1),
        PHASES=len(phases), FIRST=tuple(first), RS=(1, 1, 1), **per_phase,
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        PRECISION=precision, PACK=tiles.pack,
        # A = dY reduces over its K channels, B = W over its k
        ROUND_A=tf32_staged(precision, dy_str[2]), ROUND_B=tf32_staged(precision, w_str[1]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_STAGES=tiles.stages, WIDE=needs_wide(p),
        ONE_TAP=all(math.prod(d.J for d in ph.dims) <= 1 for ph in phases), FLAT=False,
    )
    elem = operand_element(p)
    return Launch("grad_input_phases", f"{base}_phases", (elem, elem, ELEMENT[p.result_dtype]),
                  tuple(consts.items()), check_grid(base, (first[-1], groups, 1)), tiles.warps, tiles.stages)


def flat_reduction(p: ConvProblem, tiles: TileConfig) -> bool:
    """Forward's reduction over (taps, C) flattened (the kernel's FLAT): where a step's BLOCK_K exceeds C (an RGB
    stem's 3 channels filled 3 of a step's 16) and there are taps to flatten."""
    return tiles.pack == 1 and p.in_channels < tiles.block_k and math.prod(p.filter) > 1


def forward_launch(p: ConvProblem, tiles: TileConfig, base: str, precision: str,
                   weight_axes: Sequence[str] = ()) -> Launch:
    """Forward as grad_input_phases with one phase: rows are Y's positions q (written at i = q), columns its K
    channels, the reduction runs over taps j and the C channels of X, read at s*q - lo + j*d (the read stride RS
    = s, off = -lo, o_step = -d).  The kernel's dY is X, its dX is Y, and the weight's k and c strides swap so
    that W[g, k, y, c] is read as the kernel's W[g, c, y, k].  weight_axes: as grad_input_launch's."""
    tiles.check_matrix()
    groups, k_out, c_red = packed_sizes(p.with_(in_channels=p.out_channels, out_channels=p.in_channels), tiles.pack)
    x_str = _pack_strides(activation_strides(p, p.input, p.in_channels), tiles.pack)
    y_str = _pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    w = weight_strides(p, weight_axes)
    w_swapped = (w[0], w[2], w[1], w[3], w[4], w[5])
    taps, out3 = pad3(p.filter, 1), pad3(p.output, 1)
    lo, dil = pad3(p.pad_lo, 0), pad3(p.dilation, 1)
    rows = p.batch * math.prod(out3)
    programs = -(-rows // tiles.block_m) * -(-k_out // tiles.block_n)
    one = lambda values: tuple((v,) for v in values)  # noqa: E731 - one phase: Q[d][0] ...
    consts = dict(
        C=k_out, K=c_red, N=p.batch, O=pad3(p.input, 1), S=(1, 1, 1),
        PHASES=1, FIRST=(0, programs), RS=pad3(p.stride, 1),
        Q=one(out3), J=one(taps), R=one((0, 0, 0)), OFF=one(tuple(-v for v in lo)), OSTEP=one(tuple(-d for d in dil)),
        Y0=one((0, 0, 0)), TSTEP=one((1, 1, 1)),
        DY=x_str, W=w_swapped, DX=y_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        PRECISION=precision, PACK=tiles.pack,
        # A = X and B = W both reduce over the C channels
        ROUND_A=tf32_staged(precision, x_str[2]), ROUND_B=tf32_staged(precision, w_swapped[1]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_STAGES=tiles.stages, WIDE=needs_wide(p), ONE_TAP=math.prod(taps) == 1,
        FLAT=flat_reduction(p, tiles),
    )
    elem = operand_element(p)
    return Launch("grad_input_phases", f"{base}_forward", (elem, elem, ELEMENT[p.result_dtype]),
                  tuple(consts.items()), check_grid(base, (programs, groups, 1)), tiles.warps, tiles.stages)


def geometry(p: ConvProblem) -> dict[str, tuple[int, int, int]]:
    """I, O, F (sizes of X, dY, filter), S, D, LO (stride, dilation, low padding), each per dimension padded to
    3D: the kernels' compile-time triples."""
    return dict(I=pad3(p.input, 1), O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1),
                D=pad3(p.dilation, 1), LO=pad3(p.pad_lo, 0))


def _pad_phase(ph: Phase) -> list[dict[str, int]]:
    # leading unit dimensions: one residue, one tap at y = 0 reading o = q
    unit = dict(r=0, y0=0, J=1, tap_step=1, off=0, o_step=1, Q=1)
    dims = [dict(r=d.r, y0=d.y0, J=d.J, tap_step=d.tap_step, off=d.off, o_step=d.o_step, Q=d.Q)
            for d in ph.dims]
    return [unit] * (3 - len(dims)) + dims


# grad_input_direct unrolls BLOCK_W x F[2] products per filter row and channel: chunks are cut shorter for wide
# filters so that this stays bounded (a 31x31 filter: chunks of 4 positions)
UNROLLED_PRODUCTS = 128


def grad_input_direct_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """Depthwise: one launch, a program per dX row (n, i0, i1) and block of channels; the row's chunks are a
    multiple of the stride along it (every chunk starts on stride phase 0)."""
    dy_str = activation_strides(p, p.output, p.out_channels)
    dx_str = activation_strides(p, p.input, p.in_channels)
    w_str = weight_strides(p)
    in3, stride, f2 = pad3(p.input, 1), pad3(p.stride, 1)[2], pad3(p.filter, 1)[2]
    chunk = depthwise_chunk(in3[2], min(tiles.block_m, max(1, UNROLLED_PRODUCTS // f2)))
    consts = dict(
        G=p.groups, N=p.batch,
        **geometry(p),
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        BLOCK_W=-(-chunk // stride) * stride, BLOCK_CH=tiles.block_n, WIDE=needs_wide(p),
    )
    grid = (p.batch * in3[0] * in3[1], -(-p.groups // tiles.block_n), 1)
    elem = operand_element(p)
    return Launch("grad_input_direct", f"{base}_direct", (elem, elem, ELEMENT[p.result_dtype]), tuple(consts.items()),
                  check_grid(base, grid), tiles.warps, tiles.stages)


# forward_direct holds a chunk's X window (SPAN = (BLOCK_W - 1) * S + (F - 1) * D + 1 values per channel) in
# registers beside its BLOCK_W sums: strided rows get shorter chunks so that the window stays this wide at most
FORWARD_WINDOW_MOST = 64


def forward_direct_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """Depthwise forward: one launch, a program per Y row (n, o0, o1) and block of channels; the row cut into
    chunks of at most tiles.block_m positions, fewer where the filter is wide (UNROLLED_PRODUCTS) or the
    stride long (FORWARD_WINDOW_MOST)."""
    out3, f2 = pad3(p.output, 1), pad3(p.filter, 1)[2]
    stride, dil = pad3(p.stride, 1)[2], pad3(p.dilation, 1)[2]
    # the longest chunk whose window (BLOCK_W - 1) * stride + (f2 - 1) * dil + 1 fits FORWARD_WINDOW_MOST
    window_chunk = max(1, (FORWARD_WINDOW_MOST - 1 - (f2 - 1) * dil) // stride + 1)
    chunk = depthwise_chunk(out3[2], min(tiles.block_m, max(1, UNROLLED_PRODUCTS // f2), window_chunk))
    consts = dict(
        G=p.groups, N=p.batch,
        **geometry(p),
        X=activation_strides(p, p.input, p.in_channels), W=weight_strides(p),
        Y=activation_strides(p, p.output, p.out_channels),
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        BLOCK_W=chunk, BLOCK_CH=tiles.block_n, WIDE=needs_wide(p),
    )
    grid = (p.batch * out3[0] * out3[1], depthwise_channel_blocks(p, tiles), 1)
    elem = operand_element(p)
    return Launch("forward_direct", f"{base}_direct", (elem, elem, ELEMENT[p.result_dtype]), tuple(consts.items()),
                  check_grid(base, grid), tiles.warps, tiles.stages)


# --- grad_weight -----------------------------------------------------------------------------


def depthwise_chunk(extent: int, most: int) -> int:
    """BLOCK_W: the row of `extent` positions cut into the fewest chunks of at most `most`, as even as they
    come (28 positions at most 16: two chunks of 14, not 16 + 12 with four positions masked)."""
    chunks = -(-extent // most)
    return -(-extent // chunks)


def grad_weight_depthwise_launch(p: ConvProblem, tiles: TileConfig, base: str, parts: int, run: int,
                                 slide_rows: bool, tap_rows: int) -> tuple[Launch, tuple[int, ...]]:
    """Depthwise grad_weight: f32 partials [S, G, 1, taps, 1] of S = `parts` chunks of `run` dY rows (n, o0, o1)
    each (policy.depthwise_grad_weight_split), summed like grad_weight_launch's.  slide_rows: the chunks are
    segments of `run` rows o1 within a plane (n, o0) and the kernel slides along them
    (grad_weight_depthwise_rows); tap_rows: the other kernel's TAP_ROWS (1: every tap in each thread)."""
    out3 = pad3(p.output, 1)
    blocks = depthwise_channel_blocks(p, tiles)
    x_str = activation_strides(p, p.input, p.in_channels)
    dy_str = activation_strides(p, p.output, p.out_channels)
    common = dict(G=p.groups, N=p.batch, **geometry(p), X=x_str, DY=dy_str)
    block_w = depthwise_chunk(out3[2], tiles.block_m)
    elem = operand_element(p)
    if slide_rows:
        consts = dict(common, SEG=run, BLOCK_W=block_w, BLOCK_CH=tiles.block_n)
        kernel = "grad_weight_depthwise_rows"
    else:
        consts = dict(common, ROWS_PER=run, BLOCK_W=block_w, BLOCK_CH=tiles.block_n, TAP_ROWS=tap_rows)
        kernel = "grad_weight_depthwise"
    consts["WIDE"] = needs_wide(p, parts * p.groups * math.prod(p.filter))
    launch = Launch(kernel, f"{base}_depthwise", (elem, elem, "fp32"), tuple(consts.items()),
                    check_grid(base, (blocks, parts, 1)), tiles.warps, tiles.stages)
    return launch, (parts, p.groups, 1, *pad3(p.filter, 1), 1)


def depthwise_channel_blocks(p: ConvProblem, tiles: TileConfig) -> int:
    """Programs across the channels of a depthwise kernel: blocks of BLOCK_CH channels."""
    return -(-p.groups // tiles.block_n)


def flat_positions(strides: tuple[int, ...], spatial: tuple[int, int, int]) -> bool:
    """Whether an activation's positions (n, s0, s1, s2) lie evenly apart: the element offset of position
    r = ((n * S0 + s0) * S1 + s1) * S2 + s2 is then r * strides[5] (strides as activation_strides gives them)."""
    return strides[0] == spatial[0] * strides[3] and image_flat_positions(strides, spatial)


def image_flat_positions(strides: tuple[int, ...], spatial: tuple[int, int, int]) -> bool:
    """Whether an activation's positions lie evenly apart within each image (channel-first layouts too):
    the offset of position (n, p), p = (s0 * S1 + s1) * S2 + s2, is then n * strides[0] + p * strides[5]."""
    return strides[3] == spatial[1] * strides[4] and strides[4] == spatial[2] * strides[5]


def tiles_within_images(p: ConvProblem, tiles: TileConfig) -> bool:
    """Whether each grad_weight reduction tile (BLOCK_R dY positions) lies in one image: BLOCK_R divides an
    image's positions (split-K chunks are whole tiles)."""
    return math.prod(p.output) % tiles.block_k == 0


def reduction_steps(p: ConvProblem, tiles: TileConfig) -> int:
    """grad_weight's reduction steps: N * prod(O) positions in steps of the tile's BLOCK_R."""
    return -(-(p.batch * math.prod(p.output)) // tiles.block_k)


def output_tiles(p: ConvProblem, tiles: TileConfig) -> int:
    """grad_weight's output tiles: (packed) groups x K row tiles x (taps x C) column tiles."""
    groups, c, k = packed_sizes(p, tiles.pack)
    return groups * -(-k // tiles.block_m) * -(-(c * math.prod(p.filter)) // tiles.block_n)


def grad_weight_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int], precision: str,
                       x_layout: Optional[str] = None) -> tuple[Launch, tuple[int, ...]]:
    """The launch and the shape of its f32 partials [S, G, K, F0, F1, F2, C] (filter padded to 3D; packed
    groups store their diagonal blocks there, so the shape is the same), the reduction cut into the split-K
    chunks `split` = (S, CHUNK positions) (policy.grad_weight_split).  x_layout: the layout of the copy of X the
    kernel reads (policy.dy_read_in_place), where it is not p's."""
    tiles.check_matrix()
    parts, chunk = split
    groups, c, k = packed_sizes(p, tiles.pack)
    x_problem = p.with_(layout=x_layout) if x_layout else p
    x_str = _pack_strides(activation_strides(x_problem, p.input, p.in_channels), tiles.pack)
    dy_str = _pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    f3 = pad3(p.filter, 1)
    dy_flat = flat_positions(dy_str, pad3(p.output, 1))
    consts = dict(
        C=c, K=k, N=p.batch,
        **geometry(p),
        X=x_str, DY=dy_str,
        CHUNK=chunk, G=groups,
        DY_FLAT=dy_flat,
        X_FLAT=p.input == p.output and all(s == 1 for s in p.stride) and flat_positions(x_str, pad3(p.input, 1)),
        DY_IMAGE=not dy_flat and image_flat_positions(dy_str, pad3(p.output, 1)) and tiles_within_images(p, tiles),
        PRECISION=precision, PACK=tiles.pack,
        # both reduce over the positions (n, o0, o1, o2), the innermost of which decides the copies' width
        ROUND_A=tf32_staged(precision, dy_str[5]), ROUND_B=tf32_staged(precision, x_str[5]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_k, NUM_STAGES=tiles.stages,
        WIDE=needs_wide(p, parts * math.prod(p.w_shape)),
    )
    cols = c * math.prod(p.filter)
    grid = (-(-k // tiles.block_m) * -(-cols // tiles.block_n), groups, parts)
    elem = operand_element(p)
    launch = Launch("grad_weight_partials", f"{base}_partials", (elem, elem, "fp32"), tuple(consts.items()),
                    check_grid(base, grid), tiles.warps, tiles.stages)
    return launch, (parts, p.groups, p.out_channels, *f3, p.in_channels)


# --- TMA kernels (kernels/tma.py: sm_90, launched by the stream runner only) ---------------------------



@dataclass(frozen=True)
class TmaMap:
    """A TMA descriptor the runner makes at call time: over `operand` (0 and 1: the call's arguments, 2: its
    result) viewed as the contiguous `shape` (outermost first), copied in boxes of `block` (the kernel's
    descriptor block).  im2col maps also carry the pixel box corners per spatial dimension and the element
    strides per dimension.  After compiling, `box` and `swizzle` are the binary's (Triton cuts a block wider than
    its swizzle span into narrower copies)."""

    operand: int
    shape: tuple[int, ...]
    block: tuple[int, int]
    im2col: bool = False
    lower: tuple[int, ...] = ()
    upper: tuple[int, ...] = ()
    element_strides: tuple[int, ...] = ()
    box: tuple[int, ...] = ()
    swizzle: int = 0
    # f32 read as TF32: the copy rounds each value to TF32 on its way to shared memory (CUDA's TFLOAT32 maps)
    round_tf32: bool = False


def im2col_box(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The pixel box of forward's X per spatial dimension: from -lo up to (O - 1) * s + 1 - lo (exclusive), as
    corners relative to the tensor ([-lo, I + upper)): stepped by s it holds exactly O pixels."""
    lower = tuple(-lo for lo in p.pad_lo)
    upper = tuple((o - 1) * s + 1 - i - lo for o, s, i, lo in zip(p.output, p.stride, p.input, p.pad_lo))
    return lower, upper


def forward_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, flipped: bool = False, promote: int = 0,
                       specialised: bool = False, swapped: bool = False, programs: int = 0,
                       reversed_copy: bool = False) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Forward (NHWGC, GKYXC) on kernels/tma.forward_tma: X through an im2col map over (N, *spatial, G*C), W as a
    [G*K, taps*C] matrix, Y as [N*O, G*K]; one program per (row tile, column tile, group).  flipped: p is a
    stride-1 grad_input as forward (policy.grad_input_as_forward), whose weight the kernel reads as grad_input's
    own GKYXC weight, [G*C, taps*K] in p's terms, in [BLOCK_K, BLOCK_N] tiles.  fp8 compute: X and W come as fp8
    copies (policy.tma_stream_launch stages them); promote: the channels whose products wgmma sums in its own
    accumulator before adding them to the f32 one (0: all; policy.tma_fp8_promote).  specialised: a warp of its
    own issues the copies (measured no faster on the suite's forwards; the rules leave it off,
    docs/decisions.md#tma-wgrad-specialised).  swapped (16-bit): the product transposed, the weight tile as wgmma's A
    (measured no faster; the rules leave it off, docs/decisions.md#tma-narrow).  programs: at most that many
    programs, each taking tiles in turn (kernels/tma.forward_tma_persistent; 0: one program per tile).
    reversed_copy: p is a stride-1 grad_input as forward whose weight comes copied K-innermost (GYXCK in grad_input's
    terms, a [G*taps*K, C] matrix in p's), read with the taps reversed in K-major [BLOCK_N, BLOCK_K] tiles, as
    one-pass TF32 wgmma reads them (the kernel's FLIPPED 2)."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    rows = p.batch * math.prod(p.output)
    lower, upper = im2col_box(p)
    tf32 = p.dtype == "f32"  # one-pass TF32 (policy.tma_forward_reason): both operands rounded by their copies
    maps = (
        TmaMap(0, (p.batch, *p.input, g * c), (tiles.block_m, tiles.block_k), im2col=True, lower=lower, upper=upper,
               element_strides=(1, *p.stride, 1), round_tf32=tf32),
        TmaMap(1, (g * c, math.prod(p.filter) * k), (tiles.block_k, tiles.block_n)) if flipped else
        TmaMap(1, (g * math.prod(p.filter) * k, c), (tiles.block_n, tiles.block_k), round_tf32=tf32) if reversed_copy
        else TmaMap(1, (g * k, math.prod(p.filter) * c), (tiles.block_n, tiles.block_k), round_tf32=tf32),
        TmaMap(2, (rows, g * k), (tiles.block_m, tiles.block_n)),
    )
    consts = dict(O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, DIMS=p.dims, STAGES=tiles.stages,
                  FLIPPED=2 if reversed_copy else int(flipped),
                  PROMOTE=promote, SPECIALISED=specialised, SWAPPED=swapped)
    grid = check_grid(base, (-(-rows // tiles.block_m), -(-k // tiles.block_n), g))
    if flipped and reversed_copy:
        raise ValueError(f"{base}: the weight is read flipped either from itself or from its copy, not both")
    if programs and (specialised or swapped):
        raise ValueError(f"{base}: the persistent TMA forward kernel has no copy warp and no transposed product")
    kernel = "forward_tma"
    if programs:
        kernel = "forward_tma_persistent"
        consts = {name: v for name, v in consts.items() if name not in ("SPECIALISED", "SWAPPED")}
        consts.update(G=g, ROWS=rows)
        grid = (min(math.prod(grid), programs), 1, 1)
    elem = ELEMENT[p.dtype]
    x_elem, w_elem = (FP8_ELEMENT[p.compute[0]], FP8_ELEMENT[p.compute[1]]) if p.fp8_compute else (elem, elem)
    return Launch(kernel, f"{base}_{kernel}", (x_elem, w_elem, elem), tuple(consts.items()), grid,
                  tiles.warps, tiles.stages), maps


@dataclass(frozen=True)
class HaloGrid:
    """The padded grid of kernels/halo.forward_halo for a stride-1 forward: its width WP, a window's rows R, a
    slot's RS (R rounded up to the copies' rows), the ring's rows RP (a power of 2 holding three slots) and the row
    tiles per output plane QT."""

    width: int
    rows: int
    slot_rows: int
    ring_rows: int
    row_tiles: int


HALO_COPY_ROWS = 32  # kernels/halo.COPY_ROWS
HALO_KERNELS = ("forward_halo",)


def halo_grid(p: ConvProblem, block_m: int) -> HaloGrid:
    f1, f2 = pad3(p.filter, 1)[1:]
    d1, d2 = pad3(p.dilation, 1)[1:]
    o1, o2 = pad3(p.output, 1)[1:]
    width = o2 + (f2 - 1) * d2
    rows = block_m + (f1 - 1) * d1 * width + (f2 - 1) * d2
    slot = -(-rows // HALO_COPY_ROWS) * HALO_COPY_ROWS
    ring = 1 << (3 * slot - 1).bit_length()
    return HaloGrid(width, rows, slot, ring, -(-o1 * width // block_m))


def forward_halo_launch(p: ConvProblem, tiles: TileConfig, base: str, split: int, flipped: bool = False,
                        spread: bool = True) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Stride-1 forward (NDHWGC, GKZYXC) on kernels/halo.forward_halo: X read by address into windows of
    halo_grid(p, block_m) rows, W through a map as [G*K, taps*C] in [BLOCK_N, C] tiles (flipped: p is a stride-1
    grad_input as forward reading grad_input's own weight [G*C, taps*K] in [C, BLOCK_N] tiles), Y stored by
    address.  One program per (group, column tile, image, row tile of a plane, range of `split` output planes).
    spread: the next plane's window copied a part with each tap, not all at once."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    grid_ = halo_grid(p, tiles.block_m)
    taps = math.prod(p.filter)
    maps = (TmaMap(1, (g * c, taps * k), (c, tiles.block_n)) if flipped else
            TmaMap(1, (g * k, taps * c), (tiles.block_n, c)),)
    consts = dict(I=pad3(p.input, 1), O=pad3(p.output, 1), F=pad3(p.filter, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, G=g, N=p.batch, WP=grid_.width, R=grid_.rows,
                  RS=grid_.slot_rows, RP=grid_.ring_rows, QT=grid_.row_tiles, SPLIT=split, BLOCK_M=tiles.block_m,
                  BSTAGES=tiles.stages, FLIPPED=int(flipped), SPREAD=int(spread))
    programs = g * -(-k // tiles.block_n) * p.batch * grid_.row_tiles * split
    elem = ELEMENT[p.dtype]
    return Launch("forward_halo", f"{base}_forward_halo", (elem, elem, elem), tuple(consts.items()),
                  check_grid(base, (programs, 1, 1)), tiles.warps, tiles.stages), maps


def phases_heaviest_first(p: ConvProblem) -> list[Phase]:
    """The stride phases of a grad_input in the order the TMA phases kernel takes them: most taps first, so that
    the persistent programs' last tiles are the shortest ones (ties in residue order)."""
    return sorted(grad_input_phases(p), key=lambda ph: -math.prod(ph.taps))


def phases_window(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The window every phase's copies walk (kernels/tma.grad_input_phases_tma): per spatial dimension the most
    positions of any phase (QM) and the widest reach below dY's first position (LOM, algebra.dy_padding)."""
    phases = grad_input_phases(p)
    most = tuple(max(ph.dims[i].Q for ph in phases) for i in range(p.dims))
    lo, _ = dy_padding(p, phases)
    return most, lo


def grad_input_phases_tiles(p: ConvProblem, tiles: TileConfig) -> int:
    """The TMA phases kernel's tiles: per phase, row tiles over the phases' common window, column tiles, groups."""
    most, _ = phases_window(p)
    rows = p.batch * math.prod(most)
    return len(grad_input_phases(p)) * -(-rows // tiles.block_m) * -(-p.in_channels // tiles.block_n) * p.groups


def grad_input_phases_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, programs: int
                                 ) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Strided grad_input (NHWGC, GKYXC) on kernels/tma.grad_input_phases_tma: every stride phase a forward of dY
    with its taps of the weight, all of them in one persistent launch of `programs` programs.  dY through one
    im2col map over (N, *O, G*K) whose pixel box holds QM positions per dimension from -LOM (phases_window); a
    phase whose window starts higher reads it through larger im2col offsets (its shift LOM - LO_p).  W as its
    own [G*K, taps*C] matrix in [BLOCK_K, BLOCK_N] tiles; dX stored by address (a phase's rows are every s-th
    position, no box of dX), rows past the phase's own Q positions dropped.  Per-phase tables (residue r, Q,
    taps J, first tap y0, shift) in phases_heaviest_first order, per dimension padded to 3 like the rest."""
    phases = phases_heaviest_first(p)
    most, lom = phases_window(p)
    c, k, g = p.in_channels, p.out_channels, p.groups
    rows = p.batch * math.prod(most)
    lower = tuple(-v for v in lom)
    upper = tuple(q - o - v for q, o, v in zip(most, p.output, lom))  # QM positions from -LOM: QM - 1 + 1 - O - LOM
    maps = (
        TmaMap(0, (p.batch, *p.output, g * k), (tiles.block_m, tiles.block_k), im2col=True, lower=lower, upper=upper,
               element_strides=(1,) * (p.dims + 2)),
        TmaMap(1, (g * k, math.prod(p.filter) * c), (tiles.block_k, tiles.block_n)),
    )

    consts = dict(
        PHASES=len(phases),
        PR=tuple(pad3(ph.residue, 0) for ph in phases),
        PQ=tuple(pad3(ph.sizes, 1) for ph in phases),
        PJ=tuple(pad3(ph.taps, 1) for ph in phases),
        PY=tuple(pad3(tuple(d.y0 for d in ph.dims), 0) for ph in phases),
        # a phase's window starts LO_p = (J - 1) * o_step - off below its q: LOM - LO_p above the box's start
        PSH=tuple(pad3(tuple(v - ((d.J - 1) * d.o_step - d.off) for v, d in zip(lom, ph.dims)), 0) for ph in phases),
        QM=pad3(most, 1), LOM=pad3(lom, 0), TS=pad3(tuple(d.tap_step for d in phases[0].dims), 1),
        OS=pad3(tuple(d.o_step for d in phases[0].dims), 1), FF=pad3(p.filter, 1), I=pad3(p.input, 1),
        S=pad3(p.stride, 1), C=k, K=c, G=g, ROWS=rows, DIMS=p.dims, STAGES=tiles.stages)
    grid = (min(grad_input_phases_tiles(p, tiles), programs), 1, 1)
    elem = ELEMENT[p.dtype]
    return Launch("grad_input_phases_tma", f"{base}_grad_input_phases_tma", (elem, elem, elem), tuple(consts.items()),
                  grid, tiles.warps, tiles.stages), maps


# the TMA grad_weight's f32 partials: columns per store box
PARTIALS_BOX_MOST = 128


def grad_weight_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int],
                           specialised: bool = False, promote: int = 0
                           ) -> tuple[Launch, tuple[TmaMap, ...], tuple[int, ...]]:
    """grad_weight (NHWGC) on kernels/tma.grad_weight_tma: X through the im2col map of its forward (the same
    pixel box), dY as [N*O, G*K], f32 partials as [S*G*K, taps*C]; one program per (K tile, tap and C tile,
    group, chunk); a tile wider than C spans taps.  split: the split-K chunks (S, CHUNK positions)
    (policy.tma_grad_weight_split).  specialised: a warp of its own issues the copies
    (policy.tma_grad_weight_specialised).  promote: wgmma sums this many steps at a time, each run then added in
    f32 by the SM (0: wgmma's accumulator throughout).  Returns the launch, its maps and the partials' shape
    [S, G, K, F0, F1, F2, C]."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    parts, chunk = split
    rows = p.batch * math.prod(p.output)
    taps = math.prod(p.filter)
    lower, upper = im2col_box(p)
    # a tile wider than C spans taps: one im2col box per tap; the f32 partials leave in boxes of at most 128
    # columns, through one 64 KB buffer that reuses the ring's shared memory (a 256-wide tile in two halves)
    maps = (
        TmaMap(0, (p.batch, *p.input, g * c), (tiles.block_k, min(tiles.block_n, c)), im2col=True, lower=lower,
               upper=upper, element_strides=(1, *p.stride, 1)),
        TmaMap(1, (rows, g * k), (tiles.block_k, tiles.block_m)),
        TmaMap(2, (parts * g * k, taps * c), (tiles.block_m, min(tiles.block_n, PARTIALS_BOX_MOST))),
    )
    consts = dict(O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, G=g, L=rows, CHUNK=chunk, BLOCK_N=tiles.block_n, DIMS=p.dims,
                  STAGES=tiles.stages, SPECIALISED=specialised, PROMOTE=promote)
    grid = check_grid(base, ((k // tiles.block_m) * -(-(taps * c) // tiles.block_n), g, parts))
    elem = operand_element(p)  # fp8 compute: X and dY rounded to fp8 values in f16 copies first
    launch = Launch("grad_weight_tma", f"{base}_grad_weight_tma", (elem, elem, "fp32"), tuple(consts.items()), grid,
                    tiles.warps, tiles.stages)
    return launch, maps, (parts, g, k, *pad3(p.filter, 1), c)


# --- one-pass grad_weight on flat planes (kernels/tma.grad_weight_flat_tma): TF32, and fp8 compute -----------
#
# TF32 and fp8 wgmma read both operands K-major (the reduction contiguous); grad_weight reduces over positions,
# which NHWGC stores strided by the channels.  So X and dY are first copied channel-first, rounded to the compute
# type (TF32 kept in f32; fp8/bf8 stored as fp8), X with its zero border in the two inner spatial dimensions of
# `order` (a plane P1 x P2, P2 a multiple of A, the elements in 16 bytes: 4 of f32, 16 of fp8), dY laid out on the
# same plane:
#     Xf[(n, g, c), f]  f = i0 * P1 * P2 + j1 * P2 + j2,  = X[n, i0, j1 - lo1, j2 - lo2, g, c]  (0 outside X)
#     Yf[(n, g, k), q]  q = o0 * P1 * P2 + o1 * P2 + o2,  = dY[n, o0, o1, o2, g, k]  (0 where o1 >= O1 or o2 >= O2)
# With stride 1 the position that tap t reads for output q is q + shift(t), one constant per tap:
#     shift(t) = (t0 * d0 - lo0) * P1 * P2 + t1 * d1 * P2 + t2 * d2
# (j1 = o1 + t1 * d1 stays below P1 for every real o1, so a position leaves X only through i0, which maps it
# below 0 or past I0 * P1 * P2: outside the row, where TMA reads zeros).  So
#     dW[g, k, t, c] = sum over n, q of Yf[(n, g, k), q] * Xf[(n, g, c), q + shift(t)]
# a GEMM of two K-major [rows, positions] matrices, tiled by 2D TMA boxes.  A TMA box must start 16 bytes into a
# row (A elements), and shift(t) is not always a multiple of A: its residue r = t2 * d2 mod A (P2 and P1 * P2 are
# multiples of A).  So one operand is copied once per residue r = 0 .. R - 1, shifted by r:
#     X shifted:  Xr[f] = Xf[f + r]; tap t reads Yf at q0 and X_r at q0 + shift(t) - r
#     dY shifted: Yr[u] = Yf[u - r]; tap t reads Y_r at q0 and Xf at q0 + shift(t) - r
# (both starts multiples of A), the smaller operand, stacked as [R * rows, length].  The plane's zero columns cost
# products; `order` puts outermost the spatial dimension that leaves fewest (docs/decisions.md#tf32-flat).

TMA_ALIGN_BYTES = 16  # a TMA box's first element along a row, and a row's stride: multiples of 16 bytes
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8e4nv": 1, "fp8e5": 1}
# CK's fp8 (e4m3, finite-only) and bf8 (e5m2) as Triton's element types
FP8_ELEMENT = {"fp8": "fp8e4nv", "bf8": "fp8e5"}
# the largest finite value of each: the flat copies saturate to it (an fp8 copy has no room for more)
FP8_MAX = {"fp8": 448.0, "bf8": 57344.0}


def flat_elements(p: ConvProblem) -> tuple[str, str]:
    """The element types of the flat copies of X and dY: f32 (TF32 values) or the fp8 compute types [A, B]."""
    if p.fp8_compute:
        return FP8_ELEMENT[p.compute[0]], FP8_ELEMENT[p.compute[1]]
    return "fp32", "fp32"


def flat_align(p: ConvProblem) -> int:
    """A: the copies' elements in 16 bytes (both compute types of a problem have one width)."""
    return TMA_ALIGN_BYTES // ELEMENT_BYTES[flat_elements(p)[0]]


@dataclass(frozen=True)
class FlatPlanes:
    """How grad_weight_flat_tma lays X and dY out: the spatial dimensions outermost first (`order`, indices of
    the problem's spatial dimensions padded to 3D), the inner plane (P1, P2) with X's border, the rows' lengths
    (multiples of A elements: TMA needs 16-byte row strides), the position blocks per image, the residues R,
    which operand ("x" or "dy") is copied once per residue, and A."""

    order: tuple[int, int, int]
    plane: tuple[int, int]
    x_length: int
    dy_length: int
    blocks: int
    residues: int
    shifted: str
    align: int = 4


def _round_up(v: int, align: int) -> int:
    return -(-v // align) * align


def flat_planes(p: ConvProblem, block_r: int) -> FlatPlanes:
    """The layout of the fewest reduction steps (then the fewest bytes copied, then the problem's own order)."""
    inp, out = pad3(p.input, 1), pad3(p.output, 1)
    lo, hi = pad3(p.pad_lo, 0), pad3(p.pad_hi, 0)
    taps, dil = pad3(p.filter, 1), pad3(p.dilation, 1)
    align = flat_align(p)
    best, best_cost = None, None
    for order in ((0, 1, 2), (1, 0, 2), (2, 0, 1), (0, 2, 1), (1, 2, 0), (2, 1, 0)):
        a, b, c = order
        p1, p2 = inp[b] + lo[b] + hi[b], _round_up(inp[c] + lo[c] + hi[c], align)
        residues = 1 + max(t * dil[c] % align for t in range(taps[c]))
        last = (out[a] - 1) * p1 * p2 + (out[b] - 1) * p2 + out[c]  # one past the last real position
        x_length = _round_up(inp[a] * p1 * p2, align)
        rows_x, rows_dy = p.in_channels, p.out_channels
        # the shifted operand: the one of fewer bytes with its R copies (dY's copies start r positions later)
        shift_x = residues * rows_x * x_length + rows_dy * _round_up(last, align) <= \
            rows_x * x_length + residues * rows_dy * _round_up(last + residues - 1, align)
        reach = last if shift_x else last + residues - 1
        blocks = -(-reach // block_r)
        planes = FlatPlanes(order, (p1, p2), x_length, _round_up(reach, align), blocks, residues,
                            "x" if shift_x else "dy", align)
        copied = (residues if shift_x else 1) * rows_x * x_length + (1 if shift_x else residues) * rows_dy * \
            planes.dy_length
        cost = (blocks, copied)
        if best_cost is None or cost < best_cost:
            best, best_cost = planes, cost
    assert best is not None
    return best


# a copy tile: the channels of 128 source bytes (one coalesced line per position in NHWGC) x 128 positions
PAD_PLANES_ROW_BYTES, PAD_PLANES_POSITIONS = 128, 128


def pad_planes_launch(p: ConvProblem, planes: FlatPlanes, operand: str, base: str) -> tuple[Launch, tuple[int, int]]:
    """The copy of `operand` ("x" or "dy") to its flat plane rows, rounded to its compute type (TF32, or fp8
    stored as fp8), once per residue if it is the shifted operand: the launch and the copy's shape
    [R * N*G*channels, length]."""
    x = operand == "x"
    channels = p.in_channels if x else p.out_channels
    sizes = pad3(p.input, 1) if x else pad3(p.output, 1)
    strides = activation_strides(p, p.input if x else p.output, channels)
    lo = pad3(p.pad_lo, 0) if x else (0, 0, 0)
    a, b, c = planes.order
    rows, length = p.batch * p.groups * channels, planes.x_length if x else planes.dy_length
    copies = planes.residues if planes.shifted == operand else 1
    kind = p.compute[0 if x else 1] if p.fp8_compute else None
    block_rows = PAD_PLANES_ROW_BYTES // ELEMENT_BYTES[ELEMENT[p.dtype]]
    mbits, emin = FP8_FORMATS[kind] if kind else (0, 0)
    consts = dict(CH=channels, G=p.groups, SN=strides[0], SG=strides[1], SC=strides[2],
                  S0=strides[3 + a], S1=strides[3 + b], S2=strides[3 + c], I0=sizes[a], I1=sizes[b], I2=sizes[c],
                  P1=planes.plane[0], P2=planes.plane[1], LO1=lo[b], LO2=lo[c], L=length, ROWS=rows,
                  SIGN=1 if x else -1, COPIES=copies, FP8=kind is not None, MBITS=mbits, EMIN=emin,
                  FP8_MAX=FP8_MAX[kind] if kind else 0.0, BLOCK_R=block_rows, BLOCK_F=PAD_PLANES_POSITIONS,
                  WIDE=needs_wide(p, copies * rows * length))
    grid = check_grid(f"{base}_{operand}", (-(-rows // block_rows), -(-length // PAD_PLANES_POSITIONS), 1))
    elements = flat_elements(p)[0 if x else 1]
    return Launch("pad_planes", f"{base}_{operand}_planes", (ELEMENT[p.dtype], elements), tuple(consts.items()),
                  grid, 4, 1), (copies * rows, length)


def grad_weight_flat_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int],
                                promote: int = 0) -> tuple[Launch, tuple[TmaMap, ...], tuple[int, ...], FlatPlanes]:
    """grad_weight (stride 1; f32 in one-pass TF32, or fp8 compute) on kernels/tma.grad_weight_flat_tma over the
    flat plane copies of X and dY (operands 0 and 1 of its launch: pad_planes_launch's), f32 partials as
    [S*G*K, taps*C]; one program per (K tile, tap and C tile, group, chunk), the split-K chunks `split` = (S,
    CHUNK steps of images x position blocks) (policy.tma_flat_grad_weight_split).  Returns the launch, its maps, the
    partials' shape [S, G, K, F0, F1, F2, C] and the planes.  promote (fp8): positions whose products wgmma sums in
    its own accumulator before adding them to the f32 one (0: all of them)."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    planes = flat_planes(p, tiles.block_k)
    steps = p.batch * planes.blocks
    parts, chunk = split
    a = planes.order[0]
    p1, p2 = planes.plane
    flat = [0, 0, 0]  # each spatial dimension's stride in the flat positions
    flat[planes.order[0]], flat[planes.order[1]], flat[planes.order[2]] = p1 * p2, p2, 1
    outer_lo = [0, 0, 0]
    outer_lo[a] = pad3(p.pad_lo, 0)[a]
    taps = math.prod(p.filter)
    x_copies, dy_copies = (planes.residues, 1) if planes.shifted == "x" else (1, planes.residues)
    maps = (
        TmaMap(0, (x_copies * p.batch * g * c, planes.x_length), (tiles.block_n, tiles.block_k)),
        TmaMap(1, (dy_copies * p.batch * g * k, planes.dy_length), (tiles.block_m, tiles.block_k)),
        TmaMap(2, (parts * g * k, taps * c), (tiles.block_m, tiles.block_n)),
    )
    consts = dict(F=pad3(p.filter, 1), D=pad3(p.dilation, 1), XS=tuple(flat), LOX=tuple(outer_lo), C=c, K=k, G=g,
                  N=p.batch, QB=planes.blocks, STEPS=steps, CHUNK=chunk, SHIFT_X=planes.shifted == "x",
                  ALIGN=planes.align, PROMOTE=promote, STAGES=tiles.stages)
    grid = check_grid(base, ((k // tiles.block_m) * taps * (c // tiles.block_n), g, parts))
    launch = Launch("grad_weight_flat_tma", f"{base}_grad_weight_flat_tma", (*flat_elements(p), "fp32"),
                    tuple(consts.items()), grid, tiles.warps, tiles.stages)
    return launch, maps, (parts, g, k, *pad3(p.filter, 1), c), planes


@functools.lru_cache(maxsize=None)
def gluon_tma_im2col() -> bool:
    """Whether the installed Triton compiles Gluon kernels with TMA im2col copies (Triton 3.9 does; PyTorch's
    own Triton may not).  Kernels compiled elsewhere run without it (the runner needs only the CUDA driver)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return False
    return hasattr(tma, "async_load_im2col")


@functools.lru_cache(maxsize=None)
def compile_tma_launch(launch: Launch, maps: tuple[TmaMap, ...], arch: str
                       ) -> tuple[Binary, tuple[TmaMap, ...], tuple[str, ...]]:
    """Compile a TMA launch with Triton's Gluon for `arch` (sm_90): its binary, the maps with the binary's boxes
    and swizzles, and the kinds of its parameters in order ("map": a 128-byte CUtensorMap by value, "ptr<i>": the
    device address of operand i (one no map reads), "u32", "u64")."""
    import triton  # optional dependencies: planned only where they are installed (policy.tma_forward_reason)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import halo, tma

    fn = getattr(halo if launch.kernel in HALO_KERNELS else tma, launch.kernel)
    dtypes = {"fp16": gl.float16, "bf16": gl.bfloat16, "fp32": gl.float32, "fp8e4nv": gl.float8e4nv,
              "fp8e5": gl.float8e5}
    signature = {}
    for name, m in zip(fn.arg_names, maps):
        layout = gl.NVMMASharedLayout.get_default_for(list(m.block), dtypes[launch.pointer_types[m.operand]])
        kind = "tensordesc_im2col" if m.im2col else "tensordesc"
        signature[name] = f"{kind}<{launch.pointer_types[m.operand]}[{m.block[0]},{m.block[1]}],{layout!r}>"
    constexprs = dict(launch.constants, num_warps=launch.warps)
    # the operands no map reads come as pointers, after the maps, in operand order (16-byte aligned)
    pointers = [i for i in range(len(launch.pointer_types)) if i not in {m.operand for m in maps}]
    pointer_names = [name for name in fn.arg_names[len(maps):] if name not in constexprs][:len(pointers)]
    for name, operand in zip(pointer_names, pointers):
        signature[name] = "*" + launch.pointer_types[operand]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", POINTER_ALIGNMENT]] for name in pointer_names}
    signature.update({name: "constexpr" for name in constexprs})
    options = {"num_warps": launch.warps}
    target = Target("cuda", arch)
    warp = target.gpu.subgroup_size
    if constexprs.get("SPECIALISED"):
        # a warp-specialised kernel runs a warp group (4 warps) more than num_warps: registers for all of them
        per_sm, most = target.registers
        options["maxnreg"] = min(most, per_sm // (warp * (launch.warps + 4))) // 8 * 8
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", target.arch_number, warp), options=options)
    meta = kernel.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"launch {launch.name}: Triton asked for scratch memory, which the runner does not pass")
    head = kernel.asm["ptx"].split(")", 1)[0]
    kinds = tuple("map" if "[128]" in decl else "u32" if ".u32" in decl else "u64"
                  for decl in re.findall(r"\.param ([^\n,]*)", head))
    if pointers:  # the pointers are the last parameters before Triton's trailing ones: "ptr<operand>"
        at = len(kinds) - TRITON_TRAILING_PARAMS - len(pointers)
        if kinds[at:at + len(pointers)] != ("u64",) * len(pointers):
            raise RuntimeError(f"launch {launch.name}: expected {len(pointers)} pointer parameters before Triton's "
                               f"trailing ones, got the parameter kinds {kinds}")
        kinds = kinds[:at] + tuple(f"ptr{i}" for i in pointers) + kinds[at + len(pointers):]
    compiled = tuple(replace(m, box=tuple(d["block_size"]), swizzle=d["swizzle"])
                     for m, d in zip(maps, meta.tensordesc_meta))
    # meta.num_warps: the launch's warps plus a warp-specialised kernel's worker warps (in whole warp groups)
    binary = Binary(meta.name, kernel.asm["cubin"], "cubin", threads=32 * meta.num_warps, shared_bytes=int(meta.shared),
                    params=len(kinds))
    return binary, compiled, kinds


# --- compiling -------------------------------------------------------------------------------

def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.lru_cache(maxsize=None)
def compile_launch(launch: Launch, arch: str) -> Binary:
    """Compile one launch with Triton for `arch` (no GPU needed: Triton's LLVM and its bundled ptxas)."""
    import triton  # an optional dependency: planned only where it is installed (policy.unsupported_reason)
    from triton.backends.compiler import GPUTarget

    from . import elementwise, igemm  # import triton: only where a launch is compiled

    fn = getattr(elementwise if launch.kernel in ELEMENTWISE_KERNELS else igemm, launch.kernel)
    arg_names = fn.arg_names
    pointers = arg_names[: len(launch.pointer_types)]
    signature = {name: "*" + t for name, t in zip(pointers, launch.pointer_types)}
    signature.update({name: "constexpr" for name in arg_names[len(pointers):]})
    constexprs = dict(launch.constants)
    missing = set(arg_names[len(pointers):]) - set(constexprs)
    if missing:
        raise ValueError(f"launch {launch.name}: no value for {sorted(missing)}")
    target = Target("cuda", arch)
    # every binding starts 16-byte aligned (IREE aligns buffers and their suballocations to at least 64
    # bytes): without this fact Triton loads one element at a time and cannot pipeline through cp.async
    attrs = {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i in range(len(pointers))}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # fp fusion (fma) on, Triton's historical default: the products and sums of the GEMM are fused anyway
    options = {"num_warps": launch.warps, "num_stages": launch.stages, "enable_fp_fusion": True}
    if target.ptx_version is not None:  # PTX for the driver to JIT, in an ISA the driver accepts
        options["ptx_version"] = target.ptx_version
    kernel = triton.compile(source, target=GPUTarget("cuda", target.arch_number, target.gpu.subgroup_size),
                            options=options)
    meta = kernel.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"launch {launch.name}: Triton asked for scratch memory, which IREE cannot pass")
    ptx = kernel.asm["ptx"]
    params = len(re.findall(r"\.param\s+\.", ptx.split(")", 1)[0]))
    expected = len(launch.pointer_types) + TRITON_TRAILING_PARAMS
    if params != expected:
        raise RuntimeError(f"launch {launch.name}: kernel has {params} parameters, expected {expected}")
    entry = meta.name
    if target.ptx_version is None:
        data, kind = kernel.asm["cubin"], "cubin"
    else:
        data, kind = ptx.encode(), "ptx"
    return Binary(entry, data, kind, threads=32 * launch.warps, shared_bytes=int(meta.shared), params=params)


# --- the steps around the GEMM cores, for runtimes that launch the kernels themselves (kernels/elementwise.py)

ELEMENTWISE_KERNELS = ("sum_partials", "round_fp8", "transpose_planes", "pad_planes", "space_to_depth",
                       "split_bf16")
ELEMENTWISE_BLOCK = 1024
# sum_partials: programs to aim for (two per SM of the largest GPUs)
SUM_PROGRAMS = 264
# (mantissa bits, smallest normal exponent) of the fp8 compute types: problem.FP8_FORMATS


def sum_partials_launch(p: ConvProblem, partials_shape: tuple[int, ...], base: str) -> Launch:
    """dW from grad_weight's f32 partials [S, G, K, F0, F1, F2, C] (depthwise: [S, G, 1, F0, F1, F2, 1]): the
    sum in chunk order, the scale epilogue and the cast to the result type, in the weight's layout."""
    parts, elements = partials_shape[0], math.prod(partials_shape[1:])
    alpha = float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0
    # columns per program: as many as keep SUM_PROGRAMS programs busy (a small weight with many chunks, as
    # depthwise kernels have, still spreads over the GPU), 16 to 256; rows per step fill a 4096-element tile
    block_e = min(256, max(16, 1 << max(0, (elements // SUM_PROGRAMS).bit_length() - 1)))
    block_s = min(matrix_block(parts), 4096 // block_e)
    consts = dict(E=elements, S=parts, T=math.prod(p.filter), C=p.in_channels,
                  C_FIRST=p.weight_layout == "GKCYX", ALPHA=alpha, BLOCK_S=block_s, BLOCK_E=block_e,
                  WIDE=needs_wide(p, parts * elements))
    return Launch("sum_partials", f"{base}_sum", ("fp32", ELEMENT[p.result_dtype]), tuple(consts.items()),
                  (-(-elements // block_e), 1, 1), 4, 1)


def round_fp8_launch(elements: int, dtype: str, kind: str, base: str, as_fp8: bool = False) -> Launch:
    """`elements` values of `dtype` rounded to the fp8 type `kind` (fp8 = e4m3, bf8 = e5m2), stored in f16, or
    with as_fp8 in that type (saturated)."""
    mbits, emin = FP8_FORMATS[kind]
    consts = dict(N=elements, MBITS=mbits, EMIN=emin, FP8_MAX=FP8_MAX[kind] if as_fp8 else 0.0,
                  BLOCK=ELEMENTWISE_BLOCK, WIDE=elements >= WIDE_ELEMENTS)
    return Launch("round_fp8", f"{base}_round_{kind}", (ELEMENT[dtype], FP8_ELEMENT[kind] if as_fp8 else "fp16"),
                  tuple(consts.items()), (-(-elements // ELEMENTWISE_BLOCK), 1, 1), 4, 1)





# f32 operands of the 16-bit kernels as stacked bf16 parts (kernels/elementwise.split_bf16): per product kept, the
# parts of operand A and of operand B.  bf16x3: hi x hi, hi x lo, lo x hi (passes/bf16x3.py; the rules' split);
# bf16x6 adds the three products of about 2^-16 (hi x lo2, lo2 x hi, lo x lo), leaving out what is about 2^-24 of a
# product: measured for exact f32, not taken (its six-fold sums lost accuracy; docs/decisions.md#bf16x3-grad-weight-tma)
SPLIT_PRODUCTS = {"bf16x3": ((0, 0), (0, 1), (1, 0)),
                  "bf16x6": ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1))}


def split_bf16_launch(elements: int, split: str, operand: int, base: str) -> Launch:
    """`elements` f32 values split into bf16 parts, stored once per product of `split` (SPLIT_PRODUCTS) in the
    order of the products: operand 0 (A) or 1 (B)'s part of each."""
    order = tuple(pair[operand] for pair in SPLIT_PRODUCTS[split])
    consts = dict(N=elements, PARTS=max(order) + 1, ORDER=order, BLOCK=ELEMENTWISE_BLOCK,
                  WIDE=len(order) * elements >= WIDE_ELEMENTS)
    return Launch("split_bf16", f"{base}_split_{split}_{operand}", ("fp32", "bf16"), tuple(consts.items()),
                  (-(-elements // ELEMENTWISE_BLOCK), 1, 1), 4, 1)


TRANSPOSE_BLOCK = 64


def transpose_launch(images: int, rows: int, cols: int, dtype: str, base: str) -> Optional[Launch]:
    """y[b, c, r] = x[b, r, c] for `images` planes of rows x cols `dtype` elements (an NGCHW activation's
    [G*C, positions] per image to NHWGC, or back), or None where the grid would pass CUDA's limits."""
    grid = (-(-cols // TRANSPOSE_BLOCK), -(-rows // TRANSPOSE_BLOCK), images)
    if grid[1] > CUDA_MAX_GRID[1] or grid[2] > CUDA_MAX_GRID[2]:
        return None
    consts = dict(ROWS=rows, COLS=cols, BLOCK=TRANSPOSE_BLOCK, WIDE=images * rows * cols >= WIDE_ELEMENTS)
    return Launch("transpose_planes", f"{base}_transpose", (ELEMENT[dtype], ELEMENT[dtype]), tuple(consts.items()),
                  grid, 4, 1)


SPACE_TO_DEPTH_POSITIONS = 64


def space_to_depth_launch(p: ConvProblem, q: ConvProblem, operand: str, base: str
                          ) -> tuple[Launch, tuple[int, ...]]:
    """The copy of p's `operand` ("x" or "w") regrouped space-to-depth into q's (policy.space_to_depth_forward):
    the launch and the copy's shape (q's X or GKYXC weight)."""
    x = operand == "x"
    if x:
        sb, _, sc, *spatial_strides = activation_strides(p, p.input, p.in_channels)
        sizes, lo, blocks, shape = pad3(p.input, 1), pad3(p.pad_lo, 0), p.batch, q.x_shape
        regrouped = pad3(q.input, 1)
    else:
        _, sb, sc, *spatial_strides = weight_strides(p)
        sizes, lo, blocks, shape = pad3(p.filter, 1), (0, 0, 0), p.out_channels, q.w_shape
        regrouped = pad3(q.filter, 1)
    r = pad3(p.stride, 1)
    consts = dict(CH=p.in_channels, SB=sb, SC=sc, S0=spatial_strides[0], S1=spatial_strides[1],
                  S2=spatial_strides[2], I0=sizes[0], I1=sizes[1], I2=sizes[2], R0=r[0], R1=r[1], R2=r[2],
                  LO0=lo[0], LO1=lo[1], LO2=lo[2], J0=regrouped[0], J1=regrouped[1], J2=regrouped[2],
                  BLOCK_J=SPACE_TO_DEPTH_POSITIONS, BLOCK_C=matrix_block(q.in_channels),
                  WIDE=needs_wide(p, math.prod(shape)))
    grid = check_grid(f"{base}_{operand}", (-(-math.prod(regrouped) // SPACE_TO_DEPTH_POSITIONS), blocks, 1))
    return Launch("space_to_depth", f"{base}_{operand}_space_to_depth", (ELEMENT[p.dtype], ELEMENT[p.dtype]),
                  tuple(consts.items()), grid, 4, 1), shape
