"""Gather forms for grouped convolutions with few channels per group (depthwise, ResNeXt-style).

With C*K small a gradient is bound by memory, not by matrix units: the implicit-GEMM forms give IREE
a contraction with tiny K/C loops and a zero-padded copy of the image, and it tiles them into
32-thread workgroups of scalar work (mbv2_dw_dgrad: 1.2 ms on an H200 where cuDNN takes 0.09 ms).
Here every output element is computed by one all-parallel (grad_input) or parallel-then-short-
reduction (grad_weight) generic whose body reads the other operand by `tensor.extract` at computed
positions, with out-of-range taps masked to zero instead of a padded copy: one dispatch reads each
input once from memory (the taps' re-reads hit the caches), and IREE vectorises it along the
channels (measured 2.5x to 4x faster than the GEMM forms: benchmarks/README.md).

Index algebra (per spatial dim i; forward Y[o] = sum_t X[o*s + t*d - lo] * W[t]):
  grad_input   dX[h] = sum_{t, k} dY[q] * W[t],  q = (h + lo - t*d) / s  where the division is exact
               and 0 <= q < O; other taps contribute nothing (no zero insertion, no multiply by zero:
               the masked value is a select, its product is never formed for a missing tap's data).
  grad_weight  dW[t] = sum_{n, o} X[o*s + t*d - lo] * dY[o],  X read as zero outside [0, I).
               The reduction over (n, o0) is cut into N*B row blocks (o0 = b*R + r): P[n, b, w...] are
               f32 partial sums, and one more generic adds them in (n, b) order (deterministic).
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor

from ..problem import ConvProblem
from .ir import (
    PARALLEL,
    REDUCTION,
    Space,
    activation_axes,
    elem_of,
    empty,
    generic,
    multiply_add,
    permute,
    split_axis,
    tensor_type,
    weight_axes,
    zeros,
)

# --- scalar helpers inside a generic body ---------------------------------------------------------
def _index(value: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), value).result


def _in_range(i: ir.Value, size: int) -> ir.Value:
    """0 <= i < size, for a signed index i."""
    lo = arith.cmpi(arith.CmpIPredicate.sge, i, _index(0))
    hi = arith.cmpi(arith.CmpIPredicate.slt, i, _index(size))
    return arith.andi(lo, hi)


def _clamp(i: ir.Value, size: int) -> ir.Value:
    """i clamped to [0, size): the position read for a masked tap (any in-bounds one will do)."""
    return arith.minsi(arith.maxsi(i, _index(0)), _index(size - 1))


def _masked_read(source: ir.Value, coords: list[ir.Value], valid: Optional[ir.Value]) -> ir.Value:
    value = tensor.extract(source, coords)
    if valid is None:
        return value
    zero = arith.ConstantOp(value.type, ir.FloatAttr.get(value.type, 0.0)).result
    return arith.select(valid, value, zero)


def _and(a: Optional[ir.Value], b: Optional[ir.Value]) -> Optional[ir.Value]:
    return b if a is None else a if b is None else arith.andi(a, b)


# --- grad_input and forward: one all-parallel generic of masked reads per output element ---------------
# Per spatial dim i and tap t, `reach` gives the position the output element reads in the other operand and whether
# it is there (None: always); the output element sums the taps' reads times the weight slices of (tap, channel).
Reach = Callable[[int, int, ir.Value], tuple[ir.Value, Optional[ir.Value]]]


def _sum_of_taps(p: ConvProblem, source: ir.Value, w: ir.Value, fixed: str, reach: Reach,
                 epilogue: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """out[n, o.., g, ch] = sum over (tap, j) of source[n, reach(tap).., g, j] * W(tap, j)[g, ch], `fixed` naming W's
    channel axis that j runs over (grad_input: k, forward: c).  The output shares the source's layout."""
    axes = activation_axes(p, "ch")
    # one [G, n] weight operand per (tap, j), read through plain (g, ch) maps, which IREE vectorises
    slices, keys = _weight_slices(p, w, fixed)
    space = Space([(a, PARALLEL) for a in axes])
    w_map = space.access(["g", "ch"], {"g": space["g"], "ch": space["ch"]})
    out_map = space.access(axes, {a: space[a] for a in axes})
    f32 = ir.F32Type.get()

    def body(*elems: ir.Value) -> ir.Value:
        loop = {a: linalg.IndexOp(i).result for i, a in enumerate(axes)}
        reached = {(i, ti): reach(i, ti, loop[f"sp{i}"]) for i in range(p.dims) for ti in range(p.filter[i])}
        acc = arith.ConstantOp(f32, ir.FloatAttr.get(f32, 0.0)).result
        for (tap, j), w_elem in zip(keys, elems[:-1]):
            valid = None
            coords = {"n": loop["n"], "g": loop["g"], "ch": _index(j)}
            for i, ti in enumerate(tap):
                coords[f"sp{i}"], ok = reached[(i, ti)]
                valid = _and(valid, ok)
            acc = multiply_add(_masked_read(source, [coords[a] for a in axes], valid), w_elem, acc)
        return acc

    out_shape = list(p.x_shape if fixed == "k" else p.y_shape)
    acc = generic(space, slices, empty(out_shape, f32), [w_map] * len(slices) + [out_map], body)
    return epilogue(acc)


def grad_input(p: ConvProblem, dy: ir.Value, w: ir.Value, epilogue: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """dX by one all-parallel generic: each output element h gathers its taps' dY values,
    dY[q] with q = (h + lo - t*d) / s where the division is exact and 0 <= q < O."""

    def reach(i: int, ti: int, h: ir.Value) -> tuple[ir.Value, Optional[ir.Value]]:
        s, d, lo, o = p.stride[i], p.dilation[i], p.pad_lo[i], p.output[i]
        num = arith.addi(h, _index(lo - ti * d))  # h + lo - t*d
        valid = _in_range(num, (o - 1) * s + 1)
        clamped = _clamp(num, (o - 1) * s + 1)
        if s > 1:
            valid = arith.andi(valid, arith.cmpi(arith.CmpIPredicate.eq, arith.remui(clamped, _index(s)), _index(0)))
            clamped = arith.divui(clamped, _index(s))
        return clamped, valid

    return _sum_of_taps(p, dy, w, "k", reach, epilogue)


def forward(p: ConvProblem, x: ir.Value, w: ir.Value, epilogue: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """Y by one all-parallel generic: each output element o gathers its taps' X values, X[o*s + t*d - lo], zero
    outside [0, I)."""

    def reach(i: int, ti: int, o: ir.Value) -> tuple[ir.Value, Optional[ir.Value]]:
        pos = arith.addi(arith.muli(o, _index(p.stride[i])), _index(ti * p.dilation[i] - p.pad_lo[i]))
        return _clamp(pos, p.input[i]), _in_range(pos, p.input[i])

    return _sum_of_taps(p, x, w, "c", reach, epilogue)


def _taps(p: ConvProblem) -> list[tuple[int, ...]]:
    """Every filter tap as a tuple of per-dim indices, in row-major order."""
    return list(itertools.product(*(range(r) for r in p.filter)))


def _weight_slices(p: ConvProblem, w: ir.Value, fixed: str) -> tuple[list[ir.Value], list[tuple]]:
    """W cut into one [G, n] slice per (tap, index of the `fixed` channel axis): fixed = "k" gives W[:, k, tap, :]
    as [G, C] (grad_input), fixed = "c" W[:, :, tap, c] as [G, K] (forward); with the keys (tap, index).

    The slices are cut from a copy of W as [taps.., fixed, G, other], where each is contiguous: slices of W itself
    are strided wherever the other channel axis is not innermost (C in GKYXC for forward, every GKCYX slice), and
    ran several times slower (docs/decisions.md#cpu-gather-forward)."""
    other = "c" if fixed == "k" else "k"
    copy_axes = [*[f"t{i}" for i in range(p.dims)], fixed, "g", other]
    copy = permute(w, weight_axes(p), copy_axes)
    size = dict(zip(weight_axes(p), p.w_shape))
    slices, keys = [], []
    for tap in _taps(p):
        for index in range(size[fixed]):
            slices.append(tensor.extract_slice(
                tensor_type([p.groups, size[other]], elem_of(w)), copy, [], [], [], [*tap, index, 0, 0],
                [1] * (p.dims + 1) + [p.groups, size[other]], [1] * len(copy_axes)))
            keys.append((tap, index))
    return slices, keys


# --- grad_weight ---------------------------------------------------------------------------------
def grad_weight(p: ConvProblem, x: ir.Value, dy: ir.Value, blocks: int,
                epilogue: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """dW by f32 partial sums over `blocks` row blocks (the plan's row_blocks), X gathered per tap,
    then an in-order sum of the blocks."""
    x_axes = dy_axes = activation_axes(p, "ch")
    w_axes = weight_axes(p)
    rows = p.output[0] // blocks
    # dY viewed with its first spatial axis as (b, r): o0 = b*R + r (tensor.expand_shape, no copy)
    sp0 = dy_axes.index("sp0")
    dy_blocked_axes = dy_axes[:sp0] + ["b", "r"] + dy_axes[sp0 + 1:]
    dy_blocked = split_axis(dy, sp0, blocks)
    rest = [f"sp{i}" for i in range(1, p.dims)]
    space = Space(
        [("n", PARALLEL), ("b", PARALLEL), *[(a, PARALLEL) for a in w_axes], ("r", REDUCTION),
         *[(a, REDUCTION) for a in rest]]
    )
    dy_map = space.access(dy_blocked_axes, {
        "n": space["n"], "b": space["b"], "r": space["r"], "g": space["g"], "ch": space["k"],
        **{a: space[a] for a in rest}})
    partial_axes = ["n", "b", *w_axes]
    partial_map = space.access(partial_axes, {a: space[a] for a in partial_axes})
    f32 = ir.F32Type.get()

    def body(dy_elem: ir.Value, acc: ir.Value) -> ir.Value:
        loop = {a: linalg.IndexOp(i).result for i, a in enumerate(space.names)}
        coords = {"n": loop["n"], "g": loop["g"], "ch": loop["c"]}
        valid = None
        for i in range(p.dims):
            o = (arith.addi(arith.muli(loop["b"], _index(rows)), loop["r"]) if i == 0 else loop[f"sp{i}"])
            # X position o*s + t*d - lo, zero outside [0, I)
            pos = arith.addi(arith.muli(o, _index(p.stride[i])),
                             arith.subi(arith.muli(loop[f"t{i}"], _index(p.dilation[i])), _index(p.pad_lo[i])))
            valid = _and(valid, _in_range(pos, p.input[i]))
            coords[f"sp{i}"] = _clamp(pos, p.input[i])
        value = _masked_read(x, [coords[a] for a in x_axes], valid)
        return multiply_add(value, dy_elem, acc)

    partials = generic(space, [dy_blocked], zeros([p.batch, blocks, *p.w_shape], f32), [dy_map, partial_map], body)
    # dW = sum over (n, b) in order
    total_space = Space([*[(a, PARALLEL) for a in w_axes], ("n", REDUCTION), ("b", REDUCTION)])
    total = generic(
        total_space, [partials], zeros(list(p.w_shape), f32),
        [total_space.access(partial_axes, {a: total_space[a] for a in partial_axes}),
         total_space.access(w_axes, {a: total_space[a] for a in w_axes})],
        lambda v, acc: arith.addf(acc, v),
    )
    return epilogue(total)

