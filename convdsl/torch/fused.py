"""Convolution -> BatchNorm -> activation as one module, with the BatchNorm, a residual and the activation done in
two kernels over the convolution's output forward and two backward (convdsl/kernels/batchnorm.py has the kernels
and the algebra) instead of PyTorch's three and three (and the residual's add).

    fused = ct.ConvBNAct(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), "relu")
    model = ct.fuse(torchvision.models.resnet50())    # every Conv -> BN (-> activation) of the model fused

fuse() (convdsl/torch/fusion.py) forms ConvBNAct modules (with ResNet's residual before the activation), and FusedBatchNorm modules where a
BatchNorm followed by its activation has no convolution before it.  Numerics are torch.nn's: batch statistics in
training (biased variance normalises, the unbiased one enters the running average, momentum None is the
cumulative average), running statistics in eval; only the rounding differs (the activation is computed from the
normalised value in f32 and rounded once).  The fused kernels run on CUDA in eager mode and in CUDA graphs, in
training and in eval mode without gradients; eval mode with gradients, the CPU, float64, `torch.compile` (whose
Inductor fuses these elementwise steps itself) and tensors of 2^31 elements or more run torch.nn's modules instead,
with the same results.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..backends.cuda_driver import load_function
from ..kernels.batchnorm_launches import RESIDUAL_ACTIVATIONS, BatchNormLaunches, batch_norm_launches
from ..kernels.launch import Launch
from . import fallback, native, runtime
from .modules import _ConvMixin, _ConvTransposeMixin, convert
from .stream import ALIGNMENT, _raw_stream, dtype_name

try:
    from ..kernels.compile import compile_launch
    import triton  # noqa: F401  (compile_launch needs it where a launch is compiled)
except ImportError:  # no Triton: the fused module runs torch.nn's steps
    compile_launch = None

# activations by name: torch.nn's modules and functions that fuse(), and what the unfused path computes
ACTIVATION_FUNCTIONS = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "hardswish": F.hardswish}
_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Hardswish: "hardswish"}
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


def _channels_innermost(t: torch.Tensor) -> bool:
    """Channels stored innermost and t not contiguous: channels-last for any rank (Conv1d's (N, L, C) storage too,
    which runtime's memory-format test does not count)."""
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
    run.function, run.grid = function, launch.grid  # what the native launcher launches (_native_plan)
    return run


# how a launch runs: replaced by tests with Triton's interpreter
launcher_for: Callable[[Launch, torch.device], Launcher] = _driver_launcher


class _Planned:
    """One tensor signature's launches, each compiled and loaded at its first use (eval mode needs only one)."""

    _LAUNCHES = ("stats", "apply", "apply_running", "grad_stats", "grad_apply")

    def __init__(self, launches: BatchNormLaunches, device: torch.device, residual: bool = False) -> None:
        self.launches, self.device, self.residual = launches, device, residual
        self.channels = launches.channels
        self.channels_last = launches.channels_last
        self.counters = launches.channel_blocks
        self._native: object = _UNPLANNED

    @property
    def native(self) -> Optional[object]:
        """The training launches as the native launcher's BatchNormPlan (made at first use), None where it is not
        built or the launches are not the driver's (the interpreter's in tests)."""
        if self._native is _UNPLANNED:
            self._native = _native_plan(self)
        return self._native

    def __getattr__(self, name: str) -> Launcher:  # only for a launcher not loaded yet
        if name not in self._LAUNCHES:
            raise AttributeError(name)
        launcher = launcher_for(getattr(self.launches, name), self.device)
        setattr(self, name, launcher)
        return launcher


_PLANNED: dict[tuple, _Planned] = {}
_UNPLANNED = object()
# the training launches' tensors, in the order BatchNormActivation passes them (kernels/batchnorm_launches.py)
_NATIVE_LAUNCHES = (("stats", 6), ("apply", 6), ("grad_stats", 9), ("grad_apply", 9))
_POINTER, _ZERO = 0, 2  # native.cpp's parameter kinds: a buffer of the call, a parameter never read


def _native_plan(planned: _Planned) -> Optional[object]:
    ext = native.extension() if planned.device.type == "cuda" and launcher_for is _driver_launcher else None
    if ext is None:
        return None
    plan = ext.BatchNormPlan(planned.launches.work_elements, planned.channels, planned.residual)
    for which, (name, tensors) in enumerate(_NATIVE_LAUNCHES):
        run = getattr(planned, name)
        function = run.function
        params = [(_POINTER, i) for i in range(tensors)] + [(_ZERO, 0)] * (function.params - tensors)
        plan.set(which, function.handle.value, tuple(run.grid), function.threads, function.shared_bytes,
                 function.name, params)
    return plan


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
        cl = _channels_innermost(y)
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
            planned = _Planned(launches, y.device, residual)
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
            residual = _same_layout(residual, _channels_innermost(y))  # the kernels read it as they read y
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
        native_plan = planned.native
        if native_plan is not None:  # the same launches and autograd node in C++ (native.cpp)
            stream = _stream(y.device)
            return native.extension().batch_norm_activation(
                y, weight, bias, residual, running_mean if update else None, running_var if update else None,
                batches, _counter(y.device, stream, planned.counters), native_plan)
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
        if not (_channels_innermost(y) or y.is_contiguous()):
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
