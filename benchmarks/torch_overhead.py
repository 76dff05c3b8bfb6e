"""Host time per call of convdsl.torch's modules against torch.nn's (cuDNN), on one CUDA GPU: small convolutions
(so that the GPU waits for the host) called N times back to back, forward and forward + backward, in both memory
formats; --profile adds the Python functions that cost the most host time in convdsl's forward + backward.

    python3 benchmarks/torch_overhead.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convdsl.torch as ct  # noqa: E402

CALLS = 500
# (label, Conv2d arguments, input shape, dtype): small batches, so the GPU is never the limit
LAYERS = [
    ("3x3 32->32 bf16", dict(in_channels=32, out_channels=32, kernel_size=3, padding=1), (2, 32, 8, 8),
     torch.bfloat16),
    ("3x3/2 80->112 f16", dict(in_channels=80, out_channels=112, kernel_size=3, stride=2, padding=1),
     (2, 80, 16, 16), torch.float16),
]


REPEATS = 7  # the median of this many runs of CALLS calls, the backends interleaved


def per_call_us(fn) -> float:
    """Host time per call of CALLS calls queued back to back (the GPU never waits: small problems)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / CALLS * 1e6


def interleaved_medians(calls: dict) -> dict:
    """{name: median per-call us} of each callable, run REPEATS times in turn after a warm-up."""
    for fn in calls.values():
        for _ in range(20):
            fn()
    runs: dict = {name: [] for name in calls}
    for _ in range(REPEATS):
        for name, fn in calls.items():
            runs[name].append(per_call_us(fn))
    return {name: statistics.median(v) for name, v in runs.items()}


def layer_calls(cls, kwargs: dict, shape: tuple, dtype: torch.dtype, fmt: torch.memory_format):
    torch.manual_seed(0)
    conv = cls(**kwargs).cuda().to(dtype).to(memory_format=fmt)
    x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
    xg = x.clone().requires_grad_()
    g = torch.randn_like(conv(x))
    return (lambda: conv(x)), (lambda: conv(xg).backward(g))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="cProfile convdsl's forward + backward calls")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, {CALLS} calls queued, "
          f"median of {REPEATS} interleaved runs")
    print(f"{'layer':<20} {'format':<14} {'fwd cuDNN':>10} {'convdsl':>8} {'fwd+bwd cuDNN':>14} {'convdsl':>8}")
    for label, kwargs, shape, dtype in LAYERS:
        for fmt_name, fmt in (("channels_last", torch.channels_last), ("contiguous", torch.contiguous_format)):
            calls = {}
            for backend, cls in (("cudnn", nn.Conv2d), ("convdsl", ct.Conv2d)):
                fwd, step = layer_calls(cls, kwargs, shape, dtype, fmt)
                calls[(backend, "fwd")], calls[(backend, "step")] = fwd, step
                if args.profile and backend == "convdsl":
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(200):
                        step()
                    profiler.disable()
                    torch.cuda.synchronize()
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
                    print(f"--- {label} {fmt_name}: convdsl forward + backward, 200 calls, by own time")
                    print("\n".join(out.getvalue().splitlines()[4:]))
            medians = interleaved_medians(calls)
            times = {b: (medians[(b, "fwd")], medians[(b, "step")]) for b in ("cudnn", "convdsl")}
            print(f"{label:<20} {fmt_name:<14} {times['cudnn'][0]:10.1f} {times['convdsl'][0]:8.1f} "
                  f"{times['cudnn'][1]:14.1f} {times['convdsl'][1]:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
