"""convdsl's convolutions as PyTorch operators (`torch.library` custom ops, `torch.ops.convdsl.*`).

    y  = torch.ops.convdsl.convolution(x, w, bias, stride, pad_lo, pad_hi, dilation, groups)
    dx = torch.ops.convdsl.convolution_grad_input(dy, w, input_size, stride, pad_lo, pad_hi, dilation, groups)
    dw = torch.ops.convdsl.convolution_grad_weight(x, dy, weight_size, stride, pad_lo, pad_hi, dilation, groups)
    y  = torch.ops.convdsl.conv_transpose(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups)

Tensors are PyTorch's: activations (N, G*C, *spatial), weights (G*K, C, *filter) (transposed convolutions:
(G*C_in, C_out, *filter), as torch.nn.ConvTranspose).  Their memory format picks convdsl's layout without a copy:
a contiguous activation is NGCHW, a channels-last one NHWGC; a contiguous weight is GKCYX, a channels-last one
GKYXC.  Results come back in the input's memory format.  Each op has a fake implementation (shapes only) so
that torch.compile traces it without a graph break, and convolution / conv_transpose have autograd formulas
made of the other ops, so that training runs on convdsl's kernels in both directions.

Where a call runs (runtime.run): on CUDA, the stream kernels on PyTorch's current stream where they apply
(convdsl/stream.py), a repeated call's launches from C++ where the native launcher is built (native.py), else the
IREE module through DLPack; on the CPU, the IREE module.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Optional, Sequence

import torch
from torch import nn

from ..problem import ConvProblem, output_sizes
from . import native, runtime
from .stream import NATIVE_FORMATS, dtype_name

LIB = "convdsl"


def _ints(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def transposed_output_size(size: Sequence[int], filt: Sequence[int], stride: Sequence[int], pad_lo: Sequence[int],
                           pad_hi: Sequence[int], output_padding: Sequence[int], dilation: Sequence[int]) -> list[int]:
    """The transposed convolution's output: (I - 1)*s - lo - hi + d*(R-1) + output_padding + 1."""
    return [(i - 1) * s - lo - hi + d * (r - 1) + op + 1
            for i, r, s, lo, hi, op, d in zip(size, filt, stride, pad_lo, pad_hi, output_padding, dilation)]


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _empty_like_format(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype,
                       weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The result's tensor in `like`'s memory format, or channels-last where `weight` is (torch.nn's rule)."""
    fmt = _memory_format(like)
    if weight is not None and fmt == torch.contiguous_format and weight.dim() == like.dim():
        fmt = _memory_format(weight)
    return torch.empty(list(shape), dtype=dtype, device=like.device, memory_format=fmt)


def like_forward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dY in the memory format of its forward's result (channels-last where x or w is, as torch.nn's rule), as
    PyTorch's convolution_backward makes it: the gradients' problems then follow from the forward alone, not
    from the strides whatever op produced dY happened to give (a step traced on fake tensors records them)."""
    fmt = _memory_format(x)
    if fmt == torch.contiguous_format and w.dim() == x.dim():
        fmt = _memory_format(w)
    return dy.contiguous(memory_format=fmt)


# --- forward -------------------------------------------------------------------------------------------

def _forward(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], stride, pad_lo, pad_hi, dilation,
             groups: int) -> torch.Tensor:
    y = runtime.run("forward", x, w, spatial=x.shape[2:], filt=w.shape[2:], stride=stride, pad_lo=pad_lo,
                    pad_hi=pad_hi, dilation=dilation, groups=groups)
    if not _native_operators and runtime.native_programs():
        _take_native_operators()
    if bias is not None:
        y = y.add_(bias.view(1, -1, *([1] * (y.dim() - 2))).to(y.dtype))
    return y


def _grad_input(dy, w, input_size, stride, pad_lo, pad_hi, dilation, groups) -> torch.Tensor:
    dx = runtime.run("grad_input", dy, w, spatial=input_size[2:], filt=w.shape[2:], stride=stride, pad_lo=pad_lo,
                     pad_hi=pad_hi, dilation=dilation, groups=groups)
    if not _native_operators and runtime.native_programs():
        _take_native_operators()
    return dx


def _grad_weight(x, dy, weight_size, stride, pad_lo, pad_hi, dilation, groups) -> torch.Tensor:
    dw = runtime.run("grad_weight", x, dy, spatial=x.shape[2:], filt=weight_size[2:], stride=stride,
                     pad_lo=pad_lo, pad_hi=pad_hi, dilation=dilation, groups=groups)
    if not _native_operators and runtime.native_programs():
        _take_native_operators()
    return dw


def _transposed(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups) -> torch.Tensor:
    out = transposed_output_size(x.shape[2:], w.shape[2:], stride, pad_lo, pad_hi, output_padding, dilation)
    # output_padding < stride: the convolution of `out` positions with these paddings has x's positions again
    y = runtime.run("grad_input", x, w, spatial=out, filt=w.shape[2:], stride=stride, pad_lo=pad_lo,
                    pad_hi=pad_hi, dilation=dilation, groups=groups)
    if bias is not None:
        y = y.add_(bias.view(1, -1, *([1] * (y.dim() - 2))).to(y.dtype))
    return y


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    return dy.sum(dim=[0, *range(2, dy.dim())])


# The operators are defined with torch.library's low-level registration (a schema, a kernel per device, a fake
# kernel, an autograd formula) rather than torch.library.custom_op: the dispatcher then calls the kernels
# directly, where custom_op's Python wrappers (autograd redispatch, alias checks, a dynamo guard) cost about
# 35 us a call, three times a layer in a compiled training step (docs/decisions.md#operator-registration).
_library = torch.library.Library(LIB, "DEF")
_CONV_ARGS = "int[] stride, int[] pad_lo, int[] pad_hi, int[] dilation, int groups"
_SCHEMAS = {
    "convolution": f"(Tensor x, Tensor w, Tensor? bias, {_CONV_ARGS}) -> Tensor",
    "convolution_grad_input": f"(Tensor dy, Tensor w, int[] input_size, {_CONV_ARGS}) -> Tensor",
    "convolution_grad_weight": f"(Tensor x, Tensor dy, int[] weight_size, {_CONV_ARGS}) -> Tensor",
    "conv_transpose": "(Tensor x, Tensor w, Tensor? bias, int[] stride, int[] pad_lo, int[] pad_hi, "
                      "int[] output_padding, int[] dilation, int groups) -> Tensor",
}
# Each operator has a twin for Inductor's generated graphs (inductor.py lowers to them): the same schema, kernels
# and fake kernel, but no autograd formula and no autocast kernel.  Such a graph is past autograd and its casts
# are explicit, yet the dispatcher enters an operator's autograd and autocast kernels whatever the grad mode, and
# ours are Python (torch.library's): a few microseconds a call, three calls a layer in a host-bound step.
GRAPH_TWINS = {name: f"graph_{name}" for name in _SCHEMAS}
for _name, _schema in _SCHEMAS.items():
    _library.define(_name + _schema)
    _library.define(GRAPH_TWINS[_name] + _schema)
# The three convolutions' CUDA kernels live in a library of their own: once the native extension has a program,
# they are replaced by its C++ kernels (_take_native_operators), which run a planned signature without Python.
_CUDA_KERNELS = tuple((name, kernel) for base, kernel in (("convolution", _forward),
                                                          ("convolution_grad_input", _grad_input),
                                                          ("convolution_grad_weight", _grad_weight))
                      for name in (base, GRAPH_TWINS[base]))
for _name, _kernel in (*_CUDA_KERNELS, ("conv_transpose", _transposed), ("graph_conv_transpose", _transposed)):
    _library.impl(_name, _kernel, "CPU")
for _name in ("conv_transpose", "graph_conv_transpose"):
    _library.impl(_name, _transposed, "CUDA")


def _python_cuda_kernels() -> torch.library.Library:
    library = torch.library.Library(LIB, "IMPL")
    for name, kernel in _CUDA_KERNELS:
        library.impl(name, kernel, "CUDA")
    return library


_cuda_library = _python_cuda_kernels()
_native_operators = False


def _take_native_operators() -> None:
    """From the first planned call with a native program on, the dispatcher calls native.cpp's kernels for the
    three convolutions on CUDA (torch.compile's graphs call them ~50 times a step, where the Python kernel's host
    time decided the step's); they call the Python kernels for signatures without a program.  The Python CUDA
    kernels are removed first, so that no kernel is registered twice."""
    global _native_operators
    _native_operators = True
    ext = native.extension()
    if ext is None:
        return
    global _cuda_library
    _cuda_library._destroy()
    try:
        ext.take_operators(LIB, _forward, _grad_input, _grad_weight)
    except RuntimeError as err:  # the operators keep their Python kernels, never none
        _cuda_library = _python_cuda_kernels()
        warnings.warn(f"convdsl.torch: the operators' native kernels could not be registered ({err}); operator "
                      "calls run their Python kernels", native.NativeUnavailableWarning, stacklevel=2)

convolution = torch.ops.convdsl.convolution.default
convolution_grad_input = torch.ops.convdsl.convolution_grad_input.default
convolution_grad_weight = torch.ops.convdsl.convolution_grad_weight.default
conv_transpose = torch.ops.convdsl.conv_transpose.default
graph_convolution = torch.ops.convdsl.graph_convolution.default
graph_convolution_grad_input = torch.ops.convdsl.graph_convolution_grad_input.default
graph_convolution_grad_weight = torch.ops.convdsl.graph_convolution_grad_weight.default
graph_conv_transpose = torch.ops.convdsl.graph_conv_transpose.default


@torch.library.register_fake(f"{LIB}::convolution", lib=_library)
def _convolution_fake(x, w, bias, stride, pad_lo, pad_hi, dilation, groups):
    runtime.note("forward", x, w, spatial=x.shape[2:], filt=w.shape[2:], stride=stride, pad_lo=pad_lo,
                 pad_hi=pad_hi, dilation=dilation, groups=groups)
    out = output_sizes(x.shape[2:], w.shape[2:], stride, pad_lo, pad_hi, dilation)
    return _empty_like_format([x.shape[0], w.shape[0], *out], x, runtime.result_dtype(x), w)


def _convolution_setup(ctx, inputs, output) -> None:
    x, w, bias, stride, pad_lo, pad_hi, dilation, groups = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None
    ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)


def _convolution_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dy = like_forward(dy, x, w)
    stride, pad_lo, pad_hi, dilation, groups = ctx.conv
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = convolution_grad_input(dy, w, list(x.shape), stride, pad_lo, pad_hi, dilation, groups)
    if ctx.needs_input_grad[1]:
        dw = convolution_grad_weight(x, dy, list(w.shape), stride, pad_lo, pad_hi, dilation, groups)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = bias_grad(dy)
    return dx, dw, db, None, None, None, None, None


torch.library.register_autograd(f"{LIB}::convolution", _convolution_backward, setup_context=_convolution_setup,
                                lib=_library)


# --- the gradients -----------------------------------------------------------------------------------------
# Their own autograd formulas make them differentiable (double backward: gradient penalties, Hessian-vector
# products).  Both are bilinear; with y = conv(x, w), <dx, g> = <dy, conv(g, w)> and <dw, h> = <dy, conv(x, h)>:
#   grad_input(dy, w) = dx:   d/d(dy) = conv(g, w),            d/dw = grad_weight(g, dy)
#   grad_weight(x, dy) = dw:  d/dx = grad_input(dy, h),        d/d(dy) = conv(x, h)

@torch.library.register_fake(f"{LIB}::convolution_grad_input", lib=_library)
def _grad_input_fake(dy, w, input_size, stride, pad_lo, pad_hi, dilation, groups):
    runtime.note("grad_input", dy, w, spatial=input_size[2:], filt=w.shape[2:], stride=stride, pad_lo=pad_lo,
                 pad_hi=pad_hi, dilation=dilation, groups=groups)
    return _empty_like_format(input_size, dy, runtime.result_dtype(dy), w)


@torch.library.register_fake(f"{LIB}::convolution_grad_weight", lib=_library)
def _grad_weight_fake(x, dy, weight_size, stride, pad_lo, pad_hi, dilation, groups):
    runtime.note("grad_weight", x, dy, spatial=x.shape[2:], filt=weight_size[2:], stride=stride, pad_lo=pad_lo,
                 pad_hi=pad_hi, dilation=dilation, groups=groups)
    return _empty_like_format(weight_size, x, runtime.result_dtype(x))


def _grad_input_setup(ctx, inputs, output) -> None:
    dy, w, input_size, stride, pad_lo, pad_hi, dilation, groups = inputs
    ctx.save_for_backward(dy, w)
    ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)


def _grad_input_backward(ctx, g):
    dy, w = ctx.saved_tensors
    g = g.to(dy.dtype)  # the kernels read both operands in one dtype
    d_dy = d_w = None
    if ctx.needs_input_grad[0]:
        d_dy = convolution(g, w, None, *ctx.conv)
    if ctx.needs_input_grad[1]:
        d_w = convolution_grad_weight(g, dy, list(w.shape), *ctx.conv)
    return d_dy, d_w, None, None, None, None, None, None


def _grad_weight_setup(ctx, inputs, output) -> None:
    x, dy, weight_size, stride, pad_lo, pad_hi, dilation, groups = inputs
    ctx.save_for_backward(x, dy)
    ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)


def _grad_weight_backward(ctx, h):
    x, dy = ctx.saved_tensors
    h = h.to(x.dtype)
    d_x = d_dy = None
    if ctx.needs_input_grad[0]:
        d_x = convolution_grad_input(dy, h, list(x.shape), *ctx.conv)
    if ctx.needs_input_grad[1]:
        d_dy = convolution(x, h, None, *ctx.conv)
    return d_x, d_dy, None, None, None, None, None, None


torch.library.register_autograd(f"{LIB}::convolution_grad_input", _grad_input_backward,
                                setup_context=_grad_input_setup, lib=_library)
torch.library.register_autograd(f"{LIB}::convolution_grad_weight", _grad_weight_backward,
                                setup_context=_grad_weight_setup, lib=_library)


# --- the transposed convolution ------------------------------------------------------------------------
# conv_transpose(x, w) is grad_input of the convolution that maps its output back to x: that convolution's
# input is the transposed convolution's output, its weight (G*K, C, ...) is the transposed one's (G*C_in,
# C_out, ...) as it stands.  So its backward is that convolution's forward (for x) and grad_weight (for w).

@torch.library.register_fake(f"{LIB}::conv_transpose", lib=_library)
def _transpose_fake(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups):
    out = transposed_output_size(x.shape[2:], w.shape[2:], stride, pad_lo, pad_hi, output_padding, dilation)
    runtime.note("grad_input", x, w, spatial=out, filt=w.shape[2:], stride=stride, pad_lo=pad_lo, pad_hi=pad_hi,
                 dilation=dilation, groups=groups)
    return _empty_like_format([x.shape[0], w.shape[1] * groups, *out], x, runtime.result_dtype(x), w)


def _transpose_setup(ctx, inputs, output) -> None:
    x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None
    ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)


def _transpose_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dy = like_forward(dy, x, w)
    stride, pad_lo, pad_hi, dilation, groups = ctx.conv
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = convolution(dy, w, None, stride, pad_lo, pad_hi, dilation, groups)
    if ctx.needs_input_grad[1]:
        dw = convolution_grad_weight(dy, x, list(w.shape), stride, pad_lo, pad_hi, dilation, groups)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = bias_grad(dy)
    return dx, dw, db, None, None, None, None, None, None


torch.library.register_autograd(f"{LIB}::conv_transpose", _transpose_backward, setup_context=_transpose_setup,
                                lib=_library)


# Under autocast the convolutions run in the autocast dtype of the region (bf16 or f16), as torch.nn's do:
# autocast leaves custom operators alone unless they register a kernel for its dispatch key.  The casts are
# ordinary ops, so autograd carries the gradients back to the parameters' dtype.

for _name, _fake in (("convolution", _convolution_fake), ("convolution_grad_input", _grad_input_fake),
                     ("convolution_grad_weight", _grad_weight_fake), ("conv_transpose", _transpose_fake)):
    torch.library.register_fake(f"{LIB}::{GRAPH_TWINS[_name]}", _fake, lib=_library)


def _register_autocast(op, device_type: str) -> None:
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast)

    _library.impl(op._schema.name.split("::")[-1], kernel, "Autocast" + torch._C._dispatch_key_for_device(device_type),
                  with_keyset=True)


for _op in (convolution, conv_transpose):
    for _device in ("cuda", "cpu"):
        _register_autocast(_op, _device)


# --- eager calls --------------------------------------------------------------------------------------------
# The custom operators' Python dispatch (autograd wrapper, redispatch, argument defaults) costs far more host
# time per call than a convolution's launch; outside torch.compile the modules call the same computations
# through a plain autograd.Function instead (docs/decisions.md#eager-autograd-function).  Under torch.compile
# they call the operators, which it traces, and so do calls on fake tensors while runtime.recording() (their
# fake kernels record the problems).

class EagerConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, stride, pad_lo, pad_hi, dilation, groups):
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)
        return _forward(x, w, bias, stride, pad_lo, pad_hi, dilation, groups)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[:2], ctx.has_bias and ctx.needs_input_grad[2])
        return (*_conv_gradients(needs, x, w, dy, ctx.conv), None, None, None, None, None)


def _conv_gradients(needs: Sequence[bool], x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                    conv: tuple) -> tuple:
    """(dx, dw, db) of a convolution, each where `needs` asks.  Under create_graph (grad mode on in backward:
    double backward) through the operators, whose formulas autograd records; else the plain computations."""
    dy = like_forward(dy, x, w)
    grad_input, grad_weight = ((convolution_grad_input, convolution_grad_weight) if torch.is_grad_enabled()
                               else (_grad_input, _grad_weight))
    dx = grad_input(dy, w, list(x.shape), *conv) if needs[0] else None
    dw = grad_weight(x, dy, list(w.shape), *conv) if needs[1] else None
    db = bias_grad(dy) if needs[2] else None
    return dx, dw, db


class EagerConvTranspose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups):
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        ctx.conv = (stride, pad_lo, pad_hi, dilation, groups)
        return _transposed(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = like_forward(dy, x, w)
        forward, grad_weight = ((convolution, convolution_grad_weight) if torch.is_grad_enabled()  # create_graph
                                else (_forward, _grad_weight))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = forward(dy, w, None, *ctx.conv)
        if ctx.needs_input_grad[1]:
            dw = grad_weight(dy, x, list(w.shape), *ctx.conv)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = bias_grad(dy)
        return dx, dw, db, None, None, None, None, None, None


class EagerPlans(dict):
    """A module's eager plans by input signature (plan_for).  Copies and pickles of the module start without
    them: plans hold kernels loaded on one device."""

    def __reduce__(self):
        return (EagerPlans, ())

    def __deepcopy__(self, memo) -> "EagerPlans":
        return EagerPlans()


class _Plan:
    """One convolution module's calls for one signature of its input and weight (shapes, strides, dtypes,
    device, autocast, TF32 flag), worked out at the first call: the forward's planned call (runtime.planned_call)
    and, per dY strides, the two gradients' (None where a gradient's kernels cannot read dY as it lies)."""

    __slots__ = ("conv", "forward", "autocast", "compute_dtype", "weight_dtype", "bias_shape", "gradients", "native",
                 "__weakref__")

    def __init__(self, conv: tuple, forward, autocast: Optional[str], compute_dtype: torch.dtype,
                 weight_dtype: torch.dtype, dims: int) -> None:
        self.conv = conv  # (stride, pad_lo, pad_hi, dilation, groups)
        self.forward = forward
        self.autocast = autocast  # the device type whose autocast region the plan was made in, if any
        # the kernels' dtype and the weight parameter's: under autocast the weight is cast inside the
        # convolution's own autograd node and its gradient cast back there (no separate cast nodes)
        self.compute_dtype = compute_dtype
        self.weight_dtype = weight_dtype
        self.bias_shape = (1, -1, *([1] * dims))
        self.gradients: dict[tuple, tuple] = {}
        # the same calls in the native launcher (native.py): (its convolution function, the plan), where built
        self.native: Optional[tuple] = None

    def gradients_for(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, needs: Sequence[bool]) -> tuple:
        """(grad_input's planned call, grad_weight's), each only where `needs` asks for it: a gradient no step
        asks for (the first layer's grad_input) is never planned, so no kernel is compiled or looked up for it
        (a bundle traced from a step lacks it)."""
        key = (dy.stride(), runtime.tf32_allowed(), needs[0], needs[1])
        calls = self.gradients.get(key)
        if calls is None:
            stride, lo, hi, dilation, groups = self.conv
            conv = dict(stride=stride, pad_lo=lo, pad_hi=hi, dilation=dilation, groups=groups)
            calls = self.gradients[key] = (
                runtime.planned_call("grad_input", dy, w, spatial=x.shape[2:], filt=w.shape[2:], **conv)
                if needs[0] else None,
                runtime.planned_call("grad_weight", x, dy, spatial=x.shape[2:], filt=w.shape[2:], **conv,
                                     out_dtype=self.weight_dtype) if needs[1] else None)
        return calls


class PlannedConvolution(torch.autograd.Function):
    """EagerConvolution with its calls worked out ahead (a _Plan): per call only the launches and their
    results' allocations are left (docs/decisions.md#eager-plans)."""

    @staticmethod
    def forward(ctx, x, w, bias, plan):
        # under autocast, w is the parameter (f32, say): cast here, where autograd does not record it, and its
        # gradient cast back in backward; one autograd node per convolution instead of three
        parameter = w
        w = w if w.dtype == plan.compute_dtype else w.to(plan.compute_dtype)
        ctx.save_for_backward(x, w, parameter)
        ctx.plan = plan
        y = plan.forward.launch(x, w)
        if bias is not None:
            y = y.add_(bias.view(plan.bias_shape).to(y.dtype))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, parameter = ctx.saved_tensors
        return (*_planned_gradients(ctx.plan, x, w, parameter, dy, ctx.needs_input_grad[:3]), None)


def _planned_gradients(plan: _Plan, x: torch.Tensor, w: torch.Tensor, parameter: torch.Tensor, dy: torch.Tensor,
                       needs: Sequence[bool]) -> tuple:
    """(dx, dw, db) of a planned convolution, each where `needs` asks; w is the weight in the kernels' dtype,
    parameter the module's.  PlannedConvolution's backward, and the native launcher's where it has no kernel."""
    if torch.is_grad_enabled():  # create_graph: differentiable gradients, the weight's cast recorded too
        dx, dw, db = _conv_gradients(needs, x, parameter.to(plan.compute_dtype), dy, plan.conv)
        return dx, None if dw is None else dw.to(plan.weight_dtype), db
    dy = dy.contiguous(memory_format=plan.forward.result_format)  # like_forward, worked out once
    grad_input, grad_weight = plan.gradients_for(dy, x, w, needs)
    dx = dw = db = None
    if needs[0]:
        dx = (grad_input.launch(dy, w) if grad_input is not None and runtime.aligned(dy, w)
              else _grad_input(dy, w, list(x.shape), *plan.conv))
    if needs[1]:
        # under autocast the kernels sum their f32 partials straight into the f32 parameter's gradient (no
        # 16-bit result and cast: docs/decisions.md#weight-gradient-dtype); the fallback casts
        dw = (grad_weight.launch(x, dy) if grad_weight is not None and runtime.aligned(x, dy)
              else _grad_weight(x, dy, list(w.shape), *plan.conv))
        if dw.dtype != plan.weight_dtype:
            dw = dw.to(plan.weight_dtype)
    if needs[2]:
        db = bias_grad(dy)
    return dx, dw, db


def _weak_planned_gradients(plan: "weakref.ref[_Plan]", *args) -> tuple:
    return _planned_gradients(plan(), *args)


def _native_plan(plan: _Plan, x: torch.Tensor, w: torch.Tensor, needs: Sequence[bool]) -> Optional[tuple]:
    """The plan's calls as the native launcher's ConvPlan (x and w in the kernels' dtype), with the gradients
    `needs` asks for (a gradient without a program falls back to _planned_gradients); None where the launcher
    is not built or the forward has no program."""
    ext = native.extension() if x.is_cuda else None  # the driver's launches: CUDA devices only
    if ext is None:
        return None
    forward = plan.forward.native_program(ext, x, w)
    if forward is None:
        return None
    programs = [None, None]
    if needs[0] or needs[1]:
        dy = torch.empty(plan.forward.result_shape, dtype=plan.compute_dtype, device=x.device,
                         memory_format=plan.forward.result_format)
        grad_input, grad_weight = plan.gradients_for(dy, x, w, needs)
        programs = [None if grad_input is None else grad_input.native_program(ext, dy, w),
                    None if grad_weight is None else grad_weight.native_program(ext, x, dy)]
    # through a weak reference: the native plan is the _Plan's, and a cycle through C++ is one the collector
    # cannot see
    gradients = functools.partial(_weak_planned_gradients, weakref.ref(plan))
    return ext.convolution, ext.ConvPlan(forward, *programs, dtype_name(plan.compute_dtype),
                                         dtype_name(plan.weight_dtype), NATIVE_FORMATS[plan.forward.result_format],
                                         x.dim() - 2, gradients)


def _c_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16"}.get(dtype, str(dtype).replace("torch.", ""))


def check_call(module: nn.Module, x: torch.Tensor, transposed: bool, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None) -> None:
    """The errors torch.nn raises for the same mistakes, with the same exception types."""
    dims = len(module.kernel_size)
    name = f"conv{'_transpose' if transposed else ''}{dims}d"
    if x.dim() != dims + 2:
        raise RuntimeError(f"Expected {dims + 1}D (unbatched) or {dims + 2}D (batched) input to {name}, but got "
                           f"input of size: {list(x.shape)}")
    w = module.weight if weight is None else weight
    autocast = torch.is_autocast_enabled(x.device.type)  # autocast casts all three
    if x.dtype != w.dtype and not autocast:
        raise RuntimeError(f"Input type ({x.dtype}) and weight type ({w.dtype}) should be the same")
    if bias is not None and bias.dtype != x.dtype and not autocast:
        raise RuntimeError(f"Input type ({_c_name(x.dtype)}) and bias type ({_c_name(bias.dtype)}) should be the "
                           "same")
    if x.device != w.device:
        raise RuntimeError(f"Input type ({x.device}) and weight type ({w.device}) should be on the same device")
    expected = w.shape[0] if transposed else w.shape[1] * module.groups
    if x.shape[1] != expected:
        raise RuntimeError(f"Given groups={module.groups}, weight of size {list(w.shape)}, expected input"
                           f"{list(x.shape)} to have {expected} channels, but got {x.shape[1]} channels instead")


_PLANS_ATTRIBUTE = "_convdsl_eager_plans"


def parameter(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """module.<name> without nn.Module.__getattr__ (about 1.5 us a call) where it is a registered parameter (or
    None); otherwise (a parametrization, weight_norm's plain attribute) through it."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


def plan_for(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor,
             bias: Optional[torch.Tensor]) -> Optional[_Plan]:
    """The module's eager plan for x, w and bias (CUDA, eager, kernels that read x and w as they lie), else
    None: the first call of a signature validates it (check_call) and works the plan out; later calls look it
    up."""
    if not runtime.on_stream_device(x) or torch.compiler.is_compiling() or runtime.recording_active():
        return None
    device_type = "cuda" if x.is_cuda else x.device.type  # x.device costs about 0.5 us
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    # which gradients a backward will ask for is known now: the native launcher plans them with the forward
    needs = torch.is_grad_enabled() and x.requires_grad, torch.is_grad_enabled() and w.requires_grad
    key = (x.shape, x.stride(), x.dtype, x.get_device(), w.shape, w.stride(), w.dtype, w.get_device(), autocast,
           module.stride, module.padding, module.dilation, module.groups, runtime.tf32_allowed(),
           None if bias is None else bias.dtype, needs)
    plans = module.__dict__.get(_PLANS_ATTRIBUTE)
    if plans is None:
        plans = module.__dict__[_PLANS_ATTRIBUTE] = EagerPlans()
    if key in plans:
        return plans[key]
    check_call(module, x, False, w, bias)  # torch.nn's errors for bad calls, before anything is planned
    stride, lo, hi, dilation, groups = module.conv_arguments()
    xc, wc = _autocast(device_type, x, w)
    forward = runtime.planned_call("forward", xc.detach(), wc.detach(), spatial=x.shape[2:], filt=w.shape[2:],
                                  stride=stride, pad_lo=lo, pad_hi=hi, dilation=dilation, groups=groups)
    plan = plans[key] = (None if forward is None else
                         _Plan((stride, lo, hi, dilation, groups), forward,
                               device_type if autocast is not None else None, wc.dtype, w.dtype, x.dim() - 2))
    if plan is not None:
        plan.native = _native_plan(plan, xc.detach(), wc.detach(), needs)
    return plan


def call_planned(plan: _Plan, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if plan.autocast:  # the input and bias as autocast casts them; the weight inside PlannedConvolution
        dtype = plan.compute_dtype  # the plan's key holds the autocast dtype
        if x.dtype != dtype:
            x = x.to(dtype)
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
    if plan.native is not None:  # the same launches and autograd node in C++ (offset views copied there)
        convolution_function, native_plan = plan.native
        return convolution_function(x, w, bias, native_plan)
    if not runtime.aligned(x, w):  # an offset view: the general path copies it
        return EagerConvolution.apply(x, w.to(plan.compute_dtype), bias, *plan.conv)
    return PlannedConvolution.apply(x, w, bias, plan)


def _autocast(device_type: str, *tensors):
    """The floating tensors in the autocast region's dtype (what the operators' autocast kernel does)."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype != dtype and t.is_floating_point() else t
                 for t in tensors)


def plus_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y + bias per channel, out of place: in a compiled graph the add is Inductor's to fuse into the op that reads
    y next, where inside the operator it would be a pass of its own over y."""
    return y if bias is None else y + bias.view(1, -1, *([1] * (y.dim() - 2))).to(y.dtype)


def call_convolution(x, w, bias, stride, pad_lo, pad_hi, dilation, groups) -> torch.Tensor:
    if runtime.recording_active():
        _note_eager_grad_weight(x, w, stride, pad_lo, pad_hi, dilation, groups)
        return convolution(x, w, bias, stride, pad_lo, pad_hi, dilation, groups)
    if torch.compiler.is_compiling():
        return plus_bias(convolution(x, w, None, stride, pad_lo, pad_hi, dilation, groups), bias)
    x, w, bias = _autocast(x.device.type, x, w, bias)
    return EagerConvolution.apply(x, w, bias, stride, pad_lo, pad_hi, dilation, groups)


def _note_eager_grad_weight(x, w, stride, pad_lo, pad_hi, dilation, groups) -> None:
    """While recording under autocast, the grad_weight an eager plan runs (PlannedConvolution: into the
    parameter's dtype), besides the operators' 16-bit one, so that a bundle traced once serves both paths; it
    does not count as a call of the step."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return
    dtype = torch.get_autocast_dtype(device_type)
    if w.dtype == dtype or not w.is_floating_point():
        return
    xc = x.to(dtype)
    out = output_sizes(x.shape[2:], w.shape[2:], stride, pad_lo, pad_hi, dilation)
    dy = _empty_like_format([x.shape[0], w.shape[0], *out], xc, dtype)
    runtime.note("grad_weight", xc, dy, counted=False, spatial=x.shape[2:], filt=w.shape[2:], stride=stride,
                 pad_lo=pad_lo, pad_hi=pad_hi, dilation=dilation, groups=groups, out_dtype=w.dtype)


def call_conv_transpose(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups) -> torch.Tensor:
    if runtime.recording_active():
        return conv_transpose(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups)
    if torch.compiler.is_compiling():
        return plus_bias(conv_transpose(x, w, None, stride, pad_lo, pad_hi, output_padding, dilation, groups), bias)
    x, w, bias = _autocast(x.device.type, x, w, bias)
    return EagerConvTranspose.apply(x, w, bias, stride, pad_lo, pad_hi, output_padding, dilation, groups)


def problem_of(op: str, a: torch.Tensor, b: torch.Tensor, **conv) -> ConvProblem:
    """The ConvProblem a call runs (for `explain`-style questions from Python)."""
    return runtime.problem_for(op, a, b, **conv)
