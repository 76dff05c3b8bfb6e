"""Small builders over the MLIR Python bindings (iree.compiler.ir and its dialects).

Tensors are addressed through *logical axes*: activations have n, g, ch and sp0.. (spatial),
weights g, k, c and t0.. (taps).  A tensor's layout is the order of its logical axes, so a layout
becomes an indexing map instead of a transpose: `access(axes, exprs)` builds the map whose results
follow the tensor's axis order.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence, Union

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math as math_d, tensor

from ..problem import FP8_FORMATS, ConvProblem, activation_axes, weight_axes  # noqa: F401 - re-exported

PARALLEL = "parallel"
REDUCTION = "reduction"


def element_type(name: str) -> ir.Type:
    """convdsl dtype names and MLIR float8 names -> MLIR element types (inside an active Context)."""
    table: Mapping[str, Callable[[], ir.Type]] = {
        "f32": ir.F32Type.get,
        "f16": ir.F16Type.get,
        "bf16": ir.BF16Type.get,
        "f8E4M3FN": ir.Float8E4M3FNType.get,
        "f8E5M2": ir.Float8E5M2Type.get,
        "f8E4M3FNUZ": ir.Float8E4M3FNUZType.get,
        "f8E5M2FNUZ": ir.Float8E5M2FNUZType.get,
    }
    return table[name]()


Size = Union[int, ir.Value]  # a static size, or an SSA index value for a dynamic one (the batch)


def _static(sizes: Sequence[Size]) -> list[int]:
    return [s if isinstance(s, int) else ir.ShapedType.get_dynamic_size() for s in sizes]


def _dynamic(sizes: Sequence[Size]) -> list[ir.Value]:
    return [s for s in sizes if not isinstance(s, int)]


def tensor_type(shape: Sequence[Size], elem: ir.Type) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(_static(shape), elem)


class Space:
    """The iteration space of one linalg.generic: named loops, each parallel or reduction."""

    def __init__(self, loops: Sequence[tuple[str, str]]) -> None:
        self.names = [name for name, _ in loops]
        self.kinds = [kind for _, kind in loops]

    def __getitem__(self, name: str) -> ir.AffineExpr:
        return ir.AffineDimExpr.get(self.names.index(name))

    def has(self, name: str) -> bool:
        return name in self.names

    def access(self, axes: Sequence[str], exprs: Mapping[str, ir.AffineExpr]) -> ir.AffineMapAttr:
        """Map from this space to a tensor with logical `axes`; an axis without an expr is a size-1 axis read at 0."""
        results = [exprs[a] if a in exprs else ir.AffineConstantExpr.get(0) for a in axes]
        return ir.AffineMapAttr.get(ir.AffineMap.get(len(self.names), 0, results))

    def iterators(self) -> list:
        return [getattr(linalg.IteratorType, k) for k in self.kinds]


def generic(
    space: Space,
    inputs: Sequence[ir.Value],
    init: ir.Value,
    maps: Sequence[ir.AffineMapAttr],
    body: Callable[..., ir.Value],
) -> ir.Value:
    """One linalg.generic on tensors with a single result; `body(*input_elems, out_elem)` returns the yield."""
    op = linalg.GenericOp(
        result_tensors=[init.type],
        inputs=list(inputs),
        outputs=[init],
        indexing_maps=ir.ArrayAttr.get(list(maps)),
        iterator_types=ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{k}>") for k in space.kinds]),
    )
    elem_types = [ir.RankedTensorType(v.type).element_type for v in list(inputs) + [init]]
    block = op.regions[0].blocks.append(*elem_types)
    with ir.InsertionPoint(block):
        linalg.YieldOp([body(*block.arguments)])
    return op.result


def empty(shape: Sequence[Size], elem: ir.Type) -> ir.Value:
    return tensor.EmptyOp(list(shape), elem).result


def float_const(value: float, elem: ir.Type) -> ir.Value:
    return arith.ConstantOp(elem, ir.FloatAttr.get(elem, value)).result


def zeros(shape: Sequence[Size], elem: ir.Type) -> ir.Value:
    return linalg.fill(float_const(0.0, elem), outs=[empty(shape, elem)])


def convert(value: ir.Value, to: ir.Type) -> ir.Value:
    """Scalar float conversion inside a region body (extf to wider, truncf to narrower)."""
    src = value.type
    if src == to:
        return value
    f32 = ir.F32Type.get()
    if ir.FloatType(to).width == 8 and src != f32:
        # LLVM lowers f32 -> f8 but not f16 -> f8: round through f32 (exact for f16/bf16 values)
        value, src = arith.extf(f32, value), f32
    if ir.FloatType(src).width < ir.FloatType(to).width:
        return arith.extf(to, value)
    if ir.FloatType(src).width > ir.FloatType(to).width:
        return arith.truncf(to, value)
    # same width, different format (f16 <-> bf16): go through f32
    return arith.truncf(to, arith.extf(ir.F32Type.get(), value))


def shape_of(value: ir.Value) -> list[int]:
    return list(ir.RankedTensorType(value.type).shape)


def sizes_of(value: ir.Value) -> list[Size]:
    """Static sizes as ints, dynamic ones as `tensor.dim` values."""
    kind = ir.RankedTensorType(value.type)
    return [
        tensor.dim(value, arith.ConstantOp(ir.IndexType.get(), a).result) if kind.is_dynamic_dim(a) else n
        for a, n in enumerate(kind.shape)
    ]


def elem_of(value: ir.Value) -> ir.Type:
    return ir.RankedTensorType(value.type).element_type


def extract(value: ir.Value, offsets: Sequence[int], sizes: Sequence[Size], strides: Sequence[int]) -> ir.Value:
    """A strided view (tensor.extract_slice); returns `value` itself when it is the whole tensor."""
    shape = shape_of(value)
    whole = all(
        o == 0 and st == 1 and (not isinstance(sz, int) or sz == n)
        for o, sz, st, n in zip(offsets, sizes, strides, shape)
    )
    if whole and all(isinstance(sz, int) or ir.ShapedType.is_dynamic_size(n) for sz, n in zip(sizes, shape)):
        return value
    result = tensor_type(sizes, elem_of(value))
    return tensor.extract_slice(
        result, value, [], _dynamic(sizes), [], list(offsets), _static(sizes), list(strides)
    )


def insert(
    source: ir.Value,
    dest: ir.Value,
    offsets: Sequence[int],
    strides: Sequence[int],
    sizes: Sequence[Size] | None = None,
) -> ir.Value:
    """tensor.insert_slice; `sizes` (with 1s for dropped axes) inserts a lower-rank source."""
    sizes = sizes_of(source) if sizes is None else sizes
    return tensor.insert_slice(
        source, dest, [], _dynamic(sizes), [], list(offsets), _static(sizes), list(strides)
    )


def window(value: ir.Value, starts: Mapping[int, int], sizes: Mapping[int, int],  # noqa: C901
           form: str = "insert") -> ir.Value:
    """out[i] = value[start + i] where that is inside `value`, else 0, on the given axes.

    This is zero padding (start < 0, or a window past the end) and cropping (a window that ends
    before the tensor does) in one: the part of the window that overlaps the tensor is copied into
    zeros.  A window entirely in the padding is all zeros.  `form` says how the zero border is built
    (plan.PAD_FORMS): "insert" (zeros + insert_slice), "pad" (tensor.pad, for IREE to fuse into the
    consumer) or "gather" (one elementwise generic; "insert" when the contiguous axis is too short to
    vectorise: measured slower for the 3-channel ResNet stem).
    """
    full = sizes_of(value)  # axes without a window keep their size, dynamic ones included
    out_shape = [sizes.get(a, n) for a, n in enumerate(full)]
    begin = [max(starts.get(a, 0), 0) for a in range(len(full))]
    stop = [min(starts[a] + sizes[a], full[a]) if a in sizes else full[a] for a in range(len(full))]
    if any(isinstance(e, int) and b >= e for b, e in zip(begin, stop)):
        return zeros(out_shape, elem_of(value))
    inner_sizes = [e - b if isinstance(e, int) else e for b, e in zip(begin, stop)]
    inner = extract(value, begin, inner_sizes, [1] * len(full))
    if all(a not in sizes or inner_sizes[a] == sizes[a] for a in range(len(full))):
        return inner
    low = [b - starts.get(a, 0) for a, b in enumerate(begin)]
    high = [sizes[a] - low[a] - inner_sizes[a] if a in sizes else 0 for a in range(len(full))]
    if form == "gather" and isinstance(full[-1], int) and full[-1] < MIN_GATHER_ROW:
        form = "insert"
    if form == "fuse":
        return pad_zeros(inner, low, high)
    if form == "gather":
        return pad_gather(inner, low, high, out_shape)
    return insert(inner, zeros(out_shape, elem_of(value)), low, [1] * len(full), inner_sizes)


MIN_GATHER_ROW = 16  # elements on the contiguous axis for the gather form of a zero border


def pad_zeros(value: ir.Value, low: Sequence[int], high: Sequence[int]) -> ir.Value:
    """tensor.pad with zeros: `low[a]` zeros before and `high[a]` after axis a (dynamic axes: none)."""
    elem = elem_of(value)
    shape = [n if n == ir.ShapedType.get_dynamic_size() else n + lo + hi
             for n, lo, hi in zip(shape_of(value), low, high)]
    op = tensor.PadOp(tensor_type(shape, elem), value, [], [], list(low), list(high))
    block = op.regions[0].blocks.append(*([ir.IndexType.get()] * len(shape)))
    with ir.InsertionPoint(block):
        tensor.YieldOp(float_const(0.0, elem))
    return op.result


def pad_gather(value: ir.Value, low: Sequence[int], high: Sequence[int], out_shape: Sequence[Size]) -> ir.Value:
    """out[i] = value[i - low] where 0 <= i - low < size, else 0: one all-parallel generic.

    The index is clamped before the tensor.extract (every lane loads, in bounds) and the value
    selected after, so the generic stays branch-free and IREE vectorises it along the contiguous axis.
    """
    elem = elem_of(value)
    src = shape_of(value)
    rank = len(out_shape)
    space = Space([(f"d{i}", PARALLEL) for i in range(rank)])
    index = ir.IndexType.get()

    def body(_: ir.Value) -> ir.Value:
        inside = None
        coords = []
        for a in range(rank):
            i = linalg.IndexOp(a).result
            if low[a] == 0 and high[a] == 0:
                coords.append(i)
                continue
            shifted = arith.subi(i, arith.ConstantOp(index, low[a]).result)
            ok = arith.andi(
                arith.cmpi(arith.CmpIPredicate.sge, shifted, arith.ConstantOp(index, 0).result),
                arith.cmpi(arith.CmpIPredicate.slt, shifted, arith.ConstantOp(index, src[a]).result))
            inside = ok if inside is None else arith.andi(inside, ok)
            zero = arith.ConstantOp(index, 0).result
            coords.append(arith.select(ok, shifted, zero))
        value_at = tensor.extract(value, coords)
        return arith.select(inside, value_at, float_const(0.0, elem)) if inside is not None else value_at

    return generic(space, [], empty(out_shape, elem), [space.access(space.names, {n: space[n] for n in space.names})],
                   body)


# fp8 formats as (mantissa bits, smallest normal exponent): CK's fp8 = e4m3, bf8 = e5m2


def round_to_fp8_grid(value: ir.Value, kind: str) -> ir.Value:
    """Round an f32 scalar to the nearest fp8 value (ties to even), staying in f32.

    For |v| in [2^e, 2^(e+1)) the fp8 spacing is 2^(e - m) (m mantissa bits); below the smallest
    normal 2^emin it stays 2^(emin - m) (subnormals).  So v -> roundeven(v * 2^-q) * 2^q with
    q = max(e, emin) - m, where e is read from the f32 exponent bits.  Both scalings are exact.
    Values beyond the fp8 range are not saturated (inputs of convolutions stay far below 448).
    """
    mbits, emin = FP8_FORMATS[kind]
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()

    def const(v: int) -> ir.Value:
        return arith.ConstantOp(i32, v).result

    bits = arith.bitcast(i32, value)
    biased = arith.andi(arith.shrui(bits, const(23)), const(255))
    q = arith.subi(arith.maxsi(biased, const(emin + 127)), const(mbits))  # biased q
    up = arith.bitcast(f32, arith.shli(arith.subi(const(254), q), const(23)))  # 2^-q
    down = arith.bitcast(f32, arith.shli(q, const(23)))  # 2^q
    return arith.mulf(math_d.roundeven(arith.mulf(value, up)), down)


def split_axis(value: ir.Value, axis: int, parts: int) -> ir.Value:
    """View axis `axis` (length L) as (parts, L / parts): tensor.expand_shape, a reshape without a copy."""
    shape = shape_of(value)
    new_shape = shape[:axis] + [parts, shape[axis] // parts] + shape[axis + 1:]
    groups, k = [], 0
    for a in range(len(shape)):
        groups.append([k, k + 1] if a == axis else [k])
        k += len(groups[-1])
    reassociation = ir.ArrayAttr.get(
        [ir.ArrayAttr.get([ir.IntegerAttr.get(ir.IntegerType.get_signless(64), i) for i in g]) for g in groups]
    )
    return tensor.ExpandShapeOp(tensor_type(new_shape, elem_of(value)), value, reassociation, [], new_shape).result


def permute(value: ir.Value, src_axes: Sequence[str], dst_axes: Sequence[str]) -> ir.Value:
    """A copy of `value` (logical axes src_axes) with its axes in dst_axes order (one elementwise generic)."""
    space = Space([(a, PARALLEL) for a in dst_axes])
    sizes = sizes_of(value)
    out_sizes = [sizes[list(src_axes).index(a)] for a in dst_axes]
    ident = {a: space[a] for a in dst_axes}
    return generic(
        space, [value], empty(out_sizes, elem_of(value)),
        [space.access(src_axes, ident), space.access(dst_axes, ident)], lambda v, _: v,
    )


def multiply_add(a: ir.Value, b: ir.Value, acc: ir.Value) -> ir.Value:
    """acc + a*b in f32: operands are widened first, so f16/bf16/fp8 products are exact in f32."""
    f32 = ir.F32Type.get()
    return arith.addf(acc, arith.mulf(convert(a, f32), convert(b, f32)))


def _reassociation(groups: Sequence[Sequence[int]]) -> ir.ArrayAttr:
    i64 = ir.IntegerType.get_signless(64)
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in g]) for g in groups])


def collapse(value: ir.Value, groups: Sequence[Sequence[int]]) -> ir.Value:
    """Merge each group of consecutive axes into one (tensor.collapse_shape: a reshape, no copy)."""
    shape = shape_of(value)
    new_shape = [math.prod(shape[a] for a in g) for g in groups]
    return tensor.CollapseShapeOp(tensor_type(new_shape, elem_of(value)), value, _reassociation(groups)).result


def expand(value: ir.Value, groups: Sequence[Sequence[int]], shape: Sequence[int]) -> ir.Value:
    """Split axis i of `value` into the axes groups[i] of `shape` (tensor.expand_shape: a reshape, no copy)."""
    return tensor.ExpandShapeOp(tensor_type(shape, elem_of(value)), value, _reassociation(groups), [],
                                list(shape)).result
