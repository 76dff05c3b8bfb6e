"""Judging a training step's gradients, in the spirit of `torch.testing`.

    from convdsl.torch.testing import compare_gradients
    result = compare_gradients(exact, reference, candidate)   # each {parameter name: gradient}
    assert result.agree, result.worst

`exact` is a float64 step, `reference` the step of the backend to match (cuDNN's convolutions, say) and
`candidate` the step being judged (convdsl's), all three from the same weights and batch.  The rule is in
`compare_gradients`'s docstring; it needs neither CUDA nor torchvision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

import torch

__all__ = ["GradientComparison", "GradientError", "compare_gradients"]


class GradientError(NamedTuple):
    """One parameter's gradient errors against the exact step (see `compare_gradients` for their definition)."""

    name: str
    candidate: float
    reference: float


@dataclass(frozen=True)
class GradientComparison:
    """What `compare_gradients` found.

    rows: every parameter's errors, in the order of `exact`.
    worst_ratio: the largest candidate error / max(factor x reference error, tolerance) over the parameters.
    worst: the row of that parameter (None where there are no parameters).
    floor: the absolute floor of the error's denominator (floor_fraction x the largest exact gradient norm).
    agree: worst_ratio <= 1: every parameter's candidate error is within the bound.
    """

    rows: tuple[GradientError, ...]
    worst_ratio: float
    worst: Optional[GradientError]
    floor: float
    agree: bool


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).norm())


def compare_gradients(exact: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                      candidate: Mapping[str, torch.Tensor], *, floor_fraction: float = 1e-3,
                      tolerance: float = 1e-2, factor: float = 2.0) -> GradientComparison:
    """Whether `candidate`'s gradients of one training step are as close to `exact`'s as `reference`'s are.

    Each argument maps parameter names to gradients; the three must name the same parameters with gradients of
    the same shapes (any dtype and device: the errors are computed in float64 on `exact`'s device).

    The error of a parameter's gradient `got` is

        ||got - exact|| / max(||exact||, floor),   floor = floor_fraction x the largest ||exact|| of the step,

    and the candidate agrees where, for every parameter,

        candidate's error <= max(factor x reference's error, tolerance).

    Why one step's gradients: low-precision (bf16) training drifts apart step by step whatever computes it, so loss
    curves of two backends part after enough steps even where both are right; the gradients of one step from the
    same weights and batch can be held to a bound.  Why a bound relative to the reference: rounding makes some
    error unavoidable, and what the reference backend's error is on a parameter shows how large it is there;
    `tolerance` keeps parameters where the reference happens to be very accurate from failing on harmless errors.
    Why the floor: some parameters' exact gradient is about zero (a convolution's bias just before a BatchNorm,
    which removes it), and a relative error over such a norm is rounding noise divided by almost nothing, large
    and random for either backend; measured against a small fraction of the model's gradient scale instead, the
    same noise is as small as it is on every other parameter.
    """
    if not (floor_fraction >= 0 and tolerance >= 0 and factor >= 0):
        raise ValueError(f"floor_fraction, tolerance and factor must be >= 0, not {floor_fraction}, {tolerance}, "
                         f"{factor}")
    names = list(exact)
    for what, grads in (("reference", reference), ("candidate", candidate)):
        missing, extra = [n for n in names if n not in grads], [n for n in grads if n not in exact]
        if missing or extra:
            raise ValueError(f"{what} names other parameters than exact: missing {missing}, not in exact {extra}")
        for n in names:
            if tuple(grads[n].shape) != tuple(exact[n].shape):
                raise ValueError(f"{what}[{n!r}] has shape {tuple(grads[n].shape)}, exact's is "
                                 f"{tuple(exact[n].shape)}")
    norms = {n: _norm(exact[n]) for n in names}
    floor = floor_fraction * max(norms.values(), default=0.0)

    def error(got: torch.Tensor, n: str) -> float:
        want = exact[n].detach().to(torch.float64)
        diff = _norm(got.detach().to(device=want.device, dtype=torch.float64) - want)
        scale = max(norms[n], floor)
        if scale == 0.0:  # an all-zero exact step: only an exact zero has no error
            return 0.0 if diff == 0.0 else math.inf
        return diff / scale

    rows = tuple(GradientError(n, error(candidate[n], n), error(reference[n], n)) for n in names)
    worst_ratio, worst = 0.0, None
    for row in rows:
        bound = max(factor * row.reference, tolerance)
        if bound > 0:
            ratio = row.candidate / bound
        else:
            ratio = 0.0 if row.candidate == 0 else math.inf
        if worst is None or ratio > worst_ratio or math.isnan(ratio):
            worst_ratio, worst = ratio, row
            if math.isnan(ratio):
                break
    return GradientComparison(rows=rows, worst_ratio=worst_ratio, worst=worst, floor=floor,
                              agree=bool(worst_ratio <= 1.0))
