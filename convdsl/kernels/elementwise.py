"""The steps around the GEMM cores, as Triton kernels, for runtimes that launch the cores themselves (the
stream path, convdsl/stream.py): inside an IREE module the same steps are linalg (passes/lower.py).

  sum_partials:  dW = cast(alpha * sum over s of P[s]) -- grad_weight's f32 split-K partials [S, E] summed in a
                 fixed order (rows s = j, j + BLOCK_S, ... per lane j, then the lanes by one tree: the same order
                 on every call, so the result is bitwise-reproducible), stored in the weight's layout: GKYXC
                 keeps the partials' (g, k, taps, c) order; GKCYX moves c before the taps:
                 offset (g, k) * C*T + c * T + t.  Each program sums BLOCK_E columns over all S rows.
  transpose_planes: y[b, c, r] = x[b, r, c] per image b: the NGCHW <-> NHWGC copies around the kernels
                 (an image's [G*C, positions] plane and its transpose), tiled so that both sides are coalesced.
  round_fp8:     each value rounded to the nearest fp8 (e4m3) or bf8 (e5m2) value, ties to even, stored in
                 f16 (exact), or in the fp8 type itself, saturated at its largest finite value: v -> rint(v * 2^-q) * 2^q, q = max(e, emin) - m, e the f32 exponent; both
                 scalings are exact.  rint(w) for |w| < 2^22 is (w + 1.5 * 2^23) - 1.5 * 2^23 in f32: the
                 addition rounds to an integer, ties to even (here |w| < 2^(m+1)).  Stored in f16, values beyond
                 the fp8 range are not saturated (as the linalg pass).
  pad_planes:    y[z, r, f] = round(x[n, g, c, i0, j1 - LO1, j2 - LO2]) for rows r = (n, g, c) and flat positions
                 f + SIGN * z = i0 * P1 * P2 + j1 * P2 + j2 of a P1 x P2 plane, zero outside x: X and dY (LO = 0,
                 I1 x I2 = O1 x O2) channel-first for the flat grad_weight, copy z shifted by z positions
                 (launch.flat_planes); x is read through its strides (any layout), the spatial sizes and strides
                 in the planes' order.  round: to TF32 (f32 kept), or with FP8 to the fp8 grid as round_fp8,
                 saturated at the type's largest finite value, and stored in y's fp8 type.
  split_bf16:    y[j, i] = part ORDER[j] of x[i], for each block j of ORDER: an f32 operand split into PARTS bf16
                 values, p0 = bf16(v) (nearest, ties to even), p1 = bf16(v - p0), p2 = bf16(v - p0 - p1) (each
                 difference exact in f32), stacked along its outermost axis as bf16.  The blocks of two operands
                 pair up into the products kept: bf16x3 (compute = "bf16x3", or TF32 done so) X3 = [X0; X0; X1],
                 dY3 = [dY0; dY1; dY0] along N (passes/bf16x3.py has the algebra); bf16x6 (f32) adds p0 x p2,
                 p2 x p0 and p1 x p1, dropping terms of about 2^-24 of a product, f32's own rounding.
  space_to_depth: y[b, j0, j1, j2, (r0, r1, r2, c)] = x[b, j0 * R0 + r0 - LO0, j1 * R1 + r1 - LO1,
                 j2 * R2 + r2 - LO2, c] (0 outside x): a few-channel strided forward's X (b = n) and weight
                 (b = k, LO = 0, taps past the filter 0) regrouped R0 x R1 x R2 into the channels, so that the
                 convolution runs with stride 1 (policy.space_to_depth_forward has the algebra); x is read
                 through its strides, y written contiguous with the channels innermost.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .igemm import tf32_round, wide_index


@triton.jit
def sum_partials(p, out, E: tl.constexpr, S: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
                 C_FIRST: tl.constexpr, ALPHA: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                 WIDE: tl.constexpr):
    e = wide_index(tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E), WIDE)
    inside = e < E
    rows = wide_index(tl.arange(0, BLOCK_S), WIDE)
    lanes = tl.zeros([BLOCK_S, BLOCK_E], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + rows
        lanes += tl.load(p + s[:, None] * E + e[None, :], mask=(s[:, None] < S) & inside[None, :], other=0.0)
    acc = tl.sum(lanes, axis=0) * ALPHA
    if C_FIRST:
        c = e % C
        t = (e // C) % T
        offset = (e // (C * T)) * (C * T) + c * T + t
    else:
        offset = e
    tl.store(out + offset, acc.to(out.dtype.element_ty), mask=inside)


# 1.5 * 2^23: adding it to an f32 of magnitude under 2^22 leaves no fraction bits (round to nearest even)
RINT_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def fp8_grid(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    # f32 v -> the nearest value of the fp8 grid of MBITS mantissa bits and smallest normal exponent EMIN, ties to
    # even, in f32 (module docstring: round_fp8)
    biased = (v.to(tl.int32, bitcast=True) >> 23) & 255
    q = tl.maximum(biased, EMIN + 127) - MBITS
    up = ((254 - q) << 23).to(tl.float32, bitcast=True)
    down = (q << 23).to(tl.float32, bitcast=True)
    scaled = v * up
    whole = (scaled + RINT_MAGIC) - RINT_MAGIC
    return whole * down


@triton.jit
def round_fp8(x, y, N: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FP8_MAX: tl.constexpr,
              BLOCK: tl.constexpr, WIDE: tl.constexpr):
    i = wide_index(tl.program_id(0), WIDE) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    v = fp8_grid(tl.load(x + i, mask=inside, other=0.0).to(tl.float32), MBITS, EMIN)
    if FP8_MAX > 0:  # stored as fp8: saturated at the type's largest finite value (exact in it)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    tl.store(y + i, v.to(y.dtype.element_ty), mask=inside)


@triton.jit
def bf16_nearest(v):
    # f32 -> the nearest bf16 value, ties to even, still in f32 (exact in bf16, so any conversion keeps it):
    # 0x7FFF plus the lowest kept bit added to the bits, then the low 16 cleared; NaN kept as it is.  Integer
    # operations, so that Triton's interpreter (whose own conversion truncates) rounds alike
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)


@triton.jit
def split_bf16(x, y, N: tl.constexpr, PARTS: tl.constexpr, ORDER: tl.constexpr, BLOCK: tl.constexpr,
               WIDE: tl.constexpr):
    i = wide_index(tl.program_id(0), WIDE) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    v = tl.load(x + i, mask=inside, other=0.0)
    p0 = bf16_nearest(v)
    p1 = bf16_nearest(v - p0)
    p2 = p1
    if PARTS == 3:
        p2 = bf16_nearest((v - p0) - p1)
    for j in tl.static_range(tl.constexpr(len(ORDER))):
        part = p0
        if ORDER[j] == 1:
            part = p1
        elif ORDER[j] == 2:
            part = p2
        tl.store(y + j * N + i, part.to(tl.bfloat16), mask=inside)


@triton.jit
def transpose_planes(x, y, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    # y[b, c, r] = x[b, r, c]: each of the grid's z images, a [ROWS, COLS] plane, transposed a BLOCK x BLOCK tile
    # per program (Triton moves the tile through shared memory, so loads and stores are both coalesced)
    c = wide_index(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), WIDE)
    r = wide_index(tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), WIDE)
    plane = wide_index(tl.program_id(2), WIDE) * (ROWS * COLS)
    inside = (r < ROWS)[:, None] & (c < COLS)[None, :]
    tile = tl.load(x + plane + r[:, None] * COLS + c[None, :], mask=inside)
    tl.store(y + plane + c[None, :] * ROWS + r[:, None], tile, mask=inside)


@triton.jit
def pad_planes(x, y, CH: tl.constexpr, G: tl.constexpr, SN: tl.constexpr, SG: tl.constexpr, SC: tl.constexpr,
               S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, I0: tl.constexpr, I1: tl.constexpr,
               I2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, LO1: tl.constexpr, LO2: tl.constexpr,
               L: tl.constexpr, ROWS: tl.constexpr, SIGN: tl.constexpr, COPIES: tl.constexpr, FP8: tl.constexpr,
               MBITS: tl.constexpr, EMIN: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_F: tl.constexpr, WIDE: tl.constexpr):
    # a [BLOCK_R rows, BLOCK_F positions] tile per program, for every copy z (shifted by SIGN * z positions: the
    # same source lines again, from the cache); Triton moves each tile through shared memory between the loads
    # (contiguous along the channels in NHWGC) and the stores (contiguous along the positions)
    r = wide_index(tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), WIDE)
    f = wide_index(tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F), WIDE)
    n = r // (G * CH)
    g = (r // CH) % G
    c = r % CH
    rows = r < ROWS
    row_base = n * SN + g * SG + c * SC
    for z in tl.static_range(COPIES):
        fp = f + SIGN * z
        i0 = fp // (P1 * P2)
        i1 = (fp // P2) % P1 - LO1
        i2 = fp % P2 - LO2
        inside = (fp >= 0) & (i0 < I0) & (i1 >= 0) & (i1 < I1) & (i2 >= 0) & (i2 < I2)
        v = tl.load(x + row_base[:, None] + (i0 * S0 + i1 * S1 + i2 * S2)[None, :],
                    mask=rows[:, None] & inside[None, :], other=0.0)
        if FP8:  # on the fp8 grid, saturated: exact in the fp8 type, whatever rounding the conversion has
            v = tl.minimum(tl.maximum(fp8_grid(v.to(tl.float32), MBITS, EMIN), -FP8_MAX), FP8_MAX)
        else:
            v = tf32_round(v)
        tl.store(y + (z * ROWS + r)[:, None] * L + f[None, :], v.to(y.dtype.element_ty),
                 mask=rows[:, None] & (f < L)[None, :])


@triton.jit
def space_to_depth(x, y, CH: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                   S2: tl.constexpr, I0: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr, R0: tl.constexpr,
                   R1: tl.constexpr, R2: tl.constexpr, LO0: tl.constexpr, LO1: tl.constexpr, LO2: tl.constexpr,
                   J0: tl.constexpr, J1: tl.constexpr, J2: tl.constexpr, BLOCK_J: tl.constexpr,
                   BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    # BLOCK_J positions j of image (or output channel) b = program_id(1), all R0*R1*R2*CH channels of each
    CHANNELS: tl.constexpr = R0 * R1 * R2 * CH
    J: tl.constexpr = J0 * J1 * J2
    j = wide_index(tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J), WIDE)
    b = wide_index(tl.program_id(1), WIDE)
    cc = tl.arange(0, BLOCK_C)
    c = cc % CH
    r2 = (cc // CH) % R2
    r1 = (cc // (CH * R2)) % R1
    r0 = cc // (CH * R2 * R1)
    i0 = ((j // (J1 * J2)) * R0)[:, None] + r0[None, :] - LO0
    i1 = (((j // J2) % J1) * R1)[:, None] + r1[None, :] - LO1
    i2 = ((j % J2) * R2)[:, None] + r2[None, :] - LO2
    written = (j < J)[:, None] & (cc < CHANNELS)[None, :]
    inside = written & (i0 >= 0) & (i0 < I0) & (i1 >= 0) & (i1 < I1) & (i2 >= 0) & (i2 < I2)
    v = tl.load(x + b * SB + (c * SC)[None, :] + i0 * S0 + i1 * S1 + i2 * S2, mask=inside, other=0.0)
    tl.store(y + (b * J + j)[:, None] * CHANNELS + cc[None, :], v, mask=written)
