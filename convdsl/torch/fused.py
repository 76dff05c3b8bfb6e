"""Convolution -> BatchNorm -> activation as one module, with the BatchNorm, a residual and the activation done in
two kernels over the convolution's output forward and two backward (convdsl/kernels/batchnorm.py has the kernels
and the algebra) instead of PyTorch's three and three (and the residual's add).

    fused = ct.ConvBNAct(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), "relu")
    model = ct.fuse(torchvision.models.resnet50())    # every Conv -> BN (-> activation) of the model fused

fuse() forms ConvBNAct modules (with ResNet's residual before the activation), and FusedBatchNorm modules where a
BatchNorm followed by its activation has no convolution before it.  Numerics are torch.nn's: batch statistics in
training (biased variance normalises, the unbiased one enters the running average, momentum None is the
cumulative average), running statistics in eval; only the rounding differs (the activation is computed from the
normalised value in f32 and rounded once).  The fused kernels run on CUDA in eager mode and in CUDA graphs, in
training and in eval mode without gradients; eval mode with gradients, the CPU, float64, `torch.compile` (whose
Inductor fuses these elementwise steps itself) and tensors of 2^31 elements or more run torch.nn's modules instead,
with the same results.
"""
from __future__ import annotations

import copy
import math
import operator
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..backends.cuda_driver import load_function
from ..kernels.batchnorm_launches import RESIDUAL_ACTIVATIONS, BatchNormLaunches, batch_norm_launches
from ..kernels.launch import Launch
from . import fallback, runtime
from .modules import _TORCH_BASES, _ConvMixin, _ConvTransposeMixin, convert
from .stream import ALIGNMENT, _raw_stream, dtype_name

try:
    from ..kernels.compile import compile_launch
    import triton  # noqa: F401  (compile_launch needs it where a launch is compiled)
except ImportError:  # no Triton: the fused module runs torch.nn's steps
    compile_launch = None

# activations by name: torch.nn's modules and functions that fuse(), and what the unfused path computes
ACTIVATION_FUNCTIONS = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "hardswish": F.hardswish}
_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Hardswish: "hardswish"}
_ACTIVATION_CALLS = {F.relu: "relu", torch.relu: "relu", F.relu6: "relu6", F.silu: "silu",
                     F.hardswish: "hardswish", "relu": "relu", "relu_": "relu"}
_BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def activation_name(activation: Union[None, str, nn.Module]) -> Optional[str]:
    """The fused kernels' name of an activation given as a name, a torch.nn module or None."""
    if activation is None or isinstance(activation, nn.Identity):
        return None
    if isinstance(activation, str):
        if activation not in ACTIVATION_FUNCTIONS:
            raise ValueError(f"ConvBNAct: activation {activation!r} is not one of "
                             f"{sorted(ACTIVATION_FUNCTIONS)} (or None)")
        return activation
    name = _ACTIVATION_MODULES.get(type(activation))
    if name is None:
        raise ValueError(f"ConvBNAct: activation {type(activation).__name__} is not one of "
                         f"{[m.__name__ for m in _ACTIVATION_MODULES]} (or None)")
    return name


def _channels_last(t: torch.Tensor) -> bool:
    return t.movedim(1, -1).is_contiguous() and not t.is_contiguous()


def _same_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """t stored as the kernels read it (channels-last or contiguous, 16-byte aligned)."""
    if channels_last:
        t = t if t.movedim(1, -1).is_contiguous() else t.movedim(1, -1).contiguous().movedim(-1, 1)
    else:
        t = t.contiguous()
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


Launcher = Callable[..., None]  # (stream handle, tensors in the launch's order) -> None


def _driver_launcher(launch: Launch, device: torch.device) -> Launcher:
    """The launch compiled by the installed Triton for the device's arch and loaded through the CUDA driver."""
    binary = compile_launch(launch, runtime.cuda_target(device).arch)
    function = load_function(binary.data, binary.kind, binary.name, binary.threads, binary.shared_bytes,
                             binary.params, device.index)
    bound = function.bind(launch.grid)

    def run(stream: int, *tensors: torch.Tensor) -> None:
        bound(stream, [t.data_ptr() for t in tensors])
    return run


# how a launch runs: replaced by tests with Triton's interpreter
launcher_for: Callable[[Launch, torch.device], Launcher] = _driver_launcher


class _Planned:
    """One tensor signature's launches, each compiled and loaded at its first use (eval mode needs only one)."""

    _LAUNCHES = ("stats", "apply", "apply_running", "grad_stats", "grad_apply")

    def __init__(self, launches: BatchNormLaunches, device: torch.device) -> None:
        self.launches, self.device = launches, device
        self.channels = launches.channels
        self.channels_last = launches.channels_last
        self.counters = launches.channel_blocks

    def __getattr__(self, name: str) -> Launcher:  # only for a launcher not loaded yet
        if name not in self._LAUNCHES:
            raise AttributeError(name)
        launcher = launcher_for(getattr(self.launches, name), self.device)
        setattr(self, name, launcher)
        return launcher


_PLANNED: dict[tuple, _Planned] = {}


# _planned's answer where no kernel can be had (announced once; the module runs torch.nn's steps)
_UNAVAILABLE = object()
_TRAINING = ("stats", "apply", "grad_stats", "grad_apply")
_INFERENCE = ("apply_running",)


def _planned(y: torch.Tensor, weight: torch.Tensor, running: Optional[torch.Tensor], update: bool,
             act: Optional[str], momentum: Optional[float], eps: float, needs: tuple[str, ...] = _TRAINING,
             residual: bool = False):
    """The loaded launches for y: a _Planned, None where y is neither channels-last nor contiguous, _UNAVAILABLE
    where they cannot be compiled or loaded here.  running: the running mean (its dtype), None where not tracked;
    update: training updates it; needs: the launches loaded now (a failure then, not in the middle of a step)."""
    key = (y.shape, y.stride(), y.dtype, weight.dtype, None if running is None else running.dtype, update, act,
           momentum, eps, y.get_device(), needs, residual)
    planned = _PLANNED.get(key)
    if planned is None:
        cl = _channels_last(y)
        if not (cl or y.is_contiguous()):
            return None
        if update and y.shape[0] * math.prod(y.shape[2:]) <= 1:  # torch.nn's check, once per signature
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {y.size()}")
        try:
            if compile_launch is None and launcher_for is _driver_launcher:
                raise RuntimeError("Triton is not installed")
            sms = runtime.cuda_target(y.device).gpu.sm_count if y.is_cuda else 1  # the interpreter: a few
            launches = batch_norm_launches(
                tuple(y.shape), cl, dtype_name(y.dtype), dtype_name(weight.dtype),
                dtype_name(running.dtype if running is not None else torch.float32), act, update, momentum, eps,
                sms, residual)
            planned = _Planned(launches, y.device)
            for name in needs:
                getattr(planned, name)
        except Exception as e:  # a compiler's or driver's error: the layer runs torch.nn's steps
            fallback.unavailable(f"the fused BatchNorm + {act or 'no activation'} of {tuple(y.shape)} {y.dtype}",
                                 e, instead="it runs torch.nn's BatchNorm and activation")
            planned = _UNAVAILABLE
        _PLANNED[key] = planned
    return planned


# per (device, stream): the statistics kernels' tickets (kernels/batchnorm._last_program), zero between calls (the
# last program resets its own), so one buffer serves every call queued on that stream
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _counter(device: torch.device, stream: int, blocks: int) -> torch.Tensor:
    key = (device.index or 0, stream)
    counter = _COUNTERS.get(key)
    if counter is None or counter.numel() < blocks:
        counter = _COUNTERS[key] = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device)
    return counter


def _stream(device: torch.device) -> int:
    return _raw_stream(device.index) if device.type == "cuda" else 0


_F32 = torch.float32


class BatchNormActivation(torch.autograd.Function):
    """out = act(batch_norm(y)) in training mode (batch statistics), the running statistics updated in place
    (running_mean None: not tracked); batches: num_batches_tracked, read where momentum is None.  y comes as
    `planned` was made for (its strides, 16-byte aligned)."""

    @staticmethod
    def forward(ctx, y, weight, bias, residual, running_mean, running_var, batches, planned):
        device = y.device
        work = torch.empty(planned.launches.work_elements, dtype=_F32, device=device)  # the stats, then partials
        stream = _stream(device)
        update = running_mean is not None
        planned.stats(stream, y, work, _counter(device, stream, planned.counters),
                      running_mean if update else work, running_var if update else work,
                      batches if batches is not None else work)
        out = torch.empty_like(y)
        planned.apply(stream, y, work, weight, bias, y if residual is None else residual, out)
        # with a residual the backward takes the activation's mask from out (the sum itself is not kept)
        ctx.save_for_backward(y, work, weight, bias, *(() if residual is None else (out,)))
        ctx.planned = planned
        return out

    @staticmethod
    @once_differentiable  # its kernels are not differentiable: a double backward raises, never a wrong gradient
    def backward(ctx, dout):
        y, stats, weight, bias, *kept = ctx.saved_tensors
        out = kept[0] if kept else y
        planned = ctx.planned
        if dout.stride() != y.stride() or dout.data_ptr() % ALIGNMENT:
            dout = _same_layout(dout, planned.channels_last)
        device = y.device
        c = planned.channels
        work = torch.empty(planned.launches.work_elements, dtype=_F32, device=device)
        grads = torch.empty(2 * c, dtype=_F32, device=device)  # dbeta, dgamma
        stream = _stream(device)
        planned.grad_stats(stream, dout, y, stats, weight, bias, out, work,
                           _counter(device, stream, planned.counters), grads)
        dy = torch.empty_like(y)
        dres = torch.empty_like(y) if kept else None
        planned.grad_apply(stream, dout, y, stats, weight, bias, out, grads, dy, y if dres is None else dres)
        needs = ctx.needs_input_grad
        dgamma = grads[c:] if needs[1] else None
        dbeta = grads[:c] if needs[2] else None
        if dgamma is not None and weight.dtype != _F32:
            dgamma = dgamma.to(weight.dtype)
        if dbeta is not None and bias.dtype != _F32:
            dbeta = dbeta.to(bias.dtype)
        return dy, dgamma, dbeta, dres if needs[3] else None, None, None, None, None


class _FusedNorm:
    """BatchNorm, an optional residual and an activation on a tensor y (a convolution's output), fused where the
    kernels run (CUDA; training, or eval mode without gradients), else torch.nn's modules.  The module that mixes
    it in gives `_norm` (its BatchNorm), `activation`, `_dims` (spatial dimensions) and `residual_inplace`."""

    residual_inplace = False

    def batch_norm_activation(self, y: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The BatchNorm, the residual and the activation of the convolution's output y: fused where the kernels
        run (CUDA; training, or eval mode without gradients), else torch.nn's modules."""
        bn = self._norm
        params, buffers = bn._parameters, bn._buffers  # direct: nn.Module's __getattr__ costs a call each
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        training = bn.training
        weight, bias = params.get("weight"), params.get("bias")
        if residual is not None and (residual.dtype != y.dtype or residual.shape != y.shape
                                     or self.activation not in RESIDUAL_ACTIVATIONS):
            return self._unfused(y, residual)
        if residual is not None and self._fusable(y) and (residual.stride() != y.stride()
                                                          or residual.data_ptr() % ALIGNMENT):
            residual = _same_layout(residual, _channels_last(y))  # the kernels read it as they read y
        if not training and running_mean is not None and running_var is not None:
            # eval mode: the running statistics; fused where nothing needs a gradient (inference, validation)
            if (torch.is_grad_enabled() and (y.requires_grad or (weight is not None and weight.requires_grad)
                                             or (residual is not None and residual.requires_grad))
                    or not self._fusable(y)):
                return self._unfused(y, residual)
            return self._inference(y, weight, bias, running_mean, running_var, residual)
        planned = None
        if (training or (running_mean is None and running_var is None)) and self._fusable(y):
            if y.dim() != self._dims + 2:
                bn._check_input_dim(y)  # torch.nn's error
            update = training and bn.track_running_stats and running_mean is not None
            if weight is None:
                weight, bias = self._identity(bn, y.device)
            running = running_mean if update else None
            momentum = bn.momentum if update else 0.0
            with_residual = residual is not None
            planned = _planned(y, weight, running, update, self.activation, momentum, bn.eps,
                               residual=with_residual)
            if planned is None:  # neither channels-last nor contiguous: the kernels read the contiguous copy
                y = y.contiguous()
                if with_residual:
                    residual = residual.contiguous()
                planned = _planned(y, weight, running, update, self.activation, momentum, bn.eps,
                                   residual=with_residual)
            aligned = [weight, bias, y] + ([running_mean, running_var] if update else [])
            if planned is _UNAVAILABLE or any(t.data_ptr() % ALIGNMENT for t in aligned):
                planned = None
        if planned is None:
            return self._unfused(y, residual)
        batches = buffers.get("num_batches_tracked") if update else None
        if batches is not None:
            batches.add_(1)
        return BatchNormActivation.apply(y, weight, bias, residual, running_mean if update else None,
                                         running_var if update else None, batches, planned)

    def _unfused(self, y: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        bn = self._norm
        # torch.nn's BatchNorm; a fused BatchNorm module (bn is self) through torch.nn's own forward
        y = _BatchNorm.forward(bn, y) if bn is self else bn(y)
        if residual is not None:
            y = y.add_(residual) if self.residual_inplace else y + residual
        return y if self.activation is None else ACTIVATION_FUNCTIONS[self.activation](y)

    def _inference(self, y: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   running_mean: torch.Tensor, running_var: torch.Tensor,
                   residual: Optional[torch.Tensor]) -> torch.Tensor:
        """act(BatchNorm(y) (+ residual)) with the running statistics in one pass over y."""
        bn = self._norm
        if y.dim() != self._dims + 2:
            bn._check_input_dim(y)
        if weight is None:
            weight, bias = self._identity(bn, y.device)
        if not (_channels_last(y) or y.is_contiguous()):
            y = y.contiguous()
            residual = None if residual is None else residual.contiguous()
        operands = (y, weight, bias, running_mean, running_var) + (() if residual is None else (residual,))
        if any(t.data_ptr() % ALIGNMENT for t in operands):
            return self._unfused(y, residual)
        planned = _planned(y, weight, running_mean, False, self.activation, None, bn.eps, _INFERENCE,
                           residual is not None)
        if planned is _UNAVAILABLE:
            return self._unfused(y, residual)
        out = torch.empty_like(y)
        planned.apply_running(_stream(y.device), y, running_mean, running_var, weight, bias,
                              y if residual is None else residual, out)
        return out

    @staticmethod
    def _identity(bn: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """affine=False: weight 1 and bias 0."""
        return torch.ones(bn.num_features, device=device), torch.zeros(bn.num_features, device=device)

    @staticmethod
    def _fusable(y: torch.Tensor) -> bool:
        return (y.is_cuda and y.dtype in _FUSED_DTYPES and 3 <= y.dim() <= 5
                and y.numel() < 2 ** 31 and not torch.compiler.is_compiling())


class ConvBNAct(_FusedNorm, nn.Module):
    """A convolution, the BatchNorm of its output and an optional activation ("relu", "relu6", "silu",
    "hardswish", or the torch.nn module), as one module: `conv` and `bn` are the given modules (the convolution
    converted to convdsl's), so their parameters, buffers and train/eval modes are theirs.  `forward(x, residual)`
    adds a residual before the activation (ResNet's block end: act(bn(conv(x)) + residual)); residual_inplace: as
    `out += residual` (the sum keeps the BatchNorm output's dtype), else as `out + residual` (type promotion)."""

    def __init__(self, conv: nn.Module, bn: nn.Module, activation: Union[None, str, nn.Module] = None,
                 residual_inplace: bool = False) -> None:
        super().__init__()
        dims = len(getattr(conv, "kernel_size", ()))
        if not isinstance(convert(conv), (_ConvMixin, _ConvTransposeMixin)):
            raise TypeError(f"ConvBNAct: conv must be a torch.nn convolution, got {type(conv).__name__}")
        if not isinstance(bn, _BATCH_NORMS[dims]):
            raise TypeError(f"ConvBNAct: a {dims}D convolution needs {_BATCH_NORMS[dims].__name__}, "
                            f"got {type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"ConvBNAct: bn has {bn.num_features} features, the convolution "
                             f"{conv.out_channels} output channels")
        self.conv, self.bn = conv, bn
        self.activation = activation_name(activation)
        self.residual_inplace = residual_inplace
        self._dims = dims

    def extra_repr(self) -> str:
        return f"activation={self.activation}"

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.batch_norm_activation(self.conv(x), residual)

    @property
    def _norm(self) -> nn.Module:
        return self.bn


class _FusedBatchNormMixin(_FusedNorm):
    """A torch.nn BatchNorm followed by its activation (fuse() swaps the class of a BatchNorm whose only use is an
    activation, as DenseNet's pre-activation layers have, and drops the activation's node): same parameters,
    buffers and state_dict names; `fused_activation` names the activation."""

    fused_activation: Optional[str] = None

    @property
    def _norm(self) -> nn.Module:
        return self

    @property
    def activation(self) -> Optional[str]:
        return self.fused_activation

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.batch_norm_activation(y)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.fused_activation}"


class FusedBatchNorm1d(_FusedBatchNormMixin, nn.BatchNorm1d):
    _dims = 1


class FusedBatchNorm2d(_FusedBatchNormMixin, nn.BatchNorm2d):
    _dims = 2


class FusedBatchNorm3d(_FusedBatchNormMixin, nn.BatchNorm3d):
    _dims = 3


_FUSED_BATCH_NORMS = {nn.BatchNorm1d: FusedBatchNorm1d, nn.BatchNorm2d: FusedBatchNorm2d,
                      nn.BatchNorm3d: FusedBatchNorm3d}


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _residual_add(node: Optional[fx.Node], operand: fx.Node) -> tuple[Optional[fx.Node], Optional[fx.Node], bool]:
    """(node, the other operand, in place) where node adds another tensor to `operand` (`out + r`, `out += r`,
    torch.add), else (None, None, False)."""
    if (node is None or node.op != "call_function" or node.kwargs or len(node.args) != 2
            or node.target not in (operator.add, operator.iadd, torch.add)):
        return None, None, False
    a, b = node.args
    other = b if a is operand else a if b is operand else None
    if not isinstance(other, fx.Node) or other is operand:
        return None, None, False
    # out += r changes out in place (the BatchNorm's output, which only the add uses); r += out would change r
    if node.target is operator.iadd and a is not operand:
        return None, None, False
    return node, other, node.target is operator.iadd


def _activation_of(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The activation a graph node applies to its one input, or None."""
    if node.op == "call_module":
        return _ACTIVATION_MODULES.get(type(modules.get(node.target)))
    if node.op in ("call_function", "call_method") and len(node.args) == 1:
        if node.kwargs and set(node.kwargs) != {"inplace"}:
            return None
        try:
            return _ACTIVATION_CALLS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None


class _Tracer(fx.Tracer):
    """torch.fx's tracer with every convolution a leaf (convdsl's modules and torch.nn subclasses that live outside
    torch.nn, such as torchvision's video convolutions, would otherwise be traced through), and every module without
    a BatchNorm inside a leaf: no pattern can be inside it, and its forward stays its own Python (a trace would
    freeze branches on `self.training`, as torchvision's StochasticDepth takes)."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        if isinstance(m, _TORCH_BASES) or super().is_leaf_module(m, qualified_name):
            return True
        return not any(isinstance(d, nn.modules.batchnorm._BatchNorm) for d in m.modules())


def _traces(model: nn.Module) -> tuple[fx.Graph, fx.Graph]:
    """model's graphs traced in train and in eval mode (its mode restored)."""
    training = model.training
    try:
        graphs = []
        for mode in (True, False):
            model.train(mode)
            graphs.append(_Tracer().trace(model))
    finally:
        model.train(training)
    return graphs[0], graphs[1]


def fuse(model: nn.Module) -> fx.GraphModule:
    """`model` traced by torch.fx, its convolutions converted (convert()) and every convolution whose only use is a
    BatchNorm (whose only use may be an activation) replaced by a ConvBNAct holding the same modules: returns the
    GraphModule (parameters shared with `model`); a BatchNorm followed only by an activation (not after a
    convolution) becomes a FusedBatchNorm at its own path.  A fused convolution's parameters move under its ConvBNAct
    (`layer1.0.conv1.weight` -> `layer1.0.conv1.conv.weight`, `layer1.0.bn1.*` -> `layer1.0.conv1.bn.*`), as
    torch.ao.quantization.fuse_modules renames them.  A model torch.fx cannot trace gets a ValueError."""
    convert(model)
    try:
        train_graph, eval_graph = _traces(model)
    except Exception as e:  # torch.fx raises many types; the message names the construct it could not trace
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"fuse(): torch.fx cannot trace {type(model).__name__} ({first}); convert(model) runs its "
                         f"convolutions on convdsl unfused, or build ConvBNAct modules by hand") from e
    if str(train_graph) != str(eval_graph):  # the graph would keep one mode's branches
        raise ValueError(f"fuse(): {type(model).__name__}'s forward traces differently in train and eval mode "
                         f"(a branch on self.training in a module that holds a BatchNorm); convert(model) runs "
                         f"its convolutions on convdsl unfused, or build ConvBNAct modules by hand")
    gm = fx.GraphModule(model, train_graph if model.training else eval_graph, type(model).__name__)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for bn_node in list(gm.graph.nodes):
        bn = modules.get(bn_node.target) if bn_node.op == "call_module" else None
        if type(bn) not in _BATCH_NORMS.values() or len(bn_node.args) != 1 or bn_node.kwargs:
            continue
        conv_node = bn_node.args[0]
        if not isinstance(conv_node, fx.Node) or conv_node.op != "call_module" or len(conv_node.users) != 1:
            continue
        conv = modules.get(conv_node.target)
        if (not isinstance(conv, (_ConvMixin, _ConvTransposeMixin)) or calls[conv_node.target] != 1
                or calls[bn_node.target] != 1 or len(conv_node.args) != 1 or conv_node.kwargs
                or type(bn) is not _BATCH_NORMS[len(conv.kernel_size)] or bn.num_features != conv.out_channels):
            continue
        after = _only_user(bn_node)
        add_node, residual, inplace = _residual_add(after, bn_node)
        if add_node is not None:
            act_node = _only_user(add_node)
            activation = _activation_of(act_node, modules) if act_node is not None else None
            if activation not in RESIDUAL_ACTIVATIONS:  # its derivative would need the sum: the add stays out
                add_node = residual = None
        if add_node is None:
            act_node = after
            activation = _activation_of(act_node, modules) if act_node is not None else None
        fused = ConvBNAct(conv, bn, activation, residual_inplace=inplace)
        fused.unfused_names = (conv_node.target, bn_node.target)  # where the model kept them (original_names)
        gm.add_submodule(conv_node.target, fused)
        dropped = [n for n in (act_node if activation is not None else None, add_node, bn_node, conv_node) if n]
        # the fused call where the last of the nodes it replaces was: the residual may be computed after the
        # convolution (torchvision's downsample)
        with gm.graph.inserting_before(dropped[0]):
            fused_node = gm.graph.call_module(conv_node.target, (conv_node.args[0],)
                                              + (() if residual is None else (residual,)))
        dropped[0].replace_all_uses_with(fused_node)
        for node in dropped:
            gm.graph.erase_node(node)
        # the BatchNorm now lives in the ConvBNAct only (delete_all_unused_submodules would not see its old path:
        # named_modules lists a module once)
        gm.delete_submodule(bn_node.target)
    # a BatchNorm whose only use is an activation (not after a convolution: DenseNet's pre-activation layers after a
    # concatenation): a FusedBatchNorm sharing its parameters and buffers, at its path, computes both
    for bn_node in list(gm.graph.nodes):
        bn = modules.get(bn_node.target) if bn_node.op == "call_module" else None
        if (type(bn) not in _FUSED_BATCH_NORMS or calls[bn_node.target] != 1 or len(bn_node.args) != 1
                or bn_node.kwargs):
            continue
        act_node = _only_user(bn_node)
        activation = _activation_of(act_node, modules) if act_node is not None else None
        if activation is None:
            continue
        fused_bn = copy.copy(bn)  # the same parameter and buffer dicts; the model's own module keeps its class
        fused_bn.__class__ = _FUSED_BATCH_NORMS[type(bn)]
        fused_bn.fused_activation = activation
        gm.add_submodule(bn_node.target, fused_bn)
        act_node.replace_all_uses_with(bn_node)
        gm.graph.erase_node(act_node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def original_names(model: nn.Module) -> dict[str, str]:
    """For a model from fuse(): each state_dict key -> the key the unfused model had (`conv1.conv.weight` ->
    `conv1.weight`, `conv1.bn.running_mean` -> `bn1.running_mean`); keys fuse() did not move map to themselves."""
    moved: dict[str, str] = {}
    for path, m in model.named_modules():
        names = getattr(m, "unfused_names", None) if isinstance(m, ConvBNAct) else None
        if names is not None:
            moved[f"{path}.conv."] = f"{names[0]}."
            moved[f"{path}.bn."] = f"{names[1]}."
    result = {}
    for key in model.state_dict():
        prefix = next((p for p in moved if key.startswith(p)), None)
        result[key] = key if prefix is None else moved[prefix] + key[len(prefix):]
    return result


def load_unfused_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a state_dict saved from the unfused model (a checkpoint from before fuse()) into the fused one."""
    renamed = {new: state_dict[old] for new, old in original_names(model).items() if old in state_dict}
    if strict:
        unexpected = set(state_dict) - set(original_names(model).values())
        if unexpected:
            raise KeyError(f"load_unfused_state_dict: keys the fused model has no place for: {sorted(unexpected)[:5]}")
    return model.load_state_dict(renamed, strict=strict)
