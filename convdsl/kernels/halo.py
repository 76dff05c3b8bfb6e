"""Hopper stride-1 forward convolution that reads each input position once per tile, written in Gluon.

The TMA kernels of tma.py copy one window of X per filter tap: a 3x3x3 filter reads every position of X 27
times from L2, which bounds narrow 3D layers (64 output channels) by L2 bandwidth.  Here a program copies X's
planes once into shared memory (cp.async, zero outside the image) and every tap gathers its rows from them.

Index algebra (stride 1; NDHWGC X and Y; one program per (group, column tile, image, row tile, plane range)):
    Y[n, o0, o1, o2, g, k] = sum over taps (t0, t1, t2), channels c of
                             X[n, o0 + t0*D0 - LO0, o1 + t1*D1 - LO1, o2 + t2*D2 - LO2, g, c] * W[tap, c, k]
Rows are positions of one output plane o0 on a padded grid q = o1 * WP + o2 with WP = O2 + (F2-1)*D2: the
columns o2 >= O2 of a row are computed and dropped.  On that grid X's rows have the same width: input position
(i1, i2) is row (i1 + LO1) * WP + i2 + LO2, so tap (t1, t2) of output row q reads input row q + t1*D1*WP + t2*D2,
a constant shift.  A tile of BLOCK_M rows from q0 therefore reads, per input plane, the R = BLOCK_M +
(F1-1)*D1*WP + (F2-1)*D2 rows from q0 (the window), and each tap's [BLOCK_M, C] operand is the window's rows
from its shift, gathered into registers as wgmma's A.  Window rows whose input position lies outside X are zero.

A program sweeps the input planes z = z0 + p (z0 = o_lo - LO0; D0 = 1, F0 = 3) under its range of output planes
[o_lo, o_hi) in order, each plane's window copied once.  Plane p meets filter plane t0 in output plane
o_lo + p - t0, so it is gathered once per tap (t1, t2) and multiplied by three weight tiles, one per t0, into
three accumulators: output plane o's is (o - o_lo + 2) % 3, the one plane p completes (t0 = 2) is p % 3, stored
after it and zeroed for the plane that enters.  Planes are taken in threes (static slot, accumulators and store).
Planes outside X take no products.  The windows stay in a ring of three slots: plane p + 2's window is copied
while plane p's taps run (SPREAD: a part with each tap), into the slot plane p - 1 left.  W's tap tiles come
through TMA, the three filter planes' in rings of their own of BSTAGES (FLIPPED 1: grad_input's own weight
[G*C, taps*K] in [C, BLOCK_N] tiles, taps reversed, as in tma.py).
"""
from __future__ import annotations

from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .tma import _barriers, _zero_accumulator

# rows of a window copied per instruction group (the copy layout's rows times its repeats)
COPY_ROWS = gl.constexpr(32)


@constexpr_function
def _chunk_major(rows, cols, chunk):
    # the window [rows, cols] stored as cols / chunk column blocks of 16 bytes, each its rows in order: the 8
    # consecutive rows one gather instruction reads (4 bytes each, a lane per row and channel pair) lie in
    # 128 contiguous bytes, all banks, as do the rows one 16-byte copy writes
    bases = [[0, 1 << b] for b in range(chunk.bit_length() - 1)]
    bases += [[1 << b, 0] for b in range(rows.bit_length() - 1)]
    bases += [[0, chunk << b] for b in range((cols // chunk).bit_length() - 1)]
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _copy_plane(x_ptr, win, slot, z, n, g, q0, I: gl.constexpr, LO: gl.constexpr, C: gl.constexpr,
                G: gl.constexpr, WP: gl.constexpr, R: gl.constexpr, RS: gl.constexpr, SLOTS: gl.constexpr,
                num_warps: gl.constexpr, FIRST: gl.constexpr = 0, LAST: gl.constexpr = -1):
    # window rows f = 0..R-1 of input plane z into rows slot*RS + f: padded-grid row q0 + f is input position
    # (i1, i2) = ((q0 + f) // WP - LO1, (q0 + f) % WP - LO2), zero outside X (and for planes outside it)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    rows = gl.arange(0, COPY_ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, C, gl.SliceLayout(0, layout))
    plane_ok = (z >= 0) & (z < I[0])
    # rows [FIRST, LAST) of the window (LAST -1: to its end), in steps of COPY_ROWS
    for f0 in gl.static_range(FIRST, RS if LAST < 0 else min(LAST, RS), COPY_ROWS):
        f = f0 + rows
        i1 = (q0 + f) // WP - LO[1]
        i2 = (q0 + f) % WP - LO[2]
        ok = plane_ok & (f < R) & (i1 >= 0) & (i1 < I[1]) & (i2 >= 0) & (i2 < I[2])
        pos = ((n * I[0] + z) * I[1] + i1) * I[2] + i2
        ptrs = x_ptr + (pos * (G * C) + g * C)[:, None] + cols[None, :]
        # a view's start must be a constant: one branch per slot
        for s in gl.static_range(SLOTS):
            if slot == s:
                async_copy.async_load(win.slice(s * RS + f0, COPY_ROWS), ptrs, mask=ok[:, None])


@gluon.jit
def _issue_weights(w_desc, b0, b1, b2, bar, st, tap, g, off_k, F: gl.constexpr, C: gl.constexpr, K: gl.constexpr,
                   FLIPPED: gl.constexpr):
    # the weight tiles of tap (t1, t2) = tap for filter planes t0 = 0, 1, 2 into stage st of rings b0, b1, b2 (one
    # ring each: copies into distinct buffers need no barrier between them); each [C, BLOCK_N] of grad_input's own
    # weight (FLIPPED 1, taps reversed) or [BLOCK_N, C] of a forward's
    TAPS: gl.constexpr = F[0] * F[1] * F[2]
    mbarrier.expect(bar, 3 * w_desc.block_type.nbytes)
    if FLIPPED == 1:
        tma.async_load(w_desc, [g * C, (TAPS - 1 - tap) * K + off_k], bar, b0.index(st))
        tma.async_load(w_desc, [g * C, (TAPS - 1 - F[1] * F[2] - tap) * K + off_k], bar, b1.index(st))
        tma.async_load(w_desc, [g * C, (TAPS - 1 - 2 * F[1] * F[2] - tap) * K + off_k], bar, b2.index(st))
    else:
        tma.async_load(w_desc, [g * K + off_k, tap * C], bar, b0.index(st))
        tma.async_load(w_desc, [g * K + off_k, (F[1] * F[2] + tap) * C], bar, b1.index(st))
        tma.async_load(w_desc, [g * K + off_k, (2 * F[1] * F[2] + tap) * C], bar, b2.index(st))


@gluon.jit
def _pick(b0, b1, b2, T0: gl.constexpr):
    # the ring of filter plane T0
    if T0 == 0:
        b = b0
    elif T0 == 1:
        b = b1
    else:
        b = b2
    return b


@gluon.jit
def _product(a, b, acc, FLIPPED: gl.constexpr):
    # B is the weight tile, [C, BLOCK_N] where FLIPPED (wgmma reads 16-bit B either way), else [BLOCK_N, C]
    if FLIPPED == 1:
        acc = warpgroup_mma(a, b, acc, is_async=True)
    else:
        acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _store_plane(y_ptr, acc, o, n, g, q0, off_k, O: gl.constexpr, G: gl.constexpr, K: gl.constexpr,
                 WP: gl.constexpr):
    # output plane o's accumulator into Y: its rows on the padded grid at their positions, columns o2 >= O2 and
    # rows past the plane dropped
    layout: gl.constexpr = acc.type.layout
    q = q0 + gl.arange(0, acc.shape[0], gl.SliceLayout(1, layout))
    kk = off_k + gl.arange(0, acc.shape[1], gl.SliceLayout(0, layout))
    o1 = q // WP
    o2 = q % WP
    pos = ((n * O[0] + o) * O[1] + o1) * O[2] + o2
    ptrs = y_ptr + (pos * (G * K) + g * K)[:, None] + kk[None, :]
    ok = ((o1 < O[1]) & (o2 < O[2]))[:, None] & (kk < K)[None, :]
    gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _plane(x_ptr, w_desc, y_ptr, win, b0, b1, b2, bars, acc0, acc1, acc2, step, p, SUB: gl.constexpr, planes,
           p_in, p_out, steps, z0, o_lo, n, g, q0, off_k,
           I: gl.constexpr, O: gl.constexpr, F: gl.constexpr, D: gl.constexpr, LO: gl.constexpr, C: gl.constexpr,
           K: gl.constexpr, G: gl.constexpr, WP: gl.constexpr, R: gl.constexpr, RS: gl.constexpr,
           SLOTS: gl.constexpr, BSTAGES: gl.constexpr, FLIPPED: gl.constexpr, SPREAD: gl.constexpr,
           num_warps: gl.constexpr):
    # plane p of the sweep (p % 3 == SUB): its window is in slot SUB, it completes output plane o_lo + p - 2,
    # whose accumulator is acc<SUB>
    TAPS2: gl.constexpr = F[1] * F[2]
    # window rows copied with each tap where SPREAD: whole copy-row groups
    CHUNK: gl.constexpr = (RS // COPY_ROWS + TAPS2 - 1) // TAPS2 * COPY_ROWS
    # every warp has read plane p - 1: its slot takes plane p + 2, copied at once, or (SPREAD) a part with each
    # of plane p's taps where plane p has products
    gl.barrier()
    computes = (p >= p_in) & (p < p_out)
    prefetch = p + SLOTS - 1 < planes
    if prefetch & ((SPREAD == 0) | (not computes)):
        _copy_plane(x_ptr, win, (SUB + SLOTS - 1) % SLOTS, z0 + p + SLOTS - 1, n, g, q0, I, LO, C, G, WP, R, RS,
                    SLOTS, num_warps)
    if computes:
        # plane p's group: all but the newest SLOTS - 2 (plane p + 2's is committed after the products)
        async_copy.wait_group(SLOTS - 2)
        gl.barrier()
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc0.type.layout,
                                                     k_width=32 // w_desc.dtype.primitive_bitwidth)
        a_rows = gl.arange(0, acc0.shape[0], gl.SliceLayout(1, a_layout))
        a_cols = gl.arange(0, C, gl.SliceLayout(0, a_layout))
        for t1 in gl.static_range(F[1]):
            for t2 in gl.static_range(F[2]):
                # one gather of the tap's rows, multiplied by the tap of each filter plane
                rows = SUB * RS + t1 * D[1] * WP + t2 * D[2] + a_rows
                a = win.gather(rows[:, None] + a_cols[None, :] * 0, axis=0)
                if SPREAD:
                    if prefetch:
                        _copy_plane(x_ptr, win, (SUB + SLOTS - 1) % SLOTS, z0 + p + SLOTS - 1, n, g, q0, I, LO, C, G,
                                    WP, R, RS, SLOTS, num_warps, (t1 * F[2] + t2) * CHUNK,
                                    (t1 * F[2] + t2 + 1) * CHUNK)
                st = step % BSTAGES
                mbarrier.wait(bars.index(st), (step // BSTAGES) & 1)
                # plane p's products into output planes o_lo + p - t0: acc j takes filter plane (SUB + 2 - j) % 3
                acc0 = _product(a, _pick(b0, b1, b2, (SUB + 2) % 3).index(st), acc0, FLIPPED)
                acc1 = _product(a, _pick(b0, b1, b2, (SUB + 1) % 3).index(st), acc1, FLIPPED)
                acc2 = _product(a, _pick(b0, b1, b2, SUB).index(st), acc2, FLIPPED)
                acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0, acc1, acc2))
                # the products before are done: their stage takes the weight tiles of step + BSTAGES - 1
                nxt = step + BSTAGES - 1
                if nxt < steps:
                    _issue_weights(w_desc, b0, b1, b2, bars.index(nxt % BSTAGES), nxt % BSTAGES, nxt % TAPS2, g,
                                   off_k, F, C, K, FLIPPED)
                step += 1
        acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
    async_copy.commit_group()
    # output plane o has all its taps: stored if the program owns it, its accumulator zeroed
    o = o_lo + p - 2
    if SUB == 0:
        if o >= o_lo:
            _store_plane(y_ptr, acc0, o, n, g, q0, off_k, O, G, K, WP)
        acc0 = gl.zeros_like(acc0)
    elif SUB == 1:
        if o >= o_lo:
            _store_plane(y_ptr, acc1, o, n, g, q0, off_k, O, G, K, WP)
        acc1 = gl.zeros_like(acc1)
    else:
        if o >= o_lo:
            _store_plane(y_ptr, acc2, o, n, g, q0, off_k, O, G, K, WP)
        acc2 = gl.zeros_like(acc2)
    return acc0, acc1, acc2, step


@gluon.jit
def forward_halo(w_desc, x_ptr, y_ptr,
                 I: gl.constexpr, O: gl.constexpr, F: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                 C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, N: gl.constexpr, WP: gl.constexpr,
                 R: gl.constexpr, RS: gl.constexpr, RP: gl.constexpr, QT: gl.constexpr, SPLIT: gl.constexpr,
                 BLOCK_M: gl.constexpr, BSTAGES: gl.constexpr, FLIPPED: gl.constexpr, SPREAD: gl.constexpr,
                 num_warps: gl.constexpr):
    # I, O, F, D, LO: input, output, filter, dilation, low padding per spatial dimension (3 each); WP: the padded
    # grid's width; R: a window's rows, RS: a slot's (R rounded up to COPY_ROWS), RP: the ring's (a power of 2
    # holding at least 2 slots); QT: row tiles per plane; SPLIT: output-plane ranges per (image, row tile)
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1] if FLIPPED == 1 else w_desc.block_type.shape[0]
    TAPS2: gl.constexpr = F[1] * F[2]
    SLOTS: gl.constexpr = 3
    COLT: gl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    dtype: gl.constexpr = w_desc.dtype
    pid = gl.program_id(0)
    part = pid % SPLIT
    qt = (pid // SPLIT) % QT
    n = (pid // (SPLIT * QT)) % N
    off_k = ((pid // (SPLIT * QT * N)) % COLT) * BLOCK_N
    g = pid // (SPLIT * QT * N * COLT)
    o_lo = part * O[0] // SPLIT
    tiles = (part + 1) * O[0] // SPLIT - o_lo
    q0 = qt * BLOCK_M
    z0 = o_lo - LO[0]  # plane p of the sweep is input plane z0 + p
    planes = tiles + F[0] - 1
    # the planes inside X, [p_in, p_out): the others are zero and take no products
    p_in = gl.minimum(gl.maximum(-z0, 0), planes)
    p_out = gl.maximum(gl.minimum(I[0] - z0, planes), p_in)
    steps = (p_out - p_in) * TAPS2

    win = gl.allocate_shared_memory(dtype, [RP, C], _chunk_major(RP, C, 128 // dtype.primitive_bitwidth))
    if FLIPPED == 1:
        b0 = gl.allocate_shared_memory(dtype, [BSTAGES, C, BLOCK_N], w_desc.layout)
        b1 = gl.allocate_shared_memory(dtype, [BSTAGES, C, BLOCK_N], w_desc.layout)
        b2 = gl.allocate_shared_memory(dtype, [BSTAGES, C, BLOCK_N], w_desc.layout)
    else:
        b0 = gl.allocate_shared_memory(dtype, [BSTAGES, BLOCK_N, C], w_desc.layout)
        b1 = gl.allocate_shared_memory(dtype, [BSTAGES, BLOCK_N, C], w_desc.layout)
        b2 = gl.allocate_shared_memory(dtype, [BSTAGES, BLOCK_N, C], w_desc.layout)
    bars = _barriers(BSTAGES)

    for j in gl.static_range(SLOTS - 1):  # the first planes, a copy group each
        _copy_plane(x_ptr, win, j, z0 + j, n, g, q0, I, LO, C, G, WP, R, RS, SLOTS, num_warps)
        async_copy.commit_group()
    for s in gl.static_range(BSTAGES - 1):
        if s < steps:
            _issue_weights(w_desc, b0, b1, b2, bars.index(s), s, s % TAPS2, g, off_k, F, C, K, FLIPPED)

    # an accumulator per output plane in flight (F0 = 3): plane o's is o % 3
    gl.static_assert(F[0] == 3, "the halo kernel keeps three output planes' accumulators")
    acc0 = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // dtype.primitive_bitwidth, num_warps)
    acc1 = acc0
    acc2 = acc0
    step = 0
    # planes in threes, so that a plane's slot, its accumulator and the one it completes are constants
    gl.static_assert(SLOTS == 3, "the halo kernel's ring holds three windows")
    for p3 in range(0, planes, 3):
        for sub in gl.static_range(3):
            p = p3 + sub
            if p < planes:
                acc0, acc1, acc2, step = _plane(x_ptr, w_desc, y_ptr, win, b0, b1, b2, bars, acc0, acc1, acc2, step, p,
                                                sub, planes, p_in, p_out, steps, z0, o_lo, n, g, q0, off_k,
                                                I, O, F, D, LO, C, K, G, WP, R, RS, SLOTS, BSTAGES, FLIPPED,
                                                SPREAD, num_warps)
    async_copy.wait_group(0)
    for s in gl.static_range(BSTAGES):
        mbarrier.invalidate(bars.index(s))
