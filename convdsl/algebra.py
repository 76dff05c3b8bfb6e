"""Index algebra of the implicit-GEMM forms: stride phases (grad_input) and split-K chunks (grad_weight).

Everything here is pure integer arithmetic on one spatial dimension at a time, so the property tests
in tests/test_algebra.py can enumerate it against the definition of convolution.
Per dimension: input size I, output size O, filter R, stride s, dilation d, low padding lo.
The forward map from output o and tap y to input is  i = o*s + y*d - lo.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .problem import ConvProblem, output_size

__all__ = ["Phase", "Phase1D", "SplitK", "auto_split_k", "dy_padding", "grad_input_phases", "output_size",
           "phases_1d", "plan_split_k", "split_chunks", "x_window"]


@dataclass(frozen=True)
class Phase1D:
    """Residue class r of the input gradient along one dimension: the positions i = s*q + r.

    taps:  y = y0 + j*tap_step for j in [0, J)  (every tap with (r + lo - y*d) mod s == 0)
    reads: o = q + off - j*o_step                (o_step = d/g, g = gcd(s, d))
    count: q in [0, Q),  Q = ceil((I - r) / s)
    """

    r: int
    y0: int
    J: int
    tap_step: int
    off: int
    o_step: int
    Q: int

    @property
    def empty(self) -> bool:
        # no tap reaches this residue: dX is zero there and nothing is computed
        return self.J == 0


def phases_1d(i_size: int, r_size: int, s: int, d: int, lo: int) -> list[Phase1D]:
    """The residue classes of one dimension that hold positions (min(s, I) of them), each with the taps that
    reach it.

    Derivation: dX[i] = sum over (o, y) with o*s + y*d - lo = i of dY[o] * W[y].  Write i = s*q + r.
    Then o*s = s*q + r + lo - y*d, so tap y contributes iff s divides (r + lo - y*d), and then
    o = q + (r + lo - y*d) / s.  The condition y*d == r + lo (mod s) has solutions iff g = gcd(s, d)
    divides r + lo; they form one residue class modulo s/g, so the taps in [0, R) are
    y0, y0 + s/g, y0 + 2 s/g, ...  Substituting y = y0 + j*(s/g) gives o = q + off - j*(d/g) with
    off = (r + lo - y0*d) / s.  Only s/g of the s residues can have taps: the others are all zero.
    """
    g = math.gcd(s, d)
    tap_step, o_step = s // g, d // g
    # y*d == r + lo (mod s)  <=>  y*(d/g) == (r + lo)/g (mod s/g): y0 = (r + lo)/g * inverse(d/g) mod s/g, so
    # each residue costs O(1) however large s, d or R are
    inverse = pow(o_step, -1, tap_step) if tap_step > 1 else 0
    phases = []
    # residues r >= I hold no positions (Q = 0): only min(s, I) residues are listed
    for r in range(min(s, i_size)):
        q_count = -(-(i_size - r) // s)  # ceil((I - r) / s)
        y0 = ((r + lo) // g * inverse) % tap_step if (r + lo) % g == 0 else r_size
        if y0 < r_size:
            taps = -(-(r_size - y0) // tap_step)
            off = (r + lo - y0 * d) // s
            phases.append(Phase1D(r, y0, taps, tap_step, off, o_step, q_count))
        else:
            phases.append(Phase1D(r, 0, 0, tap_step, 0, o_step, q_count))
    return phases


@dataclass(frozen=True)
class Phase:
    """One phase of a multi-dimensional input gradient: the product of one residue per dimension."""

    dims: tuple[Phase1D, ...]

    @property
    def empty(self) -> bool:
        return any(p.empty for p in self.dims)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(p.Q for p in self.dims)

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(p.J for p in self.dims)

    @property
    def residue(self) -> tuple[int, ...]:
        return tuple(p.r for p in self.dims)


def grad_input_phases(p: ConvProblem) -> list[Phase]:
    """All prod(s) phases of dX, in residue order; phases with no positions (Q = 0) are dropped."""
    per_dim = [
        phases_1d(i, r, s, d, lo) for i, r, s, d, lo in zip(p.input, p.filter, p.stride, p.dilation, p.pad_lo)
    ]
    return [Phase(combo) for combo in itertools.product(*per_dim) if all(q.Q > 0 for q in combo)]


def dy_padding(p: ConvProblem, phases: list[Phase]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Zero padding of dY so that every phase reads dY[q + off - j*o_step] in bounds.

    A phase reads o from off - (J-1)*o_step (q = 0, last tap) to Q - 1 + off (last q, tap 0);
    reads outside [0, O) are the zero border of the convolution, not inserted zeros.
    """
    lo, hi = [0] * p.dims, [0] * p.dims
    for ph in phases:
        if ph.empty:
            continue
        for k, (d1, o) in enumerate(zip(ph.dims, p.output)):
            lo[k] = max(lo[k], -(d1.off - (d1.J - 1) * d1.o_step))
            hi[k] = max(hi[k], d1.Q - 1 + d1.off - (o - 1))
    return tuple(lo), tuple(hi)


def x_window(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pad_lo, hi) applied to X so that X_padded[o*s + y*d] is defined for every o, y.

    The padded extent needed is (O-1)*s + (R-1)*d + 1; hi may be negative when the declared high
    padding (or the input tail) is never read: then X is cropped instead of padded.
    """
    hi = tuple(
        (o - 1) * s + (r - 1) * d + 1 - lo - i
        for o, r, s, d, lo, i in zip(p.output, p.filter, p.stride, p.dilation, p.pad_lo, p.input)
    )
    return p.pad_lo, hi


def split_chunks(length: int, parts: int) -> list[tuple[int, int]]:
    """Cut [0, length) into `parts` contiguous chunks [i*L//S, (i+1)*L//S): they cover it exactly once."""
    return [(i * length // parts, (i + 1) * length // parts) for i in range(parts)]


@dataclass(frozen=True)
class SplitK:
    """How grad_weight's reduction over (n, o...) is cut: S chunks along `axis` ('n' or 'o0')."""

    parts: int
    axis: str
    chunks: tuple[tuple[int, int], ...]


def auto_split_k(p: ConvProblem) -> int:
    """S from the shape: enough parallel work to fill a GPU, chunks long enough to amortise the partials.

    GEMM-like: output tiles ~ G * ceil(K/64) * ceil(C*taps/64); aim for ~256 tiles*chunks.
    Depthwise (C = K = 1): the output is only G*taps values, each a long memory-bound reduction;
    aim for ~64k independent partial sums.  Either way each chunk keeps >= 4096 reduction steps
    and there are at most 64 partials.
    """
    reduction = p.batch * math.prod(p.output)
    if p.depthwise:
        want = -(-65536 // (p.groups * math.prod(p.filter)))
    else:
        tiles = p.groups * -(-p.out_channels // 64) * -(-(p.in_channels * math.prod(p.filter)) // 64)
        want = 256 // max(tiles, 1)
    return max(1, min(want, reduction // 4096, 64))


def plan_split_k(p: ConvProblem) -> SplitK:
    """Chunks along the batch: S = split_k (or auto), at most N; `batch = ?` does not split (S = 1).

    Cutting along output rows instead was tried and dropped: IREE 3.13's CUDA backend fails to
    bufferize those chunks ("failed to bufferize op"), so a forced split_k larger than N is
    clamped to N (the plan printed by `convdsl explain` shows the S used).
    """
    parts = p.split_k if p.split_k is not None else auto_split_k(p)
    if p.dynamic_batch:
        # chunk bounds must be static; IREE's own split reduction still applies on GPUs
        return SplitK(1, "n", ((0, p.batch),))
    parts = min(parts, p.batch)
    if p.split_k is None and parts > 1:
        # auto: the largest S <= the target that divides N, so that all chunks are equal and the
        # split is one dispatch (a reshape of N into S x N/S); S = 1 when N has no such divisor
        parts = max(s for s in range(1, parts + 1) if p.batch % s == 0)
    return SplitK(parts, "n", tuple(split_chunks(p.batch, parts)))


def bf16x3_split_problem(p: ConvProblem) -> ConvProblem:
    """The bf16 problem that bf16x3's concatenated operands describe (passes/bf16x3.py): the reduction three times
    longer (C for forward, K for grad_input, N for grad_weight)."""
    changes: dict = {"dtype": "bf16", "out_dtype": p.result_dtype, "compute": None}
    if p.op == "forward":
        changes["in_channels"] = 3 * p.in_channels
    elif p.op in ("grad_input", "transposed"):
        changes["out_channels"] = 3 * p.out_channels
    else:  # grad_weight; with `batch = ?` the nominal batch, the real one comes from the arguments
        changes["batch"] = 3 * p.batch
    return p.with_(**changes)
