#!/usr/bin/env python3
"""convdsl.torch training on the CPU against torch.nn: images/s of the same small model, steps interleaved.

The model: 4 x (Conv2d 3x3 + BatchNorm2d + ReLU) (3 -> 32 -> 64 -> 64 -> 128 channels, the 2nd and 4th with
stride 2), global average pool, Linear to 10 classes; channels-last, float32.  One copy stays torch.nn, a deep
copy is converted with `convdsl.torch.convert`; both get the same weights and the same batches, each its own SGD.
After warm-up steps (the kernels' compile and the first calls are outside the timing) the two models' steps
alternate, one of each per round, so a neighbour's load falls on both alike; the median step time of each is
reported as images/s.  Then a few instrumented convdsl steps split a step into the time inside the IREE kernel
calls (the destination-passing call itself), the rest of convdsl's calls (layout views, DLPack import, result
allocation, Python) and everything else (BatchNorm, ReLU, autograd, SGD); last, one step's kernel calls are replayed
with nothing between them, each repeated alone and all in the step's order, to tell the kernels' own time from
what training around them adds.

    python3 benchmarks/torch_cpu_training.py [--batch 16] [--size 32] [--rounds 60] [--threads N] [--out DIR]

Writes <out>/cpu-torch-training-<cpu>-<date>[-tag].json when --out is given (machine, versions, command).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu_bench import apply_runtime_flags, command, cpu_model, machine, versions  # noqa: E402
import convdsl.torch as ct  # noqa: E402
from convdsl.backends import into_call  # noqa: E402
from convdsl.torch import runtime  # noqa: E402

CHANNELS = [(3, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2)]


def make_model() -> nn.Module:
    layers: list[nn.Module] = []
    for cin, cout, stride in CHANNELS:
        layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                   nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS[-1][1], 10))


def step_fn(model: nn.Module, lr: float = 0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


class Breakdown:
    """Seconds inside the IREE kernel calls and inside convdsl's calls (runtime.run), while active; the kernel
    calls of the first step kept (`calls`) for replay."""

    def __init__(self, calls_per_step: int = 0) -> None:
        self.kernel = self.convdsl = 0.0
        self.calls = 0
        self.kept: list[tuple] = []
        self._keep = calls_per_step

    def __enter__(self) -> "Breakdown":
        self._call, self._run = into_call.IntoCall.call, runtime.run
        outer = self

        def timed_call(call_self, packed):
            if len(outer.kept) < outer._keep:
                outer.kept.append((call_self, packed))
            t0 = time.perf_counter()
            try:
                return outer._call(call_self, packed)
            finally:
                outer.kernel += time.perf_counter() - t0

        def timed_run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return outer._run(*args, **kwargs)
            finally:
                outer.convdsl += time.perf_counter() - t0
                outer.calls += 1

        into_call.IntoCall.call, runtime.run = timed_call, timed_run
        return self

    def __exit__(self, *exc) -> None:
        into_call.IntoCall.call, runtime.run = self._call, self._run

    def replay_ms(self, repeats: int = 20) -> dict[str, float]:
        """The kept step's kernel calls replayed with nothing between them: each call repeated back to back (its
        operands stay in cache), and the whole step's calls in order (each call finds the previous one's data in
        cache, not its own, as in training)."""
        each = 0.0
        for call_self, packed in self.kept:
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                self._call(call_self, packed)
                ts.append(time.perf_counter() - t)
            each += statistics.median(ts)
        in_order = []
        for _ in range(repeats):
            t = time.perf_counter()
            for call_self, packed in self.kept:
                self._call(call_self, packed)
            in_order.append(time.perf_counter() - t)
        return {"kernels_each_repeated_ms": 1e3 * each, "kernels_in_order_ms": 1e3 * statistics.median(in_order)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=20, help="instrumented convdsl steps for the breakdown")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before anything runs")
    ap.add_argument("--runtime-flag", action="append", default=[],
                    help="an IREE runtime flag (e.g. --task_topology_max_group_count=1), before the device is made")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    apply_runtime_flags(args.runtime_flag)

    torch.manual_seed(0)
    ref = make_model().to(memory_format=torch.channels_last)
    mine = ct.convert(copy.deepcopy(ref))
    steps = {"torch": step_fn(ref), "convdsl": step_fn(mine)}
    batches = [(torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (args.batch,))) for _ in range(8)]

    # each side runs with its own intra-op thread count: torch.nn with PyTorch's, convdsl with what its first CPU
    # kernel call leaves (interop.cap_torch_threads; CONVDSL_TORCH_CPU_THREADS=0 leaves PyTorch's)
    threads = {"torch": torch.get_num_threads()}
    t0 = time.perf_counter()
    steps["convdsl"](*batches[0])  # compiles the kernels (outside the timing)
    threads["convdsl"] = torch.get_num_threads()
    compile_s = time.perf_counter() - t0
    for i in range(args.warmup):
        for name, step in steps.items():
            torch.set_num_threads(threads[name])
            step(*batches[i % len(batches)])

    times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # neither always goes first
        for name in order:
            x, y = batches[r % len(batches)]
            torch.set_num_threads(threads[name])
            t = time.perf_counter()
            losses[name].append(steps[name](x, y))
            times[name].append(time.perf_counter() - t)

    torch.set_num_threads(threads["convdsl"])
    with Breakdown(calls_per_step=len(CHANNELS) * 3 - 1) as bd:  # the first layer needs no grad_input
        t = time.perf_counter()
        for i in range(args.profile_steps):
            steps["convdsl"](*batches[i % len(batches)])
        total = time.perf_counter() - t
    n = args.profile_steps
    breakdown = {"step_ms": 1e3 * total / n, "kernel_ms": 1e3 * bd.kernel / n,
                 "convdsl_calls_ms": 1e3 * bd.convdsl / n,
                 "convdsl_outside_kernel_ms": 1e3 * (bd.convdsl - bd.kernel) / n,
                 "rest_ms": 1e3 * (total - bd.convdsl) / n, "calls_per_step": bd.calls / n,
                 **bd.replay_ms(),
                 "note": "instrumented steps (timers around each call add a little); kernel: IntoCall.call; "
                         "kernels_each_repeated / kernels_in_order: the step's kernel calls replayed alone"}

    result = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = {"median_step_ms": 1e3 * med, "images_per_s": args.batch / med,
                        "p10_step_ms": 1e3 * sorted(ts)[len(ts) // 10], "p90_step_ms": 1e3 * sorted(ts)[9 * len(ts) // 10]}
        result[name]["torch_threads"] = threads[name]
        print(f"{name:8s} {args.batch / med:8.1f} images/s  (median step {1e3 * med:.2f} ms, {threads[name]} "
              "intra-op threads)")
    print("convdsl step breakdown (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()
                                                      if isinstance(v, float)))
    gap = result["convdsl"]["median_step_ms"] - result["torch"]["median_step_ms"]
    print(f"gap {gap:.2f} ms/step; convdsl/torch {result['convdsl']['images_per_s'] / result['torch']['images_per_s']:.3f}")
    drift = max(abs(a - b) for a, b in zip(losses["torch"], losses["convdsl"]))

    if args.out is not None:
        record = {"command": command(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine(), "versions": {**versions(), "torch_interop_threads": torch.get_num_interop_threads()},
                  "settings": {"batch": args.batch, "image_size": args.size, "rounds": args.rounds,
                               "warmup": args.warmup, "model": "4 x (Conv2d 3x3 + BatchNorm2d + ReLU) "
                               f"{CHANNELS} channels-last f32, SGD momentum 0.9"},
                  "first_step_s": compile_s, "results": result, "breakdown": breakdown,
                  "max_loss_difference": drift}
        args.out.mkdir(parents=True, exist_ok=True)
        cpu = "".join(c if c.isalnum() else "-" for c in cpu_model()).strip("-")
        path = args.out / (f"cpu-torch-training-{cpu}-{datetime.now().date().isoformat()}"
                           + (f"-{args.tag}" if args.tag else "") + ".json")
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
