"""convdsl.torch.testing.compare_gradients, the rule that judges one training step's gradients: agreement and
disagreement on made-up gradients, the floor that keeps a near-zero exact gradient from failing on noise, the
argument checks, and one small model's step on the CPU (convdsl's convolutions in float32 against torch.nn's in
float32 and float64)."""
from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import convdsl.torch as ct  # noqa: E402
from convdsl.torch import fallback  # noqa: E402
from convdsl.torch.testing import GradientComparison, compare_gradients  # noqa: E402


def _noise(like: torch.Tensor, norm: float, seed: int) -> torch.Tensor:
    """Random noise of the given norm, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(like.shape, generator=g, dtype=torch.float64)
    return n * (norm / n.norm())


def _step() -> tuple[dict, dict]:
    """An exact step (a large weight gradient and a ~zero bias gradient) and a reference with rounding noise:
    1% of the weight gradient's norm, 1e-6 (absolute) on the bias."""
    g = torch.Generator().manual_seed(0)
    exact = {"conv.weight": torch.randn(8, 4, 3, 3, generator=g, dtype=torch.float64),
             "conv.bias": _noise(torch.empty(8), 1e-9, 1),
             "fc.weight": torch.randn(3, 16, generator=g, dtype=torch.float64)}
    reference = {n: v + _noise(v, 1e-2 * float(v.norm()), 10 + i) for i, (n, v) in enumerate(exact.items())}
    reference["conv.bias"] = exact["conv.bias"] + _noise(exact["conv.bias"], 1e-6, 20)
    return exact, reference


def test_candidate_equal_to_reference_agrees():
    exact, reference = _step()
    result = compare_gradients(exact, reference, {n: v.clone() for n, v in reference.items()})
    assert isinstance(result, GradientComparison)
    assert result.agree
    assert [r.name for r in result.rows] == list(exact)
    assert all(r.candidate == r.reference for r in result.rows)
    assert result.worst_ratio <= 0.5  # its error over max(2 x the same error, 1e-2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.agree = False


def test_one_parameter_wrong_by_ten_percent_disagrees():
    exact, reference = _step()
    candidate = dict(reference)
    candidate["fc.weight"] = exact["fc.weight"] * 1.1
    result = compare_gradients(exact, reference, candidate)
    assert not result.agree
    assert result.worst.name == "fc.weight"
    assert result.worst.candidate == pytest.approx(0.1)
    assert result.worst_ratio == pytest.approx(0.1 / max(2 * result.worst.reference, 1e-2))
    assert result.worst_ratio > 1


def test_near_zero_gradient_with_reference_sized_noise_agrees_thanks_to_the_floor():
    exact, reference = _step()
    candidate = dict(reference)
    # noise of the reference's size (3x its norm, another draw) on the bias whose exact gradient is ~1e-9
    candidate["conv.bias"] = exact["conv.bias"] + _noise(exact["conv.bias"], 3e-6, 21)
    result = compare_gradients(exact, reference, candidate)
    assert result.agree, result.worst
    assert result.floor == pytest.approx(1e-3 * max(float(v.norm()) for v in exact.values()))
    # without the floor the same noise is a relative error of thousands, three times the reference's: it fails
    assert not compare_gradients(exact, reference, candidate, floor_fraction=0.0).agree


def test_reference_noise_scaled_tenfold_on_a_large_parameter_disagrees():
    exact, reference = _step()
    candidate = dict(reference)
    w = exact["conv.weight"]
    candidate["conv.weight"] = w + 10 * (reference["conv.weight"] - w)
    result = compare_gradients(exact, reference, candidate)
    assert not result.agree
    assert result.worst.name == "conv.weight"
    assert result.worst.candidate == pytest.approx(10 * result.worst.reference)


def test_tolerance_and_factor_are_keywords():
    exact, reference = _step()
    candidate = dict(reference)
    candidate["fc.weight"] = exact["fc.weight"] * 1.1
    assert compare_gradients(exact, reference, candidate, tolerance=0.2).agree
    assert compare_gradients(exact, reference, candidate, factor=20.0).agree
    with pytest.raises(TypeError):
        compare_gradients(exact, reference, candidate, 1e-3)  # the options are keyword-only


def test_mismatched_parameters_are_refused():
    exact, reference = _step()
    with pytest.raises(ValueError, match="missing"):
        compare_gradients(exact, reference, {n: v for n, v in reference.items() if n != "fc.weight"})
    with pytest.raises(ValueError, match="shape"):
        compare_gradients(exact, reference, {**reference, "fc.weight": reference["fc.weight"].t()})
    with pytest.raises(ValueError, match=">= 0"):
        compare_gradients(exact, reference, reference, tolerance=-1.0)


def test_nan_in_the_candidate_disagrees():
    exact, reference = _step()
    candidate = {**reference, "conv.bias": torch.full_like(reference["conv.bias"], float("nan"))}
    assert not compare_gradients(exact, reference, candidate).agree


class _Tiny(nn.Module):
    """Conv2d (with a bias, whose exact gradient BatchNorm makes ~zero) + BatchNorm2d + ReLU + Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_converted_model_step_agrees_with_torch_nn_on_the_cpu(monkeypatch):
    monkeypatch.setattr(fallback, "_strict", True)  # convdsl's kernels, never PyTorch's convolution in their place
    torch.manual_seed(0)
    base = _Tiny().double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    y = torch.tensor([0, 2])

    def grads(model: nn.Module, dtype: torch.dtype) -> dict:
        model = model.to(dtype)
        nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    exact = grads(copy.deepcopy(base), torch.float64)
    reference = grads(copy.deepcopy(base), torch.float32)
    converted = ct.convert(copy.deepcopy(base))
    assert isinstance(converted.conv, ct.Conv2d)
    candidate = grads(converted, torch.float32)
    # the conv's bias: BatchNorm removes each channel's mean, so its exact gradient is rounding noise
    assert float(exact["conv.bias"].norm()) < 1e-9 * float(exact["conv.weight"].norm())
    result = compare_gradients(exact, reference, candidate)
    assert result.agree, result.worst
    assert max(r.candidate for r in result.rows) < 1e-4  # float32 rounding, not merely within the tolerance
