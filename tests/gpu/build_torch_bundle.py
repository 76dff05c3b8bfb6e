"""Compile the stream kernels that tests/test_torch_gpu.py calls into one bundle, where Triton is (no GPU
needed): the calls are traced on fake tensors on the CPU.

    python3 tests/gpu/build_torch_bundle.py --arch sm_90 --out build/gpu/torch-tests.convk
    CONVDSL_STREAM_BUNDLES=build/gpu/torch-tests.convk python3 -m pytest -m gpu tests/test_torch_gpu.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convdsl.torch as ct  # noqa: E402
from convdsl import stream  # noqa: E402
from convdsl.targets import Target  # noqa: E402
from convdsl.torch import runtime  # noqa: E402
from test_torch_gpu import (BIG_GRAD_INPUT, DTYPES, MODULES, NUMERIC, PRECISIONS, _format,  # noqa: E402
                            big_grad_input_call, f32_accurate_wgrad_problems, fp8_problems, halo_problems,
                            numeric_ops, phase_grad_input_problems, specialised_wgrad_problems)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    y = model(x.requires_grad_())
    y.backward(torch.randn_like(y))  # dY in y's memory format, as the tests pass it


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    problems = []
    for name, kwargs, shape in MODULES:
        for (dtype_name, tf32) in PRECISIONS:
            for channels_last in (True, False):
                torch.backends.cudnn.allow_tf32 = tf32
                fmt = _format(len(shape), channels_last)
                model = getattr(ct, name)(**kwargs).to(DTYPES[dtype_name]).to(memory_format=fmt)
                with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True):
                    _step(model, torch.randn(shape).to(DTYPES[dtype_name]).to(memory_format=fmt))
                problems += seen
    torch.backends.cudnn.allow_tf32 = True
    name, kwargs, shape = MODULES[0]  # test_autocast_steps_against_cudnn_and_float64: f32 parameters, bf16 autocast
    model = getattr(ct, name)(**kwargs).to(memory_format=torch.channels_last)
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        _step(model, torch.randn(shape).to(memory_format=torch.channels_last))
    problems += seen
    model = _cpu_model()
    conv = ct.Conv2d(64, 64, 3, padding=1).half().to(memory_format=torch.channels_last)
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True):
        _step(model, torch.randn(8, 32, 16, 16, dtype=torch.half).to(memory_format=torch.channels_last))
        _step(conv, torch.randn(4, 64, 16, 16, dtype=torch.half).to(memory_format=torch.channels_last))
    problems += seen
    n, c, spatial = BIG_GRAD_INPUT["batch"], BIG_GRAD_INPUT["channels"], BIG_GRAD_INPUT["spatial"]
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True):
        big_grad_input_call(torch.empty((n, *spatial, c), dtype=torch.half).permute(0, 4, 1, 2, 3),
                            torch.empty((c, c, 3, 3, 3), dtype=torch.half))
    problems += seen
    n, c, s = NUMERIC["batch"], NUMERIC["channels"], NUMERIC["size"]
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True):
        x, dy = (torch.empty((n, c, s, s), dtype=torch.half).to(memory_format=torch.channels_last) for _ in range(2))
        numeric_ops(x, torch.empty((c, c, 3, 3), dtype=torch.half).to(memory_format=torch.channels_last), dy)
    problems += seen
    problems += (fp8_problems() + specialised_wgrad_problems() + phase_grad_input_problems()
                 + f32_accurate_wgrad_problems() + halo_problems())
    target = Target("cuda", args.arch)
    unique = list(dict.fromkeys(problems))
    kernels = [stream.stream_kernel(p, target) for p in unique if stream.unsupported_reason(p, target) is None]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stream.save_bundle(kernels, args.out)
    print(f"wrote {args.out}: {len(kernels)} stream kernels ({len(unique)} problems)")
    return 0


def _cpu_model() -> nn.Module:
    torch.manual_seed(0)
    return ct.convert(nn.Sequential(
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, stride=2, padding=1, groups=8), nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 2, stride=2), nn.ReLU(), nn.Conv2d(32, 8, 1))).half().to(
        memory_format=torch.channels_last)


if __name__ == "__main__":
    sys.exit(main())
