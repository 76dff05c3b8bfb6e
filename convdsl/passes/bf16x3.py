"""compute = "bf16x3": f32 convolutions on the bf16 matrix units, three bf16 products per f32 product.

IREE has no TF32 on CUDA, so an f32 convolution runs on the FMA units (about 6 TFLOP/s on an H200,
against about 70 TFLOP/s that IREE reaches with bf16 MMA).  This is CUTLASS's 3xTF32 with bf16.

The split.  Every f32 operand value a is written as
    a_hi = bf16(a)                (round to nearest even; 8 significant bits)
    a_lo = bf16(a - f32(a_hi))    (a - a_hi is exact in f32; |a - a_hi| <= 2^-8 |a|)
so a = a_hi + a_lo + r with |r| <= 2^-8 |a - a_hi| <= 2^-16 |a|.  Then
    a*b = a_hi*b_hi + a_hi*b_lo + a_lo*b_hi + a_lo*b_lo + O(2^-16 |ab|)
and a_lo*b_lo is itself <= 2^-16 |ab|: it is dropped, leaving three products.  Each is a product of
two bf16 values (8 + 8 significant bits), exact in f32, and they are summed in f32: relative error
~1e-5 per product, far below TF32's 2^-11.

The three products as one contraction.  A convolution is sum_r A[.., r, ..] * B[.., r, ..] over a
reduction index r (plus taps and pixels, untouched here).  Concatenating three blocks along r,
    A3 = [A_hi | A_hi | A_lo]      B3 = [B_hi | B_lo | B_hi]
gives  sum_{r3 < 3R} A3[r3] B3[r3] = sum_r A_hi B_hi + sum_r A_hi B_lo + sum_r A_lo B_hi:
block j of A3 meets block j of B3 and nothing else, because both index r3 = j*R + r with the same j.
So the kernel is the problem's own bf16 convolution with a three times longer reduction, and the
whole lowering (stride phases, split-K, layouts, epilogue) is reused unchanged:
    forward        reduces over C:   X3 = [X_hi | X_hi | X_lo] along C,   W3 = [W_hi | W_lo | W_hi] along C
    grad_input,    reduces over K:   dY3 = [dY_hi | dY_hi | dY_lo] along K, W3 = [W_hi | W_lo | W_hi] along K
    transposed                       (its x stands in dY's place)
    grad_weight    reduces over N:   X3 = [X_hi; X_hi; X_lo] along N,   dY3 = [dY_hi; dY_lo; dY_hi] along N
Per group: the channel axis of each group is tripled, (3, C) -> 3C within the group, which is exactly
what the tripled problem's "C per group" means.  The result does not depend on the tripled size
(forward's Y has no C, dX has no K, dW has no N), so it comes out f32 in the original shape.

Each split is one elementwise linalg.generic over the operand with a size-3 axis inserted just before
the axis being tripled (its input map broadcasts over that axis; the body computes hi and lo and
selects by linalg.index), then a tensor.collapse_shape (3, L) -> 3L, a reshape without a copy.
Only the implicit-GEMM form is split (passes/plan.py): depthwise and gather kernels are bound by memory
and gain nothing from matrix units, so they stay f32 on the FMA units.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor

from ..algebra import bf16x3_split_problem as split_problem  # noqa: F401 - the problem the split operands describe
from ..problem import ConvProblem
from .ir import PARALLEL, Space, activation_axes, elem_of, empty, generic, sizes_of, tensor_type, weight_axes

# Which of the three blocks holds the lo part: operand A is [hi, hi, lo], operand B is [hi, lo, hi],
# so that the blocks pair as hi*hi, hi*lo, lo*hi.
LO_BLOCK = {"a": 2, "b": 1}


def reduction_axis(p: ConvProblem) -> str:
    """The reduction axis that is tripled, in words (for `convdsl explain`)."""
    return {"forward": "C", "grad_input": "K", "transposed": "K", "grad_weight": "N"}[p.op]


def split_args(p: ConvProblem, args: list[ir.Value]) -> list[ir.Value]:
    """The kernel's f32 arguments -> the concatenated bf16 operands of split_problem(p); D passes unchanged."""
    act = activation_axes(p, "ch")
    if p.op == "forward":  # X[.., c] * W[g, k, .., c]: triple C
        a, b = split(args[0], act, "ch", LO_BLOCK["a"]), split(args[1], weight_axes(p), "c", LO_BLOCK["b"])
    elif p.op in ("grad_input", "transposed"):  # dY[.., k] * W[g, k, ..]: triple K
        a, b = split(args[0], act, "ch", LO_BLOCK["a"]), split(args[1], weight_axes(p), "k", LO_BLOCK["b"])
    else:  # grad_weight: X[n, ..] * dY[n, ..]: triple N
        a, b = split(args[0], act, "n", LO_BLOCK["a"]), split(args[1], act, "n", LO_BLOCK["b"])
    return [a, b, *args[2:]]


def split(value: ir.Value, axes: list[str], axis: str, lo_block: int) -> ir.Value:
    """f32 `value` (logical `axes`) -> bf16 with `axis` tripled as blocks [hi|hi|lo] or [hi|lo|hi].

    out[.., j, i, ..] = lo(value[.., i, ..]) if j == lo_block else hi(value[.., i, ..]), then (j, i)
    collapses to j*L + i.
    """
    bf16, f32 = ir.BF16Type.get(), ir.F32Type.get()
    pos = axes.index(axis)
    out_axes = axes[:pos] + ["part"] + axes[pos:]
    sizes = sizes_of(value)
    out_sizes = sizes[:pos] + [3] + sizes[pos:]
    space = Space([(a, PARALLEL) for a in out_axes])
    in_map = space.access(axes, {a: space[a] for a in axes})  # broadcast over `part`
    out_map = space.access(out_axes, {a: space[a] for a in out_axes})
    index = ir.IndexType.get()

    def body(a: ir.Value, _: ir.Value) -> ir.Value:
        # Rounded on the f32 bit pattern, not by `arith.truncf` + `arith.extf`: IREE's llvm-cpu pipeline
        # (iree-convert-bf16-arith-to-f32) keeps bf16 values in f32 and folds extf(truncf(a)) to a, which
        # made every lo zero.  The truncf below is exact: both parts already lie on the bf16 grid.
        hi = round_to_bf16_grid(a)
        lo = round_to_bf16_grid(arith.subf(a, hi))  # a - hi is exact in f32 (Sterbenz: hi is within 2^-8 of a)
        is_lo = arith.cmpi(
            arith.CmpIPredicate.eq, linalg.IndexOp(pos).result, arith.ConstantOp(index, lo_block).result
        )
        return arith.truncf(bf16, arith.select(is_lo, lo, hi))

    assert elem_of(value) == f32, f"bf16x3 splits f32 operands, got {elem_of(value)}"
    stacked = generic(space, [value], empty(out_sizes, bf16), [in_map, out_map], body)
    return merge_axes(stacked, pos)


def round_to_bf16_grid(value: ir.Value) -> ir.Value:
    """An f32 scalar rounded to the nearest bf16 value (ties to even), staying in f32.

    bf16 is the top half of an f32: add 0x7FFF plus the lowest kept bit (ties go to the even one), then
    clear the low 16 bits; a carry into the exponent is the correct rounding up (to inf past the range).
    NaN is passed through (the carry could turn a NaN with only low payload bits into inf).
    """
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()

    def const(v: int) -> ir.Value:
        return arith.ConstantOp(i32, v).result

    bits = arith.bitcast(i32, value)
    lsb = arith.andi(arith.shrui(bits, const(16)), const(1))
    rounded = arith.andi(arith.addi(bits, arith.addi(const(0x7FFF), lsb)), const(-0x10000))  # & 0xFFFF0000
    is_nan = arith.cmpf(arith.CmpFPredicate.UNO, value, value)
    return arith.select(is_nan, value, arith.bitcast(f32, rounded))


def merge_axes(value: ir.Value, axis: int) -> ir.Value:
    """View axes (axis, axis + 1) of sizes (P, L) as one axis of size P*L (dynamic if either is):
    tensor.collapse_shape, the inverse of ir.split_axis."""
    kind = ir.RankedTensorType(value.type)
    shape = list(kind.shape)
    dynamic = ir.ShapedType.get_dynamic_size()
    merged = dynamic if kind.is_dynamic_dim(axis) or kind.is_dynamic_dim(axis + 1) else shape[axis] * shape[axis + 1]
    new_shape = shape[:axis] + [merged] + shape[axis + 2:]
    groups, k = [], 0
    for a in range(len(new_shape)):
        groups.append([k, k + 1] if a == axis else [k])
        k += len(groups[-1])
    i64 = ir.IntegerType.get_signless(64)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in g]) for g in groups])
    return tensor.CollapseShapeOp(tensor_type(new_shape, kind.element_type), value, reassociation).result
