"""Emission of each kernel as linalg on tensors: the implicit-GEMM forms.

Every contraction is one `linalg.generic` whose indexing maps carry the convolution: strided,
dilated window reads are affine expressions (o*s + t*d), layouts are the order of each map's
results, groups are a parallel loop.  The accumulator is f32; a separate elementwise generic
applies the epilogue and the output cast, which IREE fuses into the contraction's dispatch.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from iree.compiler import ir
from iree.compiler.dialects import arith, cf, func, linalg, scf, tensor, util

from ..abi import ASYNC_SUFFIX, INTO_SUFFIX
from ..algebra import Phase
from ..problem import ConvProblem
from .ir import (
    PARALLEL,
    REDUCTION,
    Space,
    activation_axes,
    collapse,
    convert,
    elem_of,
    element_type,
    empty,
    expand,
    insert,
    extract,
    float_const,
    generic,
    multiply_add,
    permute,
    window,
    round_to_fp8_grid,
    shape_of,
    tensor_type,
    sizes_of,
    split_axis,
    weight_axes,
    zeros,
)
from ..kernels.launch import Binary
from .. import policy
from . import bf16x3, extern, fused, gather, gemm
from .plan import KernelPlan

# The epilogue's tensors by argument name (problem.Epilogue.tensors: d, bias, scale, shift, residual)
_Tensors = Mapping[str, ir.Value]
# the arguments with the batch axis, laid out like the activations (the others: w and per-channel vectors)
_ACTIVATION_ARGS = ("x", "dy", "d", "residual", "saved")


def emit_kernel(plan: KernelPlan, binaries: Optional[Mapping[str, Binary]] = None) -> None:
    """Append `func.func @<kernel name>`, its destination-passing twin `@"<name>$into"` (convdsl/abi.py:
    caller-owned result and workspace, so that a call allocates nothing) and that twin with fences,
    `@"<name>$into$async"`, at the current insertion point, after the external executables of a form
    "extern" plan (`binaries`: launch name -> binary)."""
    p = plan.problem
    if plan.extern is not None:
        for launch in plan.extern.launches:
            extern.emit_executable(launch, binaries[launch.name])
    bound = dict(binaries or {})
    arg_types = [
        tensor_type(_signature_shape(p, shape, batched), element_type(dt))
        for shape, dt, batched in zip(p.arg_shapes, p.arg_dtypes, p.arg_batched)
    ]
    result_type = tensor_type(_signature_shape(p, p.result_shape, p.op != "grad_weight"),
                              element_type(p.result_dtype))
    _emit_function(plan, p.name, arg_types, result_type, bound)
    workspace_type = ir.Type.parse("!hal.buffer")
    no_attrs = ir.DictAttr.get({})
    into_arg_attrs = ir.ArrayAttr.get([
        *([no_attrs] * len(arg_types)),
        ir.DictAttr.get({"iree.abi.output": ir.IntegerAttr.get(ir.IndexType.get(), 0)}),
        ir.DictAttr.get({"iree.abi.transients": ir.UnitAttr.get()}),
    ])
    for suffix in (INTO_SUFFIX, INTO_SUFFIX + ASYNC_SUFFIX):
        into = _emit_function(plan, p.name + suffix, [*arg_types, result_type, workspace_type], result_type, bound,
                              coarse_fences=suffix.endswith(ASYNC_SUFFIX))
        into.arg_attrs = into_arg_attrs


def _emit_function(plan: KernelPlan, name: str, arg_types: list[ir.Type], result_type: ir.Type,
                   binaries: Mapping[str, Binary], coarse_fences: bool = False) -> ir.OpView:
    """One function computing `plan` from its leading len(problem.arg_shapes) arguments.  coarse_fences:
    exported with a wait and a signal fence (IREE's "coarse-fences" invocation model, convdsl/abi.py), as a
    util.func: IREE's input conversion keeps no discardable attribute of a func.func, this one included."""
    p = plan.problem
    if coarse_fences:
        fn = util.FuncOp(name, ir.TypeAttr.get(ir.FunctionType.get(arg_types, [result_type])),
                         sym_visibility="public")
        fn.attributes["iree.abi.model"] = ir.StringAttr.get("coarse-fences")
        block = fn.body.blocks.append(*arg_types)
        ret = util.ReturnOp
    else:
        fn = func.FuncOp(name, (arg_types, [result_type]))
        block = fn.add_entry_block()
        ret = func.ReturnOp
    with ir.InsertionPoint(block):
        args = list(block.arguments)[:len(p.arg_shapes)]
        if p.dynamic_batch:
            _assert_one_batch(p, args)
        if p.prologue.kind != "none":
            # dY * act'(saved) before any form reads dY; every form after it sees the operands and the epilogue's
            # tensors, as without a prologue
            args = _prologue(p, args)
        if plan.extern is not None:
            result = _emit_extern(plan, args, binaries)
        elif plan.bf16x3 is not None:
            # compute = "bf16x3": the f32 operands as concatenated bf16 hi/lo blocks, then the bf16 kernel
            # with the tripled reduction; its result is already f32 (or out_dtype) in this kernel's
            # result shape, which does not depend on the tripled axis (see passes/bf16x3.py)
            result = _emit_planned(plan.bf16x3, bf16x3.split_args(p, args))
        else:
            result = _emit_planned(plan, args)
        ret([result])
    return fn


def _assert_one_batch(p: ConvProblem, args: list[ir.Value]) -> None:
    """`batch = ?`: the activation arguments must share one batch size; a deployed module checks it itself (a
    runtime assertion), since a caller of the .vmfb may pass anything."""
    axis = arith.ConstantOp(ir.IndexType.get(), p.batch_axis("x")).result
    activations = [a for a, batched in zip(args, p.arg_batched) if batched]
    first = tensor.DimOp(activations[0], axis).result
    for name, value in zip([n for n, batched in zip(p.arg_names, p.arg_batched) if batched][1:], activations[1:]):
        same = arith.cmpi(arith.CmpIPredicate.eq, first, tensor.DimOp(value, axis).result)
        cf.AssertOp(same, f"{p.name}: argument {name!r} must have the batch size of {p.arg_names[0]!r}")


def _emit_extern(plan: KernelPlan, args: list[ir.Value], binaries: Mapping[str, Binary]) -> ir.Value:
    """The Triton GEMM cores (passes/extern.py) with the epilogue, cast and split-K sum in linalg."""
    p, ext = plan.problem, plan.extern
    assert ext is not None
    if plan.space_to_depth is not None:
        # X and W regrouped by the stream kernel's two copies (kernels/elementwise.space_to_depth), then its forward
        q = plan.space_to_depth.problem
        elem = element_type(p.dtype)
        regrouped = [extern.dispatch(launch, binaries[launch.name], [value], tensor_type(list(shape), elem))
                     for launch, value, shape in zip(ext.launches, args, (q.x_shape, q.w_shape))]
        return _emit_extern(plan.space_to_depth, regrouped, binaries)
    if plan.channels_last is not None:
        return _between_layout_copies(plan, args, lambda inner, moved: _emit_extern(inner, moved, binaries))
    if ext.copied_channels_last:  # NGCHW grad_weight: X copied channels-last, dY read in place
        channels_last = p.with_(layout="NHWGC")
        args = [_relayout(p, channels_last, a) if name in ext.copied_channels_last else a
                for name, a in zip(p.arg_names, args)]
    if ext.weight_axes:  # the launches read a copy of the weight in another axis order (policy.weight_copy_axes)
        args = [args[0], permute(args[1], weight_axes(p), list(ext.weight_axes)), *args[2:]]
    if p.fp8_compute:
        # the operands rounded to their fp8 grids once, stored in f16 (kernels/launch.operand_element)
        args = [_round_operand(plan, args[0], 0), _round_operand(plan, args[1], 1)]
    (launch,) = ext.launches  # every kernel is one launch (grad_input: all its stride phases)
    if p.op == "grad_weight":
        return extern.grad_weight(launch, binaries[launch.name], ext.partials_shape, p, args[0], args[1],
                                  lambda total: _epilogue(p, total, None))
    # forward, grad_input, transposed: the kernel applies a scale epilogue and stores in the result type
    if p.op == "forward":
        result = extern.forward(launch, binaries[launch.name], p, args[0], args[1])
    else:
        result = extern.grad_input(launch, binaries[launch.name], p, args[0], args[1])
    if p.epilogue.steps:
        # the kernel applies a scale at most: the fused steps follow as one elementwise generic on its result, a
        # dispatch of their own (IREE fuses nothing into an external dispatch); Knobs(extern=False) keeps them in
        # the linalg GEMM's dispatch instead, with IREE's slower GEMM
        result = _epilogue_generic(p, result, dict(zip(p.epilogue.tensors, args[2:])), alpha_applied=True)
    return result


def _emit_planned(plan: KernelPlan, args: list[ir.Value]) -> ir.Value:
    if plan.channels_last is not None:
        return _between_layout_copies(plan, args, _emit_op)
    return _emit_op(plan, args)


def _between_layout_copies(plan: KernelPlan, args: list[ir.Value],
                           emit: Callable[[KernelPlan, list[ir.Value]], ir.Value]) -> ir.Value:
    """NGCHW on a GPU: the channels-last plan's kernel (`emit`) between two layout copies (see plan.py);
    the weight keeps its layout."""
    p, inner = plan.problem, plan.channels_last
    names = [n for n in p.arg_names if n != "saved"]  # the prologue has been applied (_prologue)
    moved = [_relayout(p, inner.problem, a) if name in _ACTIVATION_ARGS else a for a, name in zip(args, names)]
    result = emit(inner, moved)
    return _relayout(inner.problem, p, result) if p.result_shape != p.w_shape else result


def _emit_op(plan: KernelPlan, args: list[ir.Value]) -> ir.Value:
    p = plan.problem
    tensors = dict(zip(p.epilogue.tensors, args[2:])) if p.epilogue.tensors else None
    if plan.form == "gather":
        epilogue = lambda acc: _epilogue(p, acc, tensors)  # noqa: E731
        if p.op == "grad_weight":
            return gather.grad_weight(p, args[0], args[1], plan.row_blocks, epilogue)
        if p.op == "forward":
            return gather.forward(p, args[0], args[1], epilogue)
        return gather.grad_input(p, args[0], args[1], epilogue)
    if p.op == "forward":
        return _forward(plan, args[0], args[1], tensors)
    if p.op in ("grad_input", "transposed"):
        # transposed(x, w) is grad_input's arithmetic with x in dY's place
        return _grad_input(plan, args[0], args[1], tensors)
    if plan.form == "im2col":
        return _grad_weight_im2col(plan, args[0], args[1], tensors)
    if plan.form == "depthwise-named":
        return _grad_weight_depthwise_named(plan, args[0], args[1], tensors)
    return _grad_weight(plan, args[0], args[1], tensors)


def _relayout(src: ConvProblem, dst: ConvProblem, value: ir.Value) -> ir.Value:
    """Copy an activation from src's layout to dst's (a transpose as one elementwise generic)."""
    return permute(value, activation_axes(src, "ch"), activation_axes(dst, "ch"))


def _signature_shape(p: ConvProblem, shape: tuple[int, ...], batched: bool) -> list:
    """Argument and result shapes; with `batch = ?` the N axis of activations (`batched`) is dynamic."""
    sizes: list = list(shape)
    if p.dynamic_batch and batched:
        sizes[p.batch_axis("x")] = ir.ShapedType.get_dynamic_size()
    return sizes


# --- shared pieces ------------------------------------------------------------------------------
def _spatial_positions(p: ConvProblem, axes: list[str]) -> list[int]:
    return [axes.index(f"sp{i}") for i in range(p.dims)]


def _round_operand(plan: KernelPlan, value: ir.Value, which: int) -> ir.Value:
    """Round an operand to its fp8 compute type once, before the contraction reads it.

    Native targets get an fp8 tensor (the contraction then runs on fp8 matrix instructions);
    others get the fp8 values stored exactly in f16 (see Target.fp8_native).  Without fp8 compute
    (none, or bf16x3 in a form that keeps f32) the operand is read as it is.
    """
    if not plan.problem.fp8_compute:
        return value
    return _elementwise([value], _operand_elem(plan, which, elem_of(value)),
                        lambda a, _: _round_scalar(plan, a, which))


def _operand_elem(plan: KernelPlan, which: int, elem: ir.Type) -> ir.Type:
    """Element type the contraction reads for operand A (0) or B (1)."""
    compute = plan.problem.compute
    if not plan.problem.fp8_compute:  # bf16x3 is split before the kernel (passes/bf16x3.py)
        return elem
    if plan.target.fp8_native:
        return element_type(plan.target.fp8_type(compute[which]))
    return ir.F16Type.get()


def _round_scalar(plan: KernelPlan, a: ir.Value, which: int) -> ir.Value:
    compute = plan.problem.compute
    if not plan.problem.fp8_compute:
        return a
    out = _operand_elem(plan, which, a.type)
    if plan.target.fp8_native:
        return convert(a, out)
    return convert(round_to_fp8_grid(convert(a, ir.F32Type.get()), compute[which]), out)


def _epilogue(p: ConvProblem, acc: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    """out = cast(steps(alpha * acc (+ beta * D))): one elementwise generic, fused by IREE into the producer."""
    out_elem = element_type(p.result_dtype)
    ep = p.epilogue
    if ep.kind == "none" and not ep.steps and elem_of(acc) == out_elem:
        return acc
    if ep.steps:
        return _epilogue_generic(p, acc, tensors or {}, alpha_applied=False)
    f32 = ir.F32Type.get()

    def body(*elems: ir.Value) -> ir.Value:
        v = elems[0]
        if ep.kind != "none" and ep.alpha != 1.0:
            v = arith.mulf(v, float_const(ep.alpha, f32))
        if ep.has_tensor:
            v = arith.addf(v, arith.mulf(convert(elems[1], f32), float_const(ep.beta, f32)))
        return convert(v, out_elem)

    return _elementwise([acc] + ([tensors["d"]] if ep.has_tensor else []), out_elem, body)


def _epilogue_generic(p: ConvProblem, value: ir.Value, tensors: _Tensors, alpha_applied: bool) -> ir.Value:
    """The whole epilogue (fused steps included) as one elementwise generic over `value`, the convolution's sum in
    the result's layout (or, `alpha_applied`, the external kernel's result: alpha * sum in the result's dtype)."""
    space = Space([(f"d{a}", PARALLEL) for a in range(len(shape_of(value)))])
    inputs, maps, identity = _epilogue_operands(p, tensors, space)
    out = empty(sizes_of(value), element_type(p.result_dtype))
    return generic(space, [value, *inputs], out, [identity, *maps, identity],
                   lambda v, *elems: _epilogue_scalar(p, v, elems[:-1], alpha_applied))


def _epilogue_operands(p: ConvProblem, tensors: _Tensors, space: Space) -> tuple[list[ir.Value], list, ir.Attribute]:
    """The epilogue's tensors in argument order, their maps from `space` (the result's loops in its layout:
    identity for D and the residual, (g, channel) for the per-channel vectors, broadcast over n and space) and
    the identity map."""
    identity = space.access(space.names, {n: space[n] for n in space.names})
    axes = activation_axes(p, "ch")  # the result's axes: forward and transposed results are activations
    channel = ir.AffineMapAttr.get(ir.AffineMap.get(len(space.names), 0, [
        ir.AffineDimExpr.get(axes.index("g")), ir.AffineDimExpr.get(axes.index("ch"))]))
    names = p.epilogue.tensors
    maps = [channel if n in ("bias", "scale", "shift") else identity for n in names]
    return [tensors[n] for n in names], maps, identity


def _epilogue_scalar(p: ConvProblem, v: ir.Value, elems: tuple, alpha_applied: bool) -> ir.Value:
    """The epilogue on one element: `v` the convolution's sum (alpha already applied with `alpha_applied`),
    `elems` the epilogue's tensors' elements in argument order; every step in f32, then the output cast."""
    ep, f32 = p.epilogue, ir.F32Type.get()
    named = {n: convert(e, f32) for n, e in zip(ep.tensors, elems)}
    v = convert(v, f32)
    if not alpha_applied and ep.kind != "none" and ep.alpha != 1.0:
        v = arith.mulf(v, float_const(ep.alpha, f32))
    if ep.has_tensor:
        v = arith.addf(v, arith.mulf(named["d"], float_const(ep.beta, f32)))
    for step in ep.steps:
        v = fused.step(step, v, named)
    return convert(v, element_type(p.result_dtype))


def _prologue(p: ConvProblem, args: list[ir.Value]) -> list[ir.Value]:
    """The arguments with dY replaced by dY * act'(saved), computed in f32 and rounded to dY's dtype (what torch's
    activation backward hands the convolution's backward), and `saved` dropped: one elementwise generic over dY,
    which IREE fuses with dY's consumer where it can."""
    names = list(p.arg_names)
    dy, saved = args[names.index("dy")], args[names.index("saved")]
    f32, elem = ir.F32Type.get(), elem_of(dy)
    act = p.prologue.activation

    def body(g: ir.Value, s: ir.Value, _: ir.Value) -> ir.Value:
        return convert(fused.activation_backward(act, convert(g, f32), convert(s, f32)), elem)

    scaled = _elementwise([dy, saved], elem, body)
    return [scaled if n == "dy" else a for n, a in zip(names, args) if n != "saved"]


def _shape(p: ConvProblem, shape: tuple[int, ...], like: ir.Value) -> list:
    """A static activation shape, with the batch taken from `like` when the batch is dynamic."""
    sizes = list(shape)
    if p.dynamic_batch:
        axis = p.batch_axis("x")
        sizes[axis] = sizes_of(like)[axis]
    return sizes


def _window_maps(p: ConvProblem, space: Space, *shared: str) -> tuple[dict, dict, dict]:
    """Affine exprs of the forward window, per logical axis: (X, Y-or-dY, W).

    X[n, o*s + t*d, g, c], Y[n, o, g, k], W[g, k, t, c]; loops named in `shared` (the split-K
    chunk loop "s") index every activation and the weight alike.
    """
    common = {name: space[name] for name in shared}
    x_map = {**common, "n": space["n"], "g": space["g"]}
    y_map = {**common, "n": space["n"], "g": space["g"]}
    w_map = {**common, "g": space["g"]}
    for i in range(p.dims):
        y_map[f"sp{i}"] = space[f"o{i}"]
        if space.has(f"t{i}"):
            x_map[f"sp{i}"] = space[f"o{i}"] * p.stride[i] + space[f"t{i}"] * p.dilation[i]
            w_map[f"t{i}"] = space[f"t{i}"]
        else:  # a one-tap dim without its (unit) loop: a plain GEMM index
            x_map[f"sp{i}"] = space[f"o{i}"] * p.stride[i]
    if not p.depthwise:
        x_map["ch"], y_map["ch"], w_map["c"], w_map["k"] = space["c"], space["k"], space["c"], space["k"]
    return x_map, y_map, w_map


def _elementwise(inputs: list[ir.Value], out_elem: ir.Type, body) -> ir.Value:
    """One all-parallel generic with identity maps over the (common) shape of `inputs`."""
    rank = len(shape_of(inputs[0]))
    space = Space([(f"d{i}", PARALLEL) for i in range(rank)])
    ident = space.access(space.names, {n: space[n] for n in space.names})
    return generic(space, inputs, empty(sizes_of(inputs[0]), out_elem), [ident] * (len(inputs) + 1), body)


def _x_window(plan: KernelPlan, x: ir.Value, sp: list[int]) -> ir.Value:
    """The padded X that the window reads o*s + t*d index directly: positions [-lo, -lo + extent)."""
    p = plan.problem
    return window(
        x,
        {pos: -lo for pos, lo in zip(sp, plan.x_pad_lo)},
        {pos: i + lo + hi for pos, i, lo, hi in zip(sp, p.input, plan.x_pad_lo, plan.x_pad_hi)},
        plan.pad_form,
    )


def _contraction_space(
    p: ConvProblem,
    out_axes: list[str],
    out_loops: dict[str, str],
    image_axes: list[str],
    reduction_loops: dict[str, str],
) -> Space:
    """Loops in the order of the tensors' memory: parallel loops follow the result's axes,
    reduction loops the image operand's.

    Why: IREE 3.13's CUDA backend miscompiles f16/bf16 implicit GEMMs whose loop order disagrees
    with the layout (convdsl's NGCHW grad_input and forward came out wrong on an H200 with
    (g, n, q, c | j, k); the same op with (n, g, c, q | k, j) is right; see benchmarks/README.md).
    Following the memory order is also the natural order for coalesced tiles.
    """
    # depthwise (C = K = 1) has no K or C loop: a stencil (forward, grad_input) or a plain
    # reduction (grad_weight), bound by memory, never a GEMM with K = 1
    channel_loops = {"k", "c"}
    keep = (lambda loop: loop not in channel_loops) if p.depthwise else (lambda loop: True)
    loops = [(out_loops[a], PARALLEL) for a in out_axes if a in out_loops and keep(out_loops[a])]
    loops += [(reduction_loops[a], REDUCTION) for a in image_axes if a in reduction_loops and keep(reduction_loops[a])]
    return Space(loops)


# --- forward: Y[n, o, g, k] = sum_{t, c} X[n, o*s + t*d - lo, g, c] * W[g, k, t, c] -------------
def _forward(plan: KernelPlan, x: ir.Value, w: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    p = plan.problem
    if plan.form == "im2col":
        return _forward_im2col(plan, x, w, tensors)
    x_axes, y_axes, w_axes = activation_axes(p, "ch"), activation_axes(p, "ch"), weight_axes(p)
    if p.fp8_compute:
        x, w = _round_operand(plan, x, 0), _round_operand(plan, w, 1)
    sp = _spatial_positions(p, x_axes)
    x = _x_window(plan, x, sp)
    o = [f"o{i}" for i in range(p.dims)]
    t = [f"t{i}" for i in range(p.dims)]
    space = _contraction_space(
        p,
        y_axes, {"n": "n", "g": "g", "ch": "k", **{f"sp{i}": o[i] for i in range(p.dims)}},
        x_axes, {"ch": "c", **{f"sp{i}": t[i] for i in range(p.dims)}},
    )
    x_map, y_map, w_map = _window_maps(p, space)
    acc = generic(
        space,
        [x, w],
        zeros(_shape(p, p.y_shape, x), ir.F32Type.get()),
        [space.access(x_axes, x_map), space.access(w_axes, w_map), space.access(y_axes, y_map)],
        multiply_add,
    )
    return _epilogue(p, acc, tensors)


# --- grad_input by stride phases (see convdsl/algebra.py for the derivation) -------------------
def _grad_input(plan: KernelPlan, dy: ir.Value, w: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    p = plan.problem
    if plan.form == "im2col" and policy.cpu_depth_to_space(p, plan.target):
        return _grad_input_depth_to_space(plan, dy, w, tensors)
    dy_axes = activation_axes(p, "ch")
    sp = _spatial_positions(p, dy_axes)
    if p.fp8_compute:
        dy = _round_operand(plan, dy, 0)
    dy = window(
        dy,
        {pos: -lo for pos, lo in zip(sp, plan.dy_pad_lo)},
        {pos: o + lo + hi for pos, o, lo, hi in zip(sp, p.output, plan.dy_pad_lo, plan.dy_pad_hi)},
        plan.pad_form,
    )
    if len(plan.phases) > 1:
        return _grad_input_interleaved(plan, dy, w, tensors, sp)
    # stride 1: one phase with every tap, computed straight into dX's shape
    (phase,) = plan.phases
    full = _shape(p, p.x_shape, dy)
    return _epilogue(p, _grad_input_phase(plan, phase, dy, w, full), tensors)


def _grad_input_interleaved(
    plan: KernelPlan, dy: ir.Value, w: ir.Value, tensors: Optional[_Tensors], sp: list[int]
) -> ir.Value:
    # Each phase's GEMM writes its own compact result R_r[..., q, ...]; one all-parallel generic then
    # interleaves them:  dX[..., i, ...] = R_r[..., i div s, ...]  with  r = i mod s  (per spatial dim).
    # One strided tensor.insert_slice per phase instead was copied by IREE with an element-at-a-time
    # kernel (0.2 ms per phase of the CK 2D example on an H200); this pass reads each R_r and writes dX
    # once, vectorised along the contiguous axis.  An epilogue that reads a tensor (bilinear's D, fused steps'
    # vectors and residual) runs in this pass at dX's own positions (the phases then stay in f32 with alpha
    # applied): fused steps also act where no tap reaches, act(0 + bias) not being 0; other epilogues run in the
    # phase GEMMs.
    p = plan.problem
    ep = p.epilogue
    in_pass = ep.has_tensor or bool(ep.steps)
    f32 = ir.F32Type.get()
    out_elem = element_type(p.result_dtype)
    full = _shape(p, p.x_shape, dy)
    parts: list[tuple[Phase, ir.Value]] = []
    for ph in plan.phases:
        if ph.empty:
            continue  # no tap reaches these positions: dX is zero there (plus beta * D)
        shape = list(full)
        for i, pos in enumerate(sp):
            shape[pos] = ph.dims[i].Q
        acc = _grad_input_phase(plan, ph, dy, w, shape)
        if in_pass:
            alpha = ep.alpha if ep.kind != "none" else 1.0
            scaled = (lambda v, _: arith.mulf(v, float_const(alpha, f32))) if alpha != 1.0 else None
            parts.append((ph, _elementwise([acc], f32, scaled) if scaled else acc))
        else:
            parts.append((ph, _epilogue(p, acc, None)))
    index = ir.IndexType.get()
    rank = len(full)
    space = Space([(f"d{a}", PARALLEL) for a in range(rank)])
    value_elem = f32 if in_pass else out_elem

    def const(v: int) -> ir.Value:
        return arith.ConstantOp(index, v).result

    def body(*elems: ir.Value) -> ir.Value:
        at = [linalg.IndexOp(a).result for a in range(rank)]
        q = {pos: arith.divui(at[pos], const(p.stride[i])) for i, pos in enumerate(sp)}
        r = {pos: arith.remui(at[pos], const(p.stride[i])) for i, pos in enumerate(sp)}
        value = float_const(0.0, value_elem)
        for ph, part in parts:
            coords, match = list(at), None
            for i, pos in enumerate(sp):
                # clamped: every phase is read (then selected), so its index must stay in bounds
                coords[pos] = arith.minui(q[pos], const(ph.dims[i].Q - 1))
                eq = arith.cmpi(arith.CmpIPredicate.eq, r[pos], const(ph.dims[i].r))
                match = eq if match is None else arith.andi(match, eq)
            value = arith.select(match, tensor.extract(part, coords), value)
        if in_pass:  # out = steps(alpha * acc + beta * D), rounded once
            value = _epilogue_scalar(p, value, elems[:-1], alpha_applied=True)
        return value

    if not in_pass:
        identity = space.access(space.names, {n: space[n] for n in space.names})
        return generic(space, [], empty(full, out_elem), [identity], body)
    inputs, maps, identity = _epilogue_operands(p, tensors or {}, space)
    return generic(space, inputs, empty(full, out_elem), [*maps, identity], body)


def _phase_weight(plan: KernelPlan, ph: Phase, w: ir.Value) -> ir.Value:
    """W restricted to the phase's taps, flipped, as a [G, K, J..., C] tensor, or [G, C, J..., K] with
    plan.weight_k_inner (weights are small).  _phase_weight_axes gives the order.

    Tap j' (j' = J-1-j) of the phase is filter tap y0 + (J-1-j')*tap_step; flipping makes the dY
    read q + j'*o_step increase with j', the form of a stride-1 convolution that IREE recognises.
    The flip is a gather (linalg.index + tensor.extract): an indexing map with a negative
    coefficient verifies here but is rejected inside IREE once fused into a dispatch.
    """
    p = plan.problem
    j = [f"j{i}" for i in range(p.dims)]
    space = Space([("g", PARALLEL), ("k", PARALLEL), *[(n, PARALLEL) for n in j], ("c", PARALLEL)])
    out_axes = _phase_weight_axes(plan)
    out_map = {"g": space["g"], "k": space["k"], "c": space["c"], **{f"t{i}": space[j[i]] for i in range(p.dims)}}
    elem = _operand_elem(plan, 1, elem_of(w))
    size = {"g": p.groups, "k": p.out_channels, "c": p.in_channels, **{f"t{i}": ph.taps[i] for i in range(p.dims)}}
    shape = [size[a] for a in out_axes]
    index = ir.IndexType.get()

    def body(_: ir.Value) -> ir.Value:
        loop = {name: linalg.IndexOp(i).result for i, name in enumerate(space.names)}
        coords = {"g": loop["g"], "k": loop["k"], "c": loop["c"]}
        for i, d1 in enumerate(ph.dims):
            # t = y0 + (J-1)*tap_step - j'*tap_step
            top = arith.ConstantOp(index, d1.y0 + (d1.J - 1) * d1.tap_step).result
            step = arith.ConstantOp(index, d1.tap_step).result
            coords[f"t{i}"] = arith.subi(top, arith.muli(loop[j[i]], step))
        value = tensor.extract(w, [coords[a] for a in weight_axes(p)])
        return _round_scalar(plan, value, 1) if p.fp8_compute else value

    return generic(space, [], empty(shape, elem), [space.access(out_axes, out_map)], body)


def _phase_weight_axes(plan: KernelPlan) -> list[str]:
    taps = [f"t{i}" for i in range(plan.problem.dims)]
    if plan.form == "im2col":
        return ["g", *taps, "k", "c"]  # the GEMM's B: rows (taps, K), columns C
    if plan.form == "depthwise-named":
        return [*taps, "g", "k", "c"]  # the named depthwise op's filter [taps.., G] (K = C = 1)
    return ["g", "c", *taps, "k"] if plan.weight_k_inner else ["g", "k", *taps, "c"]


def _grad_input_phase(plan: KernelPlan, ph: Phase, dy: ir.Value, w: ir.Value, shape: list[int]) -> ir.Value:
    if plan.form == "im2col":
        return _grad_input_phase_im2col(plan, ph, dy, w, shape)
    if plan.form == "depthwise-named":
        return _grad_input_phase_depthwise_named(plan, ph, dy, w, shape)
    # dX[n, s*q + r, g, c] = sum_{j', k} dYpad[n, q + base + j'*o_step, g, k] * Wphase[g, k, j', c]
    # with base = off - (J-1)*o_step + pad_lo: the window of dY this phase reads starts there.
    # (Wphase is stored [g, c, j', k] with plan.weight_k_inner: the same values, K innermost.)
    p = plan.problem
    dy_axes = activation_axes(p, "ch")
    wph = _phase_weight(plan, ph, w)
    window = _phase_window(plan, ph, dy)
    q = [f"q{i}" for i in range(p.dims)]
    j = [f"j{i}" for i in range(p.dims)]
    space = _contraction_space(
        p,
        dy_axes, {"n": "n", "g": "g", "ch": "c", **{f"sp{i}": q[i] for i in range(p.dims)}},
        dy_axes, {"ch": "k", **{f"sp{i}": j[i] for i in range(p.dims)}},
    )
    dy_map = {"n": space["n"], "g": space["g"]}
    for i in range(p.dims):
        dy_map[f"sp{i}"] = space[q[i]] + space[j[i]] * ph.dims[i].o_step
    w_map = {"g": space["g"], **{f"t{i}": space[j[i]] for i in range(p.dims)}}
    dx_map = {"n": space["n"], "g": space["g"], **{f"sp{i}": space[q[i]] for i in range(p.dims)}}
    if not p.depthwise:
        dy_map["ch"], w_map["k"], w_map["c"], dx_map["ch"] = space["k"], space["k"], space["c"], space["c"]
    wph_axes = _phase_weight_axes(plan)
    return generic(
        space,
        [window, wph],
        zeros(shape, ir.F32Type.get()),
        [space.access(dy_axes, dy_map), space.access(wph_axes, w_map), space.access(dy_axes, dx_map)],
        multiply_add,
    )


# --- grad_weight with split-K -----------------------------------------------------------------
def _grad_weight(plan: KernelPlan, x: ir.Value, dy: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    # dW[g, k, t, c] = sum_{n, o} X[n, o*s + t*d - lo, g, c] * dY[n, o, g, k]
    # The reduction (n, o...) is cut into S chunks; each yields an f32 partial, and one more generic
    # sums the partials in chunk order (deterministic), then the epilogue casts.
    p = plan.problem
    x_axes = activation_axes(p, "ch")
    sp = _spatial_positions(p, x_axes)
    n_pos = x_axes.index("n")
    if p.fp8_compute:
        x, dy = _round_operand(plan, x, 0), _round_operand(plan, dy, 1)
    x = _x_window(plan, x, sp)
    dy_axes = activation_axes(p, "ch")
    sizes = {b - a for a, b in plan.split.chunks}
    if len(plan.split.chunks) == 1:
        # no split: the whole (possibly dynamic) batch in one contraction
        return _epilogue(p, _grad_weight_chunk(plan, x, dy, dy_axes), tensors)
    if len(sizes) == 1:
        return _grad_weight_uniform_split(plan, x, dy, dy_axes, tensors)
    partials = []
    dy_n = dy_axes.index("n")
    for a, b in plan.split.chunks:
        x_off, x_size = [0] * len(shape_of(x)), sizes_of(x)
        y_off, y_size = [0] * len(shape_of(dy)), sizes_of(dy)
        x_off[n_pos], x_size[n_pos] = a, b - a
        y_off[dy_n], y_size[dy_n] = a, b - a
        partials.append(
            _grad_weight_chunk(
                plan, extract(x, x_off, x_size, [1] * len(x_off)), extract(dy, y_off, y_size, [1] * len(y_off)),
                dy_axes,
            )
        )
    # Uneven chunks: one elementwise generic adds the S partials, left to right (deterministic).
    # (Stacking them with tensor.insert_slice into one [S, ...] tensor fails to bufferize on CUDA.)
    def add_in_order(*elems: ir.Value) -> ir.Value:
        total = elems[0]
        for v in elems[1:-1]:
            total = arith.addf(total, v)
        return total

    return _epilogue(p, _elementwise(partials, ir.F32Type.get(), add_in_order), tensors)


def _sum_partials(p: ConvProblem, stacked: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    """dW = epilogue(sum_s P[s]): the partials are added in chunk order, so every run gives the same bits."""
    f32 = ir.F32Type.get()
    wshape = list(p.w_shape)
    space = Space([(f"d{i}", PARALLEL) for i in range(len(wshape))] + [("s", REDUCTION)])
    in_map = space.access(["s", *space.names[:-1]], {n: space[n] for n in space.names})
    out_map = space.access(space.names[:-1], {n: space[n] for n in space.names})
    total = generic(space, [stacked], zeros(wshape, f32), [in_map, out_map], lambda v, acc: arith.addf(acc, v))
    return _epilogue(p, total, tensors)


def _grad_weight_uniform_split(
    plan: KernelPlan, x: ir.Value, dy: ir.Value, dy_axes: list[str], tensors: Optional[_Tensors]
) -> ir.Value:
    """Equal chunks along the batch: one generic with a parallel chunk loop s.

    N = S * B: X[.., n, ..] is viewed as X[.., s, b, ..] (tensor.expand_shape, no copy), and
    P[s, g, k, t, c] = sum_{b, o} X[.., s, b, o*s + t*d, ..] * dY[.., s, b, o, ..] in one dispatch whose
    parallel extent is S times the weight's: the S partials fill the GPU when G*K*C*taps alone cannot.
    """
    p = plan.problem
    parts = plan.split.parts
    x_axes, w_axes = activation_axes(p, "ch"), weight_axes(p)
    n_pos, dy_n = x_axes.index("n"), dy_axes.index("n")
    xs = split_axis(x, n_pos, parts)
    dys = split_axis(dy, dy_n, parts)
    split_axes = x_axes[:n_pos] + ["s", "n"] + x_axes[n_pos + 1:]
    dy_split_axes = dy_axes[:dy_n] + ["s", "n"] + dy_axes[dy_n + 1:]
    o = [f"o{i}" for i in range(p.dims)]
    out_axes = ["s", *w_axes]
    space = _contraction_space(
        p,
        out_axes, {"s": "s", "g": "g", "k": "k", "c": "c", **_tap_loops(plan)},
        split_axes, {"n": "n", **{f"sp{i}": o[i] for i in range(p.dims)}},
    )
    x_map, y_map, w_map = _window_maps(p, space, "s")
    operands = _image_first(plan, (xs, space.access(split_axes, x_map)), (dys, space.access(dy_split_axes, y_map)))
    stacked = generic(
        space,
        [v for v, _ in operands],
        zeros([parts, *p.w_shape], ir.F32Type.get()),
        [*(m for _, m in operands), space.access(out_axes, w_map)],
        multiply_add,
    )
    return _sum_partials(p, stacked, tensors)


def _grad_weight_chunk(plan: KernelPlan, x: ir.Value, dy: ir.Value, dy_axes: list[str]) -> ir.Value:
    p = plan.problem
    x_axes, w_axes = activation_axes(p, "ch"), weight_axes(p)
    o = [f"o{i}" for i in range(p.dims)]
    space = _contraction_space(
        p,
        w_axes, {"g": "g", "k": "k", "c": "c", **_tap_loops(plan)},
        x_axes, {"n": "n", **{f"sp{i}": o[i] for i in range(p.dims)}},
    )
    x_map, y_map, w_map = _window_maps(p, space)
    operands = _image_first(plan, (x, space.access(x_axes, x_map)), (dy, space.access(dy_axes, y_map)))
    return generic(
        space,
        [v for v, _ in operands],
        zeros(p.w_shape, ir.F32Type.get()),
        [*(m for _, m in operands), space.access(w_axes, w_map)],
        multiply_add,
    )


def _tap_loops(plan: KernelPlan) -> dict[str, str]:
    """grad_weight's tap loops by weight axis; a GPU 1x1 (plan.dy_first) has none: it is a plain GEMM."""
    if plan.dy_first:
        return {}
    return {f"t{i}": f"t{i}" for i in range(plan.problem.dims)}


def _image_first(plan: KernelPlan, x_operand: tuple, dy_operand: tuple) -> tuple:
    """(value, map) of grad_weight's two operands in contraction order.

    X (the image) goes first: IREE's CUDA backend only recognises the implicit GEMM that way, except
    for a 1x1 filter on GPUs (plan.dy_first), a plain matmul that it gets wrong with X first.
    """
    return (dy_operand, x_operand) if plan.dy_first else (x_operand, dy_operand)


# --- the CPU form "im2col": window gather + named matmul (passes/gemm.py) -------------------------
def _phase_window(plan: KernelPlan, ph: Phase, dy: ir.Value, extra_last: int = 0) -> ir.Value:
    """The part of the padded dY that phase `ph` reads: from off - (J-1)*o_step + pad_lo, Q + (J-1)*o_step long
    (`extra_last` more along the innermost spatial dimension)."""
    p = plan.problem
    sp = _spatial_positions(p, activation_axes(p, "ch"))
    full = sizes_of(dy)
    offsets, sizes = [0] * len(full), list(full)
    for i, pos in enumerate(sp):
        d1 = ph.dims[i]
        offsets[pos] = d1.off - (d1.J - 1) * d1.o_step + plan.dy_pad_lo[i]
        sizes[pos] = d1.Q + (d1.J - 1) * d1.o_step
    sizes[sp[-1]] += extra_last
    return extract(dy, offsets, sizes, [1] * len(full))


def _to_activation(p: ConvProblem, value: ir.Value, axes: list[str]) -> ir.Value:
    """[G, N, S..., CH] (logical axes g, n, sp.., ch) in the problem's activation layout: a reshape where only
    the unit G axis moves (one group, NHWGC or GNHWC), else a transpose (one elementwise generic)."""
    src = ["g", "n", *[f"sp{i}" for i in range(p.dims)], "ch"]
    if p.groups == 1 and [a for a in axes if a != "g"] == src[1:]:
        shape = shape_of(value)
        return _reshape_unit_g(value, src, axes, [shape[src.index(a)] for a in axes])
    return permute(value, src, axes)


def _reshape_unit_g(value: ir.Value, src: list[str], axes: list[str], target: list[int]) -> ir.Value:
    # [1, N, S..., CH] -> the layout with the unit G axis elsewhere: collapse to [N*S..., CH], then expand,
    # putting G with the rows (GNHWC: before N) or with the channels (NHWGC: just before CH)
    rows = collapse(value, [list(range(0, len(src) - 1)), [len(src) - 1]])
    last_row = max(axes.index(a) for a in src[1:-1])
    groups = [list(range(0, last_row + 1)), list(range(last_row + 1, len(axes)))]
    return expand(rows, groups, target)


def _grad_input_phase_im2col(plan: KernelPlan, ph: Phase, dy: ir.Value, w: ir.Value, shape: list[int]) -> ir.Value:
    # One stride phase as a GEMM over the rows m = (n, q) and the reduction (j', k):
    #   dYcol[g, (n, q), (j', k)] = dYwin[n, q + j'*o_step, g, k]          (window gather)
    #   R[g, (n, q), c] = sum_{(j', k)} dYcol[g, (n, q), (j', k)] * Wphase[g, (j', k), c]   (matmul)
    # then R in the layout of dX's phase positions: dX[n, s*q + r, g, c] = R[g, (n, q), c].
    p = plan.problem
    dy_axes = activation_axes(p, "ch")
    grouped = p.groups > 1
    win = _phase_window(plan, ph, dy)
    q = [f"q{i}" for i in range(p.dims)]
    j = [f"j{i}" for i in range(p.dims)]
    space = gemm.parallel_space(["g", "n", *q, *j, "k"])
    dy_map = {"n": space["n"], "g": space["g"], "ch": space["k"]}
    for i in range(p.dims):
        dy_map[f"sp{i}"] = space[q[i]] + space[j[i]] * ph.dims[i].o_step
    batch = sizes_of(dy)[p.batch_axis("y")]
    col = gemm.gather(win, dy_axes, dy_map, space,
                      [p.groups, batch, *[d.Q for d in ph.dims], *ph.taps, p.out_channels], taps=j)
    a = gemm.as_matrices(col, 1 + p.dims, grouped)
    b = gemm.as_matrices(_phase_weight(plan, ph, w), p.dims + 1, grouped)  # [G, (j', k), C]
    out = gemm.matmul(a, b)
    logical = [p.groups, batch, *[d.Q for d in ph.dims], p.in_channels]
    return _to_activation(p, gemm.from_matrices(out, logical, 1 + p.dims, grouped), dy_axes)


def _grad_input_depth_to_space(plan: KernelPlan, dy: ir.Value, w: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    # stride = filter, dilation 1 (policy.cpu_depth_to_space): the windows do not overlap, so every dX position
    # i = s*q + j - lo is reached by one (q, j) and grad_input is one GEMM per group with W as it lies:
    #   R[g, (n, q), (j, c)] = sum_k dY[n, q, g, k] * W[g, k, j, c]     (matmul; (c, j) columns for GKCYX)
    #   D[n, s*q + j, g, c] = R[g, (n, q), (j, c)]                     (depth-to-space: one transpose)
    #   dX[n, i, g, c] = D[n, i + lo, g, c], 0 past D                  (a crop / zero border only where padded)
    # dY is a reshape where its axes come as (g,) n, q.., k (NHWGC with one group, GNHWC), else one transpose.
    p = plan.problem
    dy_axes = activation_axes(p, "ch")
    grouped = p.groups > 1
    batch = sizes_of(dy)[p.batch_axis("y")]
    sp = [f"sp{i}" for i in range(p.dims)]
    rows = ["g", "n", *sp, "ch"]
    if dy_axes == rows or (not grouped and [a for a in dy_axes if a != "g"] == rows[1:]):
        last = len(dy_axes) - 1  # [G, N*Q, K] (GNHWC), or [N*Q, K] with the unit G among the rows
        a = collapse(dy, [[0], list(range(1, last)), [last]] if grouped else [list(range(last)), [last]])
    else:
        q = [f"q{i}" for i in range(p.dims)]
        space = gemm.parallel_space(["g", "n", *q, "k"])
        dy_map = {"n": space["n"], "g": space["g"], "ch": space["k"], **{s: space[t] for s, t in zip(sp, q)}}
        col = gemm.gather(dy, dy_axes, dy_map, space, [p.groups, batch, *p.output, p.out_channels])
        a = gemm.as_matrices(col, 1 + p.dims, grouped)
    w_axes = weight_axes(p)  # [g, k, (taps, c) or (c, taps)]
    b = collapse(w, [[0], [1], list(range(2, len(w_axes)))] if grouped else [[0, 1], list(range(2, len(w_axes)))])
    out = gemm.matmul(a, b)
    size = {"c": p.in_channels, **{f"t{i}": f for i, f in enumerate(p.filter)}}
    r_axes = ["g", "n", *[f"q{i}" for i in range(p.dims)], *w_axes[2:]]
    r = gemm.from_matrices(out, [p.groups, batch, *p.output, *[size[x] for x in w_axes[2:]]], 1 + p.dims, grouped)
    d_axes: list[str] = []
    for x in dy_axes:
        d_axes += [x.replace("sp", "q"), x.replace("sp", "t")] if x.startswith("sp") else ["c" if x == "ch" else x]
    d = permute(r, r_axes, d_axes)
    merged, at = [], 0
    for x in dy_axes:
        width = 2 if x.startswith("sp") else 1
        merged.append(list(range(at, at + width)))
        at += width
    d = collapse(d, merged)  # [.., s*Q, ..] in dX's layout
    x_sp = _spatial_positions(p, dy_axes)
    full = _shape(p, p.x_shape, dy)
    d = window(d, {pos: lo for pos, lo in zip(x_sp, p.pad_lo)}, {pos: full[pos] for pos in x_sp}, plan.pad_form)
    return _epilogue(p, d, tensors)


def _forward_im2col(plan: KernelPlan, x: ir.Value, w: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    # Y as one GEMM per group over the rows m = (n, o):
    #   Xcol[g, (n, o), (t, c)] = Xpad[n, o*s + t*d, g, c]                  (window gather)
    #   Wcol[g, (t, c), k] = W[g, k, t, c]                                   (a copy of the small weight)
    #   Y[g, (n, o), k] = sum_{(t, c)} Xcol[g, (n, o), (t, c)] * Wcol[g, (t, c), k]   (matmul)
    # then Y in the activation layout (a reshape where only a unit G moves).
    p = plan.problem
    x_axes = activation_axes(p, "ch")
    grouped = p.groups > 1
    x = _x_window(plan, x, _spatial_positions(p, x_axes))
    o = [f"o{i}" for i in range(p.dims)]
    t = [f"t{i}" for i in range(p.dims)]
    batch = sizes_of(x)[x_axes.index("n")]
    space = gemm.parallel_space(["g", "n", *o, *t, "c"])
    x_map = {"n": space["n"], "g": space["g"], "ch": space["c"]}
    for i in range(p.dims):
        x_map[f"sp{i}"] = space[o[i]] * p.stride[i] + space[t[i]] * p.dilation[i]
    col = gemm.gather(x, x_axes, x_map, space, [p.groups, batch, *p.output, *p.filter, p.in_channels], taps=t)
    w_space = gemm.parallel_space(["g", *t, "c", "k"])
    wcol = gemm.gather(w, weight_axes(p), {a: w_space[a] for a in ["g", "k", "c", *t]}, w_space,
                       [p.groups, *p.filter, p.in_channels, p.out_channels])
    out = gemm.matmul(gemm.as_matrices(col, 1 + p.dims, grouped), gemm.as_matrices(wcol, p.dims + 1, grouped))
    logical = [p.groups, batch, *p.output, p.out_channels]
    return _epilogue(p, _to_activation(p, gemm.from_matrices(out, logical, 1 + p.dims, grouped), x_axes), tensors)


def _grad_weight_im2col(plan: KernelPlan, x: ir.Value, dy: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    # dW as one GEMM per group over the rows m = (n, o):
    #   Xcol[g, (n, o), (t, c)] = Xpad[n, o*s + t*d, g, c]                 (window gather; (c, t) for GKCYX)
    #   dYt[g, k, (n, o)] = dY[n, o, g, k]                                (transpose)
    #   dW[g, k, (t, c)] = sum_{(n, o)} dYt[g, k, (n, o)] * Xcol[g, (n, o), (t, c)]   (matmul)
    # Split (plan.row_chunks = H > 1): o0 = h * R + r with R = O0 / H rows per chunk, the chunks (n, h) a batch
    # before the groups, each its own GEMM over its rows (r, o1..) into f32 partials P[(n, h), g, k, (t, c)],
    # summed in chunk order after:
    #   Xcol[(n, h, g), (r, o1..), (t, c)] = Xpad[n, (h*R + r)*s0 + t0*d0, o1*s1 + t1*d1.., g, c]
    #   dYt[(n, h, g), k, (r, o1..)] = dY[n, h*R + r, o1.., g, k]
    p = plan.problem
    x_axes, w_axes = activation_axes(p, "ch"), weight_axes(p)
    sp = _spatial_positions(p, x_axes)
    grouped = p.groups > 1
    x = _x_window(plan, x, sp)
    o = [f"o{i}" for i in range(p.dims)]
    inner = w_axes[2:]  # the weight's column axes in its layout: t0.., c or c, t0..
    size = {"c": p.in_channels, **{f"t{i}": p.filter[i] for i in range(p.dims)}}
    batch = sizes_of(x)[x_axes.index("n")]
    split = plan.row_chunks > 1
    rows = p.output[0] // plan.row_chunks
    # the gathers' loops: the chunk (n, h) and the group lead when split, the group leads otherwise
    lead = ["n", "h", "g"] if split else ["g", "n"]
    lead_sizes = [batch, plan.row_chunks, p.groups] if split else [p.groups, batch]
    positions = ["r", *o[1:]] if split else o

    def output_row(space: Space) -> ir.AffineExpr:
        return space["h"] * rows + space["r"] if split else space["o0"]

    space = gemm.parallel_space([*lead, *positions, *inner])
    x_map = {"n": space["n"], "g": space["g"], "ch": space["c"]}
    for i in range(p.dims):
        out_i = output_row(space) if i == 0 else space[o[i]]
        x_map[f"sp{i}"] = out_i * p.stride[i] + space[f"t{i}"] * p.dilation[i]
    position_sizes = [rows, *p.output[1:]] if split else list(p.output)
    # tap slices unsplit only: split into row chunks the generic is faster, IREE fusing it into data tiling's
    # packing copy (docs/decisions.md#cpu-tap-slices)
    col = gemm.gather(x, x_axes, x_map, space, [*lead_sizes, *position_sizes, *[size[a] for a in inner]],
                      taps=() if split else [f"t{i}" for i in range(p.dims)])
    # dYt's rows k right after the batch of its GEMMs: (n, h, g) split, g otherwise (then n leads the columns)
    dy_lead, dy_sizes = (lead, lead_sizes) if split else (["g"], [p.groups])
    dy_cols, dy_col_sizes = (positions, position_sizes) if split else (["n", *o], [batch, *p.output])
    dy_space = gemm.parallel_space([*dy_lead, "k", *dy_cols])
    dy_map = {"n": dy_space["n"], "g": dy_space["g"], "ch": dy_space["k"],
              **{f"sp{i}": output_row(dy_space) if i == 0 else dy_space[o[i]] for i in range(p.dims)}}
    dy_axes = activation_axes(p, "ch")
    if split:
        # dY's first output axis split into (chunk h, row r) by a reshape first, so that the transpose reads it
        # through a permutation (IREE's llvm-cpu backend ran the h * R + r map at 0.3 GB/s: #cpu-split-k)
        at = dy_axes.index("sp0")
        dy_shape = sizes_of(dy)
        dy = expand(dy, [[i] if i < at else [at, at + 1] if i == at else [i + 1] for i in range(len(dy_shape))],
                    [*dy_shape[:at], plan.row_chunks, rows, *dy_shape[at + 1:]])
        dy_axes = [*dy_axes[:at], "sp0h", "sp0r", *dy_axes[at + 1:]]
        del dy_map["sp0"]
        dy_map.update(sp0h=dy_space["h"], sp0r=dy_space["r"])
    dyt = gemm.materialised(gemm.gather(dy, dy_axes, dy_map, dy_space, [*dy_sizes, p.out_channels, *dy_col_sizes]))
    if not split:
        a = gemm.as_matrices(dyt, 1, grouped)  # [G, K, M]
        b = gemm.as_matrices(col, 1 + p.dims, grouped)  # [G, M, (t, c)]
        dw = gemm.from_matrices(gemm.matmul(a, b), list(p.w_shape), 1, grouped)
        return _epilogue(p, dw, tensors)
    # [(n, h, g), K, M] x [(n, h, g), M, (t, c)]: one batch_matmul over chunks and groups
    a = collapse(dyt, [[0, 1, 2], [3], list(range(4, 4 + p.dims))])
    b = collapse(col, [[0, 1, 2], list(range(3, 3 + p.dims)), list(range(3 + p.dims, 3 + p.dims + len(inner)))])
    partials = gemm.matmul(a, b)  # [(n, h, g), K, (t, c)] in f32
    chunks = batch * plan.row_chunks
    stacked = expand(partials, [[0, 1], [2], list(range(3, 3 + len(inner)))],
                     [chunks, p.groups, p.out_channels, *[size[a] for a in inner]])
    return _sum_partials(p, stacked, tensors)


# --- the CPU form "depthwise-named": grad_input of a depthwise convolution as IREE's named depthwise op ----
_DEPTHWISE_OPS = {1: linalg.depthwise_conv_1d_nwc_wc, 2: linalg.depthwise_conv_2d_nhwc_hwc,
                  3: linalg.depthwise_conv_3d_ndhwc_dhwc}
# depthwise-named grad_weight: images per step of its loop over the batch, and the most images it unrolls instead
# (see _grad_weight_depthwise_named)
IMAGES_PER_STEP = 1
UNROLLED_MOST_IMAGES = 7


def _grad_input_phase_depthwise_named(plan: KernelPlan, ph: Phase, dy: ir.Value, w: ir.Value,
                                      shape: list[int]) -> ir.Value:
    # One stride phase of a depthwise grad_input (NHWGC, K = C = 1) is a stride-1 depthwise correlation
    #   dX_r[n, q, g] = sum_j' dYwin[n, q + j'*o_step, g] * Wphase[j', g]
    # i.e. linalg.depthwise_conv_Nd_n..c_..c with dilation o_step, which IREE's CPU pipeline vectorises along G.
    # The innermost q may run further (plan.depthwise_widths; its dY border reaches that far), the extra positions
    # dropped.
    p = plan.problem
    q = [d.Q for d in ph.dims]
    q_out = [*q[:-1], plan.depthwise_widths[plan.phases.index(ph)]]
    win = _phase_window(plan, ph, dy, q_out[-1] - q[-1])  # [N, S.., G, 1]
    rank = len(shape_of(win))
    channels = [[a] for a in range(rank - 2)] + [[rank - 2, rank - 1]]  # (G, 1) -> G
    image = collapse(win, channels)
    wph = _phase_weight(plan, ph, w)  # [J.., G, 1, 1]
    filt = collapse(wph, [[a] for a in range(p.dims)] + [[p.dims, p.dims + 1, p.dims + 2]])
    out = zeros([shape[0], *q_out, p.groups], ir.F32Type.get())
    acc = _DEPTHWISE_OPS[p.dims](image, filt, outs=[out], strides=[1] * p.dims,
                                 dilations=[d.o_step for d in ph.dims])
    if q_out != q:
        acc = extract(acc, [0] * (p.dims + 2), [shape[0], *q, p.groups], [1] * (p.dims + 2))
    return expand(acc, channels, shape)


def _grad_weight_depthwise_named(plan: KernelPlan, x: ir.Value, dy: ir.Value, tensors: Optional[_Tensors]) -> ir.Value:
    # grad_weight with few channels per group (NHWGC; depthwise: K = C = 1), per spatial dim i (stride s,
    # dilation d):
    #   dW[g, k, t, c] = sum_n sum_o Xpad_n[o*s + t*d, g, c] * dY[n, o, g, k]     Xpad_n: image n of X from -lo
    # For one image n and one k this is a depthwise correlation over the G*C channels (g, c), whose "image" is
    # Xpad_n, whose "filter" is dY[n]'s channel k of each group repeated along c, and whose output positions are
    # the taps t:
    #   D_nk[0, t, (g, c)] = sum_o Img[0, t*d + o*s, (g, c)] * Flt_k[o, (g, c)]
    #   Img = Xpad_n [1, P.., G*C],  Flt_k[o, (g, c)] = dY[n, o, g, k]
    # i.e. linalg.depthwise_conv_Nd_n..c_..c with strides = d (the step between output positions t) and
    # dilations = s (the step between filter positions o); Img's extent (O-1)*s + (R-1)*d + 1 is x_window's.
    # The images' convolutions accumulate into one [1, R.., G*C] tensor per k in batch order (each takes the
    # last one's result as its init), so dW[g, k, t, c] = D_k[0, t, (g, c)] with no partials.  Batches of
    # more than UNROLLED_MOST_IMAGES run as an scf.for over steps of IMAGES_PER_STEP images, the rest unrolled:
    # unrolling every image is slow to compile, a loop costs a little at small batches, and one image per step ran
    # faster than four at large ones (docs/decisions.md#cpu-few-channel-f16).  Each image's zero
    # border is its own tensor.pad (plan.pad_form "fuse"), which IREE fuses into that image's convolution: a padded
    # copy of X cost as much as the convolutions (docs/decisions.md#cpu-depthwise-wgrad); with K > 1 it feeds K
    # convolutions, and IREE copies it once.  The batch stays out of the channels: folding it in (one convolution
    # over N*G channels) needed transposed copies of X and dY and ran slower.
    p = plan.problem
    f32 = ir.F32Type.get()
    if elem_of(x) != f32 and not p.depthwise:
        # few channels per group: 16-bit operands widened to f32 first, one pass each: IREE's CPU depthwise
        # convolution is much slower on them (docs/decisions.md#cpu-few-channel-f16); depthwise, IREE fuses the
        # widening into the convolution and its CPU codegen then fails (vectors too large)
        x, dy = (_elementwise([v], f32, lambda e, _: convert(e, f32)) for v in (x, dy))
    c_count, k_count = p.in_channels, p.out_channels
    axes = activation_axes(p, "ch")  # n, sp.., g, ch (NHWGC)
    sp = _spatial_positions(p, axes)
    rank = len(axes)
    merge_channels = [[a] for a in range(rank - 2)] + [[rank - 2, rank - 1]]  # (G, C) -> G*C
    index = ir.IndexType.get()
    outs = [f"o{i}" for i in range(p.dims)]

    def const(v: int) -> ir.Value:
        return arith.ConstantOp(index, v).result

    channels, padded = p.groups * c_count, plan.depthwise_channels
    # the taps each convolution computes: the innermost dimension's maybe widened (policy.cpu_depthwise_width),
    # the extra taps reading zeros past the border, dropped at the end
    taps_out = [*p.filter[:-1], plan.depthwise_taps or p.filter[-1]]
    extra = (taps_out[-1] - p.filter[-1]) * p.dilation[-1]

    def filter_for(n: ir.Value, k: int) -> ir.Value:  # Flt_k of image n: [O.., G*C], zero channels to `padded`
        channel = _image(dy, n, k)  # [1, O.., G, 1]
        if c_count == 1:
            flat = collapse(channel, [[0, 1], *merge_channels[2:]])
        else:
            space = Space([*[(o, PARALLEL) for o in outs], ("g", PARALLEL), ("c", PARALLEL)])
            loops = {a: space[a] for a in [*outs, "g", "c"]}
            repeated = generic(space, [channel], empty([*p.output, p.groups, c_count], elem_of(dy)),
                               [space.access(["u", *outs, "g", "u"], loops),
                                space.access([*outs, "g", "c"], loops)], lambda v, _: v)
            flat = collapse(repeated, [[i] for i in range(p.dims)] + [[p.dims, p.dims + 1]])
        return flat if padded == channels else window(flat, {p.dims: 0}, {p.dims: padded}, "fuse")

    def convolve(accs: list[ir.Value], n: ir.Value) -> list[ir.Value]:  # acc_k + D_nk for each k
        # the channels merged before the border is added (a tensor.pad feeding a collapse is not fused into the
        # convolution: IREE copied each padded image with its slow memcpy), and zero channels up to `padded`
        flat = collapse(_image(x, n), merge_channels)  # [1, I.., G*C]
        starts = {pos: -lo for pos, lo in zip(sp, plan.x_pad_lo)}
        sizes = {pos: i + lo + hi for pos, i, lo, hi in zip(sp, p.input, plan.x_pad_lo, plan.x_pad_hi)}
        sizes[sp[-1]] += extra
        image = window(flat, {**starts, p.dims + 1: 0}, {**sizes, p.dims + 1: padded}, plan.pad_form)
        return [_DEPTHWISE_OPS[p.dims](image, filter_for(n, k), outs=[acc], strides=list(p.dilation),
                                       dilations=list(p.stride)) for k, acc in enumerate(accs)]

    step = IMAGES_PER_STEP
    looped = p.batch - p.batch % step if p.batch > UNROLLED_MOST_IMAGES else 0
    accs = [zeros([1, *taps_out, padded], ir.F32Type.get()) for _ in range(k_count)]
    if looped:
        loop = scf.ForOp(const(0), const(looped), const(step), accs)
        with ir.InsertionPoint(loop.body):
            first, inner = loop.induction_variable, list(loop.inner_iter_args)
            for j in range(step):
                inner = convolve(inner, arith.addi(first, const(j)) if j else first)
            scf.YieldOp(inner)
        accs = list(loop.results)
    for n in range(looped, p.batch):
        accs = convolve(accs, const(n))
    # D_k[0, t.., g*C + c] -> dW[g, k, t.., c] in the weight layout, through a [K, 1, R.., padded] stack
    stack = empty([k_count, 1, *taps_out, padded], ir.F32Type.get())
    for k, acc in enumerate(accs):
        stack = insert(acc, stack, [k] + [0] * (p.dims + 2), [1] * (p.dims + 3), [1, 1, *taps_out, padded])
    stack = extract(stack, [0] * (p.dims + 3), [k_count, 1, *p.filter, channels], [1] * (p.dims + 3))
    taps = [f"t{i}" for i in range(p.dims)]
    space = Space([("g", PARALLEL), ("k", PARALLEL), *[(t, PARALLEL) for t in taps], ("c", PARALLEL)])
    loops = {a: space[a] for a in ["g", "k", *taps, "c"]}
    loops["ch"] = space["g"] * c_count + space["c"]
    dw = generic(space, [stack], empty(list(p.w_shape), ir.F32Type.get()),
                 [space.access(["k", "u", *taps, "ch"], loops), space.access(weight_axes(p), loops)],
                 lambda v, _: v)
    return _epilogue(p, dw, tensors)


def _image(value: ir.Value, n: ir.Value, channel: Optional[int] = None) -> ir.Value:
    """Image n (an index value) of an activation whose first axis is the batch: [1, ...] (tensor.extract_slice);
    with `channel`, only that channel of the last axis: [1, ..., 1]."""
    sizes = shape_of(value)
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    last = [] if channel is None else [channel]
    out = [1, *sizes[1:]] if channel is None else [1, *sizes[1:-1], 1]
    return tensor.extract_slice(tensor_type(out, elem_of(value)), value, [n], [], [],
                                [dynamic] + [0] * (len(sizes) - 1 - len(last)) + last, out, [1] * len(sizes))
