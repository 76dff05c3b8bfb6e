"""The halo kernel (kernels/halo.py) off the GPU: which problems take it, and its index algebra.

`_emulated_forward` runs the kernel's programs in float64 with the coordinates the kernel computes: the padded
grid of width WP, each program's output-plane range, the windows of R rows copied per input plane (zero outside
X), every tap's rows gathered at its shift, the three accumulators (filter plane t0 of plane p into accumulator
(p + 2 - t0) % 3), the planes outside X skipped, and output plane o_lo + p - 2 stored after plane p.  Against the
float64 reference this checks launch.halo_grid, the split of the planes and the rotation of the accumulators;
the GPU tests run the kernel itself.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from convdsl import policy, stream
from convdsl.kernels.compile import gluon_tma_im2col
from convdsl.kernels.launch import halo_grid
from convdsl.kernels.tma_launches import forward_halo_launch
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs

HOPPER = Target("cuda", "sm_90")
# the suite's U-Net grad_input (3D, 64 -> 64 channels, 64^3, batch 2)
UNET = ConvProblem(op="grad_input", dims=3, groups=1, batch=2, in_channels=64, out_channels=64, input=(64, 64, 64),
                   filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1),
                   layout="NHWGC", weight_layout="GKYXC", dtype="bf16", name="unet")
needs_gluon = pytest.mark.skipif(not gluon_tma_im2col(), reason="the installed Triton has no Gluon")


def _emulated_forward(p: ConvProblem, x: np.ndarray, w: np.ndarray, block_m: int, split: int) -> np.ndarray:
    """kernels/halo.forward_halo on a one-group stride-1 3D forward: x (N, *I, C), w (K, *F, C) -> y (N, *O, K)."""
    grid = halo_grid(p, block_m)
    (i0, i1, i2), (o0, o1, o2) = p.input, p.output
    _, d1, d2 = p.dilation
    lo0, lo1, lo2 = p.pad_lo
    wp, rows = grid.width, grid.rows
    taps = w.transpose(1, 2, 3, 4, 0)  # (F0, F1, F2, C, K): tap (t0, t1, t2) as a [C, K] matrix
    y = np.full((p.batch, o0, o1, o2, p.out_channels), np.nan)
    for n in range(p.batch):
        for qt in range(grid.row_tiles):
            q0 = qt * block_m
            # the window's rows on the padded grid -> X's positions (zero outside X)
            q = q0 + np.arange(rows)
            a1, a2 = q // wp - lo1, q % wp - lo2
            inside = (a1 >= 0) & (a1 < i1) & (a2 >= 0) & (a2 < i2)
            for part in range(split):
                o_lo = part * o0 // split
                tiles = (part + 1) * o0 // split - o_lo
                z0, planes = o_lo - lo0, tiles + 2
                p_in = min(max(-z0, 0), planes)
                p_out = max(min(i0 - z0, planes), p_in)
                acc = [np.zeros((block_m, p.out_channels)) for _ in range(3)]
                for plane in range(planes):
                    if p_in <= plane < p_out:
                        window = np.zeros((rows, p.in_channels))
                        window[inside] = x[n, z0 + plane, a1[inside], a2[inside]]
                        for t1 in range(p.filter[1]):
                            for t2 in range(p.filter[2]):
                                shift = t1 * d1 * wp + t2 * d2
                                assert shift + block_m <= rows  # every gather inside the window
                                a = window[shift:shift + block_m]
                                for j in range(3):
                                    acc[j] += a @ taps[(plane + 2 - j) % 3, t1, t2]
                    o, done = o_lo + plane - 2, plane % 3
                    if o >= o_lo:
                        out = q0 + np.arange(block_m)
                        r1, r2 = out // wp, out % wp
                        keep = (r1 < o1) & (r2 < o2)
                        y[n, o, r1[keep], r2[keep]] = acc[done][keep]
                    acc[done] = np.zeros_like(acc[done])
    return y


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.sampled_from([16, 32]), st.integers(8, 24), st.integers(1, 7), st.integers(3, 9),
       st.integers(2, 9), st.integers(1, 2), st.integers(0, 2), st.integers(1, 4), st.sampled_from([64, 128]))
def test_emulated_halo_forward_matches_the_reference(batch, channels, out_channels, depth, height, width, dilation,
                                                     pad, split, block_m):
    assume(min(height, width) + 2 * pad > 2 * dilation)  # an output row at least
    p = ConvProblem(op="forward", dims=3, groups=1, batch=batch, in_channels=channels, out_channels=out_channels,
                    input=(depth, height, width), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, dilation, dilation),
                    pad_lo=(1, pad, pad), pad_hi=(1, pad, pad), layout="NHWGC", weight_layout="GKYXC", dtype="f32",
                    name="halo")
    split = min(split, p.output[0])
    x, w = random_inputs(p, seed=batch + channels + depth)
    want = reference(p, x, w)
    got = _emulated_forward(p, x.reshape(batch, *p.input, channels), w.reshape(out_channels, 3, 3, 3, channels),
                            block_m, split)
    assert not np.isnan(got).any(), "positions of Y never stored"
    assert relative_error(got.reshape(want.shape), want) < 1e-12


def test_halo_grid_holds_every_tap():
    # U-Net's forward: rows 64 wide padded to 66, 128-row tiles read 128 + 2 * 66 + 2 rows; slots of 288 rows,
    # three in a ring of 1024; 4224 grid rows per plane in 33 tiles
    q = policy.grad_input_as_forward(UNET)
    grid = halo_grid(q, 128)
    assert (grid.width, grid.rows, grid.slot_rows, grid.ring_rows, grid.row_tiles) == (66, 262, 288, 1024, 33)
    launch, (w_map,) = forward_halo_launch(q, policy.halo_tiles(q), "k", 2, flipped=True)
    consts = dict(launch.constants)
    assert launch.grid == (2 * 33 * 2, 1, 1) and consts["SPLIT"] == 2 and consts["FLIPPED"] == 1
    assert w_map.operand == 1 and w_map.shape == (64, 27 * 64) and w_map.block == (64, 64)


@needs_gluon
def test_which_grad_inputs_take_the_halo_kernel():
    q = policy.grad_input_as_forward(UNET)
    assert policy.halo_forward_reason(q, HOPPER) is None
    # 66 row-tile columns on 132 SMs: two plane ranges of 32, each sweeping 34 planes
    assert policy.halo_forward_split(q, HOPPER) == 2
    assert policy.halo_forward_efficiency(q, HOPPER) == pytest.approx(64 * 66 / (34 * 132) * 4096 / 4224)
    # 32 columns of dX: the TMA kernel's 64-column tiles compute half of theirs dead, so 60% of sweeps suffice
    narrow = policy.grad_input_as_forward(UNET.with_(batch=4, in_channels=32, input=(32, 32, 32)))
    assert policy.halo_forward_efficiency(narrow, HOPPER) < 0.75 and policy.halo_forward_reason(narrow, HOPPER) is None
    refused = {
        "16 planes of 8 images": UNET.with_(batch=8, input=(16, 56, 56)),  # short sweeps, 1.6 waves: 66%
        "48 channels of dY": UNET.with_(out_channels=48),
        "96 channels of dX": UNET.with_(in_channels=96),
        "stride 2": UNET.with_(stride=(2, 2, 2)),
        "five filter planes": UNET.with_(filter=(5, 3, 3), pad_lo=(2, 1, 1), pad_hi=(2, 1, 1)),
        "f32": UNET.with_(dtype="f32"),
        "a batch given at call time": UNET.with_(dynamic_batch=True),
    }
    for why, p in refused.items():
        q = policy.grad_input_as_forward(p)
        assert q is None or policy.halo_forward_reason(q, HOPPER) is not None, why
    # wgmma and TMA are Hopper's: an sm_80 target keeps the cp.async kernels, forwards included
    assert policy.halo_forward_reason(policy.grad_input_as_forward(UNET), Target("cuda", "sm_80")) is not None
    assert policy.tma_stream_launch(UNET.with_(op="forward"), Target("cuda", "sm_80"), Knobs()) is None


@needs_gluon
def test_halo_kernel_compiles_for_unet_and_says_so():
    kernel = stream.planned_stream_kernel(UNET, HOPPER, Knobs(), compile=True)
    (launch,) = kernel.launches
    assert launch.launch.kernel == "forward_halo" and launch.binary.threads == 256
    assert launch.binary.shared_bytes <= HOPPER.gpu.workgroup_memory
    # the weight through one map (its shape and strides after it), then dY's and dX's addresses, then Triton's two
    # scratch pointers
    assert kernel.tma_params[0] == "map" and kernel.tma_params[-4:-2] == ("ptr0", "ptr2")
    assert kernel.tma_params.count("map") == 1 and len(kernel.tma_params) == launch.binary.params
    assert "each input plane copied once" in kernel.describe() and "2 plane range(s)" in kernel.describe()
    assert math.prod(launch.launch.grid) == 132
    # the split is the plan's (a field of the kernel, not asked of policy again), so a loaded bundle still says it
    assert kernel.halo_splits == policy.halo_forward_split(policy.grad_input_as_forward(UNET), HOPPER) == 2
    record = json.loads(json.dumps(stream._to_record(kernel)))
    assert stream._from_record(record).describe() == kernel.describe()
    # a bundle written before the split was recorded gets the rules' split
    old = {k: v for k, v in record.items() if k not in ("halo_splits", "promote_every")}
    assert stream._from_record(old).halo_splits == 2


@needs_gluon
def test_forwards_take_the_halo_kernel_with_the_weight_as_it_is():
    forward = UNET.with_(op="forward")
    assert policy.halo_forward_reason(forward, HOPPER) is None
    kernel = stream.planned_stream_kernel(forward, HOPPER, Knobs(), compile=True)
    (launch,) = kernel.launches
    assert launch.launch.kernel == "forward_halo" and dict(launch.launch.constants)["FLIPPED"] == 0
    # the weight as [K, taps * C] in [BLOCK_N, C] tiles
    assert kernel.tma_maps[0].shape == (64, 27 * 64) and kernel.tma_maps[0].block == (64, 64)
    assert not kernel.tma_flipped_weight and "flipped" not in kernel.describe()
