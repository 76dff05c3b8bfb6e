"""torch.compile without convert(): a backend under which Inductor compiles a model's convolutions as convdsl's.

    import convdsl.torch
    compiled = torch.compile(model, backend="convdsl")    # the model's torch.nn convolutions, untouched

This is Inductor with lowerings of its own: aten.convolution becomes convdsl's forward or transposed-convolution
operator, and aten.convolution_backward convdsl's grad_input / grad_weight operators and the bias sum, exactly the
calls a `convert()`ed model's autograd formulas make.  Lowering (rather than decomposing before Inductor sees the
graph) keeps aten's convolutions in the graph Inductor plans, so its layout optimisation runs as for cuDNN: a
contiguous model's 2D convolutions take channels-last operands, its activations made so once, at the graph's
input, and every kernel around them reads and writes them so (docs/decisions.md#compile-layouts).  Everything
else is Inductor's: the graphs it generates call convdsl's operators as opaque kernels (on CUDA from C++ once
planned, ops.py), as their graph twins, which have no autograd or autocast kernel for the dispatcher to pass
through (a `convert()`ed model's operator calls become the twins too).  Layers convdsl has no kernel for (float64,
integer dtypes, an empty batch) run PyTorch's convolution inside the operator, with the one-line warning of the
eager path.

The lowerings are installed only while this backend's graphs are lowered, and Inductor's compiled-graph caches
are off for them: a graph of aten's convolutions cached by plain torch.compile would otherwise be taken for
this backend's, or the other way round.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from . import ops

aten = torch.ops.aten

def _is_channels_last(ir, node) -> bool:
    # a node not yet stored has no layout: Inductor's to choose
    if len(node.get_size()) != 4 or not ir.is_storage_and_layout(node):
        return False
    layout = node.get_layout()
    return isinstance(layout, ir.FixedLayout) and layout.is_stride_ordered(ir.NHWC_STRIDE_ORDER)


def _lowerings() -> dict:
    """aten.convolution and aten.convolution_backward lowered to convdsl's operators."""
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V

    def channels_last(node):
        return node if _is_channels_last(ir, node) else ir.ExternKernel.require_channels_last(node)

    def call(op, *args):
        return lowering.fallback_handler(op, add_to_fallback_set=False)(*args)

    def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
        # under layout optimisation 2D convolutions take channels-last operands, as Inductor's own lowering
        # gives cuDNN (the kernels' own layout; a weight's copy is Inductor's kernel then, not the operator's)
        if V.graph.layout_opt and len(x.get_size()) == 4:
            x, w = channels_last(x), channels_last(w)
        stride, padding, dilation = list(stride), list(padding), list(dilation)  # aten's padding is symmetric
        if transposed:
            y = call(ops.graph_conv_transpose, x, w, None, stride, padding, padding, list(output_padding), dilation,
                     groups)
        else:
            y = call(ops.graph_convolution, x, w, None, stride, padding, padding, dilation, groups)
        if bias is None:
            return y
        # the bias as Inductor's add (C, 1, ...), which it fuses into whatever reads y next
        shape = [bias.get_size()[0]] + [1] * (len(x.get_size()) - 2)
        return lowering.lowerings[aten.add.Tensor](y, lowering.lowerings[aten.view.default](bias, shape))

    def convolution_backward(dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                             output_mask):
        # dY and W in the forward's memory format (ops.like_forward's rule: the saved input's, as the forward ran)
        if _is_channels_last(ir, x):
            dy, w = channels_last(dy), channels_last(w)
        stride, padding, dilation = list(stride), list(padding), list(dilation)
        args = (stride, padding, padding, dilation, groups)
        dx = dw = db = None
        if transposed:  # conv_transpose(x) is grad_input's convolution: dX is the forward of dY, dW swaps roles
            if output_mask[0]:
                dx = call(ops.graph_convolution, dy, w, None, *args)
            if output_mask[1]:
                dw = call(ops.graph_convolution_grad_weight, dy, x, list(w.get_size()), *args)
        else:
            if output_mask[0]:
                dx = call(ops.graph_convolution_grad_input, dy, w, list(x.get_size()), *args)
            if output_mask[1]:
                dw = call(ops.graph_convolution_grad_weight, x, dy, list(w.get_size()), *args)
        if output_mask[2]:
            db = lowering.lowerings[aten.sum.dim_IntList](dy, [0, *range(2, len(dy.get_size()))])
        return dx, dw, db

    def twin(op):  # a convert()ed model's operator calls, as their graph twins
        graph_op = getattr(ops, ops.GRAPH_TWINS[op._opname])
        return lambda *args: call(graph_op, *args)

    ours = {op: twin(op) for op in (ops.convolution, ops.convolution_grad_input, ops.convolution_grad_weight,
                                    ops.conv_transpose)}
    return {aten.convolution.default: convolution, aten.convolution_backward.default: convolution_backward, **ours}


@contextlib.contextmanager
def _convdsl_lowerings() -> Iterator[None]:
    from torch._inductor import lowering

    ours = _lowerings()
    saved = {op: lowering.lowerings.get(op) for op in ours}
    lowering.lowerings.update(ours)
    try:
        yield
    finally:
        for op, fn in saved.items():
            if fn is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = fn


def _inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's compilation of one graph (the forward, then the backward at its first call) with the
    convolutions lowered to convdsl's operators."""
    from torch._inductor.compile_fx import compile_fx_inner

    with _convdsl_lowerings():
        return compile_fx_inner(gm, example_inputs, **kwargs)


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The `torch.compile` backend: Inductor, with the model's convolutions as convdsl's operators.  PyTorch finds
    it by name ("convdsl") through the package's `torch_dynamo_backends` entry point."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    # no compiled-graph cache (AOTAutograd's cache needs it too): see the module's docstring
    no_cache = {key: False for key in ("fx_graph_cache", "fx_graph_remote_cache") if hasattr(config, key)}
    return compile_fx(gm, example_inputs, inner_compile=_inner_compile, config_patches=no_cache)
