"""The scalar arithmetic of the fused forms, emitted inside linalg.generic bodies (f32 values in, f32 out).

Epilogue steps (problem.EPILOGUE_STEPS) act on the convolution's f32 result before the output cast; a prologue
(problem.Prologue) multiplies dY by the activation's derivative as grad_input / grad_weight read it.  The
formulas are torch's (aten's CPU and CUDA kernels), so that a fused kernel computes what the unfused torch.nn
sequence computes: relu's backward masks by the saved output, the others differentiate at the saved input, and
GELU's tanh form uses torch's constants.  convdsl/reference.py holds the same formulas in float64.
"""
from __future__ import annotations

import math
from typing import Mapping

from iree.compiler import ir
from iree.compiler.dialects import arith, math as math_d

from .ir import float_const

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # GELU tanh form: tanh(sqrt(2/pi) * (x + 0.044715 x^3))
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _c(value: float) -> ir.Value:
    return float_const(value, ir.F32Type.get())


def _sigmoid(x: ir.Value) -> ir.Value:
    return arith.divf(_c(1.0), arith.addf(_c(1.0), math_d.exp(arith.negf(x))))


def _gelu_tanh_inner(x: ir.Value) -> ir.Value:
    """tanh(sqrt(2/pi) * (x + 0.044715 x^3))."""
    cube = arith.mulf(arith.mulf(x, x), x)
    return math_d.tanh(arith.mulf(_c(_SQRT_2_OVER_PI), arith.addf(x, arith.mulf(_c(_GELU_CUBIC), cube))))


def activation(name: str, x: ir.Value) -> ir.Value:
    """act(x) for an f32 scalar, as torch.nn computes it."""
    if name == "relu":
        return arith.maximumf(x, _c(0.0))  # NaN propagates, as torch.relu's
    if name == "silu":
        return arith.mulf(x, _sigmoid(x))
    if name == "gelu":  # 0.5 x (1 + erf(x / sqrt 2))
        return arith.mulf(arith.mulf(_c(0.5), x), arith.addf(_c(1.0), math_d.erf(arith.mulf(x, _c(_INV_SQRT_2)))))
    if name == "gelu_tanh":
        return arith.mulf(arith.mulf(_c(0.5), x), arith.addf(_c(1.0), _gelu_tanh_inner(x)))
    if name == "hardswish":  # x * clamp(x + 3, 0, 6) / 6
        relu6 = arith.minimumf(arith.maximumf(arith.addf(x, _c(3.0)), _c(0.0)), _c(6.0))
        return arith.divf(arith.mulf(x, relu6), _c(6.0))
    raise ValueError(f"activation: unknown {name!r}")


def activation_backward(name: str, grad: ir.Value, saved: ir.Value) -> ir.Value:
    """grad * act'(x) for f32 scalars; `saved` is relu's output, or the other activations' input x."""
    zero = _c(0.0)
    if name == "relu":  # threshold_backward: grad where the output is positive
        return arith.select(arith.cmpf(arith.CmpFPredicate.OGT, saved, zero), grad, zero)
    x = saved
    if name == "silu":  # s (1 + x (1 - s)), s = sigmoid(x)
        s = _sigmoid(x)
        return arith.mulf(grad, arith.mulf(s, arith.addf(_c(1.0), arith.mulf(x, arith.subf(_c(1.0), s)))))
    if name == "gelu":  # Phi(x) + x phi(x)
        cdf = arith.mulf(_c(0.5), arith.addf(_c(1.0), math_d.erf(arith.mulf(x, _c(_INV_SQRT_2)))))
        pdf = arith.mulf(_c(_INV_SQRT_2PI), math_d.exp(arith.mulf(_c(-0.5), arith.mulf(x, x))))
        return arith.mulf(grad, arith.addf(cdf, arith.mulf(x, pdf)))
    if name == "gelu_tanh":  # 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        t = _gelu_tanh_inner(x)
        left = arith.mulf(_c(0.5), arith.addf(_c(1.0), t))
        slope = arith.mulf(_c(_SQRT_2_OVER_PI), arith.addf(_c(1.0), arith.mulf(_c(3 * _GELU_CUBIC), arith.mulf(x, x))))
        right = arith.mulf(arith.mulf(arith.mulf(_c(0.5), x), arith.subf(_c(1.0), arith.mulf(t, t))), slope)
        return arith.mulf(grad, arith.addf(left, right))
    if name == "hardswish":  # 0 up to -3, x/3 + 1/2 strictly between, 1 from 3 on (torch's ends)
        mid = arith.mulf(grad, arith.addf(arith.divf(x, _c(3.0)), _c(0.5)))
        above = arith.select(arith.cmpf(arith.CmpFPredicate.OLT, x, _c(3.0)), mid, grad)
        return arith.select(arith.cmpf(arith.CmpFPredicate.OLE, x, _c(-3.0)), zero, above)
    raise ValueError(f"activation_backward: unknown {name!r}")


def step(name: str, v: ir.Value, elems: Mapping[str, ir.Value]) -> ir.Value:
    """One epilogue step on the f32 value `v`; `elems` are the f32 elements of the step's tensors by name."""
    if name == "bias":
        return arith.addf(v, elems["bias"])
    if name == "affine":
        return arith.addf(arith.mulf(v, elems["scale"]), elems["shift"])
    if name == "residual":
        return arith.addf(v, elems["residual"])
    return activation(name, v)
