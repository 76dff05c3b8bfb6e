"""A float64 NumPy reference for every kernel a `ConvProblem` describes.

Written straight from the definition in docs/algebra.md, with no GEMM decomposition and no
phase splitting, so that it can judge the compiled kernels: per spatial dimension, forward output o reads
input i = o*s + y*d - lo for taps y in [0, R), and reads outside [0, I) are zero padding.

Internally every tensor is permuted to one canonical axis order:
    x, dx: (N, G, C, spatial...)    y, dy: (N, G, K, spatial...)    w, dw: (G, K, C, taps...)
Each op is a loop over the filter taps (prod(R) iterations, small) of one einsum over a strided slice of an
explicitly zero-padded activation; the padding makes every slice in range, so no index is clipped by hand.
"""
from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np

from .problem import ConvProblem

NUMPY_DTYPES: dict[str, type] = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# fp8 = e4m3 (finite-only "fn" variant, max 448), bf8 = e5m2, as in CK.
COMPUTE_DTYPES: dict[str, type] = {"fp8": ml_dtypes.float8_e4m3fn, "bf8": ml_dtypes.float8_e5m2}

# Norm-wise relative error allowed per dtype; f32 accumulation error grows slowly enough with the
# reduction length that 1e-5 holds for the sizes we test.
TOLERANCE: dict[str, float] = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}
COMPUTE_TOLERANCE = 1e-1
# compute = "bf16x3": the plain f32 convolution, computed from bf16 hi/lo pairs (three bf16 products per
# product, lo*lo dropped): ~2^-16 per product; measured 3e-6 .. 4.2e-6 on llvm-cpu (tests/test_bf16x3.py)
BF16X3_TOLERANCE = 1e-4
# compute = "tf32": operands rounded to 11 significant bits (unit roundoff 2^-11 = 4.9e-4 per operand), f32
# sums; the norm-wise error of a sum of such products stays near 1e-3 (random signs), so 5e-3 holds
TF32_TOLERANCE = 5e-3

# einsum letters for the spatial axes; up to 3 dims.
_SPATIAL = "DHW"
_TAPS = "ZYX"


# --- dtype helpers -------------------------------------------------------------------------------
def round_to_compute(a: np.ndarray, kind: str) -> np.ndarray:
    """Round `a` to the 8-bit compute type `kind` ("fp8" = e4m3fn, "bf8" = e5m2) and return it as float64.

    The rounding is ml_dtypes' round-to-nearest-even cast; values past the type's range become nan (e4m3fn)
    or inf (e5m2), which a comparison then rejects rather than hides.
    """
    if kind not in COMPUTE_DTYPES:
        raise ValueError(f"compute type: expected one of {', '.join(COMPUTE_DTYPES)}, got {kind!r}")
    return np.asarray(a, dtype=np.float64).astype(COMPUTE_DTYPES[kind]).astype(np.float64)


def tolerance(problem: ConvProblem) -> float:
    """The norm-wise relative error a kernel's result may have against `reference`."""
    if problem.bf16x3:
        return max(BF16X3_TOLERANCE, TOLERANCE[problem.result_dtype])
    if problem.tf32:
        return max(TF32_TOLERANCE, TOLERANCE[problem.result_dtype])
    if problem.compute is not None:
        return COMPUTE_TOLERANCE
    return max(TOLERANCE[problem.dtype], TOLERANCE[problem.result_dtype])


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want||_2 / max(||want||_2, tiny), in float64; inf if `got` is not finite."""
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if g.shape != w.shape:
        raise ValueError(f"relative_error: shapes differ, got {g.shape} and want {w.shape}")
    if not np.all(np.isfinite(g)):
        # nan would compare False against any tolerance anyway; inf makes the failure readable.
        return math.inf
    denom = max(float(np.linalg.norm(w.ravel())), float(np.finfo(np.float64).tiny))
    return float(np.linalg.norm((g - w).ravel())) / denom


def random_inputs(problem: ConvProblem, seed: int = 0) -> list[np.ndarray]:
    """The kernel's arguments (kernel order, shapes `arg_shapes`) drawn uniformly from [-1, 1) in their dtypes."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for shape, dtype_name in zip(problem.arg_shapes, problem.arg_dtypes):
        dtype = NUMPY_DTYPES[dtype_name]
        a = rng.uniform(-1.0, 1.0, size=shape).astype(dtype)
        # An exact zero (from the draw or from rounding a tiny draw) would let a kernel that skips that
        # element pass unnoticed; replace the rare ones with a value every dtype holds exactly.
        a[a == 0] = dtype(0.5)
        out.append(a)
    return out


# --- layouts ---------------------------------------------------------------------------------------
def _activation_perm(layout: str, dims: int) -> tuple[int, ...]:
    """Axes of a layout-ordered activation that give (N, G, C, spatial...)."""
    sp = tuple(range(dims))
    if layout == "NHWGC":  # (N, sp..., G, C)
        return (0, dims + 1, dims + 2) + tuple(1 + i for i in sp)
    if layout == "GNHWC":  # (G, N, sp..., C)
        return (1, 0, dims + 2) + tuple(2 + i for i in sp)
    if layout == "NGCHW":  # already canonical
        return tuple(range(dims + 3))
    raise ValueError(f"layout: unknown {layout!r}")


def _weight_perm(weight_layout: str, dims: int) -> tuple[int, ...]:
    """Axes of a layout-ordered weight that give (G, K, C, taps...)."""
    if weight_layout == "GKYXC":  # (G, K, taps..., C)
        return (0, 1, dims + 2) + tuple(2 + i for i in range(dims))
    if weight_layout == "GKCYX":
        return tuple(range(dims + 3))
    raise ValueError(f"weight_layout: unknown {weight_layout!r}")


def _to_canonical(a: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(a, perm))


def _from_canonical(a: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    # transpose(a, perm) maps layout -> canonical; its inverse permutation maps back.
    return np.ascontiguousarray(np.transpose(a, np.argsort(perm)))


# --- the three ops on canonical float64 tensors -------------------------------------------------
def _tap_slices(p: ConvProblem, tap: tuple[int, ...]) -> tuple[slice, ...]:
    """For one filter tap y, the padded-input indices o*s + y*d (o in [0, O)) of every spatial dim."""
    return tuple(
        slice(y * d, y * d + (o - 1) * s + 1, s)
        for y, d, s, o in zip(tap, p.dilation, p.stride, p.output)
    )


def _padded_spatial(p: ConvProblem) -> tuple[int, ...]:
    return tuple(i + lo + hi for i, lo, hi in zip(p.input, p.pad_lo, p.pad_hi))


def _crop(p: ConvProblem) -> tuple[slice, ...]:
    return tuple(slice(lo, lo + i) for lo, i in zip(p.pad_lo, p.input))


def _forward(p: ConvProblem, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y[n,g,k,o] = sum_{c,y} x[n,g,c,o*s+y*d-lo] * w[g,k,c,y]."""
    sp = _SPATIAL[: p.dims]
    pad = [(0, 0)] * 3 + list(zip(p.pad_lo, p.pad_hi))
    xp = np.pad(x, pad)  # zeros stand in for the out-of-range reads
    y = np.zeros((p.batch, p.groups, p.out_channels, *p.output), dtype=np.float64)
    spec = f"ngc{sp},gkc->ngk{sp}"
    for tap in itertools.product(*(range(r) for r in p.filter)):
        xs = xp[(slice(None),) * 3 + _tap_slices(p, tap)]
        y += np.einsum(spec, xs, w[(Ellipsis,) + tap])
    return y


def _grad_input(p: ConvProblem, dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dx[i] = sum over (o, y) with o*s + y*d - lo = i of dy[o] * w[y]: scatter-add per tap, then crop."""
    sp = _SPATIAL[: p.dims]
    # The padded buffer holds every index o*s + y*d; those landing in the padding are the reads forward
    # would have zero-filled, so they are dropped by the crop.
    dxp = np.zeros((p.batch, p.groups, p.in_channels, *_padded_spatial(p)), dtype=np.float64)
    spec = f"ngk{sp},gkc->ngc{sp}"
    for tap in itertools.product(*(range(r) for r in p.filter)):
        # Within one tap the strided slice hits distinct indices, so += does not lose colliding updates.
        dxp[(slice(None),) * 3 + _tap_slices(p, tap)] += np.einsum(spec, dy, w[(Ellipsis,) + tap])
    return np.ascontiguousarray(dxp[(slice(None),) * 3 + _crop(p)])


def _grad_weight(p: ConvProblem, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dw[g,k,c,y] = sum_{n,o} x[n,g,c,o*s+y*d-lo] * dy[n,g,k,o]."""
    sp = _SPATIAL[: p.dims]
    pad = [(0, 0)] * 3 + list(zip(p.pad_lo, p.pad_hi))
    xp = np.pad(x, pad)
    dw = np.zeros((p.groups, p.out_channels, p.in_channels, *p.filter), dtype=np.float64)
    spec = f"ngc{sp},ngk{sp}->gkc"
    for tap in itertools.product(*(range(r) for r in p.filter)):
        xs = xp[(slice(None),) * 3 + _tap_slices(p, tap)]
        dw[(Ellipsis,) + tap] = np.einsum(spec, xs, dy)
    return dw


# --- public entry point ----------------------------------------------------------------------------
def reference(problem: ConvProblem, *args: np.ndarray) -> np.ndarray:
    """The float64 result of `problem`'s kernel on `args` (kernel order), in the result's layout.

    forward(x, w) -> y; grad_input(dy, w) -> dx; grad_weight(x, dy) -> dw; transposed(x, w) -> y, where
    transposed is grad_input's arithmetic with x (of y_shape) in dy's place.  A bilinear epilogue takes D
    (result shape) last.  With fp8 `problem.compute`, operand A (first) and B (second) are first rounded to
    their 8-bit compute types; compute = "bf16x3" and "tf32" approximate f32, so their reference is the plain f32
    one (tolerance() allows for them).  The epilogue is applied in float64 and the output is not rounded.
    """
    p = problem
    expected = p.arg_shapes
    if len(args) != len(expected):
        raise ValueError(f"{p.op}: expected {len(expected)} arguments {p.arg_names}, got {len(args)}")
    arrays: list[np.ndarray] = []
    for name, a, shape in zip(p.arg_names, args, expected):
        a = np.asarray(a)
        if a.shape != tuple(shape):
            raise ValueError(f"{p.op}: argument {name} has shape {a.shape}, expected {tuple(shape)}")
        arrays.append(a.astype(np.float64))

    a_op, b_op = arrays[0], arrays[1]
    if p.fp8_compute:
        a_op = round_to_compute(a_op, p.compute[0])
        b_op = round_to_compute(b_op, p.compute[1])

    act = _activation_perm(p.layout, p.dims)
    wgt = _weight_perm(p.weight_layout, p.dims)
    if p.op == "forward":
        conv = _from_canonical(_forward(p, _to_canonical(a_op, act), _to_canonical(b_op, wgt)), act)
    elif p.op in ("grad_input", "transposed"):
        conv = _from_canonical(_grad_input(p, _to_canonical(a_op, act), _to_canonical(b_op, wgt)), act)
    elif p.op == "grad_weight":
        conv = _from_canonical(_grad_weight(p, _to_canonical(a_op, act), _to_canonical(b_op, act)), wgt)
    else:  # ConvProblem validates op; this guards against a new op added there but not here
        raise ValueError(f"op: unknown {p.op!r}")

    ep = p.epilogue
    if ep.kind == "none":
        return conv
    out = ep.alpha * conv
    if ep.kind == "bilinear":
        out = out + ep.beta * arrays[2]
    return out
