"""Drop-in modules: torch.nn's convolutions, computed by convdsl's operators (convdsl/torch/ops.py).

They subclass torch.nn.ConvNd / ConvTransposeNd, so constructor arguments, parameters, initialisation and
state_dict are torch.nn's own; only the computation differs.  `convert(model)` swaps a model's torch.nn
convolutions for them in place, keeping their parameters.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .fallback import unavailable
from .ops import call_conv_transpose, call_convolution, call_planned, check_call, parameter, plan_for


def _same_padding(kernel_size, dilation) -> tuple[list[int], list[int]]:
    """'same': total padding d*(k-1), the lower half rounded down (PyTorch puts the odd element at the end)."""
    total = [d * (k - 1) for k, d in zip(kernel_size, dilation)]
    return [t // 2 for t in total], [t - t // 2 for t in total]


class _ConvMixin:
    """torch.nn.ConvNd with convdsl's kernels: `_conv_forward(x, weight, bias)` (which torch.nn's forward and
    subclasses that transform the weight call) runs them."""

    def _padding_lo_hi(self) -> tuple[list[int], list[int]]:
        if isinstance(self.padding, str):
            if self.padding == "valid":
                zeros = [0] * len(self.kernel_size)
                return zeros, zeros
            return _same_padding(self.kernel_size, self.dilation)
        return list(self.padding), list(self.padding)

    def conv_arguments(self) -> tuple[list[int], list[int], list[int], list[int], int]:
        """(stride, pad_lo, pad_hi, dilation, groups) as the operators take them."""
        lo, hi = self._padding_lo_hi()
        return list(self.stride), lo, hi, list(self.dilation), self.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, parameter(self, "weight"), parameter(self, "bias"))

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.padding_mode != "zeros":
            _torch_only(self, f"padding_mode={self.padding_mode!r}", "convdsl computes zero padding")
            return _torch_base(self)._conv_forward(self, x, weight, bias)
        unbatched = x.dim() == len(self.kernel_size) + 1  # torch.nn also takes one sample (C, *spatial)
        if unbatched:
            x = x.unsqueeze(0)
        # on CUDA in eager mode, a repeated call finds its plan: no checks, no problem keys
        plan = plan_for(self, x, weight, bias)
        if plan is not None:
            y = call_planned(plan, x, weight, bias)
        else:
            check_call(self, x, False, weight, bias)
            y = call_convolution(x, weight, bias, *self.conv_arguments())
        return y.squeeze(0) if unbatched else y


class Conv1d(_ConvMixin, nn.Conv1d):
    forward = _ConvMixin.forward
    _conv_forward = _ConvMixin._conv_forward


class Conv2d(_ConvMixin, nn.Conv2d):
    forward = _ConvMixin.forward
    _conv_forward = _ConvMixin._conv_forward


class Conv3d(_ConvMixin, nn.Conv3d):
    forward = _ConvMixin.forward
    _conv_forward = _ConvMixin._conv_forward


class _ConvTransposeMixin:
    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        if self.padding_mode != "zeros":  # torch.nn raises its own error for these
            return _torch_base(self).forward(self, x, output_size)
        unbatched = x.dim() == len(self.kernel_size) + 1
        if unbatched:
            x = x.unsqueeze(0)
        check_call(self, x, True, self.weight, self.bias)
        dims = len(self.kernel_size)
        output_padding = self._output_padding(x, output_size, list(self.stride), list(self.padding),
                                              list(self.kernel_size), dims, list(self.dilation))
        y = call_conv_transpose(x, self.weight, self.bias, list(self.stride), list(self.padding),
                                list(self.padding), list(output_padding), list(self.dilation), self.groups)
        return y.squeeze(0) if unbatched else y


class ConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    forward = _ConvTransposeMixin.forward


class ConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    forward = _ConvTransposeMixin.forward


class ConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    forward = _ConvTransposeMixin.forward


_TORCH_BASES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _torch_base(module: nn.Module) -> type:
    return next(c for c in type(module).__mro__ if c in _TORCH_BASES)


def _torch_only(module: nn.Module, what: str, why: str) -> None:
    unavailable(f"{type(module).__name__} with {what}", why)


_SWAPS: dict[type, type] = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
                             nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
                             nn.ConvTranspose3d: ConvTranspose3d}


def _swap_class(cls: type) -> Optional[type]:
    """convdsl's class for a torch.nn convolution class: the drop-in module for torch.nn's own, and for a
    subclass (torchvision's Conv3DSimple, a weight-standardised Conv2d) a subclass of it that keeps its methods
    and computes through convdsl: its forward where it keeps torch.nn's, its _conv_forward (which torch.nn's
    forward and most overriding forwards call) always.  None: not a torch.nn convolution, or already convdsl's."""
    if not issubclass(cls, _TORCH_BASES) or issubclass(cls, (_ConvMixin, _ConvTransposeMixin)):
        return None
    swap = _SWAPS.get(cls)
    if swap is not None:
        return swap
    base = next(c for c in cls.__mro__ if c in _TORCH_BASES)
    mixin = _ConvTransposeMixin if base.__name__.startswith("ConvTranspose") else _ConvMixin
    namespace: dict = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                       "__doc__": cls.__doc__, "__reduce_ex__": _reduce_converted}
    # the mixin comes first in the MRO: name the subclass's own forward, where it has one, explicitly
    namespace["forward"] = mixin.forward if cls.forward is base.forward else cls.forward
    if mixin is _ConvMixin:
        namespace["_conv_forward"] = _ConvMixin._conv_forward
    swap = _SWAPS[cls] = type(cls.__name__, (mixin, cls), namespace)
    return swap


def _reduce_converted(self, protocol: int):
    """A converted subclass pickles as its original class plus convert() (the generated class has no name a
    pickle could find)."""
    original = next(c for c in type(self).__mro__[1:] if c not in (_ConvMixin, _ConvTransposeMixin))
    state = self.__dict__.copy()
    return (_rebuild_converted, (original, state))


def _rebuild_converted(original: type, state: dict) -> nn.Module:
    module = original.__new__(original)
    module.__dict__.update(state)
    module.__class__ = _swap_class(original)
    return module


def convert(model: nn.Module) -> nn.Module:
    """Swap every torch.nn convolution of `model` (recursively, in place; `model` itself too), subclasses
    included, for convdsl's, keeping its parameters, buffers and hooks; returns the model.  Convolutions with a
    padding_mode other than 'zeros' are left as they are (convdsl computes zero padding only)."""
    swap = _swap_class(type(model))
    if swap is not None:
        if model.padding_mode == "zeros":
            model.__class__ = swap  # same attributes and parameters; only the computation changes
        return model
    for child in model.children():
        convert(child)
    return model
