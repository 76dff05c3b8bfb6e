"""The explicit-GEMM pieces of the CPU form "im2col": a window gather into a (M, K) matrix per group, then a
named `linalg.matmul` (one group) or `linalg.batch_matmul` (groups as the batch).

Why: IREE's llvm-cpu backend sends named matmuls through data tiling (packed operands) and its matmul
microkernels, which reach the CPU's FMA peak; the implicit-GEMM generics with strided window maps are not
recognised as contractions there and run as plain loop nests, 10 to 30 times slower
(docs/decisions.md#cpu-im2col).  The gather costs one pass over the window's taps: memory-bound work that is
small next to the GEMM for every shape with more than a few channels per group.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from iree.compiler import ir
from iree.compiler.dialects import linalg, util

from .ir import PARALLEL, Space, collapse, elem_of, empty, expand, generic, shape_of, zeros


def gather(source: ir.Value, source_axes: Sequence[str], exprs: Mapping[str, ir.AffineExpr], space: Space,
           sizes: Sequence[int]) -> ir.Value:
    """out[l0, l1, ...] = source[exprs(l)] over the all-parallel `space` (loops l, extents `sizes`): one
    elementwise generic whose input map does the indexing (im2col, transposes)."""
    identity = space.access(space.names, {n: space[n] for n in space.names})
    return generic(space, [source], empty(list(sizes), elem_of(source)),
                   [space.access(source_axes, exprs), identity], lambda v, _: v)


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
