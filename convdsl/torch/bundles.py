"""A model's kernels compiled ahead: trace one training step on fake tensors (no GPU, nothing computed), then compile
every convolution it asks for into a bundle, for a GPU machine whose Triton cannot build them (PyTorch 2.11's
Triton 3.6 has no Gluon TMA copies, so it builds only the cp.async kernels) or that should not compile at first use.

    import convdsl.torch as ct
    model = ct.convert(my_model).to(memory_format=torch.channels_last)
    images = torch.randn(64, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    labels = torch.zeros(64, dtype=torch.long)
    step = ct.record_step(model, lambda m: nn.functional.cross_entropy(m(images), labels), autocast=torch.bfloat16)
    step.write_bundle("model.convk", arch="sm_90")       # where Triton 3.9 is; no GPU needed
    # on the GPU machine: CONVDSL_STREAM_BUNDLES=model.convk python3 train.py

The calls are recorded as CUDA makes them (f32 follows `torch.backends.cudnn.allow_tf32`, CPU autocast gives the
dtypes CUDA autocast gives, dY takes the forward's memory format on both), so a step traced on the CPU lists what
the same step asks for on CUDA.  A step traced with other shapes (another batch size) asks for other kernels.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import stream
from ..problem import ConvProblem
from ..targets import Target
from . import runtime


@dataclass(frozen=True)
class RecordedStep:
    """The convolutions one training step asks for: `problems` in first-call order (with the eager path's
    grad_weight into the parameter's dtype under autocast, which a step may run instead of the operators' one),
    `calls` how often each runs in the step."""

    problems: tuple[ConvProblem, ...]
    calls: Mapping[ConvProblem, int] = field(default_factory=dict)

    def stream_kernels(self, arch: str = "sm_90") -> tuple[list[stream.StreamKernel], list[tuple[ConvProblem, str]]]:
        """(every problem's stream kernel for `arch`, compiled with the installed Triton or from the disk cache;
        the problems without one, with why: those run the IREE module or PyTorch's convolution)."""
        target = Target("cuda", arch)
        kernels, without = [], []
        for p in self.problems:
            reason = stream.unsupported_reason(p, target)
            if reason is None:
                kernels.append(stream.stream_kernel(p, target))
            else:
                without.append((p, reason))
        return kernels, without

    def write_bundle(self, path: Union[str, Path], arch: str = "sm_90") -> list[tuple[ConvProblem, str]]:
        """Compile the step's stream kernels for `arch` into one bundle file (convdsl.stream's format, named in
        CONVDSL_STREAM_BUNDLES on the GPU machine); returns the problems left out, with why."""
        kernels, without = self.stream_kernels(arch)
        stream.save_bundle(kernels, path)
        return without


def record_step(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor],
                autocast: Optional[torch.dtype] = None) -> RecordedStep:
    """Run `loss(m)` (the forward and the loss of m, its inputs CPU tensors, real or fake) and its backward on fake
    tensors, m a CPU copy of `model` (the model itself keeps its gradients, buffers and device), and record every
    convolution of convdsl's that the step calls, as CUDA would call it (convert() the model first).  autocast:
    the dtype of CUDA autocast in training (bf16, f16), applied as CPU autocast while tracing; None: none."""
    traced = copy.deepcopy(model).cpu()
    for m in traced.modules():
        # momentum None averages by 1 / float(num_batches_tracked), a host read no fake tensor has; the copy's
        # statistics are never used, so it averages with a fixed factor (the convolutions are the same)
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            m.momentum = 0.1
    calls: dict[ConvProblem, int] = {}
    with runtime.recording(as_cuda=True, calls=calls) as problems, FakeTensorMode(allow_non_fake_inputs=True):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            value = loss(traced)
        value.backward()
    if not problems:
        raise ValueError(f"record_step: the step of {type(model).__name__} called none of convdsl's convolutions "
                         "(convert() the model first; float64, integer and empty-batch calls run PyTorch's own)")
    return RecordedStep(tuple(problems), dict(calls))
