"""A few-channel strided forward as a stride-1 forward over X and W regrouped space-to-depth
(policy.space_to_depth_forward, kernels/elementwise_launches.space_to_depth_launch): the copies as their launch
constants describe them, emulated in float64, then the regrouped convolution, against the float64 reference of the
problem itself."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from convdsl import policy
from convdsl.kernels.elementwise_launches import space_to_depth_launch
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error


def _regrouped(a: np.ndarray, consts: dict, blocks: int, shape: tuple[int, ...]) -> np.ndarray:
    """space_to_depth's copy: y[b, j0, j1, j2, (r0, r1, r2, c)] = x[b, j * R + r - LO, c], 0 outside x."""
    flat = a.reshape(-1).astype(np.float64)
    r = [consts[f"R{i}"] for i in range(3)]
    j_sizes = [consts[f"J{i}"] for i in range(3)]
    b, j0, j1, j2, r0, r1, r2, c = np.meshgrid(np.arange(blocks), *(np.arange(n) for n in j_sizes),
                                               *(np.arange(n) for n in r), np.arange(consts["CH"]), indexing="ij")
    i = [j0 * r[0] + r0 - consts["LO0"], j1 * r[1] + r1 - consts["LO1"], j2 * r[2] + r2 - consts["LO2"]]
    inside = np.ones(b.shape, bool)
    for axis in range(3):
        inside &= (i[axis] >= 0) & (i[axis] < consts[f"I{axis}"])
    src = b * consts["SB"] + c * consts["SC"] + i[0] * consts["S0"] + i[1] * consts["S1"] + i[2] * consts["S2"]
    out = np.where(inside, flat[np.clip(src, 0, flat.size - 1)], 0.0)
    return out.reshape(shape)


@settings(max_examples=60, deadline=None)
@given(dims=st.integers(1, 3), data=st.data())
def test_space_to_depth_forward_is_the_strided_forward(dims, data):
    stride = tuple(data.draw(st.lists(st.integers(1, 3), min_size=dims, max_size=dims)))
    assume(max(stride) > 1)
    channels = data.draw(st.integers(1, max(1, policy.SPACE_TO_DEPTH_MOST_CHANNELS // math.prod(stride))))
    assume(channels * math.prod(stride) <= policy.SPACE_TO_DEPTH_MOST_CHANNELS)
    filt = tuple(data.draw(st.lists(st.integers(1, 7), min_size=dims, max_size=dims)))
    lo = tuple(data.draw(st.integers(0, f - 1)) for f in filt)
    hi = tuple(data.draw(st.integers(0, f - 1)) for f in filt)
    size = tuple(data.draw(st.integers(max(1, f - l - h), f + 6)) for f, l, h in zip(filt, lo, hi))
    p = ConvProblem(op="forward", dims=dims, groups=1, batch=2, in_channels=channels, out_channels=3, input=size,
                    filter=filt, stride=stride, dilation=(1,) * dims, pad_lo=lo, pad_hi=hi, dtype="f16",
                    weight_layout=data.draw(st.sampled_from(["GKYXC", "GKCYX"])), name="stem")
    q = policy.space_to_depth_forward(p)
    assert q is not None and q.output == p.output and q.stride == (1,) * dims
    assert q.in_channels == channels * math.prod(stride)
    x, w = random_inputs(p, seed=4)
    (lx, x_shape), (lw, w_shape) = (space_to_depth_launch(p, q, name, "k") for name in ("x", "w"))
    assert x_shape == q.x_shape and w_shape == q.w_shape
    xq = _regrouped(x, dict(lx.constants), lx.grid[1], x_shape)  # program_id(1): the image, or the channel k
    wq = _regrouped(w, dict(lw.constants), lw.grid[1], w_shape)
    assert relative_error(reference(q, xq, wq), reference(p, x, w)) < 1e-12


def test_which_forwards_regroup():
    stem = ConvProblem(op="forward", dims=2, groups=1, batch=64, in_channels=3, out_channels=64, input=(224, 224),
                       filter=(7, 7), stride=(2, 2), dilation=(1, 1), pad_lo=(3, 3), pad_hi=(3, 3), dtype="f16",
                       name="stem")
    q = policy.space_to_depth_forward(stem)
    assert (q.in_channels, q.filter, q.input, q.output) == (12, (4, 4), (115, 115), (112, 112))
    for change in (dict(stride=(1, 1)), dict(in_channels=8), dict(op="grad_input"), dict(layout="NGCHW"),
                   dict(dilation=(2, 2)), dict(dtype="f32"), dict(groups=2, in_channels=2)):
        assert policy.space_to_depth_forward(stem.with_(**change)) is None, change
