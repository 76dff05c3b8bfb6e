"""convdsl in PyTorch: convolutions and their gradients as `torch.library` operators with autograd, drop-in
modules, and `convert(model)`.

    import convdsl.torch as ct
    model = ct.convert(torchvision_model)           # its torch.nn convolutions now run convdsl's kernels
    conv = ct.Conv2d(64, 64, 3, padding=1, groups=32)
    compiled = torch.compile(model, backend="convdsl")   # or no convert(): Inductor takes aten's convolutions as
                                                         # convdsl's (convdsl/torch/inductor.py)
    ct.record_step(model, loss_of_model).write_bundle("model.convk")   # its kernels compiled ahead (bundles.py)

On CUDA the kernels are launched on PyTorch's current stream (no host synchronisation, CUDA-graph capturable);
on the CPU they run the IREE module.  See convdsl/torch/runtime.py for the layouts and the paths.
"""
from __future__ import annotations

from .bundles import RecordedStep, record_step
from .fused import ConvBNAct, FusedBatchNorm1d, FusedBatchNorm2d, FusedBatchNorm3d
from .fusion import fuse, load_unfused_state_dict, original_names
from .fallback import KernelFallbackWarning, KernelUnavailableError, set_strict
from .modules import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, convert
from .ops import conv_transpose, convolution, convolution_grad_input, convolution_grad_weight

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "convert",
           "ConvBNAct", "FusedBatchNorm1d", "FusedBatchNorm2d", "FusedBatchNorm3d", "fuse", "original_names", "load_unfused_state_dict",
           "conv_transpose", "convolution", "convolution_grad_input", "convolution_grad_weight",
           "KernelFallbackWarning", "KernelUnavailableError", "set_strict", "RecordedStep", "record_step"]
