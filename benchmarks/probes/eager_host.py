"""Probe: where an eager ResNet-50 training step (bf16 autocast, channels-last, batch 64) spends its host time,
for convdsl's convolutions and cuDNN's.

    CONVDSL_STREAM_BUNDLES=resnet50.convk python3 benchmarks/probes/eager_host.py OUT.json   # on a CUDA GPU

Per backend, in alternating rounds: the step's wall time (host-bound in eager mode; three blocks of 20 steps)
and the process's CPU time per step (the host's own work, less shaken by other load on the machine),
the host time to queue one step with the GPU idle and none of it waited for, and in the first round a cProfile
of 10 steps (the 30 functions of most own time).  Each backend also runs with Python's garbage collector frozen
after warm-up (gc.freeze: the model's objects no longer scanned), "+freeze".
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def measure(backend: str, freeze: bool, profile: bool) -> dict:
    import gc

    import torch
    from torch import nn

    import convdsl.torch as ct
    from train_resnet import ResNet

    torch.manual_seed(0)
    model = ResNet(groups=1, width_per_group=64, classes=100)
    if backend == "convdsl":
        ct.convert(model)
    model = model.cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(64, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 100, (64,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    if freeze:
        gc.collect()
        gc.freeze()
    walls, cpu = [], []
    before = torch.cuda.memory_stats()
    for _ in range(3):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(20):
            step()
        # the process's CPU time (the autograd engine runs backward on a thread of its own): the host's own work
        cpu.append((time.process_time() - start_cpu) / 20 * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) / 20 * 1e3)
    after = torch.cuda.memory_stats()
    # device allocations and frees by the caching allocator over the 60 steps (a cudaFree synchronises)
    memory = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free",
                                                                "num_alloc_retries")}
    queue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        queue.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    text = io.StringIO()
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    if freeze:
        gc.unfreeze()
    return {"backend": backend + ("+freeze" if freeze else ""), "step_wall_ms": sorted(walls)[1],
            "step_wall_blocks_ms": walls, "host_cpu_ms": sorted(cpu)[1], "memory": memory, "queue_ms": sorted(queue)[len(queue) // 2],
            "profile_top_tottime": text.getvalue()}


def main(argv: list[str]) -> int:
    import torch

    rows = [measure(b, freeze, profile=i == 0) for i in range(2) for freeze in (False, True)
            for b in ("convdsl", "cudnn")]
    for r in rows:
        print(f"{r['backend']:16s} step {r['step_wall_ms']:.2f} ms (blocks {', '.join(f'{v:.2f}' for v in r['step_wall_blocks_ms'])}), "
              f"queue (GPU idle) {r['queue_ms']:.2f} ms, host CPU {r['host_cpu_ms']:.2f} ms, {r['memory']}")
    record = {"versions": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "command": "python3 benchmarks/probes/eager_host.py OUT.json"}, "results": rows}
    Path(argv[0]).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
