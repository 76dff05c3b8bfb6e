"""Drop-in modules: torch.nn's convolutions, computed by convdsl's operators (convdsl/torch/ops.py).

They subclass torch.nn.ConvNd / ConvTransposeNd, so constructor arguments, parameters, initialisation and
state_dict are torch.nn's own; only the computation differs.  `convert(model)` swaps a model's torch.nn
convolutions for them in place, keeping their parameters.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .ops import call_conv_transpose, call_convolution, call_planned, parameter, plan_for


def _same_padding(kernel_size, dilation) -> tuple[list[int], list[int]]:
    """'same': total padding d*(k-1), the lower half rounded down (PyTorch puts the odd element at the end)."""
    total = [d * (k - 1) for k, d in zip(kernel_size, dilation)]
    return [t // 2 for t in total], [t - t // 2 for t in total]


_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def check_call(module: nn.Module, x: torch.Tensor, transposed: bool) -> None:
    """The errors torch.nn raises for the same mistakes, with the same exception types."""
    dims = len(module.kernel_size)
    name = f"conv{'_transpose' if transposed else ''}{dims}d"
    if x.dim() != dims + 2:
        raise RuntimeError(f"Expected {dims + 1}D (unbatched) or {dims + 2}D (batched) input to {name}, but got "
                           f"input of size: {list(x.shape)}")
    w = module.weight
    if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):  # autocast casts both
        raise RuntimeError(f"Input type ({x.dtype}) and weight type ({w.dtype}) should be the same")
    if x.dtype not in _SUPPORTED:
        raise RuntimeError(f"{name}: convdsl computes float32, float16 and bfloat16, got input of type {x.dtype}")
    if x.device != w.device:
        raise RuntimeError(f"Input type ({x.device}) and weight type ({w.device}) should be on the same device")
    expected = w.shape[0] if transposed else w.shape[1] * module.groups
    if x.shape[1] != expected:
        raise RuntimeError(f"Given groups={module.groups}, weight of size {list(w.shape)}, expected input"
                           f"{list(x.shape)} to have {expected} channels, but got {x.shape[1]} channels instead")


def _batched(fn):
    """torch.nn's convolutions also take one unbatched sample (C, *spatial)."""
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.dim() == len(self.kernel_size) + 1:
            return fn(self, x.unsqueeze(0), *args, **kwargs).squeeze(0)
        return fn(self, x, *args, **kwargs)
    return forward


class _ConvMixin:
    def _padding_lo_hi(self) -> tuple[list[int], list[int]]:
        if self.padding_mode != "zeros":
            raise ValueError(f"padding_mode: convdsl computes padding_mode='zeros' only, got {self.padding_mode!r}")
        if isinstance(self.padding, str):
            if self.padding == "valid":
                zeros = [0] * len(self.kernel_size)
                return zeros, zeros
            return _same_padding(self.kernel_size, self.dilation)
        return list(self.padding), list(self.padding)

    def validate(self, x: torch.Tensor) -> None:
        check_call(self, x, transposed=False)

    def conv_arguments(self) -> tuple[list[int], list[int], list[int], list[int], int]:
        """(stride, pad_lo, pad_hi, dilation, groups) as the operators take them."""
        lo, hi = self._padding_lo_hi()
        return list(self.stride), lo, hi, list(self.dilation), self.groups

    @_batched
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on CUDA in eager mode, a repeated call finds its plan: no checks, no problem keys
        plan = plan_for(self, x)
        if plan is not None:
            return call_planned(plan, x, parameter(self, "weight"), parameter(self, "bias"))
        check_call(self, x, transposed=False)
        return call_convolution(x, self.weight, self.bias, *self.conv_arguments())


class Conv1d(_ConvMixin, nn.Conv1d):
    forward = _ConvMixin.forward


class Conv2d(_ConvMixin, nn.Conv2d):
    forward = _ConvMixin.forward


class Conv3d(_ConvMixin, nn.Conv3d):
    forward = _ConvMixin.forward


class _ConvTransposeMixin:
    @_batched
    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        check_call(self, x, transposed=True)
        if self.padding_mode != "zeros":
            raise ValueError(f"padding_mode: convdsl computes padding_mode='zeros' only, got {self.padding_mode!r}")
        dims = len(self.kernel_size)
        output_padding = self._output_padding(x, output_size, list(self.stride), list(self.padding),
                                              list(self.kernel_size), dims, list(self.dilation))
        return call_conv_transpose(x, self.weight, self.bias, list(self.stride), list(self.padding),
                                   list(self.padding), list(output_padding), list(self.dilation), self.groups)


class ConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    forward = _ConvTransposeMixin.forward


class ConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    forward = _ConvTransposeMixin.forward


class ConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    forward = _ConvTransposeMixin.forward


_SWAPS = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d, nn.ConvTranspose1d: ConvTranspose1d,
          nn.ConvTranspose2d: ConvTranspose2d, nn.ConvTranspose3d: ConvTranspose3d}


def convert(model: nn.Module) -> nn.Module:
    """Swap every torch.nn convolution of `model` (recursively, in place) for convdsl's, keeping its parameters,
    buffers and hooks; returns the model.  Convolutions with a padding_mode other than 'zeros' are left as they
    are (convdsl computes zero padding only)."""
    for name, child in model.named_children():
        swap = _SWAPS.get(type(child))
        if swap is not None and child.padding_mode == "zeros":
            child.__class__ = swap  # same attributes and parameters; only forward changes
        else:
            convert(child)
    return model
