"""From a ConvProblem to Triton launches (kernel, compile-time constants, grid) and their binaries.

A `Launch` is everything a kernel binary depends on, frozen and hashable: `compile_launch` turns it into
a cubin (sm_90: Hopper's wgmma needs the arch-specific sm_90a, which runs on H100/H200 only) or PTX
(other archs: the driver JIT-compiles it for the chip it runs on), with the facts IREE's external
dispatch needs (threads per block, dynamic shared memory, kernel parameter count).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Optional

from ..algebra import Phase, grad_input_phases
from ..problem import ConvProblem
from .tiles import TileConfig, matrix_block

# Kernel parameters Triton appends after the declared ones (global and profile scratch pointers).
# IREE passes bindings, then 32-bit constants; the two extra slots are filled with constants that the
# kernel never reads, which compile_launch checks (scratch sizes 0).
TRITON_TRAILING_PARAMS = 2
POINTER_ALIGNMENT = 16
PTX_VERSION = 80
ELEMENT = {"f16": "fp16", "bf16": "bf16", "f32": "fp32"}
# Hopper has 132 SMs (H100 SXM) or 132 (H200); the split-K and tile heuristics aim at a few waves of them
SM_COUNT = 132


@dataclass(frozen=True)
class Launch:
    kernel: str  # a @triton.jit function of convdsl/kernels/igemm.py
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


# --- canonical 3D strides --------------------------------------------------------------------

def _pad3(values: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    return tuple([fill] * (3 - len(values)) + list(values))  # type: ignore[return-value]


def activation_strides(p: ConvProblem, spatial: tuple[int, ...], channels: int) -> tuple[int, ...]:
    """Element strides (n, g, channel, s0, s1, s2) of an activation in p's layout, spatial padded to 3D."""
    sp = _pad3(spatial, 1)
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


def weight_strides(p: ConvProblem) -> tuple[int, ...]:
    """Element strides (g, k, c, y0, y1, y2) of the weight in p's weight layout, taps padded to 3D."""
    f = _pad3(p.filter, 1)
    taps, c, k = math.prod(f), p.in_channels, p.out_channels
    if p.weight_layout == "GKYXC":
        y2, y1, y0 = c, c * f[2], c * f[2] * f[1]
        return (k * taps * c, taps * c, 1, y0, y1, y2)
    y2, y1, y0 = 1, f[2], f[2] * f[1]
    return (k * c * taps, c * taps, taps, y0, y1, y2)


def _precision(p: ConvProblem) -> str:
    # f32: three-pass TF32 on the tensor cores (about f32's accuracy; error measured against the f64
    # reference in the GPU tests); compute = "bf16x3": three bf16 products, as the linalg form does;
    # compute = "tf32": one-pass TF32 (cuDNN's default for f32 convolutions) for grad_input, a third of the
    # products.  Measured on an H100 (results/*tf32*): CK 15's 3D dgrad 11.45 -> 7.45 ms (error 6.9e-4), but
    # CK's 3D grad_weight 19.7 -> 30.9 ms: with one-pass TF32 Triton copies both operands, stored MN-major,
    # with 4-byte cp.async instead of 16-byte ones (144 against 36 per tile step, seen in the PTX), so
    # grad_weight keeps three passes: the permission is not used where it does not pay
    if p.dtype != "f32":
        return "ieee"  # 16-bit operands: exact products, f32 accumulation
    if p.bf16x3:
        return "bf16x3"
    return "tf32" if p.tf32 and p.op != "grad_weight" else "tf32x3"


def operand_element(p: ConvProblem) -> str:
    """Element type the kernels read: fp8/bf8 compute arrives rounded to its grid and stored in f16 (every
    e4m3 and e5m2 value is exact in f16), the same products as fp8 matrix instructions with f32 sums.
    Measured on an H100: rounding inside the kernel broke its cp.async pipeline in run 14 (79 TFLOP/s); with
    Triton 3.9 it keeps the pipeline, on the f16 or on the fp8 matrix instructions, but its conversions cost
    what the two rounding passes do (CK 3D fp8 wgrad 3.34-3.36 ms against 3.30-3.35; results/*ab1*)."""
    return "fp16" if p.fp8_compute else ELEMENT[p.dtype]


# --- packed groups ---------------------------------------------------------------------------

def default_pack(p: ConvProblem) -> int:
    """Groups per GEMM for grouped kernels with few channels (C or K under 32, depthwise excepted: it has
    its own kernels): enough that the packed C and K reach 32, as far as the group count divides, in layouts
    where consecutive groups' channels are adjacent (packable).  Measured on an H100 (results/*tune5*),
    ResNeXt's C = K = 4: 8 groups per GEMM took dgrad 0.187 -> 0.127 ms and wgrad 0.283 -> 0.175 ms
    against 4 groups (the linalg gather form: 0.252 and 0.466); depthwise kernels packed 16 to a GEMM were
    1.3x-1.8x slower than the depthwise kernels."""
    small = min(p.in_channels, p.out_channels)
    if p.groups == 1 or p.depthwise or small >= 32 or not packable(p):
        return 1
    pack = 1
    while pack * small < 32 and p.groups % (2 * pack) == 0:
        pack *= 2
    return pack


def packable(p: ConvProblem) -> bool:
    """Packed groups read C*PACK (K*PACK) channels with one channel stride: the group stride of X, dX and
    dY must be the channel stride times C (K), as in NHWGC and NGCHW, not GNHWC."""
    x_str = activation_strides(p, p.input, p.in_channels)
    dy_str = activation_strides(p, p.output, p.out_channels)
    return x_str[1] == p.in_channels * x_str[2] and dy_str[1] == p.out_channels * dy_str[2]


def _packed(p: ConvProblem, pack: int) -> tuple[int, int, int]:
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

def default_grad_input_tiles(p: ConvProblem) -> TileConfig:
    """Tiles for shapes the tuning database does not hold, from the H100 search (results/*tune4*): columns as
    wide as C up to 256 (DeepLab and w2v2 dgrad: 1.42x and 1.11x over 128), three stages for the widest;
    few-channel groups packed (default_pack)."""
    pack = default_pack(p)
    _, c, k = _packed(p, pack)
    block_n = matrix_block(c, 256)
    wide = p.dtype == "f32"
    block_k = matrix_block(k, 32 if wide else 64)
    return TileConfig(128, block_n, block_k, warps=8 if block_n >= 128 else 4,
                      stages=3 if wide or block_n >= 128 else 4, pack=pack)


def grad_input_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """One launch for every stride phase (all-zero phases too: their programs store zeros): phase p's programs
    write the dX positions i = r + s*q of its residue r; together they write every element of dX once.
    Phases are ordered by taps, heaviest first, so that the short ones fill the last wave.  Measured on an
    H100 (ncu, run 18): a dispatch per phase, tied into one dX, made IREE copy dX into the caller's buffer
    afterwards (CK 17: 0.30 ms of kernels in a 0.48 ms call)."""
    tiles.check_matrix()
    phases = sorted(grad_input_phases(p), key=lambda ph: -math.prod(d.J for d in ph.dims))
    groups, c, k = _packed(p, tiles.pack)
    dy_str = _pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    dx_str = _pack_strides(activation_strides(p, p.input, p.in_channels), tiles.pack)
    w_str = weight_strides(p)  # the kernel finds each sub-group's weight block itself
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
        C=c, K=k, N=p.batch, O=_pad3(p.output, 1), S=_pad3(p.stride, 1),
        PHASES=len(phases), FIRST=tuple(first), **per_phase,
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        PRECISION=_precision(p), PACK=tiles.pack,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_STAGES=tiles.stages,
    )
    elem = operand_element(p)
    return Launch("grad_input_phases", f"{base}_phases", (elem, elem, ELEMENT[p.result_dtype]),
                  tuple(consts.items()), (first[-1], groups, 1), tiles.warps, tiles.stages)


def _geometry(p: ConvProblem) -> dict[str, tuple[int, int, int]]:
    """I, O, F (sizes of X, dY, filter), S, D, LO (stride, dilation, low padding), each per dimension padded to
    3D: the kernels' compile-time triples."""
    return dict(I=_pad3(p.input, 1), O=_pad3(p.output, 1), F=_pad3(p.filter, 1), S=_pad3(p.stride, 1),
                D=_pad3(p.dilation, 1), LO=_pad3(p.pad_lo, 0))


def _pad_phase(ph: Phase) -> list[dict[str, int]]:
    # leading unit dimensions: one residue, one tap at y = 0 reading o = q
    unit = dict(r=0, y0=0, J=1, tap_step=1, off=0, o_step=1, Q=1)
    dims = [dict(r=d.r, y0=d.y0, J=d.J, tap_step=d.tap_step, off=d.off, o_step=d.o_step, Q=d.Q)
            for d in ph.dims]
    return [unit] * (3 - len(dims)) + dims


def direct_grad_input_tiles(p: ConvProblem) -> TileConfig:
    """grad_input_direct: chunks of at most block_m positions along the innermost dimension x block_n channels
    over the warps (block_k unused), two channels per thread.  On an H100 (results/*dg1*, *dg2*) MobileNetV2's
    depthwise dgrad took 0.093-0.094 ms with 32 x 128 and two warps, 0.102-0.104 with 16 x 64 and one warp;
    0.112-0.118 before the window (a tile of positions x channels, every tap's dY value loaded)."""
    block_n = 128 if p.groups >= 128 else 64 if p.groups >= 64 else 32
    return TileConfig(32, block_n, 1, warps=max(1, block_n // 64), stages=1)


# grad_input_direct unrolls BLOCK_W x F[2] products per filter row and channel: chunks are cut shorter for wide
# filters so that this stays bounded (a 31x31 filter: chunks of 4 positions)
UNROLLED_PRODUCTS = 128


def grad_input_direct_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """Depthwise: one launch, a program per dX row (n, i0, i1) and block of channels; the row's chunks are a
    multiple of the stride along it (every chunk starts on stride phase 0)."""
    dy_str = activation_strides(p, p.output, p.out_channels)
    dx_str = activation_strides(p, p.input, p.in_channels)
    w_str = weight_strides(p)
    in3, stride, f2 = _pad3(p.input, 1), _pad3(p.stride, 1)[2], _pad3(p.filter, 1)[2]
    chunk = depthwise_chunk(in3[2], min(tiles.block_m, max(1, UNROLLED_PRODUCTS // f2)))
    consts = dict(
        G=p.groups, N=p.batch,
        **_geometry(p),
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        BLOCK_W=-(-chunk // stride) * stride, BLOCK_CH=tiles.block_n,
    )
    grid = (p.batch * in3[0] * in3[1], -(-p.groups // tiles.block_n), 1)
    elem = operand_element(p)
    return Launch("grad_input_direct", f"{base}_direct", (elem, elem, ELEMENT[p.result_dtype]), tuple(consts.items()),
                  grid, tiles.warps, tiles.stages)


# --- grad_weight -----------------------------------------------------------------------------

def default_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """Rows (K) as tall as K up to 128, 128 columns (taps x C); f32 with 64 columns and 4 warps, which
    took CK's 3D f32 grad_weight from 39.0 to 22.2 ms on an H100 (results/*tune4*); few-channel groups
    packed (default_pack)."""
    pack = default_pack(p)
    _, _, k = _packed(p, pack)
    block_m = matrix_block(k, 128)
    if p.dtype == "f32":
        return TileConfig(block_m, 64, 32, warps=4, stages=3, pack=pack)
    return TileConfig(block_m, 128, 64, warps=8 if block_m >= 128 else 4, stages=3 if block_m >= 128 else 4,
                      pack=pack)


def grad_weight_split(p: ConvProblem, tiles: TileConfig) -> tuple[int, int]:
    """(S, CHUNK): the reduction over L = N * prod(O) is cut into S chunks of CHUNK steps (a multiple of
    the tile's reduction step, the last chunk shorter).  S is forced (tiles.split, then the problem's split_k)
    or the fewest chunks whose programs fill the GPU's resident slots best (last_wave_fill), at most 256
    chunks of at least 8 reduction steps (each chunk adds a weight-sized f32 partial to write and sum).
    CHUNK = ceil(steps / S) steps; S is then recomputed so that no chunk is empty."""
    groups, c, k = _packed(p, tiles.pack)
    tiles_out = groups * -(-k // tiles.block_m) * -(-(c * math.prod(p.filter)) // tiles.block_n)
    length = p.batch * math.prod(p.output)
    steps = -(-length // tiles.block_k)
    parts = tiles.split or p.split_k
    if not parts:
        slots = SM_COUNT * resident_programs(tiles, 4 if p.dtype == "f32" else 2)
        parts = fullest_split(tiles_out, slots, max(1, min(256, steps // 8)))
    parts = max(1, min(parts, steps))
    chunk = -(-steps // parts) * tiles.block_k
    return -(-length // chunk), chunk


# Hopper: 228 KiB of shared memory per SM, 1 KiB of it reserved per resident block; 64 warps per SM
SHARED_PER_SM, SHARED_RESERVED, WARPS_PER_SM = 228 * 1024, 1024, 64


def resident_programs(tiles: TileConfig, element_bytes: int) -> int:
    """Programs of a GEMM kernel resident on one SM at once, as its pipeline's shared memory (stages x (A + B)
    tiles; as ncu reported for these kernels) and its warps allow (registers are not known before compiling)."""
    shared = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * element_bytes
    return max(1, min(SHARED_PER_SM // (shared + SHARED_RESERVED), WARPS_PER_SM // tiles.warps))


def fullest_split(tiles_out: int, slots: int, most: int) -> int:
    """The fewest chunks S <= most (the longest chunks) whose tiles_out x S programs keep the slots within 2% as
    busy as the best S does."""
    fill = {s: last_wave_fill(tiles_out * s, slots) for s in range(1, most + 1)}
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= best - 0.02)


def last_wave_fill(programs: int, slots: int) -> float:
    """The share of the resident slots the programs keep busy over their waves: 1.0 when they come in whole
    waves.  Measured (ncu, H100): CK's NGCHW grad_weight ran 280 programs on 264 slots, a second wave of 16."""
    waves = -(-programs // slots)
    return programs / (waves * slots)


# grad_weight_depthwise's filters with more taps than this spread their tap rows across threads (a thread
# holding every tap of ConvNeXt's 7x7 needed 254 registers)
TAPS_PER_THREAD_MOST = 16


def tap_rows(p: ConvProblem) -> int:
    """grad_weight_depthwise's TAP_ROWS: 1 (every tap in each thread) for small filters, else the filter's rows
    (f0, f1) padded to a power of two (one thread per tap row and channel).  Measured on an H100 (results/*dwF*):
    MobileNetV2's 3x3 0.114 ms with every tap a thread's against 0.118-0.142 ms with rows across threads;
    ConvNeXt's 7x7 0.122 against 0.097."""
    f = _pad3(p.filter, 1)
    if f[0] * f[1] * f[2] <= TAPS_PER_THREAD_MOST:
        return 1
    return 1 << (f[0] * f[1] - 1).bit_length()


def depthwise_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """grad_weight_depthwise: chunks of at most block_m positions along the innermost dimension (unrolled, cut
    evenly: depthwise_chunk) x block_n channels, one element of the [TAP_ROWS, block_n] tensors per thread.
    On an H100 (results/*dwE*, *dwF*): MobileNetV2's 3x3 0.106-0.114 ms with chunks of 8, 0.113 with 32;
    ConvNeXt's 7x7 (tap rows across warps) 0.097 with 32 (a whole row of 28), 0.146-0.182 with 8 or 16."""
    rows = tap_rows(p)
    return TileConfig(8 if rows == 1 else 32, 32, 1, warps=min(16, rows), stages=1)


def depthwise_chunk(extent: int, most: int) -> int:
    """BLOCK_W: the row of `extent` positions cut into the fewest chunks of at most `most`, as even as they
    come (28 positions at most 16: two chunks of 14, not 16 + 12 with four positions masked)."""
    chunks = -(-extent // most)
    return -(-extent // chunks)


def slides_along_rows(p: ConvProblem) -> bool:
    """grad_weight_depthwise_rows applies: every tap in each thread (tap_rows 1), and consecutive dY rows o1
    share X rows (stride and dilation 1 along that dimension, at least two filter rows)."""
    g = _geometry(p)
    return tap_rows(p) == 1 and g["S"][1] == 1 and g["D"][1] == 1 and g["F"][1] >= 2


def grad_weight_depthwise_launch(p: ConvProblem, tiles: TileConfig, base: str) -> tuple[Launch, tuple[int, ...]]:
    """Depthwise grad_weight: f32 partials [S, G, 1, taps, 1] of S chunks of dY rows (n, o0, o1) (tiles.split,
    else programs for 16 warps per SM: bound by memory and latency, many loads in flight, and the partials
    few enough for one linalg sum), summed like grad_weight_launch's.  Where slides_along_rows, the chunks
    are segments of rows within a plane (n, o0) and the kernel slides along them (grad_weight_depthwise_rows)."""
    blocks = -(-p.groups // tiles.block_n)
    out3 = _pad3(p.output, 1)
    rows = p.batch * out3[0] * out3[1]
    parts = max(1, min(rows, tiles.split or 16 * SM_COUNT // (blocks * tiles.warps)))
    x_str = activation_strides(p, p.input, p.in_channels)
    dy_str = activation_strides(p, p.output, p.out_channels)
    common = dict(G=p.groups, N=p.batch, **_geometry(p), X=x_str, DY=dy_str)
    block_w = depthwise_chunk(out3[2], tiles.block_m)
    elem = operand_element(p)
    if slides_along_rows(p):
        # segments of seg rows o1 per plane (n, o0), as many as the parts asked for, cut evenly
        planes = p.batch * out3[0]
        per_plane = min(out3[1], -(-parts // planes))
        seg = -(-out3[1] // per_plane)
        parts = planes * -(-out3[1] // seg)  # no segment empty
        consts = dict(common, SEG=seg, BLOCK_W=block_w, BLOCK_CH=tiles.block_n)
        kernel = "grad_weight_depthwise_rows"
    else:
        rows_per = -(-rows // parts)
        parts = -(-rows // rows_per)  # no chunk empty
        consts = dict(common, ROWS_PER=rows_per, BLOCK_W=block_w, BLOCK_CH=tiles.block_n, TAP_ROWS=tap_rows(p))
        kernel = "grad_weight_depthwise"
    launch = Launch(kernel, f"{base}_depthwise", (elem, elem, "fp32"), tuple(consts.items()),
                    (blocks, parts, 1), tiles.warps, tiles.stages)
    return launch, (parts, p.groups, 1, *_pad3(p.filter, 1), 1)


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


def dy_read_in_place(p: ConvProblem, tiles: TileConfig) -> bool:
    """NGCHW grad_weight: whether the GEMM kernel reads dY in place, with only X copied channels-last.
    X must be copied: its taps shift it along NGCHW's contiguous axis, which no vector load can follow.
    dY is not shifted: where its reduction tiles lie within images, each is contiguous (the kernel's DY_IMAGE
    addressing), so it needs no copy."""
    return (p.op == "grad_weight" and p.layout == "NGCHW" and not (p.depthwise and tiles.pack == 1)
            and tiles_within_images(p, tiles))


def grad_weight_launch(p: ConvProblem, tiles: TileConfig, base: str,
                       x_layout: Optional[str] = None) -> tuple[Launch, tuple[int, ...]]:
    """The launch and the shape of its f32 partials [S, G, K, F0, F1, F2, C] (filter padded to 3D; packed
    groups store their diagonal blocks there, so the shape is the same).  x_layout: the layout of the copy
    of X the kernel reads (dy_read_in_place), where it is not p's."""
    tiles.check_matrix()
    parts, chunk = grad_weight_split(p, tiles)
    groups, c, k = _packed(p, tiles.pack)
    x_problem = p.with_(layout=x_layout) if x_layout else p
    x_str = _pack_strides(activation_strides(x_problem, p.input, p.in_channels), tiles.pack)
    dy_str = _pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    f3 = _pad3(p.filter, 1)
    dy_flat = flat_positions(dy_str, _pad3(p.output, 1))
    consts = dict(
        C=c, K=k, N=p.batch,
        **_geometry(p),
        X=x_str, DY=dy_str,
        CHUNK=chunk, G=groups,
        DY_FLAT=dy_flat,
        X_FLAT=p.input == p.output and all(s == 1 for s in p.stride) and flat_positions(x_str, _pad3(p.input, 1)),
        DY_IMAGE=not dy_flat and image_flat_positions(dy_str, _pad3(p.output, 1)) and tiles_within_images(p, tiles),
        PRECISION=_precision(p), PACK=tiles.pack,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_k, NUM_STAGES=tiles.stages,
    )
    cols = c * math.prod(p.filter)
    grid = (-(-k // tiles.block_m) * -(-cols // tiles.block_n), groups, parts)
    elem = operand_element(p)
    launch = Launch("grad_weight_partials", f"{base}_partials", (elem, elem, "fp32"), tuple(consts.items()),
                    grid, tiles.warps, tiles.stages)
    return launch, (parts, p.groups, p.out_channels, *f3, p.in_channels)


# --- compiling -------------------------------------------------------------------------------

def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def arch_number(arch: str) -> int:
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if not match:
        raise ValueError(f"arch: expected sm_XY, got {arch!r}")
    return int(match.group(1))


@functools.lru_cache(maxsize=None)
def compile_launch(launch: Launch, arch: str) -> Binary:
    """Compile one launch with Triton for `arch` (no GPU needed: Triton's LLVM and its bundled ptxas)."""
    import triton  # planned only where it is installed (unsupported_reason)
    from triton.backends.compiler import GPUTarget

    from . import igemm

    fn = getattr(igemm, launch.kernel)
    arg_names = fn.arg_names
    pointers = arg_names[: len(launch.pointer_types)]
    signature = {name: "*" + t for name, t in zip(pointers, launch.pointer_types)}
    signature.update({name: "constexpr" for name in arg_names[len(pointers):]})
    constexprs = dict(launch.constants)
    missing = set(arg_names[len(pointers):]) - set(constexprs)
    if missing:
        raise ValueError(f"launch {launch.name}: no value for {sorted(missing)}")
    number = arch_number(arch)
    # every binding starts 16-byte aligned (IREE aligns buffers and their suballocations to at least 64
    # bytes): without this fact Triton loads one element at a time and cannot pipeline through cp.async
    attrs = {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i in range(len(pointers))}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # fp fusion (fma) on, Triton's historical default: the products and sums of the GEMM are fused anyway
    options = {"num_warps": launch.warps, "num_stages": launch.stages, "enable_fp_fusion": True}
    if number < 90:
        # PTX for the driver to JIT: ISA 8.0 (CUDA 12.0), which any driver of the last years accepts;
        # Triton's default follows its own ptxas and can be newer than the driver on the machine
        options["ptx_version"] = PTX_VERSION
    kernel = triton.compile(source, target=GPUTarget("cuda", number, 32), options=options)
    meta = kernel.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"launch {launch.name}: Triton asked for scratch memory, which IREE cannot pass")
    ptx = kernel.asm["ptx"]
    params = len(re.findall(r"\.param\s+\.", ptx.split(")", 1)[0]))
    expected = len(launch.pointer_types) + TRITON_TRAILING_PARAMS
    if params != expected:
        raise RuntimeError(f"launch {launch.name}: kernel has {params} parameters, expected {expected}")
    entry = meta.name
    if number >= 90:
        data, kind = kernel.asm["cubin"], "cubin"
    else:
        data, kind = ptx.encode(), "ptx"
    return Binary(entry, data, kind, threads=32 * launch.warps, shared_bytes=int(meta.shared), params=params)


# --- when the external kernels apply -----------------------------------------------------------

MAX_ELEMENTS = 2**31 - 1  # the kernels index with 32-bit offsets


def unsupported_reason(p: ConvProblem, backend: str, arch: str) -> Optional[str]:
    """Why this kernel keeps the linalg form on this target (None: the Triton GEMM core applies)."""
    from ..passes import gather

    if backend != "cuda":
        return f"the external kernels are CUDA kernels; target is {backend}"
    if arch_number(arch) < 80:
        return f"the kernels need sm_80 or newer (cp.async, bf16 mma); target is {arch}"
    if p.op == "forward":
        return "forward keeps the linalg form (no external kernel for it)"
    if p.dynamic_batch:
        return "batch = ?: the kernels are specialised to every size"
    if p.epilogue.kind == "bilinear":
        return "the bilinear epilogue's tensor is added by the linalg form"
    if not p.depthwise and gather.applies(p) and default_pack(p) == 1:
        return "few channels per group in a layout whose groups cannot be packed: the gather form is used"
    sizes = (p.x_shape, p.y_shape, p.w_shape)
    if any(math.prod(s) > MAX_ELEMENTS for s in sizes):
        return "a tensor has 2^31 elements or more"
    if triton_version() is None:
        return "triton is not installed"
    return None


def relayout_ngchw(p: ConvProblem) -> bool:
    """NGCHW: whether the kernels run on NHWGC copies (False: they read NGCHW through its strides).
    Measured on an H100 (results/*v15a*): Ascend's 3D dgrad 0.81 -> 0.14 ms with the copies (channels
    strided by D*H*W defeat the tiles' vector loads), CK's NGCHW wgrad 0.337 -> 0.336 ms."""
    return True


def kernel_tiles(p: ConvProblem, tiles: Optional[TileConfig]) -> TileConfig:
    """The tiles plan_launches uses for p: `tiles`, else the defaults of the kernel p runs on."""
    if tiles is not None:
        return tiles
    if p.op == "grad_weight":
        return depthwise_grad_weight_tiles(p) if p.depthwise else default_grad_weight_tiles(p)
    return direct_grad_input_tiles(p) if direct_grad_input(p) else default_grad_input_tiles(p)


def plan_launches(p: ConvProblem, tiles: Optional[TileConfig], x_layout: Optional[str] = None
                  ) -> tuple[TileConfig, tuple[Launch, ...], tuple[int, ...]]:
    """(tiles, launches, f32 partials' shape for grad_weight) of one kernel, symbols named after it;
    tiles None: the defaults of the kernel it uses (kernel_tiles).  x_layout: grad_weight's GEMM kernel reads
    a copy of X in that layout (dy_read_in_place)."""
    base = re.sub(r"\W", "_", p.name)
    packed = tiles is not None and tiles.pack > 1  # depthwise too, as packed GEMMs, where tiles ask for it
    if x_layout and (p.op != "grad_weight" or (p.depthwise and not packed)):
        raise ValueError(f"x_layout: only grad_weight's GEMM kernel reads a copy of X ({p.name})")
    tiles = kernel_tiles(p, tiles)
    if p.op == "grad_weight" and p.depthwise and not packed:
        launch, partials = grad_weight_depthwise_launch(p, tiles, base)
        return tiles, (launch,), partials
    if p.op == "grad_weight":
        launch, partials = grad_weight_launch(p, tiles, base, x_layout)
        return tiles, (launch,), partials
    if direct_grad_input(p) and not packed:
        return tiles, (grad_input_direct_launch(p, tiles, base),), ()
    return tiles, (grad_input_launch(p, tiles, base),), ()


def direct_grad_input(p: ConvProblem) -> bool:
    """Depthwise grad_input: direct sums.  Measured on an H100 (results/*v15b*): MobileNetV2's depthwise
    dgrad 0.131 ms (linalg depthwise form 0.172, cuDNN 0.114); ResNeXt's C = K = 4 groups took 0.64-9.4 ms
    with the tiles tried (its linalg gather form: 0.23), so grouped grad_input keeps the gather form."""
    return p.op in ("grad_input", "transposed") and p.depthwise
