"""Checks of convdsl.reference that do not trust it.

- forward against a pure-Python loop nest written from the definition, for every layout;
- grad_input against a loop nest of the scatter definition;
- the adjoint identities <fwd(x,w), dy> = <x, grad_input(dy,w)> = <w, grad_weight(x,dy)>, which tie the
  three ops together, over random shapes, strides, dilations, asymmetric paddings and layouts;
- transposed == grad_input, the epilogues, and the fp8/bf8 rounding helper.

Layout permutations in this file come from `ConvProblem.layout_name` through einsum letter strings, not
from the reference's own permutation tables, so a wrong table there cannot cancel a wrong table here.
"""
from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convdsl.problem import LAYOUTS, WEIGHT_LAYOUTS, ConvProblem, Epilogue
from convdsl.reference import (
    NUMPY_DTYPES,
    TOLERANCE,
    random_inputs,
    reference,
    relative_error,
    round_to_compute,
    tolerance,
)

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- layout helpers (independent of the reference) ----------------------------------------------
def _canonical_letters(p: ConvProblem, tensor: str) -> str:
    """Letters of the canonical order: x (N,G,C,sp), y (N,G,K,sp), w (G,K,C,taps)."""
    name = p.layout_name(tensor)
    sp = "".join(ch for ch in name if ch in "DHW")
    taps = "".join(ch for ch in name if ch in "ZYX")
    return {"x": "NGC" + sp, "y": "NGK" + sp, "w": "GKC" + taps}[tensor]


def to_layout(p: ConvProblem, tensor: str, canon: np.ndarray) -> np.ndarray:
    return np.einsum(f"{_canonical_letters(p, tensor)}->{p.layout_name(tensor)}", canon)


def to_canonical(p: ConvProblem, tensor: str, arr: np.ndarray) -> np.ndarray:
    return np.einsum(f"{p.layout_name(tensor)}->{_canonical_letters(p, tensor)}", arr)


# --- brute force from the definition --------------------------------------------------------------
def brute_forward(p: ConvProblem, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[n,g,k,o] = sum_{c,y} x[n,g,c,o*s+y*d-lo] * w[g,k,c,y], reads outside [0, I) are zero."""
    y = np.zeros((p.batch, p.groups, p.out_channels, *p.output))
    for n, g, k in itertools.product(range(p.batch), range(p.groups), range(p.out_channels)):
        for o in itertools.product(*(range(v) for v in p.output)):
            acc = 0.0
            for c in range(p.in_channels):
                for tap in itertools.product(*(range(r) for r in p.filter)):
                    i = tuple(oo * s + yy * d - lo for oo, yy, s, d, lo in zip(o, tap, p.stride, p.dilation, p.pad_lo))
                    if all(0 <= ii < size for ii, size in zip(i, p.input)):
                        acc += x[(n, g, c) + i] * w[(g, k, c) + tap]
            y[(n, g, k) + o] = acc
    return y


def brute_grad_input(p: ConvProblem, dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dx[i] = sum over (o, y) with o*s + y*d - lo = i of dy[o] * w[y]."""
    dx = np.zeros((p.batch, p.groups, p.in_channels, *p.input))
    for n, g, k, c in itertools.product(range(p.batch), range(p.groups), range(p.out_channels), range(p.in_channels)):
        for o in itertools.product(*(range(v) for v in p.output)):
            for tap in itertools.product(*(range(r) for r in p.filter)):
                i = tuple(oo * s + yy * d - lo for oo, yy, s, d, lo in zip(o, tap, p.stride, p.dilation, p.pad_lo))
                if all(0 <= ii < size for ii, size in zip(i, p.input)):
                    dx[(n, g, c) + i] += dy[(n, g, k) + o] * w[(g, k, c) + tap]
    return dx


# --- problem strategies ------------------------------------------------------------------------
@st.composite
def problems(draw, op: str = "forward", max_input_extra: int = 3, max_channels: int = 3, max_batch: int = 2) -> ConvProblem:
    dims = draw(st.integers(1, 3))
    filt, stride, dil, lo, hi, inp = [], [], [], [], [], []
    for _ in range(dims):
        r = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2))
        s = draw(st.integers(1, 3))
        pl = draw(st.integers(0, 2))
        ph = draw(st.integers(0, 2))
        # Smallest input with at least one output: I + lo + hi >= d*(R-1) + 1.
        need = max(1, d * (r - 1) + 1 - pl - ph)
        i = need + draw(st.integers(0, max_input_extra))
        filt.append(r), stride.append(s), dil.append(d), lo.append(pl), hi.append(ph), inp.append(i)
    return ConvProblem(
        op=op,
        dims=dims,
        groups=draw(st.integers(1, 3)),
        batch=draw(st.integers(1, max_batch)),
        in_channels=draw(st.integers(1, max_channels)),
        out_channels=draw(st.integers(1, max_channels)),
        input=tuple(inp),
        filter=tuple(filt),
        stride=tuple(stride),
        dilation=tuple(dil),
        pad_lo=tuple(lo),
        pad_hi=tuple(hi),
        layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(WEIGHT_LAYOUTS)),
    )


def _canon_arrays(p: ConvProblem, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((p.batch, p.groups, p.in_channels, *p.input))
    w = rng.standard_normal((p.groups, p.out_channels, p.in_channels, *p.filter))
    dy = rng.standard_normal((p.batch, p.groups, p.out_channels, *p.output))
    return x, w, dy


# --- brute-force comparisons ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_forward_matches_brute_force_every_layout(layout: str, weight_layout: str, dims: int) -> None:
    # Distinct sizes on every axis so that a swapped axis changes the shape or the values.
    p = ConvProblem(
        op="forward", dims=dims, groups=2, batch=2, in_channels=3, out_channels=2,
        input=(5, 6, 4)[:dims], filter=(2, 3, 2)[:dims], stride=(2, 1, 3)[:dims], dilation=(1, 2, 1)[:dims],
        pad_lo=(1, 0, 2)[:dims], pad_hi=(0, 2, 1)[:dims], layout=layout, weight_layout=weight_layout,
    )
    x, w, _ = _canon_arrays(p, 1)
    got = reference(p, to_layout(p, "x", x), to_layout(p, "w", w))
    assert got.shape == p.y_shape and got.dtype == np.float64
    want = to_layout(p, "y", brute_forward(p, x, w))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@_SETTINGS
@given(problems(max_input_extra=2, max_channels=2))
def test_forward_matches_brute_force_random(p: ConvProblem) -> None:
    x, w, _ = _canon_arrays(p, 2)
    got = reference(p, to_layout(p, "x", x), to_layout(p, "w", w))
    np.testing.assert_allclose(got, to_layout(p, "y", brute_forward(p, x, w)), rtol=1e-12, atol=1e-12)


@_SETTINGS
@given(problems(op="grad_input", max_input_extra=2, max_channels=2))
def test_grad_input_matches_brute_force_random(p: ConvProblem) -> None:
    _, w, dy = _canon_arrays(p, 3)
    got = reference(p, to_layout(p, "y", dy), to_layout(p, "w", w))
    assert got.shape == p.x_shape
    np.testing.assert_allclose(got, to_layout(p, "x", brute_grad_input(p, dy, w)), rtol=1e-12, atol=1e-12)


def test_padding_reads_are_zero() -> None:
    # 1D, I=3, R=3, lo=hi=2, all ones: output counts the in-range taps, 1,2,3,2,1.
    p = ConvProblem(op="forward", dims=1, groups=1, batch=1, in_channels=1, out_channels=1, input=(3,),
                    filter=(3,), stride=(1,), dilation=(1,), pad_lo=(2,), pad_hi=(2,))
    y = reference(p, np.ones(p.x_shape), np.ones(p.w_shape))
    assert y.ravel().tolist() == [1, 2, 3, 2, 1]


def test_hi_padding_partly_used() -> None:
    # I=7, R=2, s=3, hi=2: O = (7+2-2)//3+1 = 3; o=2 reads x[6] and padded index 7, index 8 is never read.
    p = ConvProblem(op="forward", dims=1, groups=1, batch=1, in_channels=1, out_channels=1, input=(7,),
                    filter=(2,), stride=(3,), dilation=(1,), pad_lo=(0,), pad_hi=(2,))
    x = np.arange(1.0, 8.0).reshape(p.x_shape)
    w = np.array([1.0, 10.0]).reshape(p.w_shape)
    assert reference(p, x, w).ravel().tolist() == [1 + 20, 4 + 50, 7 + 0]
    # hi=0: O = (7-2)//3+1 = 2, so x[5] and x[6] are never read and get no gradient.
    q = p.with_(pad_hi=(0,), op="grad_input")
    dx = reference(q, np.ones(q.y_shape), w)
    assert dx.ravel().tolist() == [1, 10, 0, 1, 10, 0, 0]


# --- adjoint identities --------------------------------------------------------------------------
@_SETTINGS
@given(problems(), st.integers(0, 2**31 - 1))
def test_adjoint_identities(p: ConvProblem, seed: int) -> None:
    x, w, dy = _canon_arrays(p, seed)
    xl, wl, dyl = to_layout(p, "x", x), to_layout(p, "w", w), to_layout(p, "y", dy)
    y = reference(p.with_(op="forward"), xl, wl)
    dx = reference(p.with_(op="grad_input"), dyl, wl)
    dw = reference(p.with_(op="grad_weight"), xl, dyl)
    assert y.shape == p.y_shape and dx.shape == p.x_shape and dw.shape == p.w_shape
    # Inner products are layout-independent, so compare them in the layouts the kernels use.
    a = float(np.vdot(y, dyl))
    b = float(np.vdot(xl, dx))
    c = float(np.vdot(wl, dw))
    # Scale by the sum of absolute products so that cancellation to ~0 is not a false failure.
    scale = float(np.vdot(np.abs(y), np.abs(dyl))) + float(np.vdot(np.abs(xl), np.abs(dx))) + 1e-300
    assert abs(a - b) <= 1e-9 * scale, (a, b, p.describe())
    assert abs(a - c) <= 1e-9 * scale, (a, c, p.describe())


# --- transposed and epilogues --------------------------------------------------------------------
@_SETTINGS
@given(problems(op="transposed"), st.integers(0, 1000))
def test_transposed_is_grad_input(p: ConvProblem, seed: int) -> None:
    args = random_inputs(p, seed)
    assert [a.shape for a in args] == list(p.arg_shapes)
    got = reference(p, *args)
    assert got.shape == p.x_shape
    np.testing.assert_array_equal(got, reference(p.with_(op="grad_input"), *args))


@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight", "transposed"])
def test_epilogues(op: str) -> None:
    base = ConvProblem(op=op, dims=2, groups=2, batch=2, in_channels=3, out_channels=2, input=(5, 4),
                       filter=(3, 2), stride=(2, 1), dilation=(1, 2), pad_lo=(1, 0), pad_hi=(0, 1))
    args = random_inputs(base, 7)
    plain = reference(base, *args)
    assert plain.shape == base.result_shape

    scaled = reference(base.with_(epilogue=Epilogue("scale", alpha=-2.5)), *args)
    np.testing.assert_allclose(scaled, -2.5 * plain, rtol=1e-15)

    bil = base.with_(epilogue=Epilogue("bilinear", alpha=0.5, beta=-3.0))
    assert bil.arg_shapes[-1] == bil.result_shape
    d = np.random.default_rng(3).uniform(-1, 1, bil.result_shape).astype(np.float32)
    got = reference(bil, *args, d)
    np.testing.assert_allclose(got, 0.5 * plain - 3.0 * d.astype(np.float64), rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError):
        reference(bil, *args)  # D missing


def test_argument_shapes_checked() -> None:
    p = ConvProblem(op="grad_weight", dims=1, groups=1, batch=1, in_channels=2, out_channels=2, input=(4,),
                    filter=(2,), stride=(1,), dilation=(1,), pad_lo=(0,), pad_hi=(0,))
    x, dy = random_inputs(p)
    with pytest.raises(ValueError):
        reference(p, dy, x)  # swapped


# --- dtypes, compute rounding, tolerances -------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_random_inputs_dtypes(dtype: str) -> None:
    p = ConvProblem(op="forward", dims=2, groups=2, batch=2, in_channels=3, out_channels=4, input=(6, 5),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype=dtype,
                    out_dtype="f32", epilogue=Epilogue("bilinear", 1.0, 1.0))
    args = random_inputs(p, seed=5)
    assert len(args) == 3
    for a, shape, name in zip(args, p.arg_shapes, p.arg_dtypes):
        assert a.shape == shape and a.dtype == np.dtype(NUMPY_DTYPES[name])
        f = a.astype(np.float64)
        assert np.all(f >= -1) and np.all(f <= 1) and np.all(f != 0)
    # Reproducible per seed, different across seeds.
    assert all(np.array_equal(a, b) for a, b in zip(args, random_inputs(p, seed=5)))
    assert not np.array_equal(args[0], random_inputs(p, seed=6)[0])
    # The reference accepts them and returns float64.
    assert reference(p, *args).dtype == np.float64


def test_random_inputs_depend_on_the_seed_and_the_arguments_only() -> None:
    # `convdsl run` draws once for kernels in a row with the same arguments: that must be the draw each would get.
    # A tensor of several draw blocks, so that the blocks' own generators are covered.
    p = ConvProblem(op="grad_input", dims=2, groups=1, batch=3, in_channels=8, out_channels=8, input=(300, 300),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16")
    assert math.prod(p.arg_shapes[0]) > 2 * (1 << 20)
    same = [p.with_(op="transposed", name="up"), p.with_(op="forward", name="y")]
    assert all(q.arg_shapes == p.arg_shapes and q.arg_dtypes == p.arg_dtypes for q in same)
    drawn = random_inputs(p, seed=3)
    for q in same:
        assert all(np.array_equal(a, b) for a, b in zip(drawn, random_inputs(q, seed=3)))
    # the blocks differ from each other (each its own generator, not one restarted)
    first = drawn[0].reshape(-1)
    assert not np.array_equal(first[:1000], first[1 << 20:(1 << 20) + 1000])


def _representable(kind: str) -> np.ndarray:
    dt = {"fp8": ml_dtypes.float8_e4m3fn, "bf8": ml_dtypes.float8_e5m2}[kind]
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    return vals[np.isfinite(vals)]


@pytest.mark.parametrize("kind,max_normal,min_normal,mant_bits", [("fp8", 448.0, 2.0**-6, 3), ("bf8", 57344.0, 2.0**-14, 2)])
def test_round_to_compute(kind: str, max_normal: float, min_normal: float, mant_bits: int) -> None:
    rng = np.random.default_rng(0)
    # Log-uniform magnitudes across the normal range, both signs.
    a = np.exp(rng.uniform(math.log(min_normal), math.log(max_normal), 4000)) * rng.choice([-1.0, 1.0], 4000)
    r = round_to_compute(a, kind)
    assert r.dtype == np.float64
    assert np.all(np.isin(r, _representable(kind)))
    np.testing.assert_array_equal(round_to_compute(r, kind), r)  # idempotent
    # Nearest rounding: half an ulp, 2^-(m+1) relative, within the normal range.
    assert np.max(np.abs(r - a) / np.abs(a)) <= 2.0 ** -(mant_bits + 1)
    # And nearest among all representable values (ties excluded by the continuous draw).
    table = _representable(kind)
    nearest = table[np.argmin(np.abs(a[:, None] - table[None, :]), axis=1)]
    np.testing.assert_array_equal(np.abs(r - a), np.abs(nearest - a))
    # Exact ties go to even: 1 + 2^-4 lies between 1 and 1 + 2^-3 in e4m3, even mantissa is 1.
    if kind == "fp8":
        assert round_to_compute(np.array([1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4]), kind).tolist() == [1.0, 1.25]
    with pytest.raises(ValueError):
        round_to_compute(a, "fp16")


@pytest.mark.parametrize("compute", [("fp8", "fp8"), ("bf8", "fp8"), ("fp8", "bf8")])
@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight"])
def test_compute_rounds_a_and_b(op: str, compute: tuple[str, str]) -> None:
    base = ConvProblem(op=op, dims=2, groups=1, batch=2, in_channels=3, out_channels=3, input=(5, 5),
                       filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16")
    a, b = random_inputs(base, 11)
    got = reference(base.with_(compute=compute), a, b)
    want = reference(base, round_to_compute(a, compute[0]), round_to_compute(b, compute[1]))
    np.testing.assert_array_equal(got, want)
    # The swap would differ (e4m3 and e5m2 round differently), so the A/B assignment is really tested.
    if compute[0] != compute[1]:
        swapped = reference(base, round_to_compute(a, compute[1]), round_to_compute(b, compute[0]))
        assert not np.array_equal(got, swapped)
    # The rounded result stays within the compute tolerance of the exact one.
    assert relative_error(got, reference(base, a, b)) < tolerance(base.with_(compute=compute))


def test_relative_error_and_tolerance() -> None:
    want = np.array([3.0, 4.0])
    assert relative_error(want, want) == 0.0
    assert relative_error(np.array([3.0, 4.5]), want) == pytest.approx(0.1)
    assert relative_error(np.zeros(2), np.zeros(2)) == 0.0
    assert relative_error(np.array([1e-3, 0.0]), np.zeros(2)) > 1e300  # divides by tiny, not zero
    assert type(relative_error(want, want)) is float
    assert relative_error(np.array([np.nan, 4.0]), want) == math.inf
    assert relative_error(want.astype(ml_dtypes.bfloat16), want) == 0.0
    with pytest.raises(ValueError):
        relative_error(np.zeros(3), want)

    p = ConvProblem(op="forward", dims=1, groups=1, batch=1, in_channels=1, out_channels=1, input=(3,),
                    filter=(1,), stride=(1,), dilation=(1,), pad_lo=(0,), pad_hi=(0,))
    assert tolerance(p) == TOLERANCE["f32"] == 1e-5
    assert tolerance(p.with_(out_dtype="bf16")) == 1e-2
    assert tolerance(p.with_(dtype="f16")) == 1e-2
    assert tolerance(p.with_(dtype="bf16", out_dtype="f32")) == 1e-2
    assert tolerance(p.with_(compute=("fp8", "bf8"))) == 1e-1


def test_f32_inputs_large_reduction_within_tolerance() -> None:
    # f32 operands promoted exactly to float64: the reference of rounded inputs is exact, and an f32
    # accumulation of a long reduction (C*R*R = 576) stays well inside the f32 tolerance.
    p = ConvProblem(op="grad_weight", dims=2, groups=1, batch=4, in_channels=8, out_channels=8, input=(16, 16),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    x, dy = random_inputs(p, 1)
    want = reference(p, x, dy)
    # Same sum in f32 via the reference's structure-free route: einsum over an f32 im2col.
    xc = to_canonical(p, "x", x.astype(np.float32))
    dyc = to_canonical(p, "y", dy.astype(np.float32))
    xp = np.pad(xc, [(0, 0)] * 3 + [(1, 1), (1, 1)])
    got = np.zeros((1, 8, 8, 3, 3), dtype=np.float32)
    for ty, tx in itertools.product(range(3), range(3)):
        got[..., ty, tx] = np.einsum("ngchw,ngkhw->gkc", xp[:, :, :, ty:ty + 16, tx:tx + 16], dyc)
    assert relative_error(to_layout(p, "w", got), want) < tolerance(p)


# --- padding that dwarfs the data: never made -----------------------------------------------------
@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight"])
def test_wide_padding_and_taps_that_only_see_padding_match_brute_force(op: str) -> None:
    # padding past the filter's reach in both dims, strides and dilations: several taps read only padding
    p = ConvProblem(op=op, dims=2, groups=2, batch=2, in_channels=2, out_channels=3, input=(4, 5), filter=(3, 2),
                    stride=(2, 3), dilation=(4, 5), pad_lo=(9, 6), pad_hi=(7, 11))
    x, w, dy = _canon_arrays(p, 11)
    xl, wl, dyl = to_layout(p, "x", x), to_layout(p, "w", w), to_layout(p, "y", dy)
    if op == "forward":
        np.testing.assert_allclose(reference(p, xl, wl), to_layout(p, "y", brute_forward(p, x, w)), rtol=1e-12)
    elif op == "grad_input":
        np.testing.assert_allclose(reference(p, dyl, wl), to_layout(p, "x", brute_grad_input(p, dy, w)), rtol=1e-12)
    else:  # grad_weight: dw[g,k,c,y] = sum_{n,o} x[o*s+y*d-lo] dy[o], from forward's brute force by linearity
        want = np.zeros((p.groups, p.out_channels, p.in_channels, *p.filter))
        for g, k, c in itertools.product(range(p.groups), range(p.out_channels), range(p.in_channels)):
            for tap in itertools.product(*(range(r) for r in p.filter)):
                unit = np.zeros_like(w)
                unit[(g, k, c) + tap] = 1.0
                want[(g, k, c) + tap] = np.vdot(brute_forward(p, x, unit), dy)
        np.testing.assert_allclose(reference(p, xl, dyl), to_layout(p, "w", want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight"])
def test_a_dilation_of_a_billion_costs_no_padded_copy(op: str) -> None:
    # input 8, filter 3, dilation 10^9, padding 10^9 per side: only the middle tap reads the input (o -> o), so
    # y = w[1] x, dx = w[1] dy, dw[1] = x . dy and dw[0] = dw[2] = 0.  A padded copy would take 16 GB of float64.
    p = ConvProblem(op=op, dims=1, groups=1, batch=1, in_channels=1, out_channels=1, input=(8,), filter=(3,),
                    stride=(1,), dilation=(10**9,), pad_lo=(10**9,), pad_hi=(10**9,))
    assert p.output == (8,)
    x, w, dy = _canon_arrays(p, 5)
    xl, wl, dyl = to_layout(p, "x", x), to_layout(p, "w", w), to_layout(p, "y", dy)
    if op == "forward":
        np.testing.assert_allclose(reference(p, xl, wl), to_layout(p, "y", w[..., 1:2] * x), rtol=1e-12)
    elif op == "grad_input":
        np.testing.assert_allclose(reference(p, dyl, wl), to_layout(p, "x", w[..., 1:2] * dy), rtol=1e-12)
    else:
        want = np.zeros_like(w)
        want[..., 1] = np.vdot(x, dy)
        np.testing.assert_allclose(reference(p, xl, dyl), to_layout(p, "w", want), rtol=1e-12)
