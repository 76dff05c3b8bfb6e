"""Run the fused BatchNorm + activation kernels (convdsl/kernels/batchnorm.py, through convdsl/torch/fused.py) in
Triton's interpreter on the CPU against torch.nn's BatchNorm and activation in float64; print the relative errors.

Used by tests/test_torch_fused.py in a subprocess: TRITON_INTERPRET must be set before triton is imported.
stdin: a JSON list of {"shape", "channels_last", "activation", "dtype", "momentum"}; stdout: a JSON list of
{"case", "errors": {name: relative error}, "layout_kept"}.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402

from convdsl.torch import fused  # noqa: E402

from convdsl.kernels import batchnorm  # noqa: E402


def _interpreted(launch, device):
    """A launch run by Triton's interpreter on CPU tensors, with the launch's constants and grid."""
    fn, constants = getattr(batchnorm, launch.kernel), dict(launch.constants)

    def run(_stream, *tensors):
        fn[launch.grid](*tensors, **constants)
    return run


# the kernels on CPU tensors, in the interpreter
fused.ConvBNAct._fusable = staticmethod(lambda y: True)
fused.launcher_for = _interpreted

DTYPES = {"f32": torch.float32, "f16": torch.float16}
FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
BATCH_NORMS = {3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last else t.contiguous()


def run(job: dict) -> dict:
    """Three training steps of BatchNorm + activation on the module's input y (the convolution's output), through
    ConvBNAct's fused path and torch.nn's, with momentum and num_batches_tracked; then the third step's gradients;
    then an eval-mode step under no_grad (the running statistics)."""
    torch.manual_seed(len(json.dumps(job)))
    shape, dtype, act = job["shape"], DTYPES[job["dtype"]], job["activation"]
    channels = shape[1]
    affine = job.get("affine", True)
    ref = BATCH_NORMS[len(shape)](channels, momentum=job["momentum"], affine=affine).double()
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    bn = BATCH_NORMS[len(shape)](channels, momentum=job["momentum"], affine=affine)
    bn.load_state_dict(ref.state_dict())
    module = fused.ConvBNAct.__new__(fused.ConvBNAct)  # the fused path alone: y given, no convolution
    nn.Module.__init__(module)
    module.bn, module.activation, module._dims, module.residual_inplace = bn, act, len(shape) - 2, False
    with_residual = job.get("residual", False)
    errors = {}
    for step in range(3):
        # inputs rounded to the dtype first: the reference then sees the kernels' inputs, and the error is the
        # kernels' own (BatchNorm's backward cancels: with few rows, input roundings alone would dominate)
        y = _layout(torch.randn(shape, dtype=torch.float64) * 2 + 0.7 * step, job["channels_last"])
        y = y.to(dtype).double()
        yr = y.clone().requires_grad_()
        res = _layout(torch.randn(shape, dtype=torch.float64), job["channels_last"]).to(dtype).double()
        res_r = res.clone().requires_grad_()
        out_ref = ref(yr) + res_r if with_residual else ref(yr)
        out_ref = fused.ACTIVATION_FUNCTIONS[act](out_ref) if act else out_ref
        yk = y.to(dtype)
        if job.get("strided"):  # neither layout: a transposed view (the kernels read a contiguous copy)
            yk = yk.transpose(2, 3).contiguous().transpose(2, 3)
            assert not yk.is_contiguous() and not yk.movedim(1, -1).is_contiguous()
        yk = yk.requires_grad_()
        res_k = res.to(dtype).requires_grad_()
        out = module.batch_norm_activation(yk, res_k if with_residual else None)
        grad = torch.randn(shape, dtype=torch.float64).to(dtype).double()
        out_ref.backward(grad)
        out.backward(grad.to(dtype))
    errors["out"] = _rel(out, out_ref)
    errors["grad_y"] = _rel(yk.grad, yr.grad)
    if with_residual:
        errors["grad_residual"] = _rel(res_k.grad, res_r.grad)
    if affine:
        errors["grad_weight"] = _rel(bn.weight.grad, ref.weight.grad)
        errors["grad_bias"] = _rel(bn.bias.grad, ref.bias.grad)
    errors["running_mean"] = _rel(bn.running_mean, ref.running_mean)
    errors["running_var"] = _rel(bn.running_var, ref.running_var)
    errors["batches"] = float(int(bn.num_batches_tracked) != int(ref.num_batches_tracked))
    # eval mode without gradients (inference): the running statistics in one pass
    ref.eval(), bn.eval()
    with torch.no_grad():
        y = _layout(torch.randn(shape, dtype=torch.float64), job["channels_last"]).to(dtype).double()
        out_ref = ref(y) + res if with_residual else ref(y)
        out_ref = fused.ACTIVATION_FUNCTIONS[act](out_ref) if act else out_ref
        out_eval = module.batch_norm_activation(y.to(dtype), res.to(dtype) if with_residual else None)
    errors["eval_out"] = _rel(out_eval, out_ref)
    errors["eval_layout"] = float(out_eval.stride() != y.stride())
    # a double backward (a gradient penalty) raises instead of returning a gradient without its second-order part
    bn.train()  # last: its step moves the running statistics
    yk2 = y.to(dtype).requires_grad_()
    first = torch.autograd.grad(module.batch_norm_activation(yk2).square().sum(), yk2, create_graph=True)[0]
    try:
        first.sum().backward()
        errors["double_backward_raises"] = 1.0
    except RuntimeError as e:
        errors["double_backward_raises"] = 0.0 if "once_differentiable" in str(e) else 1.0
    kept = out.stride() == (yk.contiguous().stride() if job.get("strided") else yk.stride())
    return {"case": job, "errors": errors, "layout_kept": kept}


if __name__ == "__main__":
    print(json.dumps([run(job) for job in json.load(sys.stdin)]))
