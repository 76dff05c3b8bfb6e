"""torch.compile without convert(): a backend under which Inductor compiles a model's convolutions as convdsl's.

    import convdsl.torch
    compiled = torch.compile(model, backend="convdsl")    # the model's torch.nn convolutions, untouched

AOTAutograd traces the step (forward and backward) with Inductor's decomposition table plus two entries:
aten.convolution becomes convdsl's forward or transposed-convolution operator, and aten.convolution_backward
convdsl's grad_input / grad_weight operators and the bias sum, exactly the calls a `convert()`ed model's autograd
formulas make.  Everything else is Inductor's: the graphs it generates call convdsl's operators as opaque kernels
(on CUDA from C++ once planned, ops.py).  Layers convdsl has no kernel for (float64, integer dtypes, an empty
batch) run PyTorch's convolution inside the operator, with the one-line warning of the eager path.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from . import ops

aten = torch.ops.aten


def _convolution(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                 groups: int) -> torch.Tensor:
    # aten's padding is symmetric: pad_lo = pad_hi
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    if transposed:
        y = ops.conv_transpose(x, w, None, stride, padding, padding, list(output_padding), dilation, groups)
    else:
        y = ops.convolution(x, w, None, stride, padding, padding, dilation, groups)
    return ops.plus_bias(y, bias)  # Inductor's add, to fuse into what reads y next


def _convolution_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias_sizes: Optional[Sequence[int]],
                          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                          output_padding: Sequence[int], groups: int, output_mask: Sequence[bool]) -> tuple:
    # the gradients of ops.py's autograd formulas (_convolution_backward, _transpose_backward)
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    dy = ops.like_forward(dy, x, w)
    dx = dw = db = None
    if transposed:  # conv_transpose(x) is grad_input's convolution: dX is the forward of dY, dW swaps the roles
        if output_mask[0]:
            dx = ops.convolution(dy, w, None, stride, padding, padding, dilation, groups)
        if output_mask[1]:
            dw = ops.convolution_grad_weight(dy, x, list(w.shape), stride, padding, padding, dilation, groups)
    else:
        if output_mask[0]:
            dx = ops.convolution_grad_input(dy, w, list(x.shape), stride, padding, padding, dilation, groups)
        if output_mask[1]:
            dw = ops.convolution_grad_weight(x, dy, list(w.shape), stride, padding, padding, dilation, groups)
    if output_mask[2]:
        db = ops.bias_grad(dy)
    return dx, dw, db


def decompositions() -> dict:
    """Inductor's decomposition table with aten's convolutions as convdsl's operators."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    table[aten.convolution.default] = _convolution
    table[aten.convolution_backward.default] = _convolution_backward
    return table


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The `torch.compile` backend: Inductor, with the model's convolutions as convdsl's operators.  PyTorch finds
    it by name ("convdsl") through the package's `torch_dynamo_backends` entry point."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, decompositions=decompositions())
