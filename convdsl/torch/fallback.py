"""Calls convdsl has no kernel for, computed by PyTorch's own convolution.

A model converted with `convert()` keeps training when one of its layers cannot run on convdsl's kernels: a dtype
convdsl does not compute (float64, integers), an empty batch, or a kernel that fails to compile or load on this
machine.  Each such problem is announced once, in one line, as a `KernelFallbackWarning` (empty batches, which
need no kernel, silently); `set_strict(True)` (or the environment variable CONVDSL_TORCH_STRICT=1) raises instead,
for users who must know that every convolution runs on convdsl.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Sequence

import torch

_strict: Optional[bool] = None
STRICT_ENV = "CONVDSL_TORCH_STRICT"


class KernelFallbackWarning(RuntimeWarning):
    """A convolution runs PyTorch's kernels because convdsl has none for it."""


class KernelUnavailableError(RuntimeError):
    """Strict mode: a convolution convdsl has no kernel for."""


def set_strict(strict: bool) -> None:
    """strict: raise KernelUnavailableError where no kernel can be had, instead of running PyTorch's convolution."""
    global _strict
    _strict = bool(strict)


def strict() -> bool:
    if _strict is not None:
        return _strict
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


# the Triton convdsl's kernels are written for (pyproject's `cuda` extra); an older one, such as the one a PyTorch
# build pins, may fail to compile some of them
KERNELS_TRITON = "3.9"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    triton = sys.modules.get("triton")
    if type(err).__module__.startswith("triton") and triton is not None and \
            not getattr(triton, "__version__", "").startswith(KERNELS_TRITON):
        line += f"; the installed Triton is {triton.__version__}, convdsl's kernels need {KERNELS_TRITON}"
    return line


def unavailable(what: str, reason: str | BaseException, instead: str = "it runs PyTorch's convolution") -> None:
    """Announce (once per distinct message) that `what` runs PyTorch's kernels (`instead` says which), or raise in
    strict mode."""
    why = _first_line(reason) if isinstance(reason, BaseException) else reason
    if strict():
        raise KernelUnavailableError(f"convdsl: no kernel for {what}: {why}") from (
            reason if isinstance(reason, BaseException) else None)
    warnings.warn(f"convdsl: no kernel for {what} ({why}); {instead}", KernelFallbackWarning, stacklevel=2)


def compute(op: str, a: torch.Tensor, b: torch.Tensor, *, spatial: Sequence[int], filt: Sequence[int],
            stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
            groups: int, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """op (forward(x, w), grad_input(dy, w), grad_weight(x, dy)) on PyTorch's tensors by aten's convolution.

    aten pads both sides alike: the common part of (pad_lo, pad_hi) is its padding, the rest an explicit
    zero-padding of X (forward, grad_weight) or a crop of the padded dX (grad_input)."""
    dims = len(stride)
    common = [min(lo, hi) for lo, hi in zip(pad_lo, pad_hi)]
    extra_lo = [lo - c for lo, c in zip(pad_lo, common)]
    extra_hi = [hi - c for hi, c in zip(pad_hi, common)]
    asymmetric = any(extra_lo) or any(extra_hi)
    zeros = [0] * dims
    args = (list(stride), common, list(dilation), False, zeros, groups)

    def padded(x: torch.Tensor) -> torch.Tensor:
        if not asymmetric:
            return x
        # F.pad takes the last dimension first
        return torch.nn.functional.pad(x, [v for lo, hi in zip(reversed(extra_lo), reversed(extra_hi))
                                           for v in (lo, hi)])

    if op == "forward":
        r = torch.ops.aten.convolution(padded(a), b, None, *args)
    elif op == "grad_input":
        size = [a.shape[0], b.shape[1] * groups, *(s + lo + hi for s, lo, hi in zip(spatial, extra_lo, extra_hi))]
        shape_only = torch.empty(size, dtype=a.dtype, device=a.device)
        r = torch.ops.aten.convolution_backward(a, shape_only, b, None, *args, [True, False, False])[0]
        if asymmetric:
            crop = tuple(slice(lo, lo + s) for lo, s in zip(extra_lo, spatial))
            r = r[(slice(None), slice(None), *crop)].clone()
    elif op == "grad_weight":
        size = [b.shape[1], a.shape[1] // groups, *filt]
        shape_only = torch.empty(size, dtype=a.dtype, device=a.device)
        r = torch.ops.aten.convolution_backward(b, padded(a), shape_only, None, *args, [False, True, False])[1]
    else:
        raise ValueError(f"op: expected forward, grad_input or grad_weight, got {op!r}")
    return r if out_dtype is None or r.dtype == out_dtype else r.to(out_dtype)
