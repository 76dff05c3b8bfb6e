"""A float64 NumPy reference for every kernel a `ConvProblem` describes.

Written straight from the definition in docs/algebra.md, with no GEMM decomposition and no
phase splitting, so that it can judge the compiled kernels: per spatial dimension, forward output o reads
input i = o*s + y*d - lo for taps y in [0, R), and reads outside [0, I) are zero padding.

Internally every tensor is permuted to one canonical axis order:
    x, dx: (N, G, C, spatial...)    y, dy: (N, G, K, spatial...)    w, dw: (G, K, C, taps...)
Every tap reads a strided slice of the activation, clipped to the outputs whose reads fall inside it: the zero
padding is never made, so its size (or a huge dilation) costs no memory, and a tap that only sees padding is
skipped.  forward and grad_weight stack the taps' slices and contract over (tap, channel) in one batched matrix
product per group; grad_input places each tap's outputs at the input positions they read (the scatter definition)
and contracts likewise.
The batch is taken in chunks small enough to stay in cache, the chunks spread over the machine's cores.
"""
from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, TypeVar

import ml_dtypes
import numpy as np

from .problem import ConvProblem, activation_axes

A = TypeVar("A")
T = TypeVar("T")

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

# activation values per batch chunk (see _batch_chunks): 2 MB of float64
_CHUNK_ELEMENTS = 1 << 18
# values per chunk of relative_error's sums of squares
_NORM_CHUNK = 1 << 20
# values per independently drawn block of random_inputs
_DRAW_BLOCK = 1 << 20


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
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        raise ValueError(f"relative_error: shapes differ, got {g.shape} and want {w.shape}")
    # sums of squares a chunk at a time (no whole float64 copies of large results), the chunks on every core and
    # added in order
    g, w = g.reshape(-1), w.reshape(-1)

    def sums(chunk: slice) -> tuple[float, float, bool]:
        gc = g[chunk].astype(np.float64)
        finite = bool(np.all(np.isfinite(gc)))
        wc = w[chunk].astype(np.float64, copy=False)
        gc -= wc
        return float(np.dot(gc, gc)), float(np.dot(wc, wc)), finite

    parts = _per_chunk(sums, [slice(i, i + _NORM_CHUNK) for i in range(0, g.size, _NORM_CHUNK)] or [slice(0, 0)])
    if not all(finite for _, _, finite in parts):
        # nan would compare False against any tolerance anyway; inf makes the failure readable.
        return math.inf
    diff_sq = sum(d for d, _, _ in parts)
    want_sq = sum(v for _, v, _ in parts)
    return math.sqrt(diff_sq) / max(math.sqrt(want_sq), float(np.finfo(np.float64).tiny))


def random_inputs(problem: ConvProblem, seed: int = 0) -> list[np.ndarray]:
    """The kernel's arguments (kernel order, shapes `arg_shapes`) drawn uniformly from [-1, 1) in their dtypes.

    Each argument is drawn in blocks of _DRAW_BLOCK values, each block from its own generator spawned from
    `seed`: the values depend on the seed and the shapes only, and the blocks are drawn on all cores."""
    out: list[np.ndarray] = []
    for shape, dtype_name, arg_seed in zip(problem.arg_shapes, problem.arg_dtypes,
                                           np.random.SeedSequence(seed).spawn(len(problem.arg_shapes))):
        dtype = NUMPY_DTYPES[dtype_name]
        a = np.empty(shape, dtype=dtype)
        flat = a.reshape(-1)
        blocks = [slice(i, min(i + _DRAW_BLOCK, flat.size)) for i in range(0, flat.size, _DRAW_BLOCK)]

        def draw(block: slice, block_seed: np.random.SeedSequence, dtype: type = dtype,
                 flat: np.ndarray = flat) -> None:
            # drawn in float32 (half the memory traffic of float64 draws), then rounded to the argument's dtype
            v = np.random.default_rng(block_seed).random(size=block.stop - block.start, dtype=np.float32)
            v *= 2
            v -= 1
            rounded = v.astype(dtype, copy=False)
            # An exact zero (from the draw or from rounding a tiny draw) would let a kernel that skips that
            # element pass unnoticed; replace the rare ones with a value every dtype holds exactly.
            rounded[rounded == 0] = dtype(0.5)
            flat[block] = rounded

        _per_chunk(lambda pair: draw(*pair), list(zip(blocks, arg_seed.spawn(len(blocks)))))
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
    """A float64 copy of `a` in canonical order (weights: small)."""
    return np.array(np.transpose(a, perm), dtype=np.float64, order="C")


def _from_canonical(a: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    # transpose(a, perm) maps layout -> canonical; its inverse permutation maps back.
    return np.ascontiguousarray(np.transpose(a, np.argsort(perm)))


def _chunk64(view: np.ndarray, chunk: slice) -> np.ndarray:
    """A batch chunk of a canonical view (any dtype, any strides) as a contiguous float64 array: activations are
    converted and reordered a chunk at a time, in cache, never as whole float64 copies."""
    return np.array(view[chunk], dtype=np.float64, order="C")


# --- the three ops on canonical views -------------------------------------------------
def _tap_ranges(p: ConvProblem, tap: tuple[int, ...]) -> Optional[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """For one filter tap y: per spatial dim, the outputs o whose read i = o*s + y*d - lo falls inside [0, I), and
    the input indices i they read (a strided slice); None where no output of this tap reads the input.

    Reads outside [0, I) are the zero padding: they are never made, so a huge padding or dilation costs nothing
    and a tap that only sees padding is skipped."""
    outs, ins = [], []
    for y, d, s, o_count, i_count, lo in zip(tap, p.dilation, p.stride, p.output, p.input, p.pad_lo):
        shift = y * d - lo
        first = max(0, -(shift // s))  # the least o with o*s + shift >= 0
        last = min(o_count - 1, (i_count - 1 - shift) // s)  # the greatest o with o*s + shift <= I - 1
        if first > last:
            return None
        outs.append(slice(first, last + 1))
        ins.append(slice(first * s + shift, last * s + shift + 1, s))
    return tuple(outs), tuple(ins)


def _batch_chunks(p: ConvProblem, per_image: int) -> list[slice]:
    """Slices of the batch, each about _CHUNK_ELEMENTS values of `per_image` (the largest per-image array an op
    builds): a chunk's arrays stay in cache across the filter taps (one pass over the whole batch per tap was
    memory-bound)."""
    step = max(1, _CHUNK_ELEMENTS // max(per_image, 1))
    return [slice(n, min(n + step, p.batch)) for n in range(0, p.batch, step)]


def _taps(p: ConvProblem) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(r) for r in p.filter)))


def _per_chunk(work: Callable[[A], T], chunks: Sequence[A]) -> list[T]:
    """`work` on every chunk, on as many threads as the machine has cores, results in chunk order: NumPy's copies,
    ufuncs and matrix products release the GIL, so the chunks run in parallel."""
    if len(chunks) == 1:
        return [work(chunks[0])]
    with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
        return list(pool.map(work, chunks))


def _stacked_weight(p: ConvProblem, w: np.ndarray) -> np.ndarray:
    """The canonical weight (G, K, C, taps...) as (G, K, taps*C), tap-major: the columns of _windows' rows."""
    taps = _taps(p)
    return np.ascontiguousarray(np.stack([w[(Ellipsis,) + t] for t in taps], axis=2)
                                .reshape(p.groups, p.out_channels, len(taps) * p.in_channels))


def _windows(p: ConvProblem, xc: np.ndarray) -> np.ndarray:
    """cols[n, g, (tap, c), o] = x[n, g, c, o*s + tap*d - lo] of a canonical chunk, 0 where that read is padding:
    every tap's strided window stacked, so that one matrix product per (n, g) contracts over all taps and channels
    at once."""
    taps = _taps(p)
    cols = np.zeros((xc.shape[0], p.groups, len(taps), p.in_channels, *p.output), dtype=np.float64)
    everything = (slice(None),) * 3
    for i, tap in enumerate(taps):
        ranges = _tap_ranges(p, tap)
        if ranges is not None:
            cols[:, :, i][everything + ranges[0]] = xc[everything + ranges[1]]
    return cols.reshape(xc.shape[0], p.groups, len(taps) * p.in_channels, math.prod(p.output))


def _forward(p: ConvProblem, x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
    """y[n,g,k,o] = sum_{c,y} x[n,g,c,o*s+y*d-lo] * w[g,k,c,y]: w as (G, K, taps*C) @ the stacked windows
    (G, taps*C, O).  x, y: canonical views (y is written); w: canonical float64."""
    wcat = _stacked_weight(p, w)
    per_image = p.groups * p.in_channels * max(math.prod(p.input), len(_taps(p)) * math.prod(p.output))

    def chunk_result(chunk: slice) -> None:
        y[chunk] = np.matmul(wcat, _windows(p, _chunk64(x, chunk))).reshape(-1, p.groups, p.out_channels, *p.output)

    _per_chunk(chunk_result, _batch_chunks(p, per_image))


def _grad_input(p: ConvProblem, dy: np.ndarray, w: np.ndarray, dx: np.ndarray) -> None:
    """dx[i] = sum over (o, y) with o*s + y*d - lo = i of dy[o] * w[y], the scatter definition: per tap y, dy's
    outputs that read the input (_tap_ranges) are placed at the input positions they read (distinct for one tap:
    o -> o*s + y*d - lo is one-to-one), and one matrix product per (n, g) contracts the stacked taps with w as
    (G, C, taps*K).  dy, dx: canonical views (dx is written); w: canonical float64."""
    g, k, c = p.groups, p.out_channels, p.in_channels
    taps = _taps(p)
    wt = np.ascontiguousarray(np.stack([np.swapaxes(w[(Ellipsis,) + t], 1, 2) for t in taps], axis=2)
                              .reshape(g, c, len(taps) * k))
    ranges = [_tap_ranges(p, t) for t in taps]
    everything = (slice(None),) * 3

    def chunk_result(chunk: slice) -> None:
        dyc = _chunk64(dy, chunk)
        cols = np.zeros((dyc.shape[0], g, len(taps), k, *p.input), dtype=np.float64)
        for j, tap_range in enumerate(ranges):
            if tap_range is not None:
                cols[:, :, j][everything + tap_range[1]] = dyc[everything + tap_range[0]]
        dx[chunk] = np.matmul(wt, cols.reshape(dyc.shape[0], g, len(taps) * k, -1)).reshape(-1, g, c, *p.input)

    per_image = g * max(k * math.prod(p.output), len(taps) * k * math.prod(p.input))
    _per_chunk(chunk_result, _batch_chunks(p, per_image))


def _grad_weight(p: ConvProblem, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dw[g,k,c,y] = sum_{n,o} x[n,g,c,o*s+y*d-lo] * dy[n,g,k,o]: dy (G, K, O) @ the stacked windows transposed
    (G, O, taps*C), summed over the batch (chunk partials added in batch order).  x, dy: canonical views; the
    result is canonical float64."""
    g, k, c, positions = p.groups, p.out_channels, p.in_channels, math.prod(p.output)
    per_image = g * max(c * math.prod(p.input), (len(_taps(p)) * c + k) * positions)

    def chunk_partial(chunk: slice) -> np.ndarray:
        dyc = _chunk64(dy, chunk).reshape(-1, g, k, positions)
        return np.matmul(dyc, np.swapaxes(_windows(p, _chunk64(x, chunk)), 2, 3)).sum(axis=0)  # (G, K, taps*C)

    stacked = sum(_per_chunk(chunk_partial, _batch_chunks(p, per_image)))
    # (G, K, (taps, C)) -> (G, K, C, taps...)
    dw = stacked.reshape(g, k, *p.filter, c)
    return np.ascontiguousarray(np.moveaxis(dw, -1, 2))


# --- public entry point ----------------------------------------------------------------------------
def reference(problem: ConvProblem, *args: np.ndarray) -> np.ndarray:
    """The float64 result of `problem`'s kernel on `args` (kernel order), in the result's layout.

    forward(x, w) -> y; grad_input(dy, w) -> dx; grad_weight(x, dy) -> dw; transposed(x, w) -> y, where
    transposed is grad_input's arithmetic with x (of y_shape) in dy's place.  A bilinear epilogue takes D
    (result shape) last.  With fp8 `problem.compute`, operand A (first) and B (second) are first rounded to
    their 8-bit compute types; compute = "bf16x3" and "tf32" approximate f32, so their reference is the plain f32
    one (tolerance() allows for them).  The epilogue is applied in float64 and the output is not rounded.  A
    prologue's `saved` follows the two operands: dY * act'(saved) is formed in float64 and rounded to dY's dtype,
    as the kernel's operand is; fused epilogue steps follow the head in order (their tensors by argument name).
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
        arrays.append(a)  # in its own dtype: the ops convert to float64 a batch chunk at a time

    a_op, b_op = arrays[0], arrays[1]
    named = dict(zip(p.arg_names, arrays))
    if p.prologue.kind != "none":
        # dY * act'(saved), rounded to dY's dtype as the kernel's operand is (torch's activation backward returns it
        # in that dtype); the products of the convolution then run on those values in float64
        dy = activation_backward(p.prologue.activation, named["dy"], named["saved"])
        rounded = dy.astype(named["dy"].dtype)
        a_op, b_op = (rounded, b_op) if p.op == "grad_input" else (a_op, rounded)
    if p.fp8_compute:
        a_op = round_to_compute(a_op, p.compute[0])
        b_op = round_to_compute(b_op, p.compute[1])

    act = _activation_perm(p.layout, p.dims)
    wgt = _weight_perm(p.weight_layout, p.dims)
    if p.op in ("forward", "grad_input", "transposed"):
        # the result is written through its canonical view, so it comes out in the layout without a copy
        conv = np.empty(p.result_shape, dtype=np.float64)
        op = _forward if p.op == "forward" else _grad_input
        op(p, np.transpose(a_op, act), _to_canonical(b_op, wgt), np.transpose(conv, act))
    elif p.op == "grad_weight":
        conv = _from_canonical(_grad_weight(p, np.transpose(a_op, act), np.transpose(b_op, act)), wgt)
    else:  # ConvProblem validates op; this guards against a new op added there but not here
        raise ValueError(f"op: unknown {p.op!r}")

    ep = p.epilogue
    if ep.kind == "none" and not ep.steps:
        return conv
    out = ep.alpha * conv if ep.kind != "none" else conv
    if ep.kind == "bilinear":
        out = out + ep.beta * named["d"].astype(np.float64)
    if ep.steps:
        out = _steps(p, out, named)
    return out


# --- fused epilogue steps and prologues, as torch computes them (convdsl/passes/fused.py in MLIR) ------------
_erf = np.vectorize(math.erf, otypes=[np.float64])  # NumPy has no erf; math.erf is exact to a few ulps


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """act(x) in float64: relu, silu, gelu (exact erf), gelu_tanh (torch's approximate='tanh') or hardswish."""
    x = np.asarray(x, dtype=np.float64)
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "hardswish":
        return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0
    raise ValueError(f"activation: unknown {name!r}")


def activation_backward(name: str, grad: np.ndarray, saved: np.ndarray) -> np.ndarray:
    """grad * act'(x) in float64; `saved` is relu's output (torch's threshold_backward masks by it) or the other
    activations' input x."""
    g, x = np.asarray(grad, dtype=np.float64), np.asarray(saved, dtype=np.float64)
    if name == "relu":
        return np.where(x > 0.0, g, 0.0)
    if name == "silu":
        s = 1.0 / (1.0 + np.exp(-x))
        return g * s * (1.0 + x * (1.0 - s))
    if name == "gelu":
        return g * (0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))
    if name == "gelu_tanh":
        beta = math.sqrt(2.0 / math.pi)
        t = np.tanh(beta * (x + 0.044715 * x ** 3))
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * beta * (1.0 + 3 * 0.044715 * x * x))
    if name == "hardswish":
        return np.where(x <= -3.0, 0.0, np.where(x < 3.0, g * (x / 3.0 + 0.5), g))  # torch's ends
    raise ValueError(f"activation_backward: unknown {name!r}")


def _steps(p: ConvProblem, out: np.ndarray, named: dict) -> np.ndarray:
    """The epilogue's fused steps in order on the float64 result; per-channel vectors (G, channels) broadcast along
    the result's G and channel axes."""
    axes = activation_axes(p, "ch")

    def per_channel(name: str) -> np.ndarray:
        v = named[name].astype(np.float64)
        shape = [1] * len(axes)
        shape[axes.index("g")], shape[axes.index("ch")] = v.shape
        # G comes before the channel axis in every layout, so (G, channels) reshapes without a transpose
        return v.reshape(shape)

    for step in p.epilogue.steps:
        if step == "bias":
            out = out + per_channel("bias")
        elif step == "affine":
            out = out * per_channel("scale") + per_channel("shift")
        elif step == "residual":
            out = out + named["residual"].astype(np.float64)
        else:
            out = activation(step, out)
    return out
