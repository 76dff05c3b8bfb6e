"""Numerical range on the CPU (the linalg forms): 16-bit inputs of large magnitude sum in f32 without overflow
in partial sums, and NaN and Inf in an input reach exactly the outputs that depend on it.  The same on the
GPU's kernels: tests/test_torch_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")
BASE = ConvProblem(op="grad_input", dims=2, groups=2, batch=2, in_channels=64, out_channels=64, input=(9, 8),
                   filter=(3, 3), stride=(2, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16",
                   name="k")
# grad_input strided (stride phases), grad_weight split into chunks, forward, bf16 too
PROBLEMS = [BASE, BASE.with_(op="grad_weight", split_k=2, out_dtype="f32"), BASE.with_(op="forward"),
            BASE.with_(dtype="bf16")]


def _call(p: ConvProblem, inputs: list[np.ndarray]) -> np.ndarray:
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    return np.asarray(module.call(p.name, *inputs, out_dtype=p.result_dtype), dtype=np.float64)


def large_inputs(p: ConvProblem, keep_second_half: bool = True) -> list[np.ndarray]:
    """Operand A near 600 everywhere, operand B +-1 with one sign per half of the reduction (plus small noise):
    sums over the first half pass 65504 (f16's largest) before the second half takes them back down.
    keep_second_half=False zeroes operand B's second half (the partial sum the kernel passes through)."""
    a, b = random_inputs(p, seed=1)
    a = (600.0 + a.astype(np.float32)).astype(a.dtype)
    if p.op == "grad_weight":  # dW = sum over positions of dY x X: both operands large, signs alternating by image
        sign = np.where(np.arange(p.batch) % 2 == 0, 1.0, -1.0 if keep_second_half else 0.0)
        b = (sign.reshape((-1,) + (1,) * (b.ndim - 1)) * (600.0 + b.astype(np.float32))).astype(b.dtype)
    else:  # W's reduced channels (K for grad_input, C for forward): the first half +1, the second -1
        assert p.weight_layout == "GKYXC"
        axis = 1 if p.op == "grad_input" else b.ndim - 1
        half = b.shape[axis] // 2
        sign = np.where(np.arange(b.shape[axis]) < half, 1.0, -1.0 if keep_second_half else 0.0)
        shape = [1] * b.ndim
        shape[axis] = b.shape[axis]
        b = (sign.reshape(shape) * (1.0 + 0.01 * b.astype(np.float32))).astype(b.dtype)
    return [a, b]


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"{p.op}-{p.dtype}")
def test_large_magnitudes_sum_in_f32(p):
    inputs = large_inputs(p)
    assert np.abs(reference(p, *large_inputs(p, keep_second_half=False))).max() > 65504
    want = reference(p, *inputs)
    got = _call(p, inputs)
    assert np.all(np.isfinite(got)), "a partial sum overflowed"
    # the operands' own rounding to 16 bits is in both; what is left is the sums' rounding
    assert relative_error(got, want) <= tolerance(p)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("p", PROBLEMS[:3], ids=lambda p: p.op)
def test_nan_and_inf_reach_exactly_the_outputs_that_depend_on_them(p, value):
    inputs = random_inputs(p, seed=2)
    a = inputs[0].copy()  # an activation: dY for grad_input, X for grad_weight and forward
    a.reshape(-1)[a.size // 2 + 3] = value
    inputs = [a, inputs[1]]
    want = reference(p, *inputs)
    got = _call(p, inputs)
    assert np.isnan(want).any() or np.isinf(want).any()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isposinf(got), np.isposinf(want)) and np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert relative_error(got[finite], want[finite]) <= tolerance(p)
