"""The index algebra against the definition of convolution, by enumeration and property tests."""
from __future__ import annotations

import itertools

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from convdsl.algebra import dy_padding, grad_input_phases, output_size, phases_1d, plan_split_k, split_chunks, x_window
from convdsl.problem import ConvProblem, output_sizes
from convdsl.problem import output_size as problem_output_size


@given(
    i=st.integers(1, 30), r=st.integers(1, 6), s=st.integers(1, 4), d=st.integers(1, 3),
    lo=st.integers(0, 4), hi=st.integers(0, 4),
)
@settings(max_examples=300)
def test_output_size_counts_windows(i, r, s, d, lo, hi):
    # O is the number of o >= 0 whose window o*s + [0, (R-1)*d] lies inside the padded input
    padded = i + lo + hi
    want = sum(1 for o in range(padded + 1) if o * s + (r - 1) * d <= padded - 1)
    assert max(output_size(i, r, s, d, lo, hi), 0) == want


@given(
    i=st.integers(1, 25), r=st.integers(1, 6), s=st.integers(1, 4), d=st.integers(1, 3),
    lo=st.integers(0, 4), hi=st.integers(0, 4),
)
@settings(max_examples=400)
def test_phases_reproduce_the_definition(i, r, s, d, lo, hi):
    o_size = output_size(i, r, s, d, lo, hi)
    assume(o_size >= 1)
    phases = phases_1d(i, r, s, d, lo)
    # the residues partition [0, I): every position belongs to exactly one phase
    covered = sorted(ph.r + s * q for ph in phases for q in range(ph.Q))
    assert covered == list(range(i))
    # the taps used over all phases are each filter tap that reaches a position, exactly once: no multiply by
    # an inserted zero (a tap whose residue class holds no position, r >= I, is listed nowhere)
    used = sorted(ph.y0 + j * ph.tap_step for ph in phases for j in range(ph.J))
    assert used == [y for y in range(r) if any((res + lo - y * d) % s == 0 for res in range(min(s, i)))]
    # at most s / gcd(s, d) residues have taps
    import math

    assert sum(1 for ph in phases if not ph.empty) <= s // math.gcd(s, d)
    # each phase's (q, j) -> (o, y) pairs are exactly the (o, y) pairs of the definition for i = s*q + r
    for ph in phases:
        for q in range(ph.Q):
            pos = s * q + ph.r
            want = {(o, y) for o in range(o_size) for y in range(r) if o * s + y * d - lo == pos}
            got = {
                (q + ph.off - j * ph.o_step, ph.y0 + j * ph.tap_step)
                for j in range(ph.J)
                if 0 <= q + ph.off - j * ph.o_step < o_size
            }
            assert got == want


def test_huge_strides_dilations_and_filters_cost_nothing():
    """A residue costs O(1): stride, dilation and filter of 10^9 list only the residues that hold positions."""
    phases = phases_1d(5, 10**9, 10**9, 10**9 - 1, 10**9 - 3)
    assert [ph.r for ph in phases] == [0, 1, 2, 3, 4] and all(ph.J == 1 for ph in phases)
    # each residue's tap is the one solution of y*d == r + lo (mod s) in [0, R)
    assert all((ph.r + 10**9 - 3 - ph.y0 * (10**9 - 1)) % 10**9 == 0 for ph in phases)


@given(length=st.integers(1, 200), parts=st.integers(1, 40))
def test_split_chunks_cover_exactly_once(length, parts):
    chunks = split_chunks(length, parts)
    assert len(chunks) == parts
    assert chunks[0][0] == 0 and chunks[-1][1] == length
    assert all(a <= b for a, b in chunks)
    assert all(chunks[k][1] == chunks[k + 1][0] for k in range(parts - 1))


def _problem(**kw) -> ConvProblem:
    base = dict(
        op="grad_weight", dims=2, groups=1, batch=3, in_channels=2, out_channels=2, input=(9, 7), filter=(3, 2),
        stride=(2, 1), dilation=(1, 2), pad_lo=(1, 0), pad_hi=(0, 1),
    )
    base.update(kw)
    return ConvProblem(**base)


@given(batch=st.integers(1, 6), parts=st.integers(1, 12), rows=st.integers(3, 12))
def test_split_k_plan_covers_the_reduction(batch, parts, rows):
    p = _problem(batch=batch, input=(rows, 5), split_k=parts)
    plan = plan_split_k(p)
    steps = [k for a, b in plan.chunks for k in range(a, b)]
    assert steps == list(range(p.batch))  # each sample in exactly one chunk
    assert plan.parts == len(plan.chunks) == min(parts, batch) and all(b > a for a, b in plan.chunks)


def test_auto_split_k_grows_with_the_reduction():
    small = _problem(batch=1, input=(8, 8), in_channels=256, out_channels=256)
    large = _problem(batch=256, input=(56, 56), in_channels=4, out_channels=4, groups=1)
    assert plan_split_k(small).parts == 1
    assert plan_split_k(large).parts > 1


@given(
    dims=st.integers(1, 3), data=st.data(),
)
def test_dy_window_reads_stay_in_the_padded_tensor(dims, data):
    sizes = [data.draw(st.integers(1, 9)) for _ in range(dims)]
    filt = [data.draw(st.integers(1, 4)) for _ in range(dims)]
    stride = [data.draw(st.integers(1, 3)) for _ in range(dims)]
    dil = [data.draw(st.integers(1, 2)) for _ in range(dims)]
    lo = [data.draw(st.integers(0, 2)) for _ in range(dims)]
    hi = [data.draw(st.integers(0, 2)) for _ in range(dims)]
    assume(all(output_size(*a) >= 1 for a in zip(sizes, filt, stride, dil, lo, hi)))
    p = ConvProblem(
        op="grad_input", dims=dims, groups=1, batch=1, in_channels=1, out_channels=1, input=tuple(sizes),
        filter=tuple(filt), stride=tuple(stride), dilation=tuple(dil), pad_lo=tuple(lo), pad_hi=tuple(hi),
    )
    phases = grad_input_phases(p)
    plo, phi = dy_padding(p, phases)
    # positions covered across phases tile the whole input gradient
    covered = set()
    for ph in phases:
        for qs in itertools.product(*[range(q) for q in ph.sizes]):
            covered.add(tuple(d1.r + s * q for d1, s, q in zip(ph.dims, p.stride, qs)))
        if ph.empty:
            continue
        for k, d1 in enumerate(ph.dims):
            first = d1.off - (d1.J - 1) * d1.o_step + plo[k]
            last = d1.Q - 1 + d1.off + plo[k]
            assert 0 <= first and last < p.output[k] + plo[k] + phi[k]
    assert covered == set(itertools.product(*[range(i) for i in sizes]))
    xlo, xhi = x_window(p)
    # the forward window is exactly what the last output reads
    for k in range(dims):
        assert p.input[k] + xlo[k] + xhi[k] == (p.output[k] - 1) * stride[k] + (filt[k] - 1) * dil[k] + 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(0, 5), st.integers(0, 5))
def test_one_output_size_formula(i, r, s, d, lo, hi):
    # ConvProblem.output and the index algebra count windows with problem.output_size, the one formula
    assume(output_size(i, r, s, d, lo, hi) >= 1)
    p = _problem(input=(i, 5), filter=(r, 1), stride=(s, 1), dilation=(d, 1), pad_lo=(lo, 0), pad_hi=(hi, 0))
    assert p.output[0] == output_size(i, r, s, d, lo, hi) == output_sizes((i,), (r,), (s,), (lo,), (hi,), (d,))[0]
    assert output_size is problem_output_size
