"""Hopper forward convolution with TMA im2col copies and wgmma, written in Gluon (Triton's tile-level dialect).

The GEMM kernels of igemm.py gather their activation windows with cp.async, each thread computing its own
addresses and border masks.  Hopper's TMA unit has an im2col mode that does this in hardware: given the
first output pixel of a tile, a filter tap (the im2col offsets) and the pixel box the convolution sweeps, it
copies BLOCK_M pixels x BLOCK_K channels of X into shared memory, zero outside the image, walking across rows
and images.  This kernel feeds wgmma from a ring of STAGES such copies (mbarrier per stage), keeping one
matrix product in flight while the next copies land.

Index algebra (NHWGC / NDHWGC activations, GKYXC weights; group g is program_id(2)):
    Y[n, o, g, k] = sum over taps t, channels c of X[n, o * s - lo + t * d, g, c] * W[g, k, t, c]
rows m = (n, o0, o1, o2) of Y's pixels, columns k, reduction (t, c) in steps of BLOCK_K channels of one tap.
The copy for step (t, cb) starts at pixel box coordinate o * s - lo of the tile's first row, channel
g * C + cb * BLOCK_K, with im2col offset t * d; the box is [-lo, (O - 1) * s + 1 - lo) per dimension, stepped by
s (TMA's element strides), so that it holds exactly O pixels (tma_launches.forward_tma_launch).  W is read as
a [G * K, taps * C] matrix, Y written as [N * O, G * K].  C is a multiple of BLOCK_K, and with several groups K
a multiple of BLOCK_N, so that no copy reaches into the next group or tap (policy.tma_forward_reason).
FLIPPED (1): stride-1 grad_input as this forward over dY (policy.grad_input_as_forward), reading grad_input's own
weight [G * C, taps * K] (its K is this kernel's C) with the taps in reverse order, in [BLOCK_K, BLOCK_N] tiles.
FLIPPED 2 (one-pass TF32, whose wgmma reads B K-major only): the same over grad_input's weight copied K-innermost
(GYXCK, policy.weight_copy_axes), a [G * taps * K, C] matrix in this kernel's terms: the tile of tap t is the
[BLOCK_N, BLOCK_K] box at row (g * taps + taps - 1 - t) * K + off_k, as a plain forward's tile.

SWAPPED (forward_tma, 16-bit): the product transposed, Y^T[k, m] = sum W[k, (t, c)] X^T[(t, c), m], the weight
tile as wgmma's A and the window as its N-major B; its accumulator is the tile transposed, stored transposed.
Measured no faster than the rule's tiles (docs/decisions.md#tma-narrow); the rules leave it off.

forward_tma_persistent: forward_tma with as many programs as the SMs hold at once (policy.tma_forward_programs),
each taking tiles t = pid, pid + programs, ... (column tiles innermost, then row tiles, then groups); a program's
steps over all its tiles are one sequence, so the ring holds the next tile's first copies while a tile's last
products finish and its result is stored.

grad_input_phases_tma: strided grad_input, each stride phase (docs/algebra.md) a stride-1 forward of dY over the
phase's taps of the weight, flipped, all phases in one persistent launch: one im2col map over dY whose box holds
the most positions of any phase, a phase whose window starts higher reading it through larger im2col offsets,
and dX stored by address (a phase's rows are every s-th position of dX, not a box of it).

SPECIALISED (grad_weight_tma, forward_tma): the copies are issued by a warp of its own (gl.warp_specialize) that
waits on each stage's `empty` barrier, which the product warps arrive at once the stage's product is done; without
it the product warps issue the copies themselves, after a barrier of all of them.

grad_weight_flat_tma: grad_weight in one-pass TF32 or fp8 compute over channel-first copies of X and dY on one
flat position index, where every tap is a constant shift (kernels/launch.py, flat_planes, has the algebra): both
operands are plain K-major boxes, as TF32 and fp8 wgmma read them.
"""
from __future__ import annotations

from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)


@constexpr_function
def _warps_per_cta(block_m, num_warps):
    # wgmma's atom is 4 warps along M (16 rows each); more warps tile M while it has rows left, then N
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@constexpr_function
def _instr_n(block_m, block_n, num_warps):
    # the widest wgmma N (a multiple of 8 up to 256) that divides the warps' share of BLOCK_N
    reps_m = -(-block_m // 16)
    reps_n = -(-num_warps // reps_m)
    most = max(block_n // reps_n, 8)
    n = 256
    while n > most or block_n % n != 0:
        n -= 8
    return n


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    # one mbarrier per stage of the copy ring, each completed by its stage's copies
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _zero_accumulator(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_WIDTH: gl.constexpr, num_warps: gl.constexpr):
    # the f32 accumulator in wgmma's register layout; K_WIDTH: the instruction's K (32 bytes of operands)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=_warps_per_cta(BLOCK_M, num_warps),
        instr_shape=[16, _instr_n(BLOCK_M, BLOCK_N, num_warps), K_WIDTH])
    return gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)


@gluon.jit
def _issue(x_desc, w_desc, a_buf, b_buf, bar, step, n, c0, c1, c2, g, off_k,
           F: gl.constexpr, D: gl.constexpr, C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr,
           BLOCK_K: gl.constexpr, FLIPPED: gl.constexpr):
    # the copies of reduction step `step` = (tap t, channel block cb): X's window for tap t, and W's tile: [BLOCK_N,
    # BLOCK_K] of [G*K, taps*C], or FLIPPED 1 (grad_input's own weight, [G*C, taps*K]) [BLOCK_K, BLOCK_N] of tap
    # F-1-t, or FLIPPED 2 (its K-innermost copy, [G*taps*K, C]) [BLOCK_N, BLOCK_K] of tap F-1-t
    x_channel = g * C
    CB: gl.constexpr = C // BLOCK_K
    t = step // CB
    cb = step % CB
    t2 = t % F[2]
    t1 = (t // F[2]) % F[1]
    t0 = t // (F[2] * F[1])
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if DIMS == 3:
        tma.async_load_im2col(x_desc, [n, c0, c1, c2, x_channel + cb * BLOCK_K],
                              [(t0 * D[0]).to(gl.int16), (t1 * D[1]).to(gl.int16), (t2 * D[2]).to(gl.int16)],
                              bar, a_buf)
    elif DIMS == 2:
        tma.async_load_im2col(x_desc, [n, c1, c2, x_channel + cb * BLOCK_K],
                              [(t1 * D[1]).to(gl.int16), (t2 * D[2]).to(gl.int16)], bar, a_buf)
    else:
        tma.async_load_im2col(x_desc, [n, c2, x_channel + cb * BLOCK_K], [(t2 * D[2]).to(gl.int16)], bar, a_buf)
    if FLIPPED == 1:
        tma.async_load(w_desc, [g * C + cb * BLOCK_K, (F[0] * F[1] * F[2] - 1 - t) * K + off_k], bar, b_buf)
    elif FLIPPED == 2:
        tma.async_load(w_desc, [(g * F[0] * F[1] * F[2] + F[0] * F[1] * F[2] - 1 - t) * K + off_k, cb * BLOCK_K],
                       bar, b_buf)
    else:
        tma.async_load(w_desc, [g * K + off_k, t * C + cb * BLOCK_K], bar, b_buf)


@gluon.jit
def _forward_product(a_buf, b_buf, acc, FLIPPED: gl.constexpr, PROMOTE: gl.constexpr, SWAPPED: gl.constexpr):
    # one step's product, issued: A is X's [BLOCK_M, BLOCK_K] window, B the weight's tile ([BLOCK_K, BLOCK_N]
    # already where FLIPPED 1, stored N-major: wgmma reads 16-bit B either way; else [BLOCK_N, BLOCK_K]).
    # SWAPPED (16-bit): the transposed product acc^T[BLOCK_N, BLOCK_M] += W^T X^T, the weight as wgmma's A
    if SWAPPED:
        if FLIPPED == 1:
            acc = warpgroup_mma(b_buf.permute((1, 0)), a_buf.permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(b_buf, a_buf.permute((1, 0)), acc, is_async=True)
    elif FLIPPED == 1:
        acc = warpgroup_mma(a_buf, b_buf, acc, is_async=True)
    elif PROMOTE > 0:  # fp8: each step's products summed in wgmma's own accumulator, then added in f32
        acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, max_num_imprecise_acc=PROMOTE, is_async=True)
    else:
        acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _forward_products(a_bufs, b_bufs, ready, empty, steps, acc, FLIPPED: gl.constexpr, PROMOTE: gl.constexpr,
                      SWAPPED: gl.constexpr, STAGES: gl.constexpr):
    # the product warps of the warp-specialised kernel: one product in flight, and once the step before is done
    # its stage is released
    for step in range(steps):
        st = step % STAGES
        mbarrier.wait(ready.index(st), (step // STAGES) & 1)
        acc = _forward_product(a_bufs.index(st), b_bufs.index(st), acc, FLIPPED, PROMOTE, SWAPPED)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=step > 0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def _forward_loads(x_desc, w_desc, a_bufs, b_bufs, ready, empty, steps, n, c0, c1, c2, g, off_k,
                   F: gl.constexpr, D: gl.constexpr, C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr,
                   BLOCK_K: gl.constexpr, FLIPPED: gl.constexpr, STAGES: gl.constexpr):
    # the copy warp of the warp-specialised kernel: each step's copies into its stage once the products of the
    # step STAGES before have released it (mbarriers start with phase 1 complete: the first round passes)
    for step in range(steps):
        st = step % STAGES
        mbarrier.wait(empty.index(st), ((step // STAGES) & 1) ^ 1)
        _issue(x_desc, w_desc, a_bufs.index(st), b_bufs.index(st), ready.index(st), step, n, c0, c1, c2, g, off_k,
               F, D, C, K, DIMS, BLOCK_K, FLIPPED)


@gluon.jit
def _window_origin(off_m, O: gl.constexpr, S: gl.constexpr, LO: gl.constexpr):
    # a tile's first output pixel (n, o0, o1, o2) from its first row, and where its window starts in X
    o2 = off_m % O[2]
    o1 = (off_m // O[2]) % O[1]
    o0 = (off_m // (O[2] * O[1])) % O[0]
    n = off_m // (O[2] * O[1] * O[0])
    return n, o0 * S[0] - LO[0], o1 * S[1] - LO[1], o2 * S[2] - LO[2]


@gluon.jit
def _operand_ring(x_desc, w_desc, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, FLIPPED: gl.constexpr):
    # the forward kernels' ring: X's [BLOCK_M, BLOCK_K] windows and the weight's tiles, [BLOCK_K, BLOCK_N] where
    # FLIPPED 1, else [BLOCK_N, BLOCK_K]; fp8 compute: X and W in their own fp8 types (wgmma takes e4m3 x e5m2)
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    if FLIPPED == 1:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    return a_bufs, b_bufs


@gluon.jit
def _tile_origin(tile, O: gl.constexpr, S: gl.constexpr, LO: gl.constexpr, K: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # a persistent program's tile number -> its first row off_m, column off_k, group g, and where its window
    # starts in X (n, c0, c1, c2).  Column tiles innermost, then row tiles, then groups: the programs resident
    # together read the same windows
    COL_TILES: gl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    ROW_TILES: gl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
    off_k = (tile % COL_TILES) * BLOCK_N
    off_m = ((tile // COL_TILES) % ROW_TILES) * BLOCK_M
    g = tile // (COL_TILES * ROW_TILES)
    n, c0, c1, c2 = _window_origin(off_m, O, S, LO)
    return off_m, off_k, g, n, c0, c1, c2


@gluon.jit
def _issue_flat_step(x_desc, w_desc, a_buf, b_buf, bar, j, pid, programs,
                     O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                     C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr, ROWS: gl.constexpr, STEPS: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, FLIPPED: gl.constexpr):
    # the copies of a persistent program's j-th step: step j % STEPS of its (j // STEPS)-th tile
    off_m, off_k, g, n, c0, c1, c2 = _tile_origin(pid + (j // STEPS) * programs, O, S, LO, K, ROWS, BLOCK_M, BLOCK_N)
    _issue(x_desc, w_desc, a_buf, b_buf, bar, j % STEPS, n, c0, c1, c2, g, off_k, F, D, C, K, DIMS, BLOCK_K, FLIPPED)


@gluon.jit
def forward_tma_persistent(x_desc, w_desc, y_desc,
                           O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                           C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, ROWS: gl.constexpr,
                           DIMS: gl.constexpr, STAGES: gl.constexpr, FLIPPED: gl.constexpr, PROMOTE: gl.constexpr,
                           num_warps: gl.constexpr):
    # forward_tma with fewer programs than tiles (ROWS output pixels x K columns x G groups of them), each taking
    # tiles pid, pid + programs, ...: a program's steps over all its tiles are one sequence j, so that the copies
    # of its next tile's first steps are in flight while this tile's last products finish and its result is
    # stored (that store waited for only when the next result reuses its buffer)
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    STEPS: gl.constexpr = F[0] * F[1] * F[2] * (C // BLOCK_K)
    TILES: gl.constexpr = ((ROWS + BLOCK_M - 1) // BLOCK_M) * ((K + BLOCK_N - 1) // BLOCK_N) * G
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    total = ((TILES - pid + programs - 1) // programs) * STEPS

    a_bufs, b_bufs = _operand_ring(x_desc, w_desc, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, FLIPPED)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
    bars = _barriers(STAGES)

    for i in gl.static_range(STAGES - 1):
        if i < total:
            _issue_flat_step(x_desc, w_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), i, pid, programs,
                             O, F, S, D, LO, C, K, DIMS, ROWS, STEPS, BLOCK_M, BLOCK_N, BLOCK_K, FLIPPED)
    # a loop over the program's tiles around one over a tile's steps (ptxas keeps a product in flight only where
    # the accumulator is read outside the loop that issues the products); j counts steps over all tiles
    # where the copies are: the origin of the tile of step STAGES - 1, the first the loop issues, worked out again
    # only when the copies move on to the next tile
    _m, ld_k, ld_g, ld_n, ld_c0, ld_c1, ld_c2 = _tile_origin(pid + ((STAGES - 1) // STEPS) * programs, O, S, LO, K,
                                                             ROWS, BLOCK_M, BLOCK_N)
    j = 0
    for tile in range(pid, TILES, programs):
        acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // dtype.primitive_bitwidth, num_warps)
        for step in range(STEPS):
            s = j % STAGES
            mbarrier.wait(bars.index(s), (j // STAGES) & 1)
            acc = _forward_product(a_bufs.index(s), b_bufs.index(s), acc, FLIPPED, PROMOTE, False)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            nxt = j + STAGES - 1
            if nxt < total:
                nstep = nxt % STEPS
                if nstep == 0:
                    _m, ld_k, ld_g, ld_n, ld_c0, ld_c1, ld_c2 = _tile_origin(pid + (nxt // STEPS) * programs, O, S,
                                                                             LO, K, ROWS, BLOCK_M, BLOCK_N)
                ns = nxt % STAGES
                _issue(x_desc, w_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns), nstep, ld_n, ld_c0, ld_c1,
                       ld_c2, ld_g, ld_k, F, D, C, K, DIMS, BLOCK_K, FLIPPED)
            j += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        off_m, off_k, g, n, c0, c1, c2 = _tile_origin(tile, O, S, LO, K, ROWS, BLOCK_M, BLOCK_N)
        tma.store_wait(pendings=0)  # the previous tile's result has left y_smem
        y_smem.store(acc.to(y_desc.dtype))
        fence_async_shared()
        tma.async_store(y_desc, [off_m, g * K + off_k], y_smem)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def forward_tma(x_desc, w_desc, y_desc,
                # output pixels, filter, stride, dilation, low padding per spatial dimension (3 each; 2D: first 1)
                O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr, STAGES: gl.constexpr,
                FLIPPED: gl.constexpr, PROMOTE: gl.constexpr, SPECIALISED: gl.constexpr, SWAPPED: gl.constexpr,
                num_warps: gl.constexpr):
    # SPECIALISED: one warp of its own issues the copies, the num_warps product warps only wait for them.
    # SWAPPED: the accumulator is the tile transposed, [BLOCK_N, BLOCK_M] (16-bit only; see _forward_product)
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    STEPS: gl.constexpr = F[0] * F[1] * F[2] * (C // BLOCK_K)

    off_m = gl.program_id(0) * BLOCK_M
    off_k = gl.program_id(1) * BLOCK_N
    g = gl.program_id(2)
    n, c0, c1, c2 = _window_origin(off_m, O, S, LO)
    a_bufs, b_bufs = _operand_ring(x_desc, w_desc, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, FLIPPED)
    bars = _barriers(STAGES)

    if SWAPPED:
        acc = _zero_accumulator(BLOCK_N, BLOCK_M, 256 // dtype.primitive_bitwidth, num_warps)
    else:
        acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // dtype.primitive_bitwidth, num_warps)

    if SPECIALISED:
        empty = _barriers(STAGES)
        acc = gl.warp_specialize([
            (_forward_products, (a_bufs, b_bufs, bars, empty, STEPS, acc, FLIPPED, PROMOTE, SWAPPED, STAGES)),
            (_forward_loads, (x_desc, w_desc, a_bufs, b_bufs, bars, empty, STEPS, n, c0, c1, c2, g, off_k,
                              F, D, C, K, DIMS, BLOCK_K, FLIPPED, STAGES)),
        ], [1], [40])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(empty.index(i))
    else:
        # prologue: the first STAGES - 1 steps' copies in flight
        for i in gl.static_range(STAGES - 1):
            if i < STEPS:
                _issue(x_desc, w_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), i, n, c0, c1, c2, g, off_k,
                       F, D, C, K, DIMS, BLOCK_K, FLIPPED)
        for step in range(STEPS):
            s = step % STAGES
            mbarrier.wait(bars.index(s), (step // STAGES) & 1)
            acc = _forward_product(a_bufs.index(s), b_bufs.index(s), acc, FLIPPED, PROMOTE, SWAPPED)
            # the previous step's product is done: its stage takes the copies of step + STAGES - 1
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            nxt = step + STAGES - 1
            if nxt < STEPS:
                ns = nxt % STAGES
                _issue(x_desc, w_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns), nxt, n, c0, c1, c2, g,
                       off_k, F, D, C, K, DIMS, BLOCK_K, FLIPPED)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    y_smem = gl.allocate_shared_memory(y_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
    if SWAPPED:
        y_smem.store(gl.permute(acc, (1, 0)).to(y_desc.dtype))
    else:
        y_smem.store(acc.to(y_desc.dtype))
    fence_async_shared()
    tma.async_store(y_desc, [off_m, g * K + off_k], y_smem)
    tma.store_wait(pendings=0)


@constexpr_function
def _lanes_n(block_n):
    # lanes of a warp along a stored row: 8 elements (16 bytes) each, as many as the tile's columns take
    return min(32, block_n // 8)


@gluon.jit
def _pick3(ph, TABLE: gl.constexpr, PHASES: gl.constexpr):
    # phase ph's 3-tuple of a per-phase constexpr table (ph is known only at run time: summed over the phases)
    v0 = ph * 0
    v1 = ph * 0
    v2 = ph * 0
    for i in gl.static_range(PHASES):
        hit = (ph == i).to(gl.int32)
        v0 += hit * TABLE[i][0]
        v1 += hit * TABLE[i][1]
        v2 += hit * TABLE[i][2]
    return v0, v1, v2


@gluon.jit
def _phase_tile(tile, PHASES: gl.constexpr, PJ: gl.constexpr, PY: gl.constexpr, PSH: gl.constexpr,
                QM: gl.constexpr, LOM: gl.constexpr, K: gl.constexpr, G: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # a tile of grad_input_phases_tma -> its phase and, within the phase's forward, what _tile_origin gives, with
    # the phase's taps J, first filter tap y0 and window shift per dimension.  Phases outermost (heaviest first)
    TPP: gl.constexpr = ((ROWS + BLOCK_M - 1) // BLOCK_M) * ((K + BLOCK_N - 1) // BLOCK_N) * G
    ph = tile // TPP
    off_m, off_k, g, n, c0, c1, c2 = _tile_origin(tile % TPP, QM, (1, 1, 1), LOM, K, ROWS, BLOCK_M, BLOCK_N)
    j0, j1, j2 = _pick3(ph, PJ, PHASES)
    y0, y1, y2 = _pick3(ph, PY, PHASES)
    h0, h1, h2 = _pick3(ph, PSH, PHASES)
    return ph, off_m, off_k, g, n, c0, c1, c2, j0, j1, j2, y0, y1, y2, h0, h1, h2


@gluon.jit
def _issue_phase(x_desc, w_desc, a_buf, b_buf, bar, step, n, c0, c1, c2, g, off_k, j0, j1, j2, y0, y1, y2, h0, h1, h2,
                 TS: gl.constexpr, OS: gl.constexpr, FF: gl.constexpr, C: gl.constexpr, K: gl.constexpr,
                 DIMS: gl.constexpr, BLOCK_K: gl.constexpr):
    # the copies of a phase's reduction step (tap t = (t0, t1, t2) of its J, channel block cb): dY's window at
    # the phase's shift h + t * o_step, and of grad_input's [G*K, taps*C] weight the [BLOCK_K, BLOCK_N] tile of
    # filter tap y0 + (J - 1 - t) * tap_step (the phase's taps flipped: algebra.phases_1d reads dY at
    # q + off - j * o_step for tap j; t = J - 1 - j)
    CB: gl.constexpr = C // BLOCK_K
    t = step // CB
    cb = step % CB
    t2 = t % j2
    t1 = (t // j2) % j1
    t0 = t // (j2 * j1)
    tap = ((y0 + (j0 - 1 - t0) * TS[0]) * FF[1] + y1 + (j1 - 1 - t1) * TS[1]) * FF[2] + y2 + (j2 - 1 - t2) * TS[2]
    channel = g * C + cb * BLOCK_K
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if DIMS == 3:
        tma.async_load_im2col(x_desc, [n, c0, c1, c2, channel],
                              [(h0 + t0 * OS[0]).to(gl.int16), (h1 + t1 * OS[1]).to(gl.int16),
                               (h2 + t2 * OS[2]).to(gl.int16)], bar, a_buf)
    elif DIMS == 2:
        tma.async_load_im2col(x_desc, [n, c1, c2, channel],
                              [(h1 + t1 * OS[1]).to(gl.int16), (h2 + t2 * OS[2]).to(gl.int16)], bar, a_buf)
    else:
        tma.async_load_im2col(x_desc, [n, c2, channel], [(h2 + t2 * OS[2]).to(gl.int16)], bar, a_buf)
    tma.async_load(w_desc, [channel, tap * K + off_k], bar, b_buf)


@gluon.jit
def _store_phase_rows(dx_ptr, acc, ph, off_m, off_k, g, PHASES: gl.constexpr, PR: gl.constexpr, PQ: gl.constexpr,
                      QM: gl.constexpr, I: gl.constexpr, S: gl.constexpr, K: gl.constexpr, G: gl.constexpr,
                      ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    # a phase tile's rows into dX by address: row (n, q) is dX's position r + s * q; rows past the phase's own Q
    # positions (the window holds QM) and past the last image are dropped.  Through shared memory into 16 bytes
    # of a row a thread (from the accumulator's own registers, two columns a thread, ran 1.2x-1.6x slower)
    LANES_N: gl.constexpr = _lanes_n(BLOCK_N)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_N, LANES_N], [num_warps, 1], [1, 0])
    values = gl.convert_layout(acc.to(dx_ptr.dtype.element_ty), layout)
    r0, r1, r2 = _pick3(ph, PR, PHASES)
    e0, e1, e2 = _pick3(ph, PQ, PHASES)
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = off_k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    q2 = rows % QM[2]
    q1 = (rows // QM[2]) % QM[1]
    q0 = (rows // (QM[2] * QM[1])) % QM[0]
    n = rows // (QM[2] * QM[1] * QM[0])
    pixel = ((n.to(gl.int64) * I[0] + r0 + S[0] * q0) * I[1] + r1 + S[1] * q1) * I[2] + r2 + S[2] * q2
    kept = (rows < ROWS) & (q0 < e0) & (q1 < e1) & (q2 < e2)
    addresses = dx_ptr + pixel[:, None] * (G * K) + (g * K + cols)[None, :]
    gl.store(addresses, values, mask=kept[:, None] & (cols < K)[None, :])


@gluon.jit
def grad_input_phases_tma(x_desc, w_desc, dx_ptr,
                          PHASES: gl.constexpr, PR: gl.constexpr, PQ: gl.constexpr, PJ: gl.constexpr,
                          PY: gl.constexpr, PSH: gl.constexpr, QM: gl.constexpr, LOM: gl.constexpr,
                          TS: gl.constexpr, OS: gl.constexpr, FF: gl.constexpr, I: gl.constexpr, S: gl.constexpr,
                          C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, ROWS: gl.constexpr,
                          DIMS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # strided grad_input, every stride phase a stride-1 forward of dY (x_desc, K -> C here: this kernel's C is
    # dY's channels, its K dX's) with the phase's taps of the weight, in one persistent launch: tiles (phase, group,
    # row tile, column tile), each program taking tiles pid, pid + programs, ...  Phases differ in their taps,
    # so a tile's steps (J0 * J1 * J2 * C / BLOCK_K) are read per tile; the copies run ahead through a cursor
    # (tile, step) that moves on to the next tile of the program when a tile's steps are issued
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    CB: gl.constexpr = C // BLOCK_K
    TILES: gl.constexpr = PHASES * ((ROWS + BLOCK_M - 1) // BLOCK_M) * ((K + BLOCK_N - 1) // BLOCK_N) * G
    pid = gl.program_id(0)
    programs = gl.num_programs(0)

    a_bufs, b_bufs = _operand_ring(x_desc, w_desc, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, True)
    bars = _barriers(STAGES)

    # the copy cursor: step ld_step of tile ld_tile, and that tile's origin and phase
    ld_tile = pid
    ld_step = pid * 0
    (_p, _m, ld_k, ld_g, ld_n, ld_c0, ld_c1, ld_c2, ld_j0, ld_j1, ld_j2, ld_y0, ld_y1, ld_y2, ld_h0, ld_h1,
     ld_h2) = _phase_tile(ld_tile, PHASES, PJ, PY, PSH, QM, LOM, K, G, ROWS, BLOCK_M, BLOCK_N)
    for i in gl.static_range(STAGES - 1):
        if ld_tile < TILES:
            _issue_phase(x_desc, w_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), ld_step, ld_n, ld_c0,
                         ld_c1, ld_c2, ld_g, ld_k, ld_j0, ld_j1, ld_j2, ld_y0, ld_y1, ld_y2, ld_h0, ld_h1, ld_h2,
                         TS, OS, FF, C, K, DIMS, BLOCK_K)
            ld_step += 1
            if ld_step == ld_j0 * ld_j1 * ld_j2 * CB:
                ld_step = 0
                ld_tile += programs
                (_p, _m, ld_k, ld_g, ld_n, ld_c0, ld_c1, ld_c2, ld_j0, ld_j1, ld_j2, ld_y0, ld_y1, ld_y2, ld_h0, ld_h1,
                 ld_h2) = _phase_tile(ld_tile, PHASES, PJ, PY, PSH, QM, LOM, K, G, ROWS, BLOCK_M, BLOCK_N)
    # as in forward_tma_persistent: a loop over the tiles around one over a tile's steps; j counts all steps
    j = 0
    for tile in range(pid, TILES, programs):
        (ph, off_m, off_k, g, _n, _c0, _c1, _c2, j0, j1, j2, _y0, _y1, _y2, _h0, _h1,
         _h2) = _phase_tile(tile, PHASES, PJ, PY, PSH, QM, LOM, K, G, ROWS, BLOCK_M, BLOCK_N)
        acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // x_desc.dtype.primitive_bitwidth, num_warps)
        for step in range(j0 * j1 * j2 * CB):
            s = j % STAGES
            mbarrier.wait(bars.index(s), (j // STAGES) & 1)
            acc = _forward_product(a_bufs.index(s), b_bufs.index(s), acc, True, 0, False)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ld_tile < TILES:
                ns = (j + STAGES - 1) % STAGES
                _issue_phase(x_desc, w_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns), ld_step, ld_n,
                             ld_c0, ld_c1, ld_c2, ld_g, ld_k, ld_j0, ld_j1, ld_j2, ld_y0, ld_y1, ld_y2, ld_h0, ld_h1,
                             ld_h2, TS, OS, FF, C, K, DIMS, BLOCK_K)
                ld_step += 1
                if ld_step == ld_j0 * ld_j1 * ld_j2 * CB:
                    ld_step = 0
                    ld_tile += programs
                    (_p, _m, ld_k, ld_g, ld_n, ld_c0, ld_c1, ld_c2, ld_j0, ld_j1, ld_j2, ld_y0, ld_y1, ld_y2, ld_h0,
                     ld_h1, ld_h2) = _phase_tile(ld_tile, PHASES, PJ, PY, PSH, QM, LOM, K, G, ROWS, BLOCK_M, BLOCK_N)
            j += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _store_phase_rows(dx_ptr, acc, ph, off_m, off_k, g, PHASES, PR, PQ, QM, I, S, K, G, ROWS, BLOCK_M, BLOCK_N,
                          num_warps)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _weight_tile(F: gl.constexpr, COL_TILES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # a grad_weight program's output tile: program_id(0) = (K tile, tap t, C tile), C tiles innermost
    pid = gl.program_id(0)
    off_k = (pid // (F[0] * F[1] * F[2] * COL_TILES)) * BLOCK_M
    col = pid % (F[0] * F[1] * F[2] * COL_TILES)
    return off_k, col // COL_TILES, (col % COL_TILES) * BLOCK_N


@gluon.jit
def _store_partials(p_desc, acc, bars, row, col, STAGES: gl.constexpr):
    # the f32 tile into the partials through shared memory and a TMA store, once every product is done
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    p_smem = gl.allocate_shared_memory(gl.float32, p_desc.block_type.shape, p_desc.layout)
    p_smem.store(acc)
    fence_async_shared()
    tma.async_store(p_desc, [row, col], p_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _issue_grad_weight(x_desc, dy_desc, a_buf, b_buf, bar, r0, g, col0, off_k,
                       O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                       C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr, BLOCK_N: gl.constexpr):
    # the copies of the pixel tile starting at r0 = (n, o): dY's [BLOCK_R, BLOCK_M] box of rows r0.. and the
    # group's channels k, and for each X box of the tile's columns col0.. of (tap t, channel c) the im2col window
    # of the same pixels for tap t, channels c..: one box where C holds the tile, one per tap where the tile
    # spans taps (C < BLOCK_N).  Columns past the last tap read its window again (never stored)
    XB: gl.constexpr = x_desc.block_type.shape[1]
    TAPS: gl.constexpr = F[0] * F[1] * F[2]
    o2 = r0 % O[2]
    o1 = (r0 // O[2]) % O[1]
    o0 = (r0 // (O[2] * O[1])) % O[0]
    n = r0 // (O[2] * O[1] * O[0])
    mbarrier.expect(bar, (BLOCK_N // XB) * x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
    for i in gl.static_range(BLOCK_N // XB):
        col = col0 + i * XB
        t = gl.minimum(col // C, TAPS - 1)
        c_col = col % C
        t2 = t % F[2]
        t1 = (t // F[2]) % F[1]
        t0 = t // (F[2] * F[1])
        if BLOCK_N == XB:
            box = b_buf
        else:
            box = b_buf.slice(i * XB, XB, dim=1)
        if DIMS == 3:
            tma.async_load_im2col(x_desc, [n, o0 * S[0] - LO[0], o1 * S[1] - LO[1], o2 * S[2] - LO[2], g * C + c_col],
                                  [(t0 * D[0]).to(gl.int16), (t1 * D[1]).to(gl.int16), (t2 * D[2]).to(gl.int16)],
                                  bar, box)
        elif DIMS == 2:
            tma.async_load_im2col(x_desc, [n, o1 * S[1] - LO[1], o2 * S[2] - LO[2], g * C + c_col],
                                  [(t1 * D[1]).to(gl.int16), (t2 * D[2]).to(gl.int16)], bar, box)
        else:
            tma.async_load_im2col(x_desc, [n, o2 * S[2] - LO[2], g * C + c_col], [(t2 * D[2]).to(gl.int16)], bar,
                                  box)
    tma.async_load(dy_desc, [r0, g * K + off_k], bar, a_buf)


@gluon.jit
def _grad_weight_loads(x_desc, dy_desc, a_bufs, b_bufs, ready, empty, start, steps, g, col0, off_k,
                       O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                       C: gl.constexpr, K: gl.constexpr, DIMS: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    # the copy warp of the warp-specialised kernel: each step's copies into its stage once the products of the
    # step STAGES before have released it (empty; mbarriers start with phase 1 complete, so the first round
    # passes), completing the stage's ready barrier
    for step in range(steps):
        st = step % STAGES
        mbarrier.wait(empty.index(st), ((step // STAGES) & 1) ^ 1)
        _issue_grad_weight(x_desc, dy_desc, a_bufs.index(st), b_bufs.index(st), ready.index(st),
                           start + step * BLOCK_R, g, col0, off_k, O, F, S, D, LO, C, K, DIMS, BLOCK_N)


@gluon.jit
def _grad_weight_product(a_buf, b_buf, step, steps, acc, part, PROMOTE: gl.constexpr):
    # one step's product, one in flight after it.  PROMOTE > 0: wgmma sums runs of PROMOTE steps in `part`, from
    # zero, and each run is added to acc by the SM's f32 adds (wgmma's own long sums drift: bf16x6's error grew
    # with the reduction's length, docs/decisions.md#promoted-sums); else acc is wgmma's accumulator
    if PROMOTE > 0:
        part = warpgroup_mma(a_buf.permute((1, 0)), b_buf, part, use_acc=step % PROMOTE != 0, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))
        if (step % PROMOTE == PROMOTE - 1) | (step == steps - 1):
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc = acc + part
    else:
        acc = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return acc, part


@gluon.jit
def _grad_weight_products(a_bufs, b_bufs, ready, empty, steps, acc, STAGES: gl.constexpr, PROMOTE: gl.constexpr):
    # the product warp groups: one product in flight; once the step before is done its stage is released
    part = acc
    for step in range(steps):
        st = step % STAGES
        mbarrier.wait(ready.index(st), (step // STAGES) & 1)
        acc, part = _grad_weight_product(a_bufs.index(st), b_bufs.index(st), step, steps, acc, part, PROMOTE)
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=step > 0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def grad_weight_tma(x_desc, dy_desc, p_desc,
                    # output pixels, filter, stride, dilation, low padding per spatial dimension (3 each)
                    O: gl.constexpr, F: gl.constexpr, S: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                    C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, L: gl.constexpr, CHUNK: gl.constexpr,
                    BLOCK_N: gl.constexpr, DIMS: gl.constexpr, STAGES: gl.constexpr, SPECIALISED: gl.constexpr,
                    PROMOTE: gl.constexpr, num_warps: gl.constexpr):
    # dW's f32 split-K partials: partial[s, g, k, t, c] = sum over the pixels r = (n, o) of chunk s of
    # dY[r, g, k] * X[n, o*s - lo + t*d, g, c].  One program per (K tile, column tile, group, chunk), the columns
    # (t, c) of the [G*K, taps*C] weight matrix: the GEMM's A is dY's [BLOCK_R, BLOCK_M] box read M-major, its B
    # the im2col copies [BLOCK_R, BLOCK_N] of the tile's taps.  K is a multiple of BLOCK_M, and C of BLOCK_N or
    # BLOCK_N of C (policy.tma_grad_weight_reason): no box crosses a group, a tap or a chunk's rows of the
    # partials [S * G * K, taps * C].  A tile wider than C spans taps, sharing each dY box among them.
    # SPECIALISED: one warp of its own issues the copies, the num_warps product warps only wait for them
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[0]
    PB: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_R: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    COL_TILES: gl.constexpr = (F[0] * F[1] * F[2] * C + BLOCK_N - 1) // BLOCK_N

    pid = gl.program_id(0)
    g = gl.program_id(1)
    s = gl.program_id(2)
    off_k = (pid // COL_TILES) * BLOCK_M
    col0 = (pid % COL_TILES) * BLOCK_N
    start = s * CHUNK
    steps = (L - start + BLOCK_R - 1) // BLOCK_R  # the last chunk is shorter
    if steps > CHUNK // BLOCK_R:
        steps = CHUNK // BLOCK_R

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_M], dy_desc.layout)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_N], b_layout)
    bars = _barriers(STAGES)

    acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // dtype.primitive_bitwidth, num_warps)

    if SPECIALISED:
        empty = _barriers(STAGES)
        acc = gl.warp_specialize([
            (_grad_weight_products, (a_bufs, b_bufs, bars, empty, steps, acc, STAGES, PROMOTE)),
            (_grad_weight_loads, (x_desc, dy_desc, a_bufs, b_bufs, bars, empty, start, steps, g, col0, off_k,
                                  O, F, S, D, LO, C, K, DIMS, BLOCK_N, BLOCK_R, STAGES)),
        ], [1], [40])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(empty.index(i))
    else:
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _issue_grad_weight(x_desc, dy_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i),
                                   start + i * BLOCK_R, g, col0, off_k, O, F, S, D, LO, C, K, DIMS, BLOCK_N)
        part = acc
        for step in range(steps):
            st = step % STAGES
            mbarrier.wait(bars.index(st), (step // STAGES) & 1)
            acc, part = _grad_weight_product(a_bufs.index(st), b_bufs.index(st), step, steps, acc, part, PROMOTE)
            nxt = step + STAGES - 1
            if nxt < steps:
                ns = nxt % STAGES
                _issue_grad_weight(x_desc, dy_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns),
                                   start + nxt * BLOCK_R, g, col0, off_k, O, F, S, D, LO, C, K, DIMS, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    row = (s * G + g) * K + off_k
    if PB == BLOCK_N:
        _store_partials(p_desc, acc, bars, row, col0, STAGES)
    else:  # a 256-wide tile stores its f32 halves one after the other through one 128-wide buffer
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        left, right = acc.reshape([BLOCK_M, 2, PB]).permute((0, 2, 1)).split()
        p_smem = gl.allocate_shared_memory(gl.float32, p_desc.block_type.shape, p_desc.layout)
        p_smem.store(left)
        fence_async_shared()
        tma.async_store(p_desc, [row, col0], p_smem)
        tma.store_wait(pendings=0)
        p_smem.store(right)
        fence_async_shared()
        tma.async_store(p_desc, [row, col0 + PB], p_smem)
        tma.store_wait(pendings=0)


@gluon.jit
def _issue_flat(x_desc, dy_desc, a_buf, b_buf, bar, r, g, shift, c_col, off_k,
                C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, N: gl.constexpr, QB: gl.constexpr,
                SHIFT_X: gl.constexpr, ALIGN: gl.constexpr, BLOCK_R: gl.constexpr):
    # reduction step r = (image n, position block): dY's [BLOCK_M, BLOCK_R] box of rows (n, g, k..) and X's
    # [BLOCK_N, BLOCK_R] box of rows (n, g, c..), positions shifted by the tap (TMA reads zeros outside a row);
    # the shifted operand's copy for the shift's residue mod ALIGN (the elements in 16 bytes; launch.flat_planes),
    # so that both boxes start 16 bytes in
    n = r // QB
    q0 = (r % QB) * BLOCK_R
    residue = ((shift % ALIGN) + ALIGN) % ALIGN
    if SHIFT_X:
        x_row = (residue * N * G + n * G + g) * C + c_col
        y_row = (n * G + g) * K + off_k
    else:
        x_row = (n * G + g) * C + c_col
        y_row = (residue * N * G + n * G + g) * K + off_k
    mbarrier.expect(bar, x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
    tma.async_load(dy_desc, [y_row, q0], bar, a_buf)
    tma.async_load(x_desc, [x_row, q0 + shift - residue], bar, b_buf)


@gluon.jit
def grad_weight_flat_tma(x_desc, dy_desc, p_desc,
                         # filter, dilation, each spatial dimension's stride in the flat positions, the outer
                         # dimension's low padding (3 each, in the problem's order of dimensions)
                         F: gl.constexpr, D: gl.constexpr, XS: gl.constexpr, LOX: gl.constexpr,
                         C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, N: gl.constexpr, QB: gl.constexpr,
                         STEPS: gl.constexpr, CHUNK: gl.constexpr, SHIFT_X: gl.constexpr, ALIGN: gl.constexpr,
                         PROMOTE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # partial[s, g, k, t, c] = sum over steps r of chunk s of Yf[(n, g, k), q] * Xf[(n, g, c), q + shift(t)]:
    # one program per (K tile, tap and C tile, group, chunk), as grad_weight_tma.  K and C are multiples of
    # BLOCK_M and BLOCK_N (policy.tma_flat_grad_weight_reason): no box crosses into another image or group
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p_desc.block_type.shape[1]
    BLOCK_R: gl.constexpr = x_desc.block_type.shape[1]
    COL_TILES: gl.constexpr = C // BLOCK_N

    g = gl.program_id(1)
    s = gl.program_id(2)
    off_k, t, c_col = _weight_tile(F, COL_TILES, BLOCK_M, BLOCK_N)
    t2 = t % F[2]
    t1 = (t // F[2]) % F[1]
    t0 = t // (F[2] * F[1])
    shift = (t0 * D[0] - LOX[0]) * XS[0] + (t1 * D[1] - LOX[1]) * XS[1] + (t2 * D[2] - LOX[2]) * XS[2]
    start = s * CHUNK
    steps = STEPS - start  # the last chunk is shorter
    if steps > CHUNK:
        steps = CHUNK

    # f32 copies (TF32 values) or fp8 ones (dY's and X's compute types may differ: wgmma takes e4m3 x e5m2)
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BLOCK_M, BLOCK_R], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_N, BLOCK_R], x_desc.layout)
    bars = _barriers(STAGES)
    TF32: gl.constexpr = x_desc.dtype == gl.float32

    acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // x_desc.dtype.primitive_bitwidth, num_warps)

    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue_flat(x_desc, dy_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), start + i, g, shift,
                        c_col, off_k, C, K, G, N, QB, SHIFT_X, ALIGN, BLOCK_R)
    for step in range(steps):
        st = step % STAGES
        mbarrier.wait(bars.index(st), (step // STAGES) & 1)
        # the f32 copies hold TF32 values already (launch.pad_planes_launch rounds them), so wgmma's truncation
        # of the low mantissa bits changes nothing
        if TF32:
            acc = warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), acc, precision="tf32",
                                is_async=True)
        elif PROMOTE > 0:  # fp8: products summed in wgmma's own (narrower) accumulator PROMOTE at a time, then in f32
            acc = warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), acc,
                                max_num_imprecise_acc=PROMOTE, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        nxt = step + STAGES - 1
        if nxt < steps:
            ns = nxt % STAGES
            _issue_flat(x_desc, dy_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns), start + nxt, g,
                        shift, c_col, off_k, C, K, G, N, QB, SHIFT_X, ALIGN, BLOCK_R)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    _store_partials(p_desc, acc, bars, (s * G + g) * K + off_k, t * C + c_col, STAGES)
