"""The "IREE as a user gets it today" baseline: the direct linalg forms torch-mlir emits for a convolution
and its backward (aten.convolution_backward), built with the MLIR Python bindings for one ConvProblem.

These are the forms convdsl is compared against, so they follow what torch-mlir's TorchToLinalg lowering
produces, with the problem's layout expressed as indexing maps (no transposes), and f32 accumulation
(torch-mlir's default accumulator for f16/bf16) followed by one elementwise cast to the output dtype:

- forward:      Y[n, o, g, k] = sum_{t, c} Xpad[n, o*s + t*d, g, c] * W[g, k, t, c]   (one generic)
- grad_input:   the transposed convolution as torch-mlir lowers it: dY is zero-inserted and padded by ONE
                strided tensor.insert_slice into a zero tensor (stride s, offset (R-1)*d - lo), the weight
                is flipped by a gather generic (linalg.index + tensor.extract), and a stride-1 convolution
                with dilation d runs over the result:
                dX[n, i, g, c] = sum_{t', k} Dz[n, i + t'*d, g, k] * Wflip[g, k, t', c]
                For s > 1 most multiplications read an inserted zero (that is the point of comparison).
- grad_weight:  dW[g, k, t, c] = sum_{n, o} Xpad[n, o*s + t*d, g, c] * dY[n, o, g, k], the image X first
                (IREE's CUDA backend only recognises the convolution that way), without split-K.

Loop order (`order`): "layout" (the default) iterates the output's axes in its memory order, then the
taps, then the reduced channel: for NHWGC that is linalg.conv_2d_nhwgc_gkhwc generalised
(n, o..., g, k | t..., c), for NGCHW conv_2d_ngchw_gfchw generalised (n, g, k, o... | c, t...).
"channel-major" is (n, g, out-channel, o... | in-channel, t...) whatever the layout: torch-mlir's NCHW loop
order carried over to channels-last tensors.  IREE 3.13's CUDA backend (sm_80 PTX, run on an H200)
returned wrong grad_input results for that order on every f16/bf16 NHWGC case with G = 1 and a padded or
zero-inserted dY (relative error ~1), while the same IR is right on llvm-cpu (tests/test_benchmarks.py) and
in f32; the "layout" order of the same computation is right on the GPU.  benchmarks/README.md has the cases.
grad_weight keeps the order (g, k, t..., c | n, o...) in both.

Compiled with IREE's defaults plus --iree-dispatch-creation-enable-split-reduction (TODAY_FLAGS).
With `compute` set (fp8 compute), both operands are first rounded to the fp8 grid by an elementwise
generic (the values stay in f16), as convdsl does on CUDA and the CPU, so both compute the same function.
"""
from __future__ import annotations

from typing import Sequence

from iree.compiler import ir
from iree.compiler.dialects import arith, func, linalg, tensor

from convdsl.passes.ir import (
    PARALLEL,
    REDUCTION,
    Space,
    activation_axes,
    convert,
    elem_of,
    element_type,
    empty,
    extract,
    generic,
    insert,
    round_to_fp8_grid,
    shape_of,
    weight_axes,
    zeros,
)
from convdsl.problem import ConvProblem

TODAY_FLAGS = ("--iree-dispatch-creation-enable-split-reduction",)
ORDERS = ("layout", "channel-major")


# --- small pieces ---------------------------------------------------------------------------------
def _identity(rank: int) -> tuple[Space, ir.AffineMapAttr]:
    space = Space([(f"d{i}", PARALLEL) for i in range(rank)])
    return space, space.access(space.names, {n: space[n] for n in space.names})


def _elementwise(value: ir.Value, out_elem: ir.Type, fn) -> ir.Value:
    space, ident = _identity(len(shape_of(value)))
    return generic(space, [value], empty(shape_of(value), out_elem), [ident, ident], lambda a, _: fn(a))


def _round_fp8(value: ir.Value, kind: str) -> ir.Value:
    """Round every element to the fp8 grid of `kind`, kept exactly in f16."""
    f16, f32 = ir.F16Type.get(), ir.F32Type.get()
    return _elementwise(value, f16, lambda a: convert(round_to_fp8_grid(convert(a, f32), kind), f16))


def _cast(value: ir.Value, out_elem: ir.Type) -> ir.Value:
    if elem_of(value) == out_elem:
        return value
    return _elementwise(value, out_elem, lambda a: convert(a, out_elem))


def _multiply_add(a: ir.Value, b: ir.Value, acc: ir.Value) -> ir.Value:
    f32 = ir.F32Type.get()
    return arith.addf(acc, arith.mulf(convert(a, f32), convert(b, f32)))


def _spatial_positions(p: ConvProblem, axes: Sequence[str]) -> list[int]:
    return [list(axes).index(f"sp{i}") for i in range(p.dims)]


def _place(value: ir.Value, positions: Sequence[int], lo: Sequence[int], hi: Sequence[int],
           stride: Sequence[int]) -> ir.Value:
    """Zero-insert (stride s: s-1 zeros between elements) and zero-pad the given axes with ONE strided
    tensor.insert_slice into a zero tensor, as torch-mlir does; negative lo/hi crop afterwards."""
    shape = shape_of(value)
    if all(s == 1 for s in stride) and not any(lo) and not any(hi):
        return value
    full, offsets, strides = list(shape), [0] * len(shape), [1] * len(shape)
    for pos, l, h, s in zip(positions, lo, hi, stride):
        full[pos] = max(l, 0) + (shape[pos] - 1) * s + 1 + max(h, 0)
        offsets[pos], strides[pos] = max(l, 0), s
    placed = insert(value, zeros(full, elem_of(value)), offsets, strides)
    if any(l < 0 for l in lo) or any(h < 0 for h in hi):
        crop_off, crop_size = [0] * len(shape), list(full)
        for pos, l, h in zip(positions, lo, hi):
            crop_off[pos] = max(-l, 0)
            crop_size[pos] = full[pos] - max(-l, 0) - max(-h, 0)
        placed = extract(placed, crop_off, crop_size, [1] * len(shape))
    return placed


# --- the three ops ----------------------------------------------------------------------------------
def _loops(p: ConvProblem, order: str, out_ch: str, in_ch: str, sp: list[str], taps: list[str]) -> Space:
    """The iteration space of forward / grad_input: output axes, then reductions, in `order`."""
    if order == "channel-major":
        par, red = ["n", "g", out_ch, *sp], [in_ch, *taps]
    elif order == "layout":
        names = {"n": ["n"], "g": ["g"], "ch": [out_ch], **{f"sp{i}": [s] for i, s in enumerate(sp)}}
        par = [n for a in activation_axes(p, "ch") for n in names[a]]
        red = [in_ch, *taps] if p.layout == "NGCHW" else [*taps, in_ch]
    else:
        raise ValueError(f"order: expected one of {', '.join(ORDERS)}, got {order!r}")
    return Space([(n, PARALLEL) for n in par] + [(n, REDUCTION) for n in red])


def _forward(p: ConvProblem, x: ir.Value, w: ir.Value, order: str) -> ir.Value:
    x_axes, w_axes = activation_axes(p, "ch"), weight_axes(p)
    xp = _place(x, _spatial_positions(p, x_axes), p.pad_lo, p.pad_hi, [1] * p.dims)
    o, t = [f"o{i}" for i in range(p.dims)], [f"t{i}" for i in range(p.dims)]
    space = _loops(p, order, "k", "c", o, t)
    x_map = {"n": space["n"], "g": space["g"], "ch": space["c"]}
    for i in range(p.dims):
        x_map[f"sp{i}"] = space[o[i]] * p.stride[i] + space[t[i]] * p.dilation[i]
    w_map = {"g": space["g"], "k": space["k"], "c": space["c"], **{f"t{i}": space[t[i]] for i in range(p.dims)}}
    y_map = {"n": space["n"], "g": space["g"], "ch": space["k"], **{f"sp{i}": space[o[i]] for i in range(p.dims)}}
    return generic(space, [xp, w], zeros(p.y_shape, ir.F32Type.get()),
                   [space.access(x_axes, x_map), space.access(w_axes, w_map), space.access(x_axes, y_map)],
                   _multiply_add)


def _flip_weight(p: ConvProblem, w: ir.Value) -> ir.Value:
    """Wflip[g, k, t', c] = W[g, k, R-1-t', c] in any weight layout: a gather generic (torch-mlir's flip)."""
    t = [f"t{i}" for i in range(p.dims)]
    space = Space([("g", PARALLEL), ("k", PARALLEL), *[(n, PARALLEL) for n in t], ("c", PARALLEL)])
    out_axes = ["g", "k", *t, "c"]
    shape = [p.groups, p.out_channels, *p.filter, p.in_channels]
    index = ir.IndexType.get()

    def body(_: ir.Value) -> ir.Value:
        loop = {name: linalg.IndexOp(i).result for i, name in enumerate(space.names)}
        coords = {"g": loop["g"], "k": loop["k"], "c": loop["c"]}
        for i in range(p.dims):
            last = arith.ConstantOp(index, p.filter[i] - 1).result
            coords[f"t{i}"] = arith.subi(last, loop[t[i]])
        return tensor.extract(w, [coords[a] for a in weight_axes(p)])

    return generic(space, [], empty(shape, elem_of(w)), [space.access(out_axes, {n: space[n] for n in out_axes})],
                   body)


def _grad_input(p: ConvProblem, dy: ir.Value, w: ir.Value, order: str) -> ir.Value:
    axes = activation_axes(p, "ch")
    sp = _spatial_positions(p, axes)
    # offset (R-1)*d - lo before the zero-inserted dY; after it, what makes the length I + (R-1)*d
    lo = [d * (r - 1) - l for r, d, l in zip(p.filter, p.dilation, p.pad_lo)]
    hi = [i + (r - 1) * d - lw - ((o - 1) * s + 1)
          for i, r, d, lw, o, s in zip(p.input, p.filter, p.dilation, lo, p.output, p.stride)]
    dz = _place(dy, sp, lo, hi, p.stride)
    wf = _flip_weight(p, w)
    q, t = [f"i{i}" for i in range(p.dims)], [f"t{i}" for i in range(p.dims)]
    space = _loops(p, order, "c", "k", q, t)
    dz_map = {"n": space["n"], "g": space["g"], "ch": space["k"]}
    for i in range(p.dims):
        dz_map[f"sp{i}"] = space[q[i]] + space[t[i]] * p.dilation[i]
    wf_axes = ["g", "k", *t, "c"]
    wf_map = {"g": space["g"], "k": space["k"], "c": space["c"], **{n: space[n] for n in t}}
    dx_map = {"n": space["n"], "g": space["g"], "ch": space["c"], **{f"sp{i}": space[q[i]] for i in range(p.dims)}}
    return generic(space, [dz, wf], zeros(p.x_shape, ir.F32Type.get()),
                   [space.access(axes, dz_map), space.access(wf_axes, wf_map), space.access(axes, dx_map)],
                   _multiply_add)


def _grad_weight(p: ConvProblem, x: ir.Value, dy: ir.Value, order: str) -> ir.Value:
    axes, w_axes = activation_axes(p, "ch"), weight_axes(p)
    xp = _place(x, _spatial_positions(p, axes), p.pad_lo, p.pad_hi, [1] * p.dims)
    o, t = [f"o{i}" for i in range(p.dims)], [f"t{i}" for i in range(p.dims)]
    space = Space([("g", PARALLEL), ("k", PARALLEL), *[(n, PARALLEL) for n in t], ("c", PARALLEL),
                   ("n", REDUCTION), *[(n, REDUCTION) for n in o]])
    x_map = {"n": space["n"], "g": space["g"], "ch": space["c"]}
    for i in range(p.dims):
        x_map[f"sp{i}"] = space[o[i]] * p.stride[i] + space[t[i]] * p.dilation[i]
    y_map = {"n": space["n"], "g": space["g"], "ch": space["k"], **{f"sp{i}": space[o[i]] for i in range(p.dims)}}
    w_map = {"g": space["g"], "k": space["k"], "c": space["c"], **{n: space[n] for n in t}}
    # the image X first: IREE's CUDA backend fails to pack the reduction dimensions with dY first
    return generic(space, [xp, dy], zeros(p.w_shape, ir.F32Type.get()),
                   [space.access(axes, x_map), space.access(axes, y_map), space.access(w_axes, w_map)],
                   _multiply_add)


def emit_today(p: ConvProblem, order: str = "layout") -> None:
    if p.epilogue.kind != "none":
        raise NotImplementedError("iree-today forms: epilogues are not part of the baseline")
    if p.op not in ("forward", "grad_input", "grad_weight"):
        raise NotImplementedError(f"iree-today forms: op {p.op}")
    arg_types = [ir.RankedTensorType.get(list(s), element_type(d)) for s, d in zip(p.arg_shapes, p.arg_dtypes)]
    result_type = ir.RankedTensorType.get(list(p.result_shape), element_type(p.result_dtype))
    fn = func.FuncOp(p.name, (arg_types, [result_type]))
    block = fn.add_entry_block()
    with ir.InsertionPoint(block):
        a, b = block.arguments[0], block.arguments[1]
        if p.fp8_compute:  # (bf16x3 is convdsl's own rewrite: IREE as a user gets it today runs f32)
            a, b = _round_fp8(a, p.compute[0]), _round_fp8(b, p.compute[1])
        acc = {"forward": _forward, "grad_input": _grad_input, "grad_weight": _grad_weight}[p.op](p, a, b, order)
        func.ReturnOp([_cast(acc, element_type(p.result_dtype))])


def today_mlir(problems: Sequence[ConvProblem], order: str = "layout") -> str:
    """One module with a function per problem (named problem.name, convdsl's argument order)."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            for p in problems:
                emit_today(p, order)
        if not module.operation.verify():
            raise RuntimeError("iree-today module does not verify")
        return str(module)


def compile_today(problems: Sequence[ConvProblem], target, order: str = "layout") -> bytes:
    from convdsl.backends.iree import compile_mlir

    return compile_mlir(today_mlir(problems, order), target, extra_flags=TODAY_FLAGS)
