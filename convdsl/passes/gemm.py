"""The explicit-GEMM pieces of the CPU form "im2col": a window gather into a (M, K) matrix per group (one strided
slice copy per tap where the window needs no transpose), then a named `linalg.matmul` (one group) or
`linalg.batch_matmul` (groups as the batch).

Why: IREE's llvm-cpu backend sends named matmuls through data tiling (packed operands) and its matmul
microkernels, which reach the CPU's FMA peak; the implicit-GEMM generics with strided window maps are not
recognised as contractions there and run as plain loop nests, 10 to 30 times slower
(docs/decisions.md#cpu-im2col).  The gather costs one pass over the window's taps: memory-bound work that is
small next to the GEMM for every shape with more than a few channels per group.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, Optional, Sequence

from iree.compiler import ir
from iree.compiler.dialects import linalg, tensor, util

from .ir import PARALLEL, Size, Space, collapse, elem_of, empty, expand, generic, shape_of, tensor_type, zeros

# the most taps a window gather copies as slices: past it (a 7x7x7 filter) the copies' count outweighs their speed
MOST_TAP_SLICES = 64
# the fewest contiguous elements a slice copy moves at a time (its innermost run, the channels): shorter runs (the
# ResNet stem's 3 channels) copy slower than the generic gathers them (docs/decisions.md#cpu-tap-slices)
LEAST_SLICE_RUN = 16


def gather(source: ir.Value, source_axes: Sequence[str], exprs: Mapping[str, ir.AffineExpr], space: Space,
           sizes: Sequence[Size], taps: Sequence[str] = ()) -> ir.Value:
    """out[l0, l1, ...] = source[exprs(l)] over the all-parallel `space` (loops l, extents `sizes`).

    With `taps` (the loops of the filter taps) a window gather is one strided slice copy per tap where the
    indexing allows it (gather_tap_slices); otherwise, and for transposes, one elementwise generic whose input
    map does the indexing.  IREE's llvm-cpu backend copies slices as plain memcpy dispatches, faster than it runs
    the generic (docs/decisions.md#cpu-tap-slices)."""
    if taps:
        sliced = gather_tap_slices(source, exprs, space, sizes, source_axes, taps)
        if sliced is not None:
            return sliced
    identity = space.access(space.names, {n: space[n] for n in space.names})
    return generic(space, [source], empty(list(sizes), elem_of(source)),
                   [space.access(source_axes, exprs), identity], lambda v, _: v)


def _linear(expr: ir.AffineExpr) -> Optional[tuple[dict[int, int], int]]:
    """expr as ({loop: coefficient}, constant), or None where it is not linear in the loops."""
    expr = expr.maybe_downcast() if hasattr(expr, "maybe_downcast") else expr
    if isinstance(expr, ir.AffineDimExpr):
        return {expr.position: 1}, 0
    if isinstance(expr, ir.AffineConstantExpr):
        return {}, expr.value
    if isinstance(expr, ir.AffineAddExpr):
        lhs, rhs = _linear(expr.lhs), _linear(expr.rhs)
        if lhs is None or rhs is None:
            return None
        terms = dict(lhs[0])
        for loop, c in rhs[0].items():
            terms[loop] = terms.get(loop, 0) + c
        return terms, lhs[1] + rhs[1]
    if isinstance(expr, ir.AffineMulExpr):
        lhs, rhs = _linear(expr.lhs), _linear(expr.rhs)
        if lhs is None or rhs is None or (lhs[0] and rhs[0]):
            return None
        (terms, const), scale = (lhs, rhs[1]) if not rhs[0] else (rhs, lhs[1])
        return {loop: c * scale for loop, c in terms.items()}, const * scale
    return None


def gather_tap_slices(source: ir.Value, exprs: Mapping[str, ir.AffineExpr], space: Space, sizes: Sequence[Size],
                      source_axes: Sequence[str], taps: Sequence[str]) -> Optional[ir.Value]:
    """The window gather out[l] = source[exprs(l)] as one tensor.extract_slice / insert_slice pair per tap, or
    None where its indexing is not of that kind.

    Each source axis a reads  const_a + sum_t u_at * t + stride_a * pos_a(l)  where t runs over the tap loops
    and pos_a is a mixed-radix number of position loops (h * R + r, or one loop o).  For fixed taps that is the
    strided slice  source[const_a + sum_t u_at * t :: stride_a]  of size  prod(extents of pos_a), which
    lands in out at the taps' indices, provided the position loops come in the same order in the source (axis by
    axis) as in out; unit loops and axes drop out of both.  Static sizes only, and each copy's innermost run (the
    last axis of both, unstrided) at least LEAST_SLICE_RUN elements."""
    if not all(isinstance(n, int) for n in sizes) or not all(isinstance(n, int) for n in shape_of(source)):
        return None
    extent = {space.names.index(n): int(sz) for n, sz in zip(space.names, sizes)}
    tap_loops = [space.names.index(t) for t in taps]
    if math.prod(extent[t] for t in tap_loops) > MOST_TAP_SLICES:
        return None
    axis_terms = []  # per source axis: (tap coefficients, constant, stride, position loops outermost first)
    for axis in source_axes:
        lin = _linear(exprs[axis]) if axis in exprs else ({}, 0)
        if lin is None:
            return None
        terms, const = lin
        if any(c < 0 for c in terms.values()):
            return None
        tap_terms = {t: terms.get(t, 0) for t in tap_loops}
        pos = sorted(((c, loop) for loop, c in terms.items() if loop not in tap_loops and extent[loop] > 1),
                     reverse=True)
        stride = pos[-1][0] if pos else 1
        for (c_outer, _), (c_inner, inner) in zip(pos, pos[1:]):  # mixed radix: each weight the next one's span
            if c_outer != c_inner * extent[inner]:
                return None
        axis_terms.append((tap_terms, const, stride, [loop for _, loop in pos]))
    order = [loop for _, _, _, loops in axis_terms for loop in loops]
    wanted = [i for i in range(len(space.names)) if i not in tap_loops and extent[i] > 1]
    if order != wanted:
        return None
    _, _, last_stride, last_loops = axis_terms[-1]
    innermost = len(space.names) - 1
    if last_loops != [innermost] or last_stride != 1 or extent[innermost] < LEAST_SLICE_RUN:
        return None
    # the same for every tap: each slice's sizes and strides, and how its kept axes split into out's loops
    spans = [math.prod(extent[loop] for loop in loops) for _, _, _, loops in axis_terms]
    strides = [stride if loops else 1 for _, _, stride, loops in axis_terms]
    kept = [span for span, (_, _, _, loops) in zip(spans, axis_terms) if loops]
    split = [[extent[loop] for loop in loops] for _, _, _, loops in axis_terms if loops]
    starts = list(itertools.accumulate((len(s) for s in split), initial=0))
    groups = [list(range(a, b)) for a, b in zip(starts, starts[1:])]
    out_sizes = [1 if i in tap_loops else extent[i] for i in range(len(space.names))]
    elem = elem_of(source)
    out = empty([int(n) for n in sizes], elem)
    for tap in itertools.product(*(range(extent[t]) for t in tap_loops)):
        at = dict(zip(tap_loops, tap))
        offsets = [const + sum(u * at[t] for t, u in tap_terms.items()) for tap_terms, const, _, _ in axis_terms]
        piece = tensor.extract_slice(tensor_type(kept, elem), source, [], [], [], offsets, spans, strides)
        if any(len(s) > 1 for s in split):
            piece = expand(piece, groups, [n for s in split for n in s])
        out_offsets = [at.get(i, 0) for i in range(len(space.names))]
        out = tensor.insert_slice(piece, out, [], [], [], out_offsets, out_sizes, [1] * len(out_sizes))
    return out


def parallel_space(names: Sequence[str]) -> Space:
    return Space([(n, PARALLEL) for n in names])


def as_matrices(value: ir.Value, rows: int, grouped: bool) -> ir.Value:
    """[G, r0.., c0..] -> [G, R, C] (grouped) or [G * R, C] ... with G = 1: [R, C]; `rows` axes after G form R.

    A reshape (collapse_shape): the axes are already in (G, rows, columns) order.
    """
    rank = len(shape_of(value))
    row_axes = list(range(1, 1 + rows))
    col_axes = list(range(1 + rows, rank))
    if grouped:
        return collapse(value, [[0], row_axes, col_axes])
    return collapse(value, [[0, *row_axes], col_axes])  # G = 1 merged into the rows


def from_matrices(value: ir.Value, shape: Sequence[int], rows: int, grouped: bool) -> ir.Value:
    """The inverse of as_matrices: [G, R, C] or [R, C] back to `shape` = [G, r0.., c0..]."""
    rank = len(shape)
    row_axes = list(range(1, 1 + rows))
    col_axes = list(range(1 + rows, rank))
    if grouped:
        return expand(value, [[0], row_axes, col_axes], shape)
    return expand(value, [[0, *row_axes], col_axes], shape)


def matmul(a: ir.Value, b: ir.Value) -> ir.Value:
    """f32 C = A B: [M, K] x [K, N] -> linalg.matmul; [G, M, K] x [G, K, N] -> linalg.batch_matmul (the groups
    are the batch).  16-bit operands are widened by the named op; products accumulate in f32."""
    sa, sb = shape_of(a), shape_of(b)
    f32 = ir.F32Type.get()
    out = zeros([*sa[:-1], sb[-1]], f32)
    if len(sa) == 2:
        return linalg.matmul(a, b, outs=[out])
    return linalg.batch_matmul(a, b, outs=[out])


def materialised(value: ir.Value) -> ir.Value:
    """`value` computed in a dispatch of its own (util.optimization_barrier): IREE 3.13's data tiling fused the
    transpose producing grad_weight's dY^T operand of a grouped batch_matmul (NHWGC) into the packing and
    computed wrong results (benchmarks/iree-upstream.md); kept apart, the transpose is one more pass over dY."""
    return util.OptimizationBarrierOp([value.type], [value]).results[0]
