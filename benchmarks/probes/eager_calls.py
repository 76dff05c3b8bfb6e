"""Probe: host time per eager convolution call, convdsl's module against torch.nn's (cuDNN), on a layer small
enough that the GPU never holds the host back (bf16 autocast, channels-last, 8 x 64 x 8 x 8, 3x3).

    CONVDSL_STREAM_BUNDLES=B.convk python3 benchmarks/probes/eager_calls.py OUT.json   # on a CUDA GPU

Per backend, interleaved over 5 rounds: microseconds per forward call (no autograd recording), per forward with
autograd recording, and per forward + backward (loss.backward on the output's sum).  The bundle must hold the
layer's kernels (compile them where Triton is with `build BUNDLE`).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPE, CHANNELS = (8, 64, 8, 8), 64


def _layer(backend: str, device: str = "cuda"):
    import torch
    from torch import nn

    import convdsl.torch as ct

    torch.manual_seed(0)
    conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
    if backend == "convdsl":
        ct.convert(conv)
    return conv.to(device).to(memory_format=torch.channels_last)


def _per_call_us(fn, calls: int = 2000) -> float:
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def measure(backend: str) -> dict:
    import torch

    conv = _layer(backend)
    x = torch.randn(SHAPE, device="cuda").to(memory_format=torch.channels_last).requires_grad_()

    def forward() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            conv(x)

    def forward_recorded() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            conv(x)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = conv(x)
        y.backward(torch.ones_like(y))

    return {"forward_us": _per_call_us(forward), "forward_recorded_us": _per_call_us(forward_recorded),
            "forward_backward_us": _per_call_us(step, 1000)}


def build(out: Path) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl import stream
    from convdsl.targets import Target
    from convdsl.torch import runtime

    conv = _layer("convdsl", "cpu")
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(torch.randn(SHAPE).to(memory_format=torch.channels_last).requires_grad_())
        y.backward(torch.ones_like(y))
    target = Target("cuda", "sm_90")
    stream.save_bundle([stream.stream_kernel(p, target) for p in dict.fromkeys(seen)], out)
    print(f"wrote {out}")


def main(argv: list[str]) -> int:
    if argv[0] == "build":
        build(Path(argv[1]))
        return 0
    import torch

    rounds = [{b: measure(b) for b in ("convdsl", "cudnn")} for _ in range(5)]
    summary = {b: {k: statistics.median(r[b][k] for r in rounds) for k in rounds[0][b]} for b in ("convdsl", "cudnn")}
    print(json.dumps(summary, indent=1))
    record = {"versions": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "command": "python3 benchmarks/probes/eager_calls.py OUT.json"},
              "summary": summary, "rounds": rounds}
    Path(argv[0]).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
