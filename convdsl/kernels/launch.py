"""What a kernel launch is, and the index geometry the launch builders and the planning policy share.

A `Launch` is everything a kernel binary depends on, frozen and hashable: the kernel, its compile-time constants
and its grid.  The builders make them (kernels/igemm_launches.py: the cp.async GEMM and direct kernels;
kernels/tma_launches.py: Hopper's TMA kernels; kernels/elementwise_launches.py: the steps around them), and
kernels/compile.py turns one into a `Binary`: a cubin (sm_90: Hopper's wgmma needs the arch-specific sm_90a,
which runs on H100/H200 only) or PTX (other archs: the driver JIT-compiles it for the chip it runs on), with the
facts IREE's external dispatch needs (threads per block, dynamic shared memory, kernel parameter count).  The
mechanics only: which kernel, which tiles, how many split-K chunks and which precision are decided in
convdsl/policy/ and arrive as arguments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..algebra import Phase, dy_padding, grad_input_phases
from ..problem import ConvProblem, weight_axes
from ..targets import CUDA_MAX_GRID
from .tiles import TileConfig

# Kernel parameters Triton appends after the declared ones (global and profile scratch pointers).
# IREE passes bindings, then 32-bit constants; the two extra slots are filled with constants that the
# kernel never reads, which compile_launch checks (scratch sizes 0).
TRITON_TRAILING_PARAMS = 2
POINTER_ALIGNMENT = 16
ELEMENT = {"f16": "fp16", "bf16": "bf16", "f32": "fp32"}


@dataclass(frozen=True)
class Launch:
    kernel: str  # a @triton.jit function of convdsl/kernels/igemm.py (or elementwise.py, tma.py, halo.py)
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


def pack_strides(strides: tuple[int, ...], pack: int) -> tuple[int, ...]:
    """(n, g, channel, s0, s1, s2) of a packed view: a packed group spans PACK groups."""
    return (strides[0], strides[1] * pack, *strides[2:])


def flat_reduction(p: ConvProblem, tiles: TileConfig) -> bool:
    """Forward's reduction over (taps, C) flattened (the kernel's FLAT): where a step's BLOCK_K exceeds C (an RGB
    stem's 3 channels filled 3 of a step's 16) and there are taps to flatten."""
    return tiles.pack == 1 and p.in_channels < tiles.block_k and math.prod(p.filter) > 1


def geometry(p: ConvProblem) -> dict[str, tuple[int, int, int]]:
    """I, O, F (sizes of X, dY, filter), S, D, LO (stride, dilation, low padding), each per dimension padded to
    3D: the kernels' compile-time triples."""
    return dict(I=pad3(p.input, 1), O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1),
                D=pad3(p.dilation, 1), LO=pad3(p.pad_lo, 0))


# --- tiles over grad_weight's reduction, depthwise rows and positions ------------------------------

def depthwise_chunk(extent: int, most: int) -> int:
    """BLOCK_W: the row of `extent` positions cut into the fewest chunks of at most `most`, as even as they
    come (28 positions at most 16: two chunks of 14, not 16 + 12 with four positions masked)."""
    chunks = -(-extent // most)
    return -(-extent // chunks)


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


# --- TMA kernels (kernels/tma.py, kernels/halo.py: sm_90, launched by the stream runner only) -----------

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


def halo_grid(p: ConvProblem, block_m: int) -> HaloGrid:
    f1, f2 = pad3(p.filter, 1)[1:]
    d1, d2 = pad3(p.dilation, 1)[1:]
    o1, o2 = pad3(p.output, 1)[1:]
    width = o2 + (f2 - 1) * d2
    rows = block_m + (f1 - 1) * d1 * width + (f2 - 1) * d2
    slot = -(-rows // HALO_COPY_ROWS) * HALO_COPY_ROWS
    ring = 1 << (3 * slot - 1).bit_length()
    return HaloGrid(width, rows, slot, ring, -(-o1 * width // block_m))


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


# --- the flat planes of the one-pass grad_weight (kernels/tma.grad_weight_flat_tma): TF32, and fp8 compute ---
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
