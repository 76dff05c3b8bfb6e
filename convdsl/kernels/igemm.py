"""The GEMM cores of forward, grad_input and grad_weight as Triton kernels (CUDA targets), and the direct
(non-GEMM) kernels of their depthwise forms.

IREE 3.13 lowers convdsl's linalg implicit GEMMs for CUDA to mma.sync fed by scalar global loads, with no
cp.async and no ldmatrix (70-95 TFLOP/s on an H100 against cuDNN's 400-700; benchmarks/README.md).  These
kernels are the same implicit GEMMs written tile by tile; Triton pipelines their loads through shared
memory (cp.async or TMA-free wgmma on sm_90) and convdsl links the resulting binary into the IREE module
as an external dispatch (passes/extern.py), so that IREE still owns the buffers, the schedule and the ABI.

Every problem is canonicalised to 3 spatial dimensions (leading dimensions of size 1), and every tensor
is addressed through element strides, so one kernel serves 1D/2D/3D and every layout (NHWGC, GNHWC,
NGCHW; GKYXC, GKCYX).  All shapes are compile-time constants: Triton folds the index arithmetic.

Index algebra (per spatial dimension d; docs/algebra.md, convdsl/algebra.py):
  grad_input, one stride phase (residue r):  dX[i = r + s*q] = sum over taps j < J, channels k of
      dY[o = q + off - j*o_step] * W[y = y0 + j*tap_step]        (o outside [0, O) reads zero)
  forward, the same kernel with one phase (r = 0, unit write stride), the roles of the channels swapped and a
      read stride:  Y[q] = sum over taps j, channels c of X[i = s*q - lo + j*d] * W[j]  (off = -lo, o_step = -d)
  depthwise forward (forward_direct, no GEMM):  Y[n, o, g] = sum over taps t of X[n, i = o*s + t*d - lo, g] * W[g, t]
  grad_weight:  dW[k, y, c] = sum over n, o of dY[n, o, k] * X[n, i = o*s + y*d - lo, c]
      (i outside [0, I) reads zero), the sum over (n, o) cut into S chunks of whole BLOCK_R steps,
      each chunk's f32 partial sum stored apart and added in chunk order afterwards (deterministic).
Packed groups (PACK > 1, few channels per group, ResNeXt-like): PACK consecutive groups form one GEMM of
PACK*C columns and PACK*K reductions (rows for grad_weight) whose weight is block-diagonal: grad_input masks
the off-diagonal weight blocks to zero, grad_weight stores only the diagonal blocks.  The matrix units do
PACK times the useful products, in exchange for tiles of 16 and more (these kernels are bound by memory).
The packed view needs the channels of consecutive groups to be adjacent (NHWGC, NGCHW): launch.py folds
the group stride into the channel stride.
fp8/bf8 compute: the operands arrive already rounded to their fp8 grid and stored in f16 (a linalg pass
before the dispatch), so the kernels multiply exact fp8 values on the f16 path and keep cp.async loads.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wide_index(v, WIDE: tl.constexpr):
    # an index in 64 bits where the launch's tensors need offsets past 32 bits (launch.needs_wide), else as it
    # came (32 bits): every offset is built from program ids, aranges and loop counters passed through here
    if WIDE:
        return tl.cast(v, tl.int64)
    else:
        return v


@triton.jit
def tf32_round(v):
    # f32 -> the nearest TF32 value (10-bit mantissa, ties away from zero, as cvt.rna.tf32.f32): half a TF32 unit
    # added to the magnitude's bits, then the 13 low bits cleared; NaN kept as it is (its payload could carry
    # into the exponent and read as infinity).  Written in integer operations rather than inline PTX so that
    # Triton's interpreter runs it too
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, ROUND_A: tl.constexpr, ROUND_B: tl.constexpr):
    # acc + a @ b.  One-pass TF32 wgmma reads its shared-memory operands K-major (the reduction contiguous); an
    # operand stored the other way (launch.tf32_staged) Triton copied with 4-byte cp.async, 4x the copy
    # instructions of 16-byte ones.  Rounding it to TF32 here makes Triton load it whole into registers and
    # store it K-major for the matrix instructions, and rounds to nearest where wgmma would truncate
    # (docs/decisions.md#tf32-staged)
    if ROUND_A:
        a = tf32_round(a)
    if ROUND_B:
        b = tf32_round(b)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _chunk(steps, SPLIT: tl.constexpr):
    # the reduction steps [first, last) of this program's split-K chunk: even chunks of `steps`, whole when SPLIT = 1
    if SPLIT > 1:
        s = tl.program_id(2)
        return (s * steps) // SPLIT, ((s + 1) * steps) // SPLIT
    else:
        return 0, steps


@triton.jit
def grad_input_phases(
    dy, w, dx,
    # sizes: channels, batch; dY spatial O and stride S per dimension (3 each)
    C: tl.constexpr, K: tl.constexpr, N: tl.constexpr, O: tl.constexpr, S: tl.constexpr,
    # the stride phases: phase p owns programs [FIRST[p], FIRST[p + 1]) (heaviest first); per dimension d and
    # phase p (Q[d][p] ...): positions Q and taps J; dX position i = R + S*q; dY position o = RS*q + OFF - j*OSTEP;
    # tap y = Y0 + j*TSTEP.  RS (read stride) is 1 for grad_input; forward runs as one phase with RS = its stride
    PHASES: tl.constexpr, FIRST: tl.constexpr, RS: tl.constexpr,
    Q: tl.constexpr, J: tl.constexpr, R: tl.constexpr, OFF: tl.constexpr, OSTEP: tl.constexpr, Y0: tl.constexpr,
    TSTEP: tl.constexpr,
    # element strides: dY (n, g, k, o0, o1, o2), W (g, k, c, y0, y1, y2), dX (n, g, c, i0, i1, i2)
    DY: tl.constexpr, W: tl.constexpr, DX: tl.constexpr,
    ALPHA: tl.constexpr, PRECISION: tl.constexpr, PACK: tl.constexpr,
    # one-pass TF32 with dY (A) / W (B) stored with the reduction not contiguous: rounded in registers (mma)
    ROUND_A: tl.constexpr, ROUND_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, WIDE: tl.constexpr,
    # no phase has more than one tap (launch.one_tap): the phases of one tap take the one-tap loop
    ONE_TAP: tl.constexpr,
    # one phase with fewer reduction channels than a tile step holds (an RGB stem's 3): the reduction runs over
    # (taps, channels) flattened, BLOCK_K of them per step, instead of a step per tap
    FLAT: tl.constexpr,
    # split-K (one phase only): program_id(2) = s runs reduction steps [s*T // SPLIT, (s+1)*T // SPLIT) of the
    # phase's T and stores its f32 sum at dX's offsets + s * PART (dX is then the [SPLIT, PART] f32 partials; a
    # sum kernel adds them in order, applies ALPHA and casts): few output tiles with a long reduction fill the GPU
    SPLIT: tl.constexpr, PART: tl.constexpr,
):
    # One launch for every stride phase: each program finds its phase (a uniform branch) and runs that phase's
    # tile with the phase's constants folded in, so dX is written by one dispatch (IREE places it in the
    # caller's buffer; per-phase dispatches tied into one tensor cost a copy of dX and a barrier per phase)
    pid = wide_index(tl.program_id(0), WIDE)
    g = wide_index(tl.program_id(1), WIDE)
    for p in tl.static_range(PHASES):
        if (pid >= FIRST[p]) & (pid < FIRST[p + 1]):
            # phase p's tile (local counts from its first program): a GEMM per (packed) group g with rows
            # m = (n, q0, q1, q2), columns c, reduction (j0, j1, j2, k); PACK > 1: C and K count the PACK
            # groups' channels, column c of sub-group c // (C / PACK) meets only the reductions k of the same
            # sub-group (the weight's other blocks are zero)
            local = pid - FIRST[p]
            M: tl.constexpr = N * Q[0][p] * Q[1][p] * Q[2][p]
            TILES_M: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
            TILES_N: tl.constexpr = (C + BLOCK_N - 1) // BLOCK_N
            K_STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
            # grouped tile order: GROUP_M row tiles share their W columns in L2
            width = GROUP_M * TILES_N
            first_m = (local // width) * GROUP_M
            rows_here = tl.minimum(TILES_M - first_m, GROUP_M)
            tile_m = first_m + (local % width) % rows_here
            tile_n = (local % width) // rows_here

            m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            c = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            kk = wide_index(tl.arange(0, BLOCK_K), WIDE)
            m_ok = m < M
            q2 = m % Q[2][p]
            q1 = (m // Q[2][p]) % Q[1][p]
            q0 = (m // (Q[2][p] * Q[1][p])) % Q[0][p]
            n = m // (Q[2][p] * Q[1][p] * Q[0][p])
            c_ok = c < C
            dy_row = dy + g * DY[1] + n * DY[0]
            if PACK > 1:
                C_SUB: tl.constexpr = C // PACK
                K_SUB: tl.constexpr = K // PACK
                c_sub = c // C_SUB
                w_col = w + (g * PACK + c_sub) * W[0] + (c % C_SUB) * W[2]
            else:
                w_col = w + g * W[0] + c * W[2]

            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FLAT:
                # reduction index r = j * K + k over every tap j and channel k: per step BLOCK_K of them, each
                # column of the A tile its own tap (a 2D window gather), the B tile's rows their own tap and channel
                TAPS: tl.constexpr = J[0][p] * J[1][p] * J[2][p]
                # dY position o = q * RS + (OFF - j * OSTEP): a row part (fixed) and a column part (per step),
                # so that a tile's offsets and bounds cost one add (and a compare per dimension) per element
                r0 = q0 * RS[0]
                r1 = q1 * RS[1]
                r2 = q2 * RS[2]
                row_base = dy_row + r0 * DY[3] + r1 * DY[4] + r2 * DY[5]
                first, last = _chunk((TAPS * K + BLOCK_K - 1) // BLOCK_K, SPLIT)
                for step in tl.range(first, last, num_stages=NUM_STAGES):
                    r = step * BLOCK_K + kk
                    r_ok = r < TAPS * K
                    j = r // K
                    k = r % K
                    j2 = j % J[2][p]
                    j1 = (j // J[2][p]) % J[1][p]
                    j0 = j // (J[2][p] * J[1][p])
                    d0 = OFF[0][p] - j0 * OSTEP[0][p]
                    d1 = OFF[1][p] - j1 * OSTEP[1][p]
                    d2 = OFF[2][p] - j2 * OSTEP[2][p]
                    in_dy = (m_ok[:, None] & r_ok[None, :]
                             & ((r0[:, None] + d0[None, :]) >= 0) & ((r0[:, None] + d0[None, :]) < O[0])
                             & ((r1[:, None] + d1[None, :]) >= 0) & ((r1[:, None] + d1[None, :]) < O[1])
                             & ((r2[:, None] + d2[None, :]) >= 0) & ((r2[:, None] + d2[None, :]) < O[2]))
                    col = d0 * DY[3] + d1 * DY[4] + d2 * DY[5] + k * DY[2]
                    a = tl.load(row_base[:, None] + col[None, :], mask=in_dy, other=0.0)
                    tap = ((Y0[0][p] + j0 * TSTEP[0][p]) * W[3] + (Y0[1][p] + j1 * TSTEP[1][p]) * W[4]
                           + (Y0[2][p] + j2 * TSTEP[2][p]) * W[5])
                    b = tl.load(w_col[None, :] + (tap + k * W[1])[:, None], mask=r_ok[:, None] & c_ok[None, :],
                                other=0.0)
                    acc = mma(a, b, acc, PRECISION, ROUND_A, ROUND_B)
            elif ONE_TAP & (J[0][p] * J[1][p] * J[2][p] == 1) & (PACK == 1):
                # one tap (1x1 filters; stride phases of one tap where no phase has more): each row's dY
                # position is fixed, so the offsets and masks of the rows are formed once and the loop only walks
                # the channels, as a plain GEMM does (the general loop below re-derives them every step: up to
                # 2.9x slower on ResNet-50's 1x1 layers; docs/decisions.md#one-tap-loop)
                o0 = q0 * RS[0] + OFF[0][p]
                o1 = q1 * RS[1] + OFF[1][p]
                o2 = q2 * RS[2] + OFF[2][p]
                row_ok = m_ok & (o0 >= 0) & (o0 < O[0]) & (o1 >= 0) & (o1 < O[1]) & (o2 >= 0) & (o2 < O[2])
                a_ptrs = dy_row[:, None] + (o0 * DY[3] + o1 * DY[4] + o2 * DY[5])[:, None] + (kk * DY[2])[None, :]
                tap = Y0[0][p] * W[3] + Y0[1][p] * W[4] + Y0[2][p] * W[5]
                b_ptrs = w_col[None, :] + (tap + kk * W[1])[:, None]
                first, last = _chunk(K_STEPS, SPLIT)
                a_ptrs += first * BLOCK_K * DY[2]
                b_ptrs += first * BLOCK_K * W[1]
                for step in tl.range(first, last, num_stages=NUM_STAGES):
                    if K % BLOCK_K == 0:  # masks constant along the channels: whole vectors per load
                        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                        b = tl.load(b_ptrs, mask=c_ok[None, :], other=0.0)
                    else:
                        k_ok = kk < K - step * BLOCK_K
                        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                        b = tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
                    acc = mma(a, b, acc, PRECISION, ROUND_A, ROUND_B)
                    a_ptrs += BLOCK_K * DY[2]
                    b_ptrs += BLOCK_K * W[1]
            else:
                first, last = _chunk(J[0][p] * J[1][p] * J[2][p] * K_STEPS, SPLIT)
                for step in tl.range(first, last, num_stages=NUM_STAGES):
                    j = wide_index(step // K_STEPS, WIDE)
                    k = (step % K_STEPS) * BLOCK_K + kk
                    j2 = j % J[2][p]
                    j1 = (j // J[2][p]) % J[1][p]
                    j0 = j // (J[2][p] * J[1][p])
                    o0 = q0 * RS[0] + (OFF[0][p] - j0 * OSTEP[0][p])
                    o1 = q1 * RS[1] + (OFF[1][p] - j1 * OSTEP[1][p])
                    o2 = q2 * RS[2] + (OFF[2][p] - j2 * OSTEP[2][p])
                    row_ok = m_ok & (o0 >= 0) & (o0 < O[0]) & (o1 >= 0) & (o1 < O[1]) & (o2 >= 0) & (o2 < O[2])
                    k_ok = k < K
                    a_ptrs = dy_row[:, None] + (o0 * DY[3] + o1 * DY[4] + o2 * DY[5])[:, None] + (k * DY[2])[None, :]
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    tap = ((Y0[0][p] + j0 * TSTEP[0][p]) * W[3] + (Y0[1][p] + j1 * TSTEP[1][p]) * W[4]
                       + (Y0[2][p] + j2 * TSTEP[2][p]) * W[5])
                    if PACK > 1:
                        b_ptrs = w_col[None, :] + (tap + (k % K_SUB) * W[1])[:, None]
                        diagonal = (k // K_SUB)[:, None] == c_sub[None, :]
                        b = tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :] & diagonal, other=0.0)
                    else:
                        b_ptrs = w_col[None, :] + (tap + k * W[1])[:, None]
                        b = tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
                    acc = mma(a, b, acc, PRECISION, ROUND_A, ROUND_B)

            i0 = R[0][p] + S[0] * q0
            i1 = R[1][p] + S[1] * q1
            i2 = R[2][p] + S[2] * q2
            dx_ptrs = (dx + g * DX[1] + (n * DX[0] + i0 * DX[3] + i1 * DX[4] + i2 * DX[5])[:, None]
                       + (c * DX[2])[None, :])
            if SPLIT > 1:  # this chunk's f32 partial sum; the sum kernel scales and casts
                dx_ptrs += wide_index(tl.program_id(2), WIDE) * PART
                tl.store(dx_ptrs, acc, mask=m_ok[:, None] & c_ok[None, :])
            else:
                out = acc * ALPHA
                tl.store(dx_ptrs, out.to(dx.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


@triton.jit
def grad_weight_partials(
    x, dy, partials,
    # sizes: channels, batch
    C: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
    # sizes per spatial dimension, padded to 3 (I: X, O: dY, F: filter; S stride, D dilation, LO low padding)
    I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
    # element strides: X (n, g, c, i0, i1, i2), dY (n, g, k, o0, o1, o2)
    X: tl.constexpr, DY: tl.constexpr,
    # split-K: chunk s covers reduction steps [s*CHUNK, min((s+1)*CHUNK, L)), CHUNK a multiple of BLOCK_R
    CHUNK: tl.constexpr, G: tl.constexpr,
    # DY_FLAT / X_FLAT: dY's / X's positions lie r * DY[5] / r * X[5] apart (launch.flat_positions);
    # DY_IMAGE: only within an image (channel-first dY), and BLOCK_R divides an image's positions
    DY_FLAT: tl.constexpr, X_FLAT: tl.constexpr, DY_IMAGE: tl.constexpr,
    PRECISION: tl.constexpr, PACK: tl.constexpr,
    # one-pass TF32 with dY (A) / X (B) stored with the positions not contiguous: rounded in registers (mma)
    ROUND_A: tl.constexpr, ROUND_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr,
    WIDE: tl.constexpr,
):
    # GEMM per (packed) group g: rows k, columns (f0, f1, f2, c) (c fastest), reduction (n, o0, o1, o2);
    # partials[s, g, k, f0, f1, f2, c] in f32.  PACK > 1: G, K and C count packed groups and their channels;
    # only the diagonal blocks (row and column of one sub-group) are stored, at their group's place
    L: tl.constexpr = N * O[0] * O[1] * O[2]
    T: tl.constexpr = F[0] * F[1] * F[2]
    COLS: tl.constexpr = T * C
    TILES_N: tl.constexpr = (COLS + BLOCK_N - 1) // BLOCK_N
    pid = wide_index(tl.program_id(0), WIDE)
    g = wide_index(tl.program_id(1), WIDE)
    s = wide_index(tl.program_id(2), WIDE)
    tile_m = pid // TILES_N
    tile_n = pid % TILES_N

    k = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = k < K
    col_ok = col < COLS
    c = col % C
    f = col // C
    f2 = f % F[2]
    f1 = (f // F[2]) % F[1]
    f0 = f // (F[2] * F[1])
    # X position of column (f, c) at output position o: o*S + f*D - LO
    shift0 = f0 * D[0] - LO[0]
    shift1 = f1 * D[1] - LO[1]
    shift2 = f2 * D[2] - LO[2]
    x_col = x + g * X[1] + c * X[2] + shift0 * X[3] + shift1 * X[4] + shift2 * X[5]
    dy_row = dy + g * DY[1] + k * DY[2]
    rr = wide_index(tl.arange(0, BLOCK_R), WIDE)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = s * CHUNK
    for r0 in tl.range(start, tl.minimum(start + CHUNK, L), BLOCK_R, num_stages=NUM_STAGES):
        r = r0 + rr
        r_ok = r < L
        o2 = r % O[2]
        o1 = (r // O[2]) % O[1]
        o0 = (r // (O[2] * O[1])) % O[0]
        n = r // (O[2] * O[1] * O[0])
        if DY_FLAT:  # positions (n, o0, o1, o2) evenly spaced in dY: offset r * stride, no decomposition
            a_ptrs = dy_row[:, None] + (r * DY[5])[None, :]
        elif DY_IMAGE:  # the tile lies in one image n_r: offset n_r * DY[0] + (r - n_r * P) * stride, contiguous
            n_r = r0 // (O[0] * O[1] * O[2])
            a_ptrs = dy_row[:, None] + (n_r * DY[0] + (r - n_r * (O[0] * O[1] * O[2])) * DY[5])[None, :]
        else:
            a_ptrs = dy_row[:, None] + (n * DY[0] + o0 * DY[3] + o1 * DY[4] + o2 * DY[5])[None, :]
        a = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        i0 = (o0 * S[0])[:, None] + shift0[None, :]
        i1 = (o1 * S[1])[:, None] + shift1[None, :]
        i2 = (o2 * S[2])[:, None] + shift2[None, :]
        if WIDE:
            in_x = (i0 >= 0) & (i0 < I[0]) & (i1 >= 0) & (i1 < I[1]) & (i2 >= 0) & (i2 < I[2])
        else:  # 0 <= i < I as one unsigned comparison per dimension
            in_x = ((i0.to(tl.uint32, bitcast=True) < I[0]) & (i1.to(tl.uint32, bitcast=True) < I[1])
                    & (i2.to(tl.uint32, bitcast=True) < I[2]))
        if X_FLAT:  # stride 1 and X's positions laid out as dY's: X offset r * stride (plus the tap's shift)
            b_ptrs = x_col[None, :] + (r * X[5])[:, None]
        else:
            b_ptrs = x_col[None, :] + (n * X[0] + o0 * (S[0] * X[3]) + o1 * (S[1] * X[4]) + o2 * (S[2] * X[5]))[:, None]
        b = tl.load(b_ptrs, mask=in_x & r_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(a, b, acc, PRECISION, ROUND_A, ROUND_B)

    if PACK > 1:
        C_SUB: tl.constexpr = C // PACK
        K_SUB: tl.constexpr = K // PACK
        sub = k // K_SUB
        row = ((s * G + g) * PACK + sub) * K_SUB + k % K_SUB
        out_ptrs = partials + row[:, None] * (T * C_SUB) + (f * C_SUB + c % C_SUB)[None, :]
        diagonal = sub[:, None] == (c // C_SUB)[None, :]
        tl.store(out_ptrs, acc, mask=k_ok[:, None] & col_ok[None, :] & diagonal)
    else:
        out_ptrs = partials + ((s * G + g) * K + k)[:, None] * COLS + col[None, :]
        tl.store(out_ptrs, acc, mask=k_ok[:, None] & col_ok[None, :])


@triton.jit
def grad_input_direct(
    dy, w, dx,
    # depthwise (C = K = 1 per group) grad_input, a sliding window in registers: no GEMM worth the matrix units.
    # Each thread owns channels (a vector of BLOCK_CH over the program's warps) and a program one row
    # (n, i0, i1) of dX, cut into chunks of BLOCK_W positions (unrolled; a multiple of S[2], so every chunk
    # starts on the same stride phase).  Per tap row (f0, f1) the SPAN dY positions the chunk reaches are
    # loaded once and reused by every tap x position of the row, where a tile per tap loaded every product's
    # dY value.
    G: tl.constexpr, N: tl.constexpr,
    # sizes per spatial dimension, padded to 3 (I: X, O: dY, F: filter; S stride, D dilation, LO low padding)
    I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
    # element strides: dY (n, g, k, o0, o1, o2), W (g, k, c, y0, y1, y2), dX (n, g, c, i0, i1, i2)
    DY: tl.constexpr, W: tl.constexpr, DX: tl.constexpr,
    ALPHA: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_CH: tl.constexpr, WIDE: tl.constexpr,
):
    # dX position i2 = w0 + iw takes tap f2 from dY position o2 = (i2 + LO - f2 D) / S where S divides it; with
    # w0 a multiple of S that is o2 = w0 / S + e for e = (iw + LO - f2 D) / S, and e spans [E_LO, E_HI]
    E_LO: tl.constexpr = (LO[2] - (F[2] - 1) * D[2]) // S[2]
    E_HI: tl.constexpr = (BLOCK_W - 1 + LO[2]) // S[2]
    row = wide_index(tl.program_id(0), WIDE)
    ch = wide_index(tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH), WIDE)
    ch_ok = ch < G
    zero = ch * 0  # scalar conditions as vectors (Triton's interpreter makes a scalar's bool an int32)
    i1 = row % I[1]
    i0 = (row // I[1]) % I[0]
    n = row // (I[1] * I[0])
    for w0_ in range(0, I[2], BLOCK_W):
        w0 = wide_index(w0_, WIDE)
        accs = ()
        for iw in tl.static_range(BLOCK_W):
            accs = accs + (tl.zeros((BLOCK_CH,), dtype=tl.float32),)
        # tap rows (f0, f1) in a loop, not unrolled: the unrolled code grows as BLOCK_W x F[2] per row (a 13x13
        # filter unrolled whole took 5 minutes to compile, a 31x31 one did not finish)
        for f01 in range(F[0] * F[1]):
            f0 = f01 // F[1]
            f1 = f01 % F[1]
            # the dY row o = (i + LO - f D) / S, where S divides it (a runtime condition)
            a0 = i0 + (LO[0] - f0 * D[0])
            a1 = i1 + (LO[1] - f1 * D[1])
            row_ok = (ch_ok & (zero + a0 >= 0) & (zero + a0 % S[0] == 0) & (zero + a0 < O[0] * S[0])
                      & (zero + a1 >= 0) & (zero + a1 % S[1] == 0) & (zero + a1 < O[1] * S[1]))
            base = dy + (n * DY[0] + (a0 // S[0]) * DY[3] + (a1 // S[1]) * DY[4]) + ch * DY[1]
            taps = ()  # the row's weights (through L1: every chunk of every dX row reads them)
            for f2 in tl.static_range(tl.constexpr(F[2])):
                taps = taps + (tl.load(w + ch * W[0] + f0 * W[3] + f1 * W[4] + f2 * W[5], mask=ch_ok,
                                       other=0.0).to(tl.float32),)
            dys = ()
            for e in tl.static_range(tl.constexpr(E_HI - E_LO + 1)):
                o2 = w0 // S[2] + (e + E_LO)
                dys = dys + (tl.load(base + o2 * DY[5], mask=row_ok & (zero + o2 >= 0) & (zero + o2 < O[2]),
                                     other=0.0).to(tl.float32),)
            new = ()
            for iw in tl.static_range(BLOCK_W):
                acc = accs[iw]
                for f2 in tl.static_range(tl.constexpr(F[2])):
                    if (iw + LO[2] - f2 * D[2]) % S[2] == 0:
                        acc += dys[(iw + LO[2] - f2 * D[2]) // S[2] - E_LO] * taps[f2]
                new = new + (acc,)
            accs = new
        for iw in tl.static_range(BLOCK_W):
            i2 = w0 + iw
            tl.store(dx + (n * DX[0] + i0 * DX[3] + i1 * DX[4] + i2 * DX[5]) + ch * DX[1],
                     (accs[iw] * ALPHA).to(dx.dtype.element_ty), mask=ch_ok & (zero + i2 < I[2]))


@triton.jit
def forward_direct(
    x, w, y,
    # depthwise (C = K = 1 per group) forward, a sliding window in registers: grad_input_direct's scheme turned
    # around.  Each thread owns channels (a vector of BLOCK_CH over the program's warps) and a program one row
    # (n, o0, o1) of Y, cut into chunks of BLOCK_W positions (unrolled).  Per tap row (f0, f1) the SPAN X
    # positions the chunk reads are loaded once and reused by every tap x position of the row.
    G: tl.constexpr, N: tl.constexpr,
    # sizes per spatial dimension, padded to 3 (I: X, O: Y, F: filter; S stride, D dilation, LO low padding)
    I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
    # element strides: X (n, g, c, i0, i1, i2), W (g, k, c, y0, y1, y2), Y (n, g, k, o0, o1, o2)
    X: tl.constexpr, W: tl.constexpr, Y: tl.constexpr,
    ALPHA: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_CH: tl.constexpr, WIDE: tl.constexpr,
):
    # Y position o2 = w0 + ow takes tap f2 from X position i2 = o2 * S + f2 * D - LO, that is
    # i2 = (w0 * S - LO) + j for j = ow * S + f2 * D, and j spans [0, SPAN)
    SPAN: tl.constexpr = (BLOCK_W - 1) * S[2] + (F[2] - 1) * D[2] + 1
    row = wide_index(tl.program_id(0), WIDE)
    ch = wide_index(tl.program_id(1) * BLOCK_CH + tl.arange(0, BLOCK_CH), WIDE)
    ch_ok = ch < G
    zero = ch * 0  # scalar conditions as vectors (Triton's interpreter makes a scalar's bool an int32)
    o1 = row % O[1]
    o0 = (row // O[1]) % O[0]
    n = row // (O[1] * O[0])
    for w0_ in range(0, O[2], BLOCK_W):
        w0 = wide_index(w0_, WIDE)
        accs = ()
        for ow in tl.static_range(BLOCK_W):
            accs = accs + (tl.zeros((BLOCK_CH,), dtype=tl.float32),)
        # tap rows (f0, f1) in a loop, not unrolled: the unrolled code grows as BLOCK_W x F[2] per row
        for f01 in range(F[0] * F[1]):
            f0 = f01 // F[1]
            f1 = f01 % F[1]
            # the X row i = o * S + f * D - LO (outside X: zeros)
            i0 = o0 * S[0] + (f0 * D[0] - LO[0])
            i1 = o1 * S[1] + (f1 * D[1] - LO[1])
            row_ok = ch_ok & (zero + i0 >= 0) & (zero + i0 < I[0]) & (zero + i1 >= 0) & (zero + i1 < I[1])
            base = x + (n * X[0] + i0 * X[3] + i1 * X[4]) + ch * X[1]
            taps = ()  # the row's weights (through L1: every chunk of every Y row reads them)
            for f2 in tl.static_range(tl.constexpr(F[2])):
                taps = taps + (tl.load(w + ch * W[0] + f0 * W[3] + f1 * W[4] + f2 * W[5], mask=ch_ok,
                                       other=0.0).to(tl.float32),)
            xs = ()
            for j in tl.static_range(SPAN):
                i2 = w0 * S[2] + (j - LO[2])
                xs = xs + (tl.load(base + i2 * X[5], mask=row_ok & (zero + i2 >= 0) & (zero + i2 < I[2]),
                                   other=0.0).to(tl.float32),)
            new = ()
            for ow in tl.static_range(BLOCK_W):
                acc = accs[ow]
                for f2 in tl.static_range(tl.constexpr(F[2])):
                    acc += xs[ow * S[2] + f2 * D[2]] * taps[f2]
                new = new + (acc,)
            accs = new
        for ow in tl.static_range(BLOCK_W):
            o2 = w0 + ow
            tl.store(y + (n * Y[0] + o0 * Y[3] + o1 * Y[4] + o2 * Y[5]) + ch * Y[1],
                     (accs[ow] * ALPHA).to(y.dtype.element_ty), mask=ch_ok & (zero + o2 < O[2]))


@triton.jit
def grad_weight_depthwise(
    x, dy, partials,
    # depthwise (C = K = 1 per group) grad_weight with a sliding window in registers.  A program's tensors are
    # [TAP_ROWS, BLOCK_CH]: tap rows (f0, f1) across threads x channels.  It sweeps ROWS_PER rows (n, o0, o1) of
    # dY, each cut into chunks of BLOCK_W positions (unrolled).  Per chunk the chunk's dY values are loaded
    # once; per group of TAP_ROWS tap rows (GROUPS of them, unrolled) the SPAN X positions of each tap row are
    # loaded once and every one of its F[2] taps x BLOCK_W positions reuses them.  The F[2] x GROUPS f32
    # accumulators are stored at the end into partials[s, g, f0, f1, f2] (the grad_weight partials
    # [S, G, K, taps, C] with K = C = 1).  TAP_ROWS = 1 keeps every tap in a thread (fewest loads: MobileNetV2's
    # 3x3); more keeps a thread's registers at F[2] x GROUPS + BLOCK_W + SPAN (ConvNeXt's 7x7 with every tap a
    # thread's: 254 registers, 8 warps per SM, 0.122 ms; a tap row per warp: 76 registers, 0.097 ms).
    G: tl.constexpr, N: tl.constexpr,
    # sizes per spatial dimension, padded to 3 (I: X, O: dY, F: filter; S stride, D dilation, LO low padding)
    I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
    # element strides: X (n, g, c, i0, i1, i2), dY (n, g, k, o0, o1, o2) (the channel strides unused: C = K = 1)
    X: tl.constexpr, DY: tl.constexpr,
    ROWS_PER: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_CH: tl.constexpr, TAP_ROWS: tl.constexpr,
    WIDE: tl.constexpr,
):
    ROWS: tl.constexpr = N * O[0] * O[1]
    GROUPS: tl.constexpr = (F[0] * F[1] + TAP_ROWS - 1) // TAP_ROWS
    # a chunk of dY positions w0 + [0, BLOCK_W) reads X at (w0 + ow) * S[2] + f2 * D[2] - LO[2], that is at
    # w0 * S[2] - LO[2] + j for j = ow * S[2] + f2 * D[2] < SPAN
    SPAN: tl.constexpr = (BLOCK_W - 1) * S[2] + (F[2] - 1) * D[2] + 1
    ch = wide_index(tl.program_id(0) * BLOCK_CH + tl.arange(0, BLOCK_CH), WIDE)
    s = wide_index(tl.program_id(1), WIDE)
    tr = tl.arange(0, TAP_ROWS)
    ch_ok = (ch < G)[None, :]
    # dY offsets of a position, the same for every tap row (the loads of one warp's copies meet in L1)
    dy_tile = tr[:, None] * 0 + (ch * DY[1])[None, :]
    accs = ()
    for a in tl.static_range(tl.constexpr(GROUPS * F[2])):
        accs = accs + (tl.zeros((TAP_ROWS, BLOCK_CH), dtype=tl.float32),)
    for row in range(s * ROWS_PER, tl.minimum((s + 1) * ROWS_PER, ROWS)):
        o1 = row % O[1]
        o0 = (row // O[1]) % O[0]
        n = row // (O[1] * O[0])
        for w0_ in range(0, O[2], BLOCK_W):
            w0 = wide_index(w0_, WIDE)
            dys = ()
            for ow in tl.static_range(BLOCK_W):
                # positions past the row's end load zeros: their products vanish
                dys = dys + (tl.load(dy + (n * DY[0] + o0 * DY[3] + o1 * DY[4] + (w0 + ow) * DY[5]) + dy_tile,
                                     mask=ch_ok & (dy_tile * 0 + (w0 + ow) < O[2]), other=0.0).to(tl.float32),)
            new = ()
            for grp in tl.static_range(GROUPS):
                f01 = grp * TAP_ROWS + tr
                i0 = o0 * S[0] + ((f01 // F[1]) * D[0] - LO[0])
                i1 = o1 * S[1] + ((f01 % F[1]) * D[1] - LO[1])
                row_ok = ch_ok & ((f01 < F[0] * F[1]) & (i0 >= 0) & (i0 < I[0]) & (i1 >= 0) & (i1 < I[1]))[:, None]
                x_tile = (n * X[0] + i0 * X[3] + i1 * X[4])[:, None] + (ch * X[1])[None, :]
                xs = ()
                for j in tl.static_range(SPAN):
                    i2 = x_tile * 0 + (w0 * S[2] + (j - LO[2]))
                    xs = xs + (tl.load(x + x_tile + i2 * X[5], mask=row_ok & (i2 >= 0) & (i2 < I[2]),
                                       other=0.0).to(tl.float32),)
                for f2 in tl.static_range(tl.constexpr(F[2])):
                    acc = accs[grp * F[2] + f2]
                    for ow in tl.static_range(BLOCK_W):
                        acc += xs[ow * S[2] + f2 * D[2]] * dys[ow]
                    new = new + (acc,)
            accs = new
    for grp in tl.static_range(GROUPS):
        f01 = grp * TAP_ROWS + tr
        out = partials + ((s * G + ch) * (F[0] * F[1] * F[2]))[None, :] + (f01 * F[2])[:, None]
        for f2 in tl.static_range(tl.constexpr(F[2])):
            tl.store(out + f2, accs[grp * F[2] + f2], mask=ch_ok & (f01 < F[0] * F[1])[:, None])


@triton.jit
def _x_row(x_ch, i0, i1, w0, ch_ok, zero, I: tl.constexpr, S: tl.constexpr, LO: tl.constexpr, X: tl.constexpr,
           SPAN: tl.constexpr):
    # grad_weight_depthwise_rows: SPAN positions of X row (i0, i1) from w0 * S[2] - LO[2] on, as f32 (zeros
    # outside X), one tensor of channels each; zero: the kernel's, to test scalars as vectors
    row_ok = ch_ok & (zero + i0 >= 0) & (zero + i0 < I[0]) & (zero + i1 >= 0) & (zero + i1 < I[1])
    xs = ()
    for j in tl.static_range(SPAN):
        i2 = w0 * S[2] + (j - LO[2])
        xs = xs + (tl.load(x_ch + i0 * X[3] + i1 * X[4] + i2 * X[5],
                           mask=row_ok & (zero + i2 >= 0) & (zero + i2 < I[2]), other=0.0).to(tl.float32),)
    return xs


@triton.jit
def grad_weight_depthwise_rows(
    x, dy, partials,
    # depthwise (C = K = 1 per group) grad_weight, every tap in each thread, sliding along dY's rows: the
    # variant of grad_weight_depthwise for S[1] = D[1] = 1, where dY rows o1 and o1 + 1 read F[1] - 1 of the same
    # X rows (i1 = o1 + f1 - LO[1]).  A program owns a segment of SEG rows o1 of one plane (n, o0) and BLOCK_CH
    # channels; per chunk of BLOCK_W positions it keeps the F[0] x (F[1] - 1) X rows the next dY row shares in
    # registers and loads one new X row per f0 and step, where grad_weight_depthwise loads F[1] of them.  Its
    # partial sums go to partials[s, g, f0, f1, f2] for segment s.
    G: tl.constexpr, N: tl.constexpr,
    # sizes per spatial dimension, padded to 3 (I: X, O: dY, F: filter; S stride, D dilation, LO low padding)
    I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, S: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
    # element strides: X (n, g, c, i0, i1, i2), dY (n, g, k, o0, o1, o2) (the channel strides unused: C = K = 1)
    X: tl.constexpr, DY: tl.constexpr,
    SEG: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_CH: tl.constexpr, WIDE: tl.constexpr,
):
    SEGS: tl.constexpr = (O[1] + SEG - 1) // SEG  # segments per plane (n, o0)
    # a chunk of dY positions w0 + [0, BLOCK_W) reads X at w0 * S[2] - LO[2] + j for j < SPAN
    SPAN: tl.constexpr = (BLOCK_W - 1) * S[2] + (F[2] - 1) * D[2] + 1
    KEPT: tl.constexpr = F[1] - 1  # X rows per f0 a dY row shares with the next
    ch = wide_index(tl.program_id(0) * BLOCK_CH + tl.arange(0, BLOCK_CH), WIDE)
    s = wide_index(tl.program_id(1), WIDE)
    ch_ok = ch < G
    zero = ch * 0  # scalar conditions as vectors (Triton's interpreter makes a scalar's bool an int32)
    plane = s // SEGS
    first = (s % SEGS) * SEG
    last = tl.minimum(first + SEG, O[1])
    o0 = plane % O[0]
    n = plane // O[0]
    x_ch = x + n * X[0] + ch * X[1]
    dy_ch = dy + n * DY[0] + o0 * DY[3] + ch * DY[1]
    accs = ()
    for a in tl.static_range(tl.constexpr(F[0] * F[1] * F[2])):
        accs = accs + (tl.zeros((BLOCK_CH,), dtype=tl.float32),)
    for w0_ in range(0, O[2], BLOCK_W):
        w0 = wide_index(w0_, WIDE)
        # the X rows i1 = first + f1 - LO[1] (f1 < KEPT) of every f0, SPAN positions each: index
        # (f0 * KEPT + f1) * SPAN + j
        kept = ()
        for f0 in tl.static_range(tl.constexpr(F[0])):
            for f1 in tl.static_range(KEPT):
                kept = kept + _x_row(x_ch, o0 * S[0] + f0 * D[0] - LO[0], first + (f1 - LO[1]), w0, ch_ok, zero,
                                     I, S, LO, X, SPAN)
        for o1 in range(first, last):
            dys = ()
            for ow in tl.static_range(BLOCK_W):
                # positions past the row's end load zeros: their products vanish
                dys = dys + (tl.load(dy_ch + o1 * DY[4] + (w0 + ow) * DY[5],
                                     mask=ch_ok & (zero + w0 + ow < O[2]), other=0.0).to(tl.float32),)
            # the new X row of every f0: i1 = o1 + KEPT - LO[1]
            fresh = ()
            for f0 in tl.static_range(tl.constexpr(F[0])):
                fresh = fresh + _x_row(x_ch, o0 * S[0] + f0 * D[0] - LO[0], o1 + (KEPT - LO[1]), w0, ch_ok, zero,
                                       I, S, LO, X, SPAN)
            new = ()
            for f0 in tl.static_range(tl.constexpr(F[0])):
                for f1 in tl.static_range(tl.constexpr(F[1])):
                    for f2 in tl.static_range(tl.constexpr(F[2])):
                        acc = accs[(f0 * F[1] + f1) * F[2] + f2]
                        for ow in tl.static_range(BLOCK_W):
                            # (no local for the window index: Triton would carry it through the loop as a tensor)
                            if f1 < KEPT:
                                acc += kept[(f0 * KEPT + f1) * SPAN + ow * S[2] + f2 * D[2]] * dys[ow]
                            else:
                                acc += fresh[f0 * SPAN + ow * S[2] + f2 * D[2]] * dys[ow]
                        new = new + (acc,)
            accs = new
            # slide: row f1 + 1 becomes row f1 for the next dY row
            slid = ()
            for f0 in tl.static_range(tl.constexpr(F[0])):
                for f1 in tl.static_range(KEPT):
                    for j in tl.static_range(SPAN):
                        if f1 + 1 < KEPT:
                            slid = slid + (kept[(f0 * KEPT + f1 + 1) * SPAN + j],)
                        else:
                            slid = slid + (fresh[f0 * SPAN + j],)
            kept = slid
    out = partials + (s * G + ch) * (F[0] * F[1] * F[2])
    for t in tl.static_range(tl.constexpr(F[0] * F[1] * F[2])):
        tl.store(out + t, accs[t], mask=ch_ok)
