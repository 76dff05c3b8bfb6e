"""Host time per call of convdsl.torch's operators against torch.nn's (cuDNN), on one CUDA GPU: a small
convolution (so that the GPU waits for the host) called N times back to back, forward and forward + backward.

    python3 benchmarks/torch_overhead.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convdsl.torch as ct  # noqa: E402

CALLS = 500


def per_call_us(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / CALLS * 1e6


def main() -> int:
    x = torch.randn(2, 32, 8, 8, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    rows = []
    for label, cls in (("cudnn", nn.Conv2d), ("convdsl", ct.Conv2d)):
        torch.manual_seed(0)
        conv = cls(32, 32, 3, padding=1).cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
        xg = x.clone().requires_grad_()
        fwd = per_call_us(lambda: conv(x))
        step = per_call_us(lambda: conv(xg).sum().backward())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            conv32 = cls(32, 32, 3, padding=1).cuda().to(memory_format=torch.channels_last)
            auto = per_call_us(lambda: conv32(x))
        rows.append((label, fwd, step, auto))
    print(f"{'':10} {'forward':>10} {'fwd+bwd':>10} {'autocast fwd':>14}   (host us per call, {CALLS} calls queued)")
    for label, fwd, step, auto in rows:
        print(f"{label:10} {fwd:10.1f} {step:10.1f} {auto:14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
