"""The TMA forward kernel (kernels/tma.py) off the GPU: which problems take it, and its index algebra.

The kernel hands TMA a pixel box, a first pixel per row tile and an im2col offset per tap; the hardware walks
the box.  `_im2col_tile` models that walk as PTX describes im2col mode (per spatial dimension the positions
lower, lower + e, ... up to the dimension's size + upper - 1, e the element stride; pixels in (N, spatial)
order, wrapping across rows and images; zeros outside the tensor), and `_emulated_forward` runs the kernel's
tiles through it with the coordinates the kernel computes.  Against the float64 reference this checks the
corners of launch.im2col_box, the coordinates, the group offsets and the conditions that keep a copy inside its
group (policy.tma_forward_reason); the GPU tests run the kernel itself.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convdsl import policy, stream
from convdsl.algebra import grad_input_phases
from convdsl.kernels.compile import gluon_tma_im2col
from convdsl.kernels.launch import im2col_box
from convdsl.kernels.tma_launches import forward_tma_launch, grad_input_phases_tma_launch, grad_weight_tma_launch
from convdsl.kernels.tiles import TileConfig
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs

HOPPER, AMPERE = Target("cuda", "sm_90"), Target("cuda", "sm_80")
BASE = ConvProblem(op="forward", dims=2, groups=1, batch=2, in_channels=32, out_channels=24, input=(7, 6),
                   filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), layout="NHWGC",
                   dtype="f16", name="k")


def _im2col_tile(x: np.ndarray, coord: tuple[int, ...], offsets: tuple[int, ...], lower, upper, strides,
                 pixels: int, channels: int) -> np.ndarray:
    """TMA's im2col copy from x (N, *spatial, channels total) as PTX's im2col mode describes it."""
    spatial = x.shape[1:-1]
    counts = [(size + up - 1 - lo) // e + 1 for size, lo, up, e in zip(spatial, lower, upper, strides)]
    steps = [(start - lo) // e for start, lo, e in zip(coord[1:-1], lower, strides)]
    first = coord[0]
    for j, count in zip(steps, counts):
        first = first * count + j
    tile = np.zeros((pixels, channels))
    c0 = coord[-1]
    for row in range(pixels):
        index, pos = first + row, []
        for count in reversed(counts):
            pos.insert(0, index % count)
            index //= count
        n = index
        at = [lo + j * e + off for lo, j, e, off in zip(lower, pos, strides, offsets)]
        if n < x.shape[0] and all(0 <= a < size for a, size in zip(at, spatial)):
            got = x[(n, *at)][c0:c0 + channels]
            tile[row, :len(got)] = got
    return tile


def _emulated_forward(p: ConvProblem, x: np.ndarray, w: np.ndarray, flipped: bool = False,
                      programs: int | None = None, reversed_copy: bool = False) -> np.ndarray:
    """forward_tma's tiles, copies and stores, in float64, through _im2col_tile.  flipped: p is a grad_input as
    forward and w grad_input's own weight, read as the kernel's FLIPPED form reads it; reversed_copy: w is that
    weight's K-innermost copy, read as FLIPPED 2 reads it (boxes past a tap's rows read the next tap's, whose
    products land in columns past K, clipped at the store).  programs: those of the
    persistent kernel (None: the rule's, policy.tma_forward_programs), whose schedule is replayed as it runs:
    each program's tiles in turn, and each copy made where the kernel's loop says its tile starts."""
    tiles = policy.tma_forward_tiles(p, HOPPER)
    if programs is None:
        programs = policy.tma_forward_programs(p, tiles, HOPPER)
    launch, maps = forward_tma_launch(p, tiles, "k", flipped, programs=programs, reversed_copy=reversed_copy)
    consts = dict(launch.constants)
    x_map, w_map, y_map = maps
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    xs = x.reshape(x_map.shape).astype(np.float64)
    w2 = w.reshape(w_map.shape).astype(np.float64)
    y2 = np.full(y_map.shape, np.nan)
    dims = p.dims
    out, s, d, lo = consts["O"], consts["S"], consts["D"], consts["LO"]
    taps_3d = consts["F"]
    c, k = consts["C"], consts["K"]
    steps = math.prod(taps_3d) * (c // bk)

    def product(off_m: int, off_k: int, g: int, step: int) -> np.ndarray:
        # the [bm, bn] product of the copies of `step` made for the tile at (off_m, off_k, g)
        o2 = off_m % out[2]
        o1 = (off_m // out[2]) % out[1]
        o0 = (off_m // (out[2] * out[1])) % out[0]
        n = off_m // (out[2] * out[1] * out[0])
        corner = (o0 * s[0] - lo[0], o1 * s[1] - lo[1], o2 * s[2] - lo[2])[3 - dims:]
        t, cb = divmod(step, c // bk)
        t2, t1, t0 = t % taps_3d[2], (t // taps_3d[2]) % taps_3d[1], t // (taps_3d[2] * taps_3d[1])
        offsets = (t0 * d[0], t1 * d[1], t2 * d[2])[3 - dims:]
        a = _im2col_tile(xs, (n, *corner, g * c + cb * bk), offsets, x_map.lower, x_map.upper,
                         x_map.element_strides[1:-1], bm, bk)
        if flipped:  # [BLOCK_K, BLOCK_N] of tap F-1-t in grad_input's [G*K, taps*C] weight
            b = np.zeros((bk, bn))
            col = (math.prod(taps_3d) - 1 - t) * k + off_k
            tile = w2[g * c + cb * bk:g * c + cb * bk + bk, col:col + bn]
            b[:tile.shape[0], :tile.shape[1]] = tile
            return a @ b
        b = np.zeros((bn, bk))
        if reversed_copy:  # [BLOCK_N, BLOCK_K] at row (g * taps + taps - 1 - t) * K + off_k of [G*taps*K, C]
            row = (g * math.prod(taps_3d) + math.prod(taps_3d) - 1 - t) * k + off_k
            rows = w2[row:row + bn, cb * bk:cb * bk + bk]
            b[:rows.shape[0], :rows.shape[1]] = rows
            return a @ b.T
        rows = w2[g * k + off_k:g * k + off_k + bn, t * c + cb * bk:t * c + cb * bk + bk]
        b[:rows.shape[0], :rows.shape[1]] = rows
        return a @ b.T

    def store(off_m: int, off_k: int, g: int, acc: np.ndarray) -> None:
        stored = y2[off_m:off_m + bm, g * k + off_k:g * k + off_k + bn]  # TMA clips at the bounds
        stored[...] = acc[:stored.shape[0], :stored.shape[1]]

    grid = launch.grid
    if launch.kernel == "forward_tma":
        for g in range(grid[2]):
            for pm in range(grid[0]):
                for pn in range(grid[1]):
                    store(pm * bm, pn * bn, g, sum(product(pm * bm, pn * bn, g, step) for step in range(steps)))
        return y2.reshape(p.y_shape)
    assert launch.kernel == "forward_tma_persistent" and grid[1:] == (1, 1)
    col_tiles, row_tiles = -(-k // bn), -(-consts["ROWS"] // bm)
    count = col_tiles * row_tiles * consts["G"]
    stages, progs = consts["STAGES"], grid[0]

    def origin(tile: int) -> tuple[int, int, int]:  # column tiles innermost, then row tiles, then groups
        return ((tile // col_tiles) % row_tiles) * bm, (tile % col_tiles) * bn, tile // (col_tiles * row_tiles)

    for pid in range(progs):
        total = -(-(count - pid) // progs) * steps
        # the copies in flight: step j's, made for the tile origin the kernel had for it
        copies = {i: (origin(pid + (i // steps) * progs), i % steps) for i in range(min(stages - 1, total))}
        kept = origin(pid + ((stages - 1) // steps) * progs)
        j = 0
        for tile in range(pid, count, progs):
            acc = np.zeros((bm, bn))
            for _ in range(steps):
                at, step = copies.pop(j)
                acc += product(*at, step)
                nxt = j + stages - 1
                if nxt < total:
                    if nxt % steps == 0:
                        kept = origin(pid + (nxt // steps) * progs)
                    copies[nxt] = (kept, nxt % steps)
                j += 1
            store(*origin(tile), acc)
        assert not copies
    return y2.reshape(p.y_shape)


def _problem(dims: int, size: int, stride: int, dilation: int, pad: tuple[int, int], taps: int, groups: int,
             c: int, k: int, batch: int) -> ConvProblem:
    return BASE.with_(dims=dims, input=(size,) * dims, filter=(taps,) * dims, stride=(stride,) * dims,
                      dilation=(dilation,) * dims, pad_lo=(pad[0],) * dims, pad_hi=(pad[1],) * dims, groups=groups,
                      in_channels=c, out_channels=k, batch=batch)


@pytest.mark.parametrize("p", [
    BASE,  # K = 24 < BLOCK_N: the column tile reaches past K, zeros in, clipped out
    BASE.with_(batch=3, input=(9, 11), stride=(2, 2), pad_lo=(1, 0), pad_hi=(0, 1)),  # strided, asymmetric padding
    BASE.with_(in_channels=64, dilation=(2, 3), pad_lo=(2, 3), pad_hi=(2, 3)),  # dilated (DeepLab's atrous)
    BASE.with_(dims=3, input=(4, 5, 3), filter=(3, 3, 3), stride=(1, 2, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
               pad_hi=(1, 1, 1)),  # 3D: five-dimensional maps
    BASE.with_(dims=1, input=(13,), filter=(5,), stride=(3,), dilation=(1,), pad_lo=(2,), pad_hi=(2,)),  # 1D
    BASE.with_(groups=2, in_channels=16, out_channels=64),  # groups: channel and row offsets per group
    BASE.with_(filter=(1, 3), pad_lo=(0, 1), pad_hi=(0, 1), stride=(2, 2), in_channels=48),  # one row of taps
    # f32 in one-pass TF32: 32 channels a step (the copies' TF32 rounding is left out, as the products' is)
    BASE.with_(dtype="f32", compute="tf32", in_channels=64, stride=(2, 1)),
    BASE.with_(dtype="f32", compute="tf32", in_channels=40, groups=2, out_channels=64),  # 8 channels a step
    # fp8 compute: 128 channels (128 bytes) a step, and 32 (wgmma's fewest) where C allows no more (the copies'
    # fp8 rounding is left out)
    BASE.with_(compute=("bf8", "fp8"), in_channels=256, stride=(2, 1)),
    BASE.with_(dtype="bf16", compute=("fp8", "bf8"), in_channels=96, groups=2, out_channels=128),
])
def test_emulated_tma_forward_matches_the_reference(p):
    assert policy.tma_forward_reason(p, HOPPER) in (None, "the installed Triton has no Gluon TMA im2col copies "
                                                          "(Triton 3.9 has)"), p.describe()
    x, w = random_inputs(p, seed=5)
    got = _emulated_forward(p, x, w)
    assert not np.isnan(got).any(), "some outputs were never stored"
    assert relative_error(got, reference(p.with_(compute=None), x, w)) < 1e-12


def test_tf32_forward_maps_round_their_operands_and_f32_gradients_keep_their_kernels():
    # forward's X and W copies are TFLOAT32 maps (rounded by TMA); f32 grad_input with stride 1 runs as the forward
    # over its weight's K-innermost copy (the flipped weight's own tiles are N-major, which TF32 wgmma cannot read),
    # strided ones keep cp.async; f32 grad_weight runs as bf16x3 on the 16-bit kernel (NHWGC, stride 1) or on the
    # flat-plane kernel (other layouts)
    p = BASE.with_(dtype="f32", compute="tf32", in_channels=64, out_channels=128)
    _, maps = forward_tma_launch(p, policy.tma_forward_tiles(p, HOPPER), "k")
    assert [m.round_tf32 for m in maps] == [True, True, False]
    assert policy.tma_forward_tiles(p, HOPPER).block_k == 32
    assert "exact products, f32 in one-pass TF32" in policy.tma_forward_reason(p.with_(compute=None), HOPPER)
    if gluon_tma_im2col():
        assert policy.tma_stream_launch(p, HOPPER, Knobs()).launch.kernel == "forward_tma"
        dgrad = p.with_(op="grad_input", in_channels=128, out_channels=128)
        plan = policy.tma_stream_launch(dgrad, HOPPER, Knobs())
        assert plan.launch.kernel == "forward_tma" and dict(plan.launch.constants)["FLIPPED"] == 2
        assert plan.weight_axes == policy.weight_copy_axes(dgrad) == ("g", "t0", "t1", "c", "k")
        assert [m.round_tf32 for m in plan.maps] == [True, True, False]
        assert policy.tma_stream_launch(dgrad.with_(stride=(2, 2)), HOPPER, Knobs()) is None
        assert policy.tma_stream_launch(dgrad.with_(compute=None), HOPPER, Knobs()) is None  # three-pass TF32
        wgrad = p.with_(op="grad_weight", in_channels=128, out_channels=128)
        assert policy.tma_stream_launch(wgrad, HOPPER, Knobs()).launch.kernel == "grad_weight_tma"
        assert policy.tma_stream_launch(wgrad.with_(layout="GNHWC"), HOPPER, Knobs()).launch.kernel == \
            "grad_weight_flat_tma"
        assert "f32" in policy.tma_grad_weight_reason(wgrad, HOPPER)


@settings(max_examples=25, deadline=None)
@given(dims=st.integers(1, 3), size=st.integers(3, 9), stride=st.integers(1, 3), dilation=st.integers(1, 2),
       pad=st.tuples(st.integers(0, 2), st.integers(0, 2)), taps=st.integers(1, 3), groups=st.sampled_from([1, 2]),
       batch=st.integers(1, 3))
def test_im2col_box_walks_exactly_the_output_pixels(dims, size, stride, dilation, pad, taps, groups, batch):
    p = _problem(dims, size, stride, dilation, pad, taps, groups, 16, 64 if groups > 1 else 40, batch)
    if any(o < 1 for o in p.output):
        return
    lower, upper = im2col_box(p)
    for o, s, i, lo, low, up in zip(p.output, p.stride, p.input, p.pad_lo, lower, upper):
        walk = list(range(low, i + up, s))  # the positions TMA visits along this dimension
        assert walk == [q * s - lo for q in range(o)]
    if dims <= 2 and p.groups == 1:  # the whole kernel for the smaller cases (the emulation is slow in 3D)
        x, w = random_inputs(p, seed=1)
        assert relative_error(_emulated_forward(p, x, w), reference(p, x, w)) < 1e-12


needs_gluon = pytest.mark.skipif(not gluon_tma_im2col(), reason="the installed Triton has no Gluon TMA im2col")


@needs_gluon
def test_which_forwards_take_the_tma_kernel():
    takes = lambda p, target=HOPPER: policy.tma_forward_reason(p, target) is None  # noqa: E731
    assert takes(BASE) and takes(BASE.with_(dtype="bf16"))
    assert not takes(BASE, AMPERE), "wgmma and TMA im2col: sm_90 only"
    assert not takes(BASE.with_(dtype="f32")) and takes(BASE.with_(dtype="f32", compute="tf32")), \
        "f32: in one-pass TF32 only (three passes need the cp.async kernel's splits)"
    assert not takes(BASE.with_(op="grad_input")) and not takes(BASE.with_(op="grad_weight"))
    assert not takes(BASE.with_(layout="NGCHW")) and not takes(BASE.with_(weight_layout="GKCYX"))
    one_by_one = BASE.with_(filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0))
    assert takes(one_by_one) and not takes(one_by_one.with_(stride=(2, 2))), "1x1: TMA at stride 1 (#tma-1x1)"
    one_row = BASE.with_(filter=(1, 3), pad_lo=(0, 1), pad_hi=(0, 1))
    assert takes(one_row) and not takes(one_row.with_(weight_layout="GKCYX"))
    assert not takes(BASE.with_(in_channels=3)), "an RGB stem's 3 channels: not a whole 16-channel step"
    assert not takes(BASE.with_(groups=8, in_channels=1, out_channels=1)), "depthwise"
    assert not takes(BASE.with_(groups=2, out_channels=24)), "a column tile would cross into the next group"
    assert not takes(BASE.with_(dynamic_batch=True))
    low, _ = HOPPER.tma_im2col_corners(5)
    deep = BASE.with_(dims=3, input=(40, 8, 8), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                      pad_lo=(-low + 1, 1, 1), pad_hi=(-low + 1, 1, 1))
    assert not takes(deep), "3D padding past the five-dimensional map's corner range"
    # tiles in the knobs are a cp.async kernel's: the TMA kernel keeps its own; extern = false keeps the cp.async
    # kernel, and so does the IREE module (extern_launches)
    tiles = policy.tma_forward_tiles(BASE, HOPPER).label()
    assert policy.tma_stream_launch(BASE, HOPPER, Knobs(tiles="t64x64x32w4s3"))[0].warps == 4 and "w4s4" in tiles
    assert policy.tma_stream_launch(BASE, HOPPER, Knobs(extern=False)) is None
    assert policy.extern_launches(BASE, HOPPER, Knobs()).launches[0].kernel == "grad_input_phases"


@pytest.mark.parametrize("channels, size, stride, wide", [
    (256, 14, 1, True),  # 98 wide tiles in one wave, against 196 narrow ones in two
    (512, 7, 1, False),  # 50 wide tiles leave most SMs idle where 100 narrow ones fill one wave
    (256, 65, 1, True),
    (128, 56, 1, False),  # K < 256: a 256-column tile is half zeros
])
def test_wide_forward_tiles_where_they_take_fewer_waves(channels, size, stride, wide):
    p = BASE.with_(batch=64, in_channels=channels, out_channels=channels, input=(size, size), stride=(stride,) * 2,
                   filter=(3, 3), pad_lo=(1, 1), pad_hi=(1, 1))
    tiles = policy.tma_forward_tiles(p, HOPPER)
    assert (tiles.block_n, tiles.warps) == ((256, 8) if wide else (128 if channels >= 128 else 64, 4))
    # 128 x 256 x 64 of 16-bit in 3 stages, and its f16 output tile, fit an SM's shared memory
    assert not wide or tiles.stages * (128 + 256) * 64 * 2 + 128 * 256 * 2 <= HOPPER.gpu.shared_per_sm
    assert policy.tma_forward_tiles(p.with_(dtype="f32", compute="tf32"), HOPPER).block_n == 128
    # with groups, a wide column tile must not cross into the next group
    assert policy.tma_forward_tiles(p.with_(groups=2, out_channels=384, in_channels=384), HOPPER).block_n == 128


def test_narrow_forward_tiles_take_256_rows_over_wide_reductions():
    # 64 columns over 128 channels a tap: two warp groups of 128 rows each (docs/decisions.md#tma-narrow)
    p = BASE.with_(batch=64, in_channels=128, out_channels=64, input=(28, 28), filter=(3, 3), pad_lo=(1, 1),
                   pad_hi=(1, 1))
    tiles = policy.tma_forward_tiles(p, HOPPER)
    assert (tiles.block_m, tiles.block_n, tiles.warps, tiles.stages) == (256, 64, 8, 4)
    assert tiles.stages * (256 + 64) * tiles.block_k * 2 + 256 * 64 * 2 <= HOPPER.gpu.shared_per_sm
    # CK 15's 3D grad_input (C = 64, K = 128) runs as such a forward
    dgrad = p.with_(op="grad_input", in_channels=64, out_channels=128)
    assert policy.tma_stream_launch(dgrad, HOPPER, Knobs()).tiles.block_m == 256
    # elsewhere 128 rows: 64 channels a tap, more columns, a short TF32 reduction (9 taps x 2 steps: TF32 has its
    # own rule, test_tf32_narrow_forwards_take_256_rows_over_long_reductions), groups, fp8
    for other in (p.with_(in_channels=64), p.with_(out_channels=128),
                  p.with_(dtype="f32", compute="tf32", in_channels=64), p.with_(groups=2),
                  p.with_(compute=("fp8", "fp8"))):
        assert policy.tma_forward_tiles(other, HOPPER).block_m == 128, other.describe()


DGRAD = BASE.with_(op="grad_input", out_channels=48)  # its forward reduces over K = 48: three 16-channel steps


@pytest.mark.parametrize("p", [
    DGRAD,  # 3x3, padding 1: dY padded by 1 on each side
    DGRAD.with_(dilation=(2, 1), pad_lo=(1, 0), pad_hi=(3, 2)),
    DGRAD.with_(op="transposed", in_channels=64, out_channels=32, groups=2, filter=(2, 3), pad_lo=(0, 1),
                pad_hi=(1, 1)),
    DGRAD.with_(dims=3, input=(4, 5, 3), filter=(3, 1, 3), dilation=(1, 1, 1), stride=(1, 1, 1), pad_lo=(1, 0, 1),
                pad_hi=(1, 0, 1)),
    DGRAD.with_(dims=1, input=(11,), filter=(4,), stride=(1,), dilation=(2,), pad_lo=(3,), pad_hi=(2,)),
])
def test_stride_one_grad_input_runs_as_forward_reading_the_weight_flipped(p):
    q = policy.grad_input_as_forward(p)
    assert q is not None and q.output == p.input
    assert policy.tma_forward_reason(q, HOPPER) in (None, "the installed Triton has no Gluon TMA im2col copies "
                                                          "(Triton 3.9 has)"), q.describe()
    dy, w = random_inputs(p, seed=2)
    got = _emulated_forward(q, dy, w, flipped=True)  # grad_input's own weight, no copy
    assert relative_error(got.reshape(p.result_shape), reference(p, dy, w)) < 1e-12
    # strides and padding past the filter's reach keep the cp.async kernel
    assert policy.grad_input_as_forward(p.with_(stride=(2,) * p.dims)) is None
    assert policy.grad_input_as_forward(p.with_(pad_lo=(p.filter[0] * p.dilation[0],) * p.dims)) is None
    if gluon_tma_im2col():  # a GKCYX weight keeps its taps inside: no tile of it is a box
        assert policy.tma_stream_launch(p.with_(weight_layout="GKCYX"), HOPPER, Knobs()) is None
        # taken flipped, unless the cp.async kernel runs it faster (48 channels of dY: 16 a step over the taps)
        slower = policy.tma_forward_slower(q, HOPPER)
        assert (p.out_channels % 32 != 0) == (slower is not None)
        launch = policy.tma_stream_launch(p, HOPPER, Knobs())
        assert launch is None if slower else launch[2] is True


@pytest.mark.parametrize("p", [
    DGRAD.with_(dtype="f32", compute="tf32"),
    DGRAD.with_(dtype="f32", compute="tf32", op="transposed", in_channels=64, out_channels=32, groups=2,
                filter=(2, 3), pad_lo=(0, 1), pad_hi=(1, 1)),
    DGRAD.with_(dtype="f32", compute="tf32", dims=3, input=(4, 5, 3), filter=(3, 1, 3), dilation=(1, 1, 1),
                stride=(1, 1, 1), pad_lo=(1, 0, 1), pad_hi=(1, 0, 1), in_channels=48),
])
def test_tf32_grad_input_runs_as_forward_over_the_reversed_weight_copy(p):
    # one-pass TF32 grad_input: the forward of dY over grad_input's weight copied K-innermost (the copy the runner
    # makes, weight_copy_axes), its tap tiles read in reverse; products in float64 (TMA's TF32 rounding aside)
    q = policy.grad_input_as_forward(p)
    assert policy.tma_forward_reason(q, HOPPER) in (None, "the installed Triton has no Gluon TMA im2col copies "
                                                          "(Triton 3.9 has)"), q.describe()
    dy, w = random_inputs(p.with_(compute=None), seed=3)
    axes = policy.weight_copy_axes(p)
    names = ["g", "k", *(f"t{i}" for i in range(p.dims)), "c"]  # GKYXC
    copy = np.ascontiguousarray(w.reshape(p.w_shape).transpose([names.index(a) for a in axes]))
    got = _emulated_forward(q, dy, copy, reversed_copy=True)
    assert not np.isnan(got).any(), "some outputs were never stored"
    assert relative_error(got.reshape(p.result_shape), reference(p.with_(compute=None), dy, w)) < 1e-12
    with pytest.raises(ValueError, match="either from itself or from its copy"):
        forward_tma_launch(q, policy.tma_forward_tiles(q, HOPPER), "k", flipped=True, reversed_copy=True)



R21 = BASE.with_(dims=3, batch=8, in_channels=64, out_channels=144, input=(8, 56, 56), filter=(1, 3, 3),
                 stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(0, 1, 1), pad_hi=(0, 1, 1), dtype="bf16")


def test_forward_tiles_fit_the_columns_and_the_programs():
    # r2plus1d_18's (2+1)D layers (docs/decisions.md#tma-forward-fit): K = 144 over several taps computes 192
    # columns in 64-wide tiles of two warp groups, not 256 in 128-wide ones
    assert policy.tma_forward_tiles(R21, HOPPER).label() == "t256x64x64w8s4"
    assert policy.tma_forward_tiles(R21.with_(out_channels=192), HOPPER).label() == "t256x64x64w8s4"
    # 1x1 layers keep 128-wide columns (measured both ways), as do K that fill them or leave more than 64 over
    one_tap = R21.with_(filter=(1, 1, 1), pad_lo=(0, 0, 0), pad_hi=(0, 0, 0))
    for p in (one_tap, R21.with_(out_channels=128), R21.with_(out_channels=224), R21.with_(groups=2, in_channels=128,
                                                                                            out_channels=288)):
        assert policy.tma_forward_tiles(p, HOPPER).block_n == 128, p.describe()
    # 128-row tiles that leave more than half the SMs without one take 64 rows: the late 7x7 layers
    late = R21.with_(in_channels=1152, out_channels=512, input=(1, 7, 7), filter=(3, 1, 1), pad_lo=(1, 0, 0),
                     pad_hi=(1, 0, 0))
    assert policy.tma_forward_tiles(late, HOPPER).label() == "t64x128x64w4s4"
    assert policy.tma_forward_tiles(late.with_(batch=64), HOPPER).block_m == 128  # 196 tiles of 128 rows
    assert policy.tma_forward_tiles(late.with_(dtype="f32", compute="tf32"), HOPPER).block_m == 128  # TF32's own


def test_forward_tiles_take_32_columns_for_32_output_channels():
    # DenseNet-121's growth layers (K = 32 from C = 128, 3x3): 32-wide columns, not 64 computed for 32 in 256-row
    # tiles (0.50-0.83x the time at 7x7 to 56x56; docs/decisions.md#layer-fit); few tiles still take 64 rows
    growth = R21.with_(dims=2, batch=64, in_channels=128, out_channels=32, input=(28, 28), filter=(3, 3),
                       stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    assert policy.tma_forward_tiles(growth, HOPPER).label() == "t128x32x64w4s4"
    assert policy.tma_forward_tiles(growth.with_(input=(7, 7)), HOPPER).label() == "t64x32x64w4s4"
    planned = stream.planned_stream_kernel(growth, HOPPER, Knobs())
    assert "forward_tma" in planned.launches[0].launch.kernel and planned.tiles == "t128x32x64w4s4"
    # 64 output channels keep 64-wide columns (256 rows over C >= 128: #tma-narrow), as do K = 24 over 144 channels
    # 16 a step (EfficientNet's 1x1s: 1.07-1.13x slower on 32 columns)
    assert policy.tma_forward_tiles(growth.with_(out_channels=64), HOPPER).label() == "t256x64x64w8s4"
    assert policy.tma_forward_tiles(growth.with_(in_channels=144, out_channels=24, filter=(1, 1), pad_lo=(0, 0),
                                                 pad_hi=(0, 0)), HOPPER).label() == "t256x64x16w8s4"


def test_forwards_the_cp_async_kernel_runs_faster_keep_it():
    # 16 channels a step over several taps, and few tiles over a long reduction: the cp.async kernel
    # (docs/decisions.md#tma-forward-fit); the TMA kernel could take both (tma_forward_reason)
    sixteen = R21.with_(in_channels=144, out_channels=64, filter=(3, 1, 1), pad_lo=(1, 0, 0), pad_hi=(1, 0, 0))
    long = R21.with_(in_channels=1152, out_channels=512, input=(1, 7, 7))  # 9 taps x 18 steps, 16 tiles
    for p in (sixteen, long):
        assert policy.tma_forward_reason(p, HOPPER) in (None, "the installed Triton has no Gluon TMA im2col copies "
                                                              "(Triton 3.9 has)")
        assert policy.tma_forward_slower(p, HOPPER) is not None, p.describe()
    assert "16 channels a step" in policy.tma_forward_slower(sixteen, HOPPER)
    assert "split-K" in policy.tma_forward_slower(long, HOPPER)
    # one tap, 32 channels a step, a shorter reduction (3 taps x 18 steps), many tiles, f32: the rules as before
    for p in (sixteen.with_(filter=(1, 1, 1), pad_lo=(0, 0, 0), pad_hi=(0, 0, 0)), sixteen.with_(in_channels=160),
              long.with_(filter=(3, 1, 1), pad_lo=(1, 0, 0), pad_hi=(1, 0, 0)), long.with_(batch=64),
              long.with_(dtype="f32", compute="tf32")):
        assert policy.tma_forward_slower(p, HOPPER) is None, p.describe()
    # the same rules hold for a stride-1 grad_input, run as the forward over the flipped weight: r2plus1d_18's
    # grad_input into 512 channels from 1152 splits its reduction on the cp.async kernel
    dgrad = R21.with_(op="grad_input", in_channels=512, out_channels=1152, input=(1, 7, 7))
    assert policy.tma_forward_slower(policy.grad_input_as_forward(dgrad), HOPPER) is not None
    planned = stream.planned_stream_kernel(dgrad, HOPPER, Knobs())
    assert "TMA" not in planned.describe() and "split-K" in planned.describe()
    # a flipped grad_input the halo kernel takes keeps it, 16 channels a step or not (#halo-grad-input)
    halo = R21.with_(op="grad_input", batch=2, in_channels=32, out_channels=16, input=(16, 32, 32), filter=(3, 3, 3),
                     pad_lo=(1, 1, 1), pad_hi=(1, 1, 1))
    assert policy.tma_forward_slower(policy.grad_input_as_forward(halo), HOPPER) is not None
    if gluon_tma_im2col():
        assert policy.tma_stream_launch(halo, HOPPER, Knobs()).launch.kernel == "forward_halo"


def test_tf32_narrow_forwards_take_256_rows_over_long_reductions():
    # one-pass TF32 with at most 64 columns: 256 x 64 tiles of two warp groups where a tile's reduction takes
    # TF32_NARROW_STEPS steps (32 channels each) or more: CK 15's and U-Net's 3D grad_inputs as forwards, not
    # ResNet-50's 3x3 over 64 channels (18 steps) nor wider outputs
    def tiles(op, c, k, dims):
        p = BASE.with_(op=op, dtype="f32", compute="tf32", in_channels=c, out_channels=k, dims=dims,
                       input=(6,) * dims, filter=(3,) * dims, stride=(1,) * dims, dilation=(1,) * dims,
                       pad_lo=(1,) * dims, pad_hi=(1,) * dims)
        q = policy.grad_input_as_forward(p) or p
        return policy.tma_forward_tiles(q, HOPPER)

    assert tiles("grad_input", 64, 128, 3).label() == "t256x64x32w8s4"  # 27 taps x 4 steps
    assert tiles("grad_input", 64, 64, 3).label() == "t256x64x32w8s4"  # 27 x 2
    assert tiles("grad_input", 64, 64, 2).label() == "t128x64x32w4s4"  # 9 x 2
    assert tiles("grad_input", 128, 64, 3).block_m == 128  # 128 columns
    assert tiles("forward", 128, 64, 3).label() == "t256x64x32w8s4"  # a forward alike
    # 16-bit keeps its own rule: 128 reduction channels a tap or more
    assert policy.tma_forward_tiles(BASE.with_(batch=8, in_channels=64, out_channels=64, dims=3, input=(16,) * 3,
                                               filter=(3,) * 3, stride=(1,) * 3, dilation=(1,) * 3,
                                               pad_lo=(1,) * 3, pad_hi=(1,) * 3), HOPPER).block_m == 128


PERSISTENT_CASES = [
    BASE.with_(batch=8, input=(9, 10)),  # 6 row tiles, K = 24 < BLOCK_N
    BASE.with_(batch=5, input=(9, 10), out_channels=200),  # two column tiles, innermost in a program's turn
    BASE.with_(batch=4, input=(9, 10), groups=2, in_channels=16, out_channels=64),  # groups outermost
    # one step a tile: the ring's copies run three tiles ahead of the products
    BASE.with_(batch=6, dims=1, input=(50,), filter=(1,), stride=(1,), dilation=(1,), pad_lo=(0,), pad_hi=(0,),
               in_channels=16),
    DGRAD.with_(batch=8, input=(9, 10)),  # a stride-1 grad_input, run as a forward reading the weight flipped
]


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("p", PERSISTENT_CASES)
def test_emulated_persistent_forward_matches_the_reference(p, programs):
    # forward_tma_persistent's schedule (kernels/tma.py): each program's tiles in turn, its copies issued
    # across the tiles' boundaries from the tile origin the loop keeps
    flipped = p.op == "grad_input"
    q = policy.grad_input_as_forward(p) if flipped else p
    tiles = policy.tma_forward_tiles(q, HOPPER)
    launch, _ = forward_tma_launch(q, tiles, "k", flipped, programs=programs)
    count = -(-q.batch * math.prod(q.output) // tiles.block_m) * -(-q.out_channels // tiles.block_n) * q.groups
    assert launch.kernel == "forward_tma_persistent" and launch.grid == (min(programs, count), 1, 1)
    x, w = random_inputs(p, seed=3)
    got = _emulated_forward(q, x, w, flipped=flipped, programs=programs)
    assert not np.isnan(got).any(), "some outputs were never stored"
    assert relative_error(got.reshape(p.result_shape), reference(p, x, w)) < 1e-12


def test_persistent_forward_programs():
    # as many programs as the SMs hold at once, where there are more tiles than that
    hopper = HOPPER.gpu
    big = BASE.with_(batch=64, input=(56, 56), in_channels=64, out_channels=64)  # 128 x 64 tiles: two an SM
    tiles = policy.tma_forward_tiles(big, HOPPER)
    assert (tiles.block_m, tiles.block_n) == (128, 64)
    assert 2 * (policy.tma_forward_shared_bytes(big, tiles) + hopper.shared_reserved_per_block) <= hopper.shared_per_sm
    assert policy.tma_forward_programs(big, tiles, HOPPER) == 2 * hopper.sm_count
    wide = big.with_(out_channels=128)  # 128 x 128 tiles: one an SM
    assert policy.tma_forward_programs(wide, policy.tma_forward_tiles(wide, HOPPER), HOPPER) == hopper.sm_count
    # no more tiles than programs, and one-pass TF32: a program per tile
    small = big.with_(batch=4)
    assert policy.tma_forward_programs(small, policy.tma_forward_tiles(small, HOPPER), HOPPER) == 0
    tf32 = big.with_(dtype="f32", compute="tf32")
    assert policy.tma_forward_programs(tf32, policy.tma_forward_tiles(tf32, HOPPER), HOPPER) == 0
    plan = policy.tma_stream_launch(big, HOPPER, Knobs())
    assert plan.launch.kernel == "forward_tma_persistent" and plan.launch.grid == (2 * hopper.sm_count, 1, 1)
    dgrad = policy.tma_stream_launch(big.with_(op="grad_input"), HOPPER, Knobs())
    assert dgrad.flipped and dgrad.launch.kernel == "forward_tma_persistent"


def _emulated_grad_input_phases(p: ConvProblem, dy: np.ndarray, w: np.ndarray, programs: int) -> np.ndarray:
    """grad_input_phases_tma in float64 through _im2col_tile, replayed as it runs: each program's tiles in turn
    (phases outermost), its copies issued by the cursor (tile, step) that moves to the program's next tile when a
    tile's steps are issued, and each tile's rows stored by address where its phase has positions."""
    tiles = policy.tma_grad_input_phases_tiles(p)
    launch, maps = grad_input_phases_tma_launch(p, tiles, "k", programs)
    cs = dict(launch.constants)
    x_map, w_map = maps
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    dys = dy.reshape(x_map.shape).astype(np.float64)
    w2 = w.reshape(w_map.shape).astype(np.float64)
    dx = np.full((p.batch * math.prod(p.input), p.groups * p.in_channels), np.nan)
    qm, lom, ts, os_, ff, size, stride = cs["QM"], cs["LOM"], cs["TS"], cs["OS"], cs["FF"], cs["I"], cs["S"]
    c, k, g_count, rows, phases, stages = cs["C"], cs["K"], cs["G"], cs["ROWS"], cs["PHASES"], cs["STAGES"]
    col_tiles, row_tiles = -(-k // bn), -(-rows // bm)
    per_phase = col_tiles * row_tiles * g_count
    count = phases * per_phase
    dims = p.dims

    def origin(tile: int) -> dict:  # _phase_tile
        ph, rest = divmod(tile, per_phase)
        off_m, off_k = ((rest // col_tiles) % row_tiles) * bm, (rest % col_tiles) * bn
        g = rest // (col_tiles * row_tiles)
        o2, o1, o0, n = off_m % qm[2], (off_m // qm[2]) % qm[1], (off_m // (qm[2] * qm[1])) % qm[0], \
            off_m // math.prod(qm)
        corner = (o0 - lom[0], o1 - lom[1], o2 - lom[2])[3 - dims:]
        return dict(ph=ph, off_m=off_m, off_k=off_k, g=g, n=n, corner=corner, J=cs["PJ"][ph], Y=cs["PY"][ph],
                    H=cs["PSH"][ph], steps=math.prod(cs["PJ"][ph]) * (c // bk))

    def product(at: dict, step: int) -> np.ndarray:  # _issue_phase's copies, multiplied
        t, cb = divmod(step, c // bk)
        j = at["J"]
        t3 = (t // (j[2] * j[1]), (t // j[2]) % j[1], t % j[2])
        offsets = tuple(h + ti * o for h, ti, o in zip(at["H"], t3, os_))[3 - dims:]
        ys = [y + (jj - 1 - ti) * st_ for y, jj, ti, st_ in zip(at["Y"], j, t3, ts)]
        tap = (ys[0] * ff[1] + ys[1]) * ff[2] + ys[2]
        channel = at["g"] * c + cb * bk
        a = _im2col_tile(dys, (at["n"], *at["corner"], channel), offsets, x_map.lower, x_map.upper,
                         x_map.element_strides[1:-1], bm, bk)
        b = np.zeros((bk, bn))
        block = w2[channel:channel + bk, tap * k + at["off_k"]:tap * k + at["off_k"] + bn]
        b[:block.shape[0], :block.shape[1]] = block
        return a @ b

    def store(at: dict, acc: np.ndarray) -> None:  # _store_phase_rows
        r, e = cs["PR"][at["ph"]], cs["PQ"][at["ph"]]
        for i in range(bm):
            row = at["off_m"] + i
            q3 = ((row // (qm[2] * qm[1])) % qm[0], (row // qm[2]) % qm[1], row % qm[2])
            n = row // math.prod(qm)
            if row >= rows or any(qi >= ei for qi, ei in zip(q3, e)):
                continue
            pixel = ((n * size[0] + r[0] + stride[0] * q3[0]) * size[1] + r[1] + stride[1] * q3[1]) * size[2] \
                + r[2] + stride[2] * q3[2]
            cols = min(bn, k - at["off_k"])
            dx[pixel, at["g"] * k + at["off_k"]:at["g"] * k + at["off_k"] + cols] = acc[i, :cols]

    for pid in range(launch.grid[0]):
        copies, j = {}, 0
        cursor = [pid, 0, origin(pid)]  # tile, step, its origin

        def issue(slot: int) -> None:
            copies[slot] = (cursor[2], cursor[1])
            cursor[1] += 1
            if cursor[1] == cursor[2]["steps"]:
                cursor[0] += launch.grid[0]
                cursor[1] = 0
                cursor[2] = origin(cursor[0]) if cursor[0] < count else None

        for i in range(stages - 1):
            if cursor[0] < count:
                issue(i)
        for tile in range(pid, count, launch.grid[0]):
            at = origin(tile)
            acc = np.zeros((bm, bn))
            for _ in range(at["steps"]):
                made_for, step = copies.pop(j)
                acc += product(made_for, step)
                if cursor[0] < count:
                    issue(j + stages - 1)
                j += 1
            store(at, acc)
    return dx.reshape(p.result_shape)


PHASES_BASE = BASE.with_(op="grad_input", batch=2, in_channels=16, out_channels=32, input=(9, 10), stride=(2, 2))
PHASES_CASES = [
    PHASES_BASE,  # 3x3 stride 2, padding 1: phases of 4, 2, 2 and 1 taps; 5 and 4 positions in the first dimension
    PHASES_BASE.with_(pad_lo=(0, 0), pad_hi=(0, 1)),  # phases whose windows start at different rows of dY
    PHASES_BASE.with_(dims=1, input=(23,), filter=(5,), stride=(3,), dilation=(2,), pad_lo=(3,), pad_hi=(2,)),
    PHASES_BASE.with_(dims=3, batch=1, input=(5, 4, 5), filter=(3, 2, 3), stride=(2, 2, 2), dilation=(1, 1, 1),
                      pad_lo=(1, 0, 1), pad_hi=(1, 0, 1)),  # 3D, a 2-tap dimension: 8 phases
    PHASES_BASE.with_(groups=2, in_channels=64, out_channels=16),  # groups: the column tile stays in its group
    PHASES_BASE.with_(batch=3, in_channels=200),  # two column tiles, and several row tiles a phase
    PHASES_BASE.with_(op="transposed"),  # the transposed convolution: grad_input's arithmetic
]


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("p", PHASES_CASES)
def test_emulated_grad_input_phases_match_the_reference(p, programs):
    # grad_input_phases_tma's tables, window and schedule (kernels/tma.py, tma_launches.grad_input_phases_tma_launch)
    dy, w = random_inputs(p, seed=5)
    got = _emulated_grad_input_phases(p, dy, w, programs)
    assert not np.isnan(got).any(), "some positions of dX were never stored"
    assert relative_error(got, reference(p, dy, w)) < 1e-12


@given(dims=st.integers(1, 2), stride=st.integers(2, 3), filt=st.integers(2, 5), dilation=st.integers(1, 2),
       size=st.integers(3, 8), lo=st.integers(0, 3), extra=st.integers(0, 2))
@settings(max_examples=25, deadline=None)
def test_emulated_grad_input_phases_property(dims, stride, filt, dilation, size, lo, extra):
    # any strided grad_input the rule takes (every phase with taps) equals the reference when run as the kernel
    # runs it; the rule refuses the rest with a reason
    reach = dilation * (filt - 1)
    lo = min(lo, reach)
    out = (size + lo + min(extra, reach) - reach - 1) // stride + 1
    if out < 1:
        return
    hi = (out - 1) * stride + reach + 1 - size - lo  # the padding that makes O's last window end inside it
    if hi < 0:
        return
    p = PHASES_BASE.with_(dims=dims, batch=1, input=(size,) * dims, filter=(filt,) * dims, stride=(stride,) * dims,
                          dilation=(dilation,) * dims, pad_lo=(lo,) * dims, pad_hi=(hi,) * dims)
    reason = policy.tma_grad_input_phases_reason(p, HOPPER) if gluon_tma_im2col() else None
    phases = grad_input_phases(p)
    if len(phases) < stride ** dims or any(ph.empty for ph in phases):
        assert reason is None or "phase" in reason
        return
    dy, w = random_inputs(p, seed=1)
    got = _emulated_grad_input_phases(p, dy, w, 2)
    assert not np.isnan(got).any()
    assert relative_error(got, reference(p, dy, w)) < 1e-12


@needs_gluon
def test_which_grad_inputs_take_the_tma_phases_kernel():
    # ResNet-50's stride-2 3x3 grad_input: 4 phases x 98 row tiles of 128 x 128, 132 programs
    big = PHASES_BASE.with_(batch=64, input=(56, 56), in_channels=128, out_channels=128)
    assert policy.tma_grad_input_phases_reason(big, HOPPER) is None
    plan = policy.tma_stream_launch(big, HOPPER, Knobs())
    # 128 x 128 tiles in 3 stages: two programs an SM
    assert plan.launch.kernel == "grad_input_phases_tma" and plan.launch.grid == (2 * HOPPER.gpu.sm_count, 1, 1)
    assert plan.tiles == policy.tma_grad_input_phases_tiles(big) and (plan.tiles.block_n, plan.tiles.stages) == (128, 3)
    refused = {
        "stride 1": big.with_(stride=(1, 1)),
        "f32": big.with_(dtype="f32", compute="tf32"),
        "1x1 stride 2: three phases without taps": big.with_(filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0)),
        "GKCYX weight": big.with_(weight_layout="GKCYX"),
        "dY channels not whole steps": big.with_(out_channels=24),
        "no more tiles than programs": big.with_(batch=8),
    }
    for why, q in refused.items():
        assert policy.tma_grad_input_phases_reason(q, HOPPER), why
    assert "sm_90" in policy.tma_grad_input_phases_reason(big, AMPERE)
    # 64 dX channels: 128 x 64 tiles, two programs an SM
    narrow = big.with_(in_channels=64, batch=128)
    assert policy.tma_stream_launch(narrow, HOPPER, Knobs()).launch.grid == (2 * HOPPER.gpu.sm_count, 1, 1)


@needs_gluon
def test_tma_phases_kernel_takes_the_shared_memory_the_rule_counts():
    # the programs an SM follow from policy.tma_grad_input_phases_shared_bytes: the compiled binaries must take no more
    for channels in (128, 64):
        p = PHASES_BASE.with_(batch=64, input=(56, 56), in_channels=channels, out_channels=128)
        kernel = stream.planned_stream_kernel(p, HOPPER, Knobs(), compile=True)
        (launch,) = kernel.launches
        assert launch.launch.kernel == "grad_input_phases_tma"
        tiles = policy.tma_grad_input_phases_tiles(p)
        assert launch.binary.shared_bytes <= policy.tma_grad_input_phases_shared_bytes(p, tiles)
        gpu = HOPPER.gpu
        assert 2 * (launch.binary.shared_bytes + gpu.shared_reserved_per_block) <= gpu.shared_per_sm
        assert kernel.tma_params.count("map") == 2 and kernel.tma_params.count("ptr2") == 1
        assert "all phases in one persistent launch" in kernel.describe()


@needs_gluon
def test_promoted_and_reversed_copy_kernels_compile():
    # exact f32 grad_weight as bf16x6 with wgmma's sums added in f32 (two product warp groups and a copy warp; and
    # one warp group): a binary of its own beside the unpromoted one; and one-pass TF32 grad_input as the forward
    # over the reversed weight copy
    from dataclasses import replace

    from convdsl.kernels.compile import compile_tma_launch

    for p in (F32_WIDE.with_(compute=None), F32_WGRAD.with_(compute=None)):
        plan = policy.tma_stream_launch(p, HOPPER, Knobs())
        consts = dict(plan.launch.constants)
        assert consts["PROMOTE"] > 0
        promoted, _, _ = compile_tma_launch(plan.launch, plan.maps, "sm_90")
        plain, _, _ = compile_tma_launch(replace(plan.launch, constants=tuple({**consts, "PROMOTE": 0}.items())),
                                         plan.maps, "sm_90")
        assert promoted.data != plain.data and promoted.params == plain.params
    kernel = stream.planned_stream_kernel(F32_WIDE.with_(compute=None), HOPPER, Knobs(), compile=True)
    assert "wgmma's sums added in f32 every 8 steps" in kernel.describe() and "(bf16x6)" in kernel.describe()
    dgrad = stream.planned_stream_kernel(DGRAD.with_(dtype="f32", compute="tf32"), HOPPER, Knobs(), compile=True)
    assert dgrad.launches[0].launch.kernel == "forward_tma" and "read taps reversed" in dgrad.describe()


@needs_gluon
def test_tma_kernel_compiles_and_its_record_round_trips():
    # enough rows for 128-row tiles (fewer tiles than half the SMs take 64 rows: #tma-forward-fit)
    kernel = stream.planned_stream_kernel(BASE.with_(batch=256, in_channels=64, out_channels=128), HOPPER, Knobs(),
                                          compile=True)
    assert [sl.launch.kernel for sl in kernel.launches] == ["forward_tma"]
    assert "TMA im2col" in kernel.describe()
    # three descriptors passed by value, each with its shape and strides, then Triton's two scratch pointers
    assert kernel.tma_params.count("map") == 3 and len(kernel.tma_params) == kernel.launches[0].binary.params
    x_map, w_map, y_map = kernel.tma_maps
    assert x_map.im2col and x_map.box == (128, 64) and w_map.shape == (128, 9 * 64) and y_map.shape == (256 * 42, 128)
    # a 128-column block of 2-byte elements is copied as two 64-column boxes (128-byte swizzle span)
    assert y_map.box == (128, 64) and w_map.box == (128, 64)
    back = stream._from_record(json.loads(json.dumps(stream._to_record(kernel))))
    assert back.tma_maps == kernel.tma_maps and back.tma_params == kernel.tma_params
    assert back.launches[0].binary == kernel.launches[0].binary
    dgrad = stream.planned_stream_kernel(BASE.with_(op="grad_input", in_channels=64, out_channels=64), HOPPER, Knobs())
    assert dgrad.tma_flipped_weight and "flipped weight" in dgrad.describe()
    assert not stream.planned_stream_kernel(BASE.with_(op="grad_input", stride=(2, 2)), HOPPER, Knobs()).tma_maps


@needs_gluon
def test_specialised_grad_weight_runs_a_copy_warp_and_says_so():
    # 3D 128 x 128 tiles of two product warp groups: one warp group more in the binary (the copy warp's), which
    # is what describe() reads after a bundle round trip (the record keeps no compile-time constants)
    p = BASE.with_(op="grad_weight", dims=3, in_channels=128, out_channels=128, input=(4, 5, 6), filter=(3, 3, 3),
                   stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1))
    kernel = stream.planned_stream_kernel(p, HOPPER, Knobs(), compile=True)
    (launch,) = kernel.launches
    assert launch.launch.kernel == "grad_weight_tma" and launch.launch.warps == 8
    assert launch.binary.threads == 32 * (8 + 4)
    back = stream._from_record(json.loads(json.dumps(stream._to_record(kernel))))
    assert "the copies issued by a warp of their own" in back.describe()
    square = stream.planned_stream_kernel(p.with_(dims=2, input=(5, 6), filter=(3, 3), stride=(1, 1), dilation=(1, 1),
                                               pad_lo=(1, 1), pad_hi=(1, 1)), HOPPER, Knobs(), compile=True)
    assert "a warp of their own" not in square.describe() and square.launches[0].binary.threads == 32 * 4


def _emulated_grad_weight(p: ConvProblem, x: np.ndarray, dy: np.ndarray, tiles: TileConfig | None = None
                          ) -> np.ndarray:
    """grad_weight_tma's tiles, copies and partial stores in float64 through _im2col_tile, then the chunks' sum:
    a program's columns (tap, channel) col0.. of the [taps * C] axis, one im2col box per tap where the tile is
    wider than C, the last tile's columns past the last tap computed from its window again and left unstored."""
    tiles = tiles or policy.tma_grad_weight_tiles(p, HOPPER)
    launch, maps, partials_shape = grad_weight_tma_launch(p, tiles, "k", policy.reduction_split(p, tiles, 3, HOPPER))
    consts = dict(launch.constants)
    x_map, dy_map, p_map = maps
    bm, bn, br = tiles.block_m, tiles.block_n, tiles.block_k
    xb, pb = x_map.block[1], p_map.block[1]
    xs = x.reshape(x_map.shape).astype(np.float64)
    dys = dy.reshape(dy_map.shape).astype(np.float64)
    part = np.full(p_map.shape, np.nan)
    out, s_, d, lo, taps_3d = consts["O"], consts["S"], consts["D"], consts["LO"], consts["F"]
    c, k, g_count, rows, chunk = consts["C"], consts["K"], consts["G"], consts["L"], consts["CHUNK"]
    taps = math.prod(taps_3d)
    dims, col_tiles = p.dims, -(-taps * c // bn)
    grid = launch.grid
    assert grid[0] == (k // bm) * col_tiles and bn % xb == 0 and (c % xb == 0) and pb <= 128
    for s in range(grid[2]):
        for g in range(grid[1]):
            for pid in range(grid[0]):
                off_k, col0 = (pid // col_tiles) * bm, (pid % col_tiles) * bn
                acc = np.zeros((bm, bn))
                for r0 in range(s * chunk, min(rows, (s + 1) * chunk), br):
                    o2, o1 = r0 % out[2], (r0 // out[2]) % out[1]
                    o0, n = (r0 // (out[2] * out[1])) % out[0], r0 // (out[2] * out[1] * out[0])
                    corner = (o0 * s_[0] - lo[0], o1 * s_[1] - lo[1], o2 * s_[2] - lo[2])[3 - dims:]
                    boxes = []
                    for i in range(bn // xb):
                        t, c_col = min((col0 + i * xb) // c, taps - 1), (col0 + i * xb) % c
                        t2, t1, t0 = t % taps_3d[2], (t // taps_3d[2]) % taps_3d[1], t // (taps_3d[2] * taps_3d[1])
                        offsets = (t0 * d[0], t1 * d[1], t2 * d[2])[3 - dims:]
                        boxes.append(_im2col_tile(xs, (n, *corner, g * c + c_col), offsets, x_map.lower, x_map.upper,
                                                  x_map.element_strides[1:-1], br, xb))
                    a = np.zeros((br, bm))
                    box = dys[r0:r0 + br, g * k + off_k:g * k + off_k + bm]
                    a[:box.shape[0], :box.shape[1]] = box
                    acc += a.T @ np.concatenate(boxes, axis=1)
                row = (s * g_count + g) * k + off_k
                for j in range(0, bn, pb):  # TMA stores drop the columns past the partials' last
                    width = max(0, min(pb, taps * c - (col0 + j)))
                    part[row:row + bm, col0 + j:col0 + j + width] = acc[:, j:j + width]
    total = part.reshape(partials_shape).sum(0)  # [G, K, F0, F1, F2, C]
    return total.reshape(p.groups, k, *p.filter, c)


@pytest.mark.parametrize("p", [
    BASE.with_(op="grad_weight", in_channels=64, out_channels=128),
    BASE.with_(op="grad_weight", in_channels=128, out_channels=64, stride=(2, 2), dilation=(1, 2), pad_lo=(1, 2),
               pad_hi=(0, 2), batch=3),
    BASE.with_(op="grad_weight", groups=2, in_channels=64, out_channels=64, dims=3, input=(3, 4, 5),
               filter=(2, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(0, 1, 1), pad_hi=(1, 1, 1)),
    # 3D with 64 channels: the rule's tiles take two taps; 27 taps, so the last tile's second is past the filter
    BASE.with_(op="grad_weight", in_channels=64, out_channels=64, dims=3, input=(3, 4, 5), filter=(3, 3, 3),
               stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)),
])
def test_emulated_tma_grad_weight_matches_the_reference(p):
    x, dy = random_inputs(p, seed=4)
    got = _emulated_grad_weight(p, x, dy)
    assert not np.isnan(got).any(), "some partials were never stored"
    assert relative_error(got, reference(p, x, dy)) < 1e-12
    if gluon_tma_im2col():
        assert policy.tma_grad_weight_reason(p, HOPPER) is None
        assert policy.tma_grad_weight_reason(p.with_(in_channels=32), HOPPER) is not None  # not whole 64-blocks
        assert policy.tma_grad_weight_reason(p.with_(filter=(1,) * p.dims, pad_lo=(0,) * p.dims,
                                                     pad_hi=(0,) * p.dims), HOPPER) is not None  # 1x1


WIDE_WGRAD_TILES = TileConfig(128, 256, 64, warps=8, stages=3)


@pytest.mark.parametrize("p", [
    # C = 128: two taps a tile, 9 taps so the last tile's second tap is past the filter
    BASE.with_(op="grad_weight", in_channels=128, out_channels=128, groups=2, batch=3),
    # C = 64: four taps a tile; 3D, 27 taps
    BASE.with_(op="grad_weight", in_channels=64, out_channels=128, dims=3, input=(3, 4, 5), filter=(3, 3, 3),
               stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)),
    # C = 512: two 256-column tiles a tap
    BASE.with_(op="grad_weight", in_channels=512, out_channels=128, filter=(1, 3), pad_lo=(0, 1), pad_hi=(0, 1)),
])
def test_emulated_wide_tma_grad_weight_spans_taps(p):
    x, dy = random_inputs(p, seed=5)
    got = _emulated_grad_weight(p, x, dy, WIDE_WGRAD_TILES)
    assert not np.isnan(got).any(), "some partials were never stored"
    assert relative_error(got, reference(p, x, dy)) < 1e-12


def test_tma_grad_weight_tiles():
    # 64 x 64 tiles take 128 positions a step; 3D 128 x 128 tiles two warp groups in 4 stages; 2D ones as before
    wgrad = BASE.with_(op="grad_weight", in_channels=64, out_channels=64)
    assert policy.tma_grad_weight_tiles(wgrad, HOPPER).label() == "t64x64x128w4s3"
    square = wgrad.with_(in_channels=128, out_channels=128)
    assert policy.tma_grad_weight_tiles(square, HOPPER).label() == "t128x128x64w4s4"
    assert policy.tma_grad_weight_tiles(wgrad.with_(out_channels=128), HOPPER).label() == "t128x64x64w4s4"
    deep = wgrad.with_(dims=3, input=(4, 5, 6), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                       pad_lo=(1, 1, 1), pad_hi=(1, 1, 1), in_channels=128, out_channels=128)
    assert policy.tma_grad_weight_tiles(deep, HOPPER).label() == "t128x128x64w8s4"
    # 3D with 64 channels C and K: 64 x 128 tiles of two taps (2D keeps 64 x 64)
    assert policy.tma_grad_weight_tiles(deep.with_(in_channels=64, out_channels=64), HOPPER).label() == \
        "t64x128x128w4s3"
    # 256 columns where C holds whole 256-channel tiles and the estimate takes them: wav2vec2's 1D grad_weight,
    # a 3D 256-channel one; not CK 11's 3D (C = 128) nor ResNet-50's 256-channel 3x3 at 14x14, which would need
    # more chunks to fill the SMs with half the tiles
    ck11 = deep.with_(groups=8, batch=64, input=(28, 28, 3))
    assert policy.tma_grad_weight_tiles(ck11, HOPPER).label() == "t128x128x64w8s4"
    w2v2 = wgrad.with_(dims=1, batch=16, in_channels=512, out_channels=512, input=(3199,), filter=(3,), stride=(2,),
                       dilation=(1,), pad_lo=(0,), pad_hi=(0,))
    assert policy.tma_grad_weight_tiles(w2v2, HOPPER).label() == "t128x256x64w8s4"
    vol = deep.with_(batch=8, in_channels=256, out_channels=256, input=(16, 16, 16))
    assert policy.tma_grad_weight_tiles(vol, HOPPER).label() == "t128x256x64w8s4"
    r50 = square.with_(batch=64, in_channels=256, out_channels=256, input=(14, 14))
    assert policy.tma_grad_weight_tiles(r50, HOPPER).label() == "t128x128x64w4s4"
    for q in (wgrad, square, deep, ck11, w2v2, vol, r50):
        t = policy.tma_grad_weight_tiles(q, HOPPER)
        # two product warp groups take a copy warp of their own
        assert policy.tma_grad_weight_specialised(t) == (t.warps == 8)
        # the ring fits, and the f32 tile's store (boxes of at most 128 columns) reuses its memory
        ring = t.stages * (t.block_m + t.block_n) * t.block_k * 2
        assert ring <= HOPPER.gpu.workgroup_memory and t.block_m * min(t.block_n, 128) * 4 <= ring


RESNET_WGRAD = ConvProblem(op="grad_weight", dims=2, groups=1, batch=64, in_channels=512, out_channels=512,
                           input=(7, 7), filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1),
                           pad_hi=(1, 1), layout="NHWGC", dtype="bf16", name="k")


@settings(max_examples=40, deadline=None)
@given(channels=st.sampled_from([64, 128, 256, 512]), size=st.sampled_from([7, 14, 28, 56]),
       batch=st.integers(1, 64))
def test_tma_grad_weight_split_grows_with_the_reduction(channels, size, batch):
    # the split weighs waves of programs against the partials each chunk adds: a longer reduction over the same
    # weight never takes fewer chunks, a chunk is never empty, and a split asked for is kept
    p = RESNET_WGRAD.with_(in_channels=channels, out_channels=channels, input=(size, size), batch=batch)
    tiles = policy.tma_grad_weight_tiles(p, HOPPER)
    parts = policy.tma_grad_weight_parts(p, tiles, HOPPER)
    longer = policy.tma_grad_weight_parts(p.with_(batch=2 * batch), tiles, HOPPER)
    steps = -(-batch * size * size // tiles.block_k)
    assert 1 <= parts <= min(256, steps) and longer >= parts
    assert policy.tma_grad_weight_parts(p.with_(split_k=5), tiles, HOPPER) == 5


def test_tma_grad_weight_split_takes_fewer_chunks_where_partials_are_large():
    # ResNet-50's 512-channel 3x3 grad_weight at 7x7: 144 output tiles, and a 9.4 MB f32 partial per chunk;
    # the fill of the resident slots alone (grad_weight_parts) asks for more chunks than the estimate does
    tiles = policy.tma_grad_weight_tiles(RESNET_WGRAD, HOPPER)
    assert policy.tma_grad_weight_parts(RESNET_WGRAD, tiles, HOPPER) < policy.grad_weight_parts(RESNET_WGRAD, tiles,
                                                                                                HOPPER)


# --- the flat-plane TF32 grad_weight (kernels/tma.grad_weight_flat_tma) --------------------------------------

F32_WGRAD = BASE.with_(op="grad_weight", dtype="f32", compute="tf32", in_channels=64, out_channels=64)
F32_WIDE = F32_WGRAD.with_(in_channels=128, out_channels=128)
FP8_WGRAD = F32_WIDE.with_(dtype="f16", compute=("bf8", "fp8"))


def _pad_planes(x: np.ndarray, consts: dict, copies: int) -> np.ndarray:
    """pad_planes' copy (kernels/elementwise.py) as its constants describe it, in float64, without the rounding:
    copy z shifted by SIGN * z positions, the copies stacked along the rows."""
    rows, length = consts["ROWS"], consts["L"]
    r, f = np.arange(rows), np.arange(length)
    n, g, c = r // (consts["G"] * consts["CH"]), (r // consts["CH"]) % consts["G"], r % consts["CH"]
    p1, p2 = consts["P1"], consts["P2"]
    out = []
    for z in range(copies):
        fp = f + consts["SIGN"] * z
        i0, i1, i2 = fp // (p1 * p2), (fp // p2) % p1 - consts["LO1"], fp % p2 - consts["LO2"]
        inside = (fp >= 0) & (i0 < consts["I0"]) & (i1 >= 0) & (i1 < consts["I1"]) & (i2 >= 0) & \
            (i2 < consts["I2"])
        src = (n * consts["SN"] + g * consts["SG"] + c * consts["SC"])[:, None] + \
            (i0 * consts["S0"] + i1 * consts["S1"] + i2 * consts["S2"])[None, :]
        flat = x.reshape(-1).astype(np.float64)
        out.append(np.where(inside[None, :], flat[np.clip(src, 0, flat.size - 1)], 0.0))
    return np.concatenate(out)


def _box(a: np.ndarray, row: int, col: int, rows: int, cols: int) -> np.ndarray:
    """A TMA tiled box: zeros outside the tensor (negative coordinates too)."""
    out = np.zeros((rows, cols))
    r0, c0 = max(row, 0), max(col, 0)
    r1, c1 = min(row + rows, a.shape[0]), min(col + cols, a.shape[1])
    if r1 > r0 and c1 > c0:
        out[r0 - row:r1 - row, c0 - col:c1 - col] = a[r0:r1, c0:c1]
    return out


def _emulated_flat_grad_weight(p: ConvProblem, x: np.ndarray, dy: np.ndarray, parts: int = 3) -> np.ndarray:
    """grad_weight_flat_tma's copies, boxes and partial stores in float64 with the coordinates the kernel
    computes, then the chunks' sum."""
    from convdsl.kernels.elementwise_launches import pad_planes_launch
    from convdsl.kernels.launch import flat_planes
    from convdsl.kernels.tma_launches import grad_weight_flat_tma_launch

    tiles = policy.tma_flat_grad_weight_tiles(p)
    steps = p.batch * flat_planes(p, tiles.block_k).blocks
    launch, maps, partials_shape, planes = grad_weight_flat_tma_launch(p, tiles, "k",
                                                                       policy.even_chunks(steps, parts, 65535))
    copies = [pad_planes_launch(p, planes, name, "k") for name in ("x", "dy")]
    xf, yf = (_pad_planes(a, dict(la.constants), dict(la.constants)["COPIES"])
              for a, (la, _) in zip((x, dy), copies))
    assert [xf.shape, yf.shape] == [shape for _, shape in copies] == [m.shape for m in maps[:2]]
    consts = dict(launch.constants)
    f, d, xs, lox = consts["F"], consts["D"], consts["XS"], consts["LOX"]
    c, k, g_count, qb, steps, chunk = (consts[n] for n in ("C", "K", "G", "QB", "STEPS", "CHUNK"))
    images = consts["N"]
    bm, bn, br = tiles.block_m, tiles.block_n, tiles.block_k
    part = np.full(maps[2].shape, np.nan)
    for s in range(launch.grid[2]):
        for g in range(launch.grid[1]):
            for pid in range(launch.grid[0]):
                off_k = (pid // (math.prod(f) * (c // bn))) * bm
                t, c_col = divmod(pid % (math.prod(f) * (c // bn)), c // bn)
                c_col *= bn
                t2, t1, t0 = t % f[2], (t // f[2]) % f[1], t // (f[2] * f[1])
                shift = (t0 * d[0] - lox[0]) * xs[0] + (t1 * d[1] - lox[1]) * xs[1] + (t2 * d[2] - lox[2]) * xs[2]
                acc = np.zeros((bm, bn))
                residue = shift % planes.align
                for r in range(s * chunk, min(steps, (s + 1) * chunk)):
                    n, q0 = r // qb, (r % qb) * br
                    x_row, y_row = (n * g_count + g) * c + c_col, (n * g_count + g) * k + off_k
                    if consts["SHIFT_X"]:
                        x_row += residue * images * g_count * c
                    else:
                        y_row += residue * images * g_count * k
                    # TMA: 16-byte starts
                    assert q0 % planes.align == 0 and (q0 + shift - residue) % planes.align == 0
                    a = _box(yf, y_row, q0, bm, br)
                    b = _box(xf, x_row, q0 + shift - residue, bn, br)
                    acc += a @ b.T
                part[(s * g_count + g) * k + off_k:(s * g_count + g) * k + off_k + bm,
                     t * c + c_col:t * c + c_col + bn] = acc
    total = part.reshape(partials_shape).sum(0).reshape(p.groups, k, *p.filter, c)  # GKYXC, as sum_partials
    return np.moveaxis(total, -1, 2) if p.weight_layout == "GKCYX" else total


FLAT_CASES = [
    F32_WGRAD.with_(out_channels=128),  # X the smaller operand: copied once per residue
    F32_WGRAD.with_(in_channels=128, input=(6, 7)),  # dY the smaller: its copies start r positions later
    F32_WGRAD.with_(batch=3, dilation=(1, 2), pad_lo=(1, 3), pad_hi=(0, 1)),  # dilated, asymmetric padding
    F32_WGRAD.with_(layout="NGCHW", weight_layout="GKCYX", input=(5, 9)),  # channel-first read through strides
    F32_WGRAD.with_(groups=2, dims=3, input=(3, 4, 5), filter=(2, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                    pad_lo=(0, 1, 1), pad_hi=(1, 1, 1)),  # 3D: the smallest dimension goes outermost
    F32_WGRAD.with_(dims=3, input=(6, 5, 2), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                    pad_lo=(1, 1, 1), pad_hi=(1, 1, 1), layout="GNHWC"),
    F32_WGRAD.with_(dims=1, input=(21,), filter=(5,), stride=(1,), dilation=(2,), pad_lo=(4,), pad_hi=(3,)),
    F32_WIDE.with_(groups=2, batch=2, input=(9, 10)),  # the rule's 128 x 128 tiles, two groups
    # fp8 compute: 16 elements in 16 bytes, so residues mod 16 (dilation 5: taps 0, 5, 10 along the inner plane)
    FP8_WGRAD.with_(batch=2, input=(7, 9)),
    FP8_WGRAD.with_(in_channels=64, out_channels=128, dilation=(1, 5), pad_lo=(1, 5), pad_hi=(1, 5), input=(5, 6)),
    FP8_WGRAD.with_(dims=3, groups=2, input=(3, 4, 5), filter=(2, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                    pad_lo=(0, 1, 1), pad_hi=(1, 1, 1), dtype="bf16", compute=("fp8", "bf8")),
]


def test_flat_cases_shift_either_operand():
    from convdsl.kernels.launch import flat_planes

    assert {flat_planes(p, 32).shifted for p in FLAT_CASES} == {"x", "dy"}


@pytest.mark.parametrize("p", FLAT_CASES)
def test_emulated_flat_grad_weight_matches_the_reference(p):
    x, dy = random_inputs(p, seed=6)
    got = _emulated_flat_grad_weight(p, x, dy)
    assert not np.isnan(got).any(), "some partials were never stored"
    # the reference with exact products: the emulation leaves out the copies' TF32 rounding
    assert relative_error(got, reference(p.with_(compute=None), x, dy)) < 1e-12
    if gluon_tma_im2col():
        wide = p.in_channels % 128 == 0 and p.out_channels % 128 == 0  # 64-channel tiles keep the cp.async kernel
        assert (policy.tma_flat_grad_weight_reason(p, HOPPER) is None) == wide
        plan = policy.tma_stream_launch(p.with_(in_channels=128, out_channels=128), HOPPER, Knobs())
        if p.layout == "NHWGC":  # the 16-bit TMA im2col kernel over rounded copies (fp8) or bf16 splits (TF32)
            assert plan.launch.kernel == "grad_weight_tma" and [la.kernel for la, _ in plan.staging] == \
                (["round_fp8"] * 2 if p.fp8_compute else ["split_bf16"] * 2)
        else:
            assert plan.launch.kernel == "grad_weight_flat_tma" and [la.kernel for la, _ in plan.staging] == \
                ["pad_planes", "pad_planes"]


def test_flat_planes_put_the_smallest_dimension_outermost():
    # CK 11's 3D grad_weight (28 x 28 x 3): the 3-wide dimension outermost leaves a 30 x 30 plane, 89% of its
    # positions real, where the problem's own order (a 30 x 5 plane) leaves 56%
    from convdsl.kernels.launch import flat_planes

    p = F32_WGRAD.with_(dims=3, input=(28, 28, 3), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                        pad_lo=(1, 1, 1), pad_hi=(1, 1, 1), groups=8, batch=64, in_channels=128, out_channels=128)
    planes = flat_planes(p, 32)
    assert planes.order[0] == 2 and planes.plane == (30, 32)
    assert 28 * 28 * 3 / (planes.blocks * 32) > 0.8


@pytest.mark.parametrize("change, why", [
    (dict(stride=(2, 2), pad_lo=(1, 1)), "stride 1"),
    (dict(compute=None), "one-pass TF32"),
    (dict(dtype="bf16", compute=None), "one-pass TF32"),
    (dict(in_channels=96), "128-channel tiles"),
    (dict(in_channels=64, out_channels=128), "128-channel tiles"),
    (dict(filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0)), "one tap"),
    (dict(batch=4096, input=(224, 224)), "GiB"),
])
def test_flat_grad_weight_reasons(change, why):
    p = F32_WIDE.with_(**change)
    reason = policy.tma_flat_grad_weight_reason(p, HOPPER)
    assert reason is not None and why in reason
    assert "sm_90" in policy.tma_flat_grad_weight_reason(F32_WIDE, AMPERE)


PAD_SCALE = 600.0  # the fp8 copies' inputs scaled past e4m3's largest finite value (448): saturated


def test_pad_planes_kernel_matches_its_algebra():
    # the Triton kernel in Triton's interpreter (a subprocess: TRITON_INTERPRET is read at import) against
    # _pad_planes, with the TF32 rounding, or fp8's (saturated), applied to the emulation's values
    import subprocess
    import sys

    import ml_dtypes

    script = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
from convdsl.kernels import elementwise
from convdsl.kernels.elementwise_launches import pad_planes_launch
from convdsl.kernels.launch import flat_planes
from convdsl.problem import problem_from_spec
from convdsl.reference import random_inputs
TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn,
         "fp8e5": torch.float8_e5m2}
out = []
for spec, scale in json.loads(sys.stdin.read()):
    p = problem_from_spec(spec)
    x, dy = (a * np.asarray(scale, a.dtype) for a in random_inputs(p, seed=7))
    planes = flat_planes(p, 32)
    for name, a in (("x", x), ("dy", dy)):
        la, shape = pad_planes_launch(p, planes, name, "k")
        y = torch.full(shape, float("nan")).to(TYPES[la.pointer_types[1]])
        source = torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(TYPES[la.pointer_types[0]])
        getattr(elementwise, la.kernel)[la.grid](source, y, **dict(la.constants))
        out.append(y.float().numpy().tolist())
print(json.dumps(out))
'''
    from convdsl.kernels.elementwise_launches import pad_planes_launch
    from convdsl.kernels.launch import FP8_MAX, flat_planes
    from convdsl.problem import problem_to_spec
    from convdsl.reference import COMPUTE_DTYPES

    cases = [F32_WGRAD.with_(batch=2, dilation=(1, 2), pad_lo=(1, 3), pad_hi=(0, 1), in_channels=64),
             F32_WGRAD.with_(layout="NGCHW", weight_layout="GKCYX", groups=2, dims=3, input=(3, 4, 5),
                             filter=(2, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(0, 1, 1),
                             pad_hi=(1, 1, 1), batch=1, in_channels=128),
             FP8_WGRAD.with_(batch=1, in_channels=32, input=(5, 6)),
             FP8_WGRAD.with_(batch=1, out_channels=32, input=(5, 6), dtype="bf16", compute=("fp8", "bf8"))]
    scales = [1.0, 1.0, PAD_SCALE, PAD_SCALE]
    assert [flat_planes(p, 32).shifted for p in cases] == ["x", "dy", "x", "dy"]  # both signs of the shift
    done = subprocess.run([sys.executable, "-c", script],
                          input=json.dumps([[problem_to_spec(p), s] for p, s in zip(cases, scales)]),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = iter(json.loads(done.stdout.strip().splitlines()[-1]))
    for p, scale in zip(cases, scales):
        x, dy = (a * np.asarray(scale, a.dtype) for a in random_inputs(p, seed=7))
        planes = flat_planes(p, 32)
        for i, (name, a) in enumerate((("x", x), ("dy", dy))):
            la = pad_planes_launch(p, planes, name, "k")[0]
            want = _pad_planes(a, dict(la.constants), dict(la.constants)["COPIES"])
            if p.fp8_compute:  # nearest fp8 value, ties to even, saturated at the largest finite one
                kind = p.compute[i]
                assert kind == "bf8" or np.abs(want).max() > FP8_MAX[kind]  # e4m3 saturates somewhere
                want = np.clip(want, -FP8_MAX[kind], FP8_MAX[kind]).astype(COMPUTE_DTYPES[kind]).astype(np.float32)
            else:
                bits = want.astype(np.float32).view(np.uint32)
                want = ((bits + 0x1000) & 0xFFFFE000).view(np.float32)  # TF32, ties away from zero
            assert np.array_equal(np.asarray(next(got), dtype=np.float32), want), (p.name, name)


def test_fp8_flat_planes_align_to_16_elements():
    # a TMA box starts 16 bytes into a row: 16 fp8 elements, so the inner plane is a multiple of 16 and the taps
    # along it leave up to 16 residues (3 for a 3-tap filter); CK 11's fp8 grad_weight takes the kernel
    from convdsl.kernels.launch import flat_planes

    p = FP8_WGRAD.with_(dims=3, input=(28, 28, 3), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                        pad_lo=(1, 1, 1), pad_hi=(1, 1, 1), groups=8, batch=64)
    planes = flat_planes(p, 128)
    assert planes.align == 16 and planes.plane == (30, 32) and planes.residues == 3
    assert planes.x_length % 16 == 0 and planes.dy_length % 16 == 0
    assert flat_planes(F32_WIDE, 32).align == 4
    if gluon_tma_im2col():
        # NHWGC takes the 16-bit TMA im2col kernel (test_fp8_grad_weight_...); a layout it cannot read, the flat one
        plan = policy.tma_stream_launch(p.with_(layout="GNHWC"), HOPPER, Knobs())
        assert plan.launch.kernel == "grad_weight_flat_tma" and plan.launch.pointer_types == \
            ("fp8e5", "fp8e4nv", "fp32")
        assert dict(plan.launch.constants)["PROMOTE"] == plan.tiles.block_k == 128
        assert [la.pointer_types for la, _ in plan.staging] == [("fp16", "fp8e5"), ("fp16", "fp8e4nv")]
    # without fp8 wgmma (before Hopper) the f16 kernel over operands rounded first
    assert "sm_90" in policy.tma_flat_grad_weight_reason(p, AMPERE)


def test_fp8_grad_weight_takes_the_16_bit_tma_kernel_over_rounded_copies():
    # X and dY rounded to their fp8 grids in f16 copies (not saturated: the f16 path keeps values past the fp8
    # range as the reference does), then the 16-bit TMA im2col grad_weight: CK 11's 2.05 -> 1.70 ms against the
    # flat-plane kernel on fp8 wgmma, whose channel-first copies cost more (docs/decisions.md#fp8-grad-weight-tma)
    for p in (FP8_WGRAD, FP8_WGRAD.with_(dtype="bf16", compute=("fp8", "bf8"), dims=3, input=(3, 4, 5),
                                          filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
                                          pad_hi=(1, 1, 1))):
        assert policy.tma_grad_weight_reason(p, HOPPER) in (None, "the installed Triton has no Gluon TMA im2col "
                                                                  "copies (Triton 3.9 has)")
        if gluon_tma_im2col():
            plan = policy.tma_stream_launch(p, HOPPER, Knobs())
            assert plan.launch.kernel == "grad_weight_tma" and plan.launch.pointer_types == ("fp16", "fp16", "fp32")
            elem = "fp16" if p.dtype == "f16" else "bf16"
            assert [(la.kernel, la.pointer_types, shape) for la, shape in plan.staging] == [
                ("round_fp8", (elem, "fp16"), p.x_shape), ("round_fp8", (elem, "fp16"), p.y_shape)]
            assert [dict(la.constants)["FP8_MAX"] for la, _ in plan.staging] == [0.0, 0.0]
            assert [dict(la.constants)["MBITS"] for la, _ in plan.staging] == \
                [{"fp8": 3, "bf8": 2}[kind] for kind in p.compute]
    # the grad_input of fp8 compute has no TMA kernel (its flipped weight tiles are N-major)
    assert policy.tma_grad_weight_reason(FP8_WGRAD.with_(op="grad_input"), HOPPER) == "not grad_weight"


def _bf16_parts(a: np.ndarray) -> list[np.ndarray]:
    """f32 values as three bf16 parts (nearest, ties to even), each of what the ones before leave."""
    import ml_dtypes

    parts, rest = [], a.astype(np.float32)
    for _ in range(3):
        parts.append(rest.astype(ml_dtypes.bfloat16).astype(np.float32))
        rest = rest - parts[-1]
    return parts


@pytest.mark.parametrize("p, split, tolerance", [
    (F32_WGRAD.with_(in_channels=128, out_channels=128, batch=2, input=(5, 6)), "bf16x3", 2e-5),
    (F32_WGRAD.with_(compute="bf16x3", dims=3, groups=2, input=(3, 4, 5), filter=(2, 3, 3), stride=(1, 1, 1),
                     dilation=(1, 1, 1), pad_lo=(0, 1, 1), pad_hi=(1, 1, 1)), "bf16x3", 2e-5),
    # exact f32: six products, leaving out terms of about 2^-24 of a product
    (F32_WGRAD.with_(compute=None, in_channels=128, out_channels=64, batch=2, input=(5, 6)), "bf16x6", 1e-6),
])
def test_f32_grad_weight_as_stacked_bf16_parts_on_the_tma_kernel(p, split, tolerance):
    # f32 NHWGC with stride 1: the 16-bit TMA grad_weight over X's and dY's bf16 parts stacked along N, one block
    # per product kept (elementwise_launches.SPLIT_PRODUCTS; split_bf16), its tiles and partial stores in float64
    # through the emulation, against the exact float64 result
    from convdsl.kernels.elementwise_launches import SPLIT_PRODUCTS

    products = SPLIT_PRODUCTS[split]
    stacked = p.with_(batch=len(products) * p.batch, dtype="bf16", compute=None)
    if gluon_tma_im2col():
        assert policy.tma_split_grad_weight(p, HOPPER) == (stacked, split)
    x, dy = random_inputs(p, seed=7)
    xs, dys = _bf16_parts(x), _bf16_parts(dy)
    got = _emulated_grad_weight(stacked, np.concatenate([xs[a] for a, _ in products]),
                                np.concatenate([dys[b] for _, b in products]))
    err = relative_error(got, reference(p.with_(compute=None), x, dy))
    assert err < tolerance, err
    if gluon_tma_im2col():
        plan = policy.tma_stream_launch(p, HOPPER, Knobs())
        assert plan.launch.kernel == "grad_weight_tma" and plan.launch.pointer_types == ("bf16", "bf16", "fp32")
        # f32-accurate splits add wgmma's sums in f32 every PROMOTED_ROWS rows, within two accumulators of at most
        # PROMOTED_ACCUMULATOR_MOST registers a thread; one-pass TF32 keeps wgmma's accumulator
        promote = dict(plan.launch.constants)["PROMOTE"]
        if p.tf32:
            assert promote == 0
        else:
            assert promote * plan.tiles.block_k == policy.PROMOTED_ROWS
            assert plan.tiles.block_m * plan.tiles.block_n <= 32 * plan.tiles.warps * policy.PROMOTED_ACCUMULATOR_MOST
        assert [(la.kernel, la.pointer_types, dict(la.constants)["ORDER"], shape) for la, shape in plan.staging] \
            == [("split_bf16", ("fp32", "bf16"), tuple(a for a, _ in products), stacked.x_shape),
                ("split_bf16", ("fp32", "bf16"), tuple(b for _, b in products), stacked.y_shape)]
    # strided: the split would copy all of X, s^dims the positions the products read; 16-bit as before
    assert policy.tma_split_grad_weight(p.with_(stride=(2,) * p.dims), HOPPER) is None
    assert policy.tma_split_grad_weight(p.with_(dtype="f16", compute=None), HOPPER) is None


def test_split_bf16_stacks_the_parts_of_each_product():
    # the split kernel in Triton's interpreter (a subprocess: TRITON_INTERPRET is read at import) against ml_dtypes'
    # bf16 (nearest, ties to even), both operands of both splits
    import subprocess
    import sys

    from convdsl.kernels.elementwise_launches import SPLIT_PRODUCTS

    script = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from convdsl.kernels import elementwise
from convdsl.kernels.elementwise_launches import split_bf16_launch
values = torch.tensor(json.loads(sys.stdin.read()), dtype=torch.float32)
out = {}
for split in ("bf16x3", "bf16x6"):
    for operand in (0, 1):
        la = split_bf16_launch(values.numel(), split, operand, "k")
        order = dict(la.constants)["ORDER"]
        y = torch.empty((len(order), values.numel()), dtype=torch.bfloat16)
        elementwise.split_bf16[la.grid](values, y, **dict(la.constants))
        out[f"{split}:{operand}"] = y.float().tolist()
print(json.dumps(out))
'''
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.standard_normal(700) * 10.0 ** rng.integers(-6, 6, 700), [0.0, 1.0, -3.0e-3,
                             1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -9]]).astype(np.float32)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(values.astype(float).tolist()),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    parts = _bf16_parts(values)
    for split, products in SPLIT_PRODUCTS.items():
        for operand in (0, 1):
            want = np.stack([parts[pair[operand]] for pair in products])
            assert np.array_equal(np.asarray(got[f"{split}:{operand}"], dtype=np.float32), want), (split, operand)
    assert np.all(np.abs(values - parts[0] - parts[1]) <= 2.0 ** -16 * np.abs(values))
    assert np.all(np.abs(values - parts[0] - parts[1] - parts[2]) <= 2.0 ** -24 * np.abs(values))


def test_fp8_forward_reads_fp8_copies_on_fp8_wgmma():
    # X and W rounded into fp8 copies (saturated), then the TMA forward kernel with fp8 wgmma, each step's
    # products added in f32; grad_input as forward keeps cp.async (its flipped weight tiles are N-major)
    p = BASE.with_(compute=("bf8", "fp8"), in_channels=256, out_channels=128)
    assert policy.tma_forward_tiles(p, HOPPER).block_k == 128
    if gluon_tma_im2col():
        plan = policy.tma_stream_launch(p, HOPPER, Knobs())
        assert plan.launch.kernel == "forward_tma" and plan.launch.pointer_types == ("fp8e5", "fp8e4nv", "fp16")
        assert dict(plan.launch.constants)["PROMOTE"] == 128
        assert [(la.kernel, la.pointer_types, shape) for la, shape in plan.staging] == [
            ("round_fp8", ("fp16", "fp8e5"), p.x_shape), ("round_fp8", ("fp16", "fp8e4nv"), p.w_shape)]
        assert all(dict(la.constants)["FP8_MAX"] > 0 for la, _ in plan.staging)
        assert policy.tma_stream_launch(p.with_(op="grad_input"), HOPPER, Knobs()) is None
    # the 16-bit forward has no copies and no promotion
    assert dict(forward_tma_launch(BASE, policy.tma_forward_tiles(BASE, HOPPER), "k")[0].constants)["PROMOTE"] == 0


def test_round_fp8_into_fp8_saturates():
    # the fp8 copies' rounding in Triton's interpreter (a subprocess: TRITON_INTERPRET is read at import): the
    # nearest value, ties to even, saturated at the largest finite one, against ml_dtypes
    import subprocess
    import sys

    import ml_dtypes

    script = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
from convdsl.kernels import elementwise
from convdsl.kernels.elementwise_launches import round_fp8_launch
values = torch.tensor(json.loads(sys.stdin.read()), dtype=torch.float16)
out = []
for kind, dtype in (("fp8", torch.float8_e4m3fn), ("bf8", torch.float8_e5m2)):
    la = round_fp8_launch(values.numel(), "f16", kind, "k", as_fp8=True)
    y = torch.empty(values.shape, dtype=dtype)
    elementwise.round_fp8[la.grid](values, y, **dict(la.constants))
    out.append(y.float().tolist())
print(json.dumps(out))
'''
    from convdsl.kernels.launch import FP8_MAX

    rng = np.random.default_rng(3)
    values = np.concatenate([rng.uniform(-2, 2, 200), rng.uniform(-600, 600, 200), [0.0, 1e-5, -3e-3, 465.0,
                             -500.0, 60000.0]]).astype(np.float16)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(values.astype(float).tolist()),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, dtype, result in zip(("fp8", "bf8"), (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2), got):
        wide = values.astype(np.float64)
        want = np.clip(wide, -FP8_MAX[kind], FP8_MAX[kind]).astype(dtype).astype(np.float64)
        assert np.array_equal(np.asarray(result), want), kind


@needs_gluon
def test_swapped_forward_compiles_flipped_and_plain():
    # SWAPPED (probe benchmarks/probes/tma_swapped.py, docs/decisions.md#tma-narrow): the weight tile as wgmma's A,
    # read K-major (plain) or through a transposed view (FLIPPED, grad_input's own weight), the window as B
    from convdsl.kernels.compile import compile_tma_launch

    p = BASE.with_(in_channels=64, out_channels=64, dtype="f16")
    tiles = TileConfig(128, 64, 64, warps=4, stages=4)
    for flipped in (False, True):
        launch, maps = forward_tma_launch(p, tiles, "k", flipped=flipped, swapped=True)
        assert dict(launch.constants)["SWAPPED"] is True
        binary, _, kinds = compile_tma_launch(launch, maps, "sm_90")
        assert binary.threads == 128 and kinds.count("map") == 3
        # the ring: 4 stages of a 128 x 64 window and a 64 x 64 weight tile, 16-bit
        assert binary.shared_bytes >= 4 * (128 * 64 + 64 * 64) * 2


def test_one_tap_grad_weights_past_one_row_tile_take_the_tma_kernel():
    # the TMA grad_weight beat the cp.async one-tap GEMM on 16-bit 1x1s with more than 128 rows (K) and lost by up
    # to 1.58x with 128 (DenseNet-121's bottlenecks: narrow columns split many ways; docs/decisions.md#grad-weight-fit)
    wide = RESNET_WGRAD.with_(in_channels=1024, out_channels=2048, input=(14, 14), filter=(1, 1), stride=(2, 2),
                              pad_lo=(0, 0), pad_hi=(0, 0))
    assert policy.tma_grad_weight_reason(wide, HOPPER) is None
    assert "grad_weight_tma" in stream.planned_stream_kernel(wide, HOPPER, Knobs()).launches[0].launch.kernel
    narrow = wide.with_(in_channels=960, out_channels=128, stride=(1, 1))
    assert "one tap" in policy.tma_grad_weight_reason(narrow, HOPPER)
    assert not stream.planned_stream_kernel(narrow, HOPPER, Knobs()).tma_maps
    for kept in (wide.with_(groups=2), wide.with_(dtype="f32", compute="tf32")):
        assert "one tap" in policy.tma_grad_weight_reason(kept, HOPPER)
    # an f32 1x1 is not planned as stacked bf16 parts on the TMA kernel either (only 16-bit 1x1s were measured)
    assert policy.tma_split_grad_weight(wide.with_(dtype="f32", stride=(1, 1)), HOPPER) is None


def test_stride_one_16_bit_1x1_gemms_take_the_tma_forward():
    # ResNet-50's 1x1 layers (plain GEMMs): the persistent TMA forward beat the cp.async one-tap loop on all 20 of
    # ResNet-50's and DenseNet-121's measured (docs/decisions.md#tma-1x1); strided, f32 and grad_weight 1x1s were not
    # measured there and keep the cp.async kernels
    one = RESNET_WGRAD.with_(op="forward", in_channels=256, out_channels=1024, input=(14, 14), filter=(1, 1),
                             pad_lo=(0, 0), pad_hi=(0, 0))
    assert policy.tma_forward_reason(one, HOPPER) is None
    forward = stream.planned_stream_kernel(one, HOPPER, Knobs())
    assert forward.tma_maps and forward.launches[0].launch.kernel.startswith("forward_tma")
    dgrad = stream.planned_stream_kernel(one.with_(op="grad_input"), HOPPER, Knobs())
    assert dgrad.tma_flipped_weight and dgrad.launches[0].launch.kernel.startswith("forward_tma")
    for kept in (one.with_(stride=(2, 2), input=(28, 28)), one.with_(dtype="f32", compute="tf32")):
        assert "one tap" in policy.tma_forward_reason(kept, HOPPER)
        assert not stream.planned_stream_kernel(kept, HOPPER, Knobs()).tma_maps
    # grad_weight: only past one 128-row tile (test_one_tap_grad_weights_past_one_row_tile_take_the_tma_kernel)
    assert "one tap" in policy.tma_grad_weight_reason(one.with_(op="grad_weight", out_channels=128), HOPPER)
    # on Ampere, and in a module, the cp.async kernel
    assert policy.tma_forward_reason(one, AMPERE) is not None
