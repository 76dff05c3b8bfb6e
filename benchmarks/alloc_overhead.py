#!/usr/bin/env python3
"""What a call costs around the kernel on the CPU (IREE's local-task device): the ways to call one module.

Per case (suite cases at a reduced batch, compiled here), on the same inputs, timed in interleaved rounds (each
round times every way once in turn, the median of the rounds is kept, so a neighbour's load falls on all alike):
  - kept:      the destination-passing `<name>$into` into a result and workspace allocated once (device inputs);
  - caching:   the module's plain allocating function on a device created with IREE's caching allocator
               (`create_default_device(allocators=["caching"])`, iree-run-module's --device_allocator=caching);
  - plain:     the same function on a device created with IREE's defaults (what iree-run-module and a plain
               iree.runtime user get);
  - kernel:    convdsl's Kernel object called with NumPy arrays, returning a NumPy array (inputs imported,
               result downloaded) on convdsl's own device, which the NumPy API calls;
  - aligned:   the same with the inputs in 64-byte aligned NumPy arrays (IREE imports those without a copy;
               NumPy aligns its own to 16 bytes).

    python3 benchmarks/alloc_overhead.py [--cases a,b] [--batch 2] [--rounds 200] [--out benchmarks/results/]

Writes <out>/cpu-api-overhead-<cpu>-<date>[-tag].json when --out is given.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu_bench import bench_problems, command, cpu_model, machine, versions  # noqa: E402
from convdsl.api import get_kernel  # noqa: E402
from convdsl.reference import random_inputs  # noqa: E402

DEFAULT_CASES = ["r50_1x1_dgrad", "mbv2_dw_dgrad", "r50_3x3_s2_wgrad", "w2v2_conv1d_s2_dgrad"]


def aligned(a: np.ndarray, alignment: int = 64) -> np.ndarray:
    """A copy of `a` whose data starts at a multiple of `alignment` bytes."""
    raw = np.empty(a.nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def interleaved(ways: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per way over `rounds` rounds, every way called once per round (after 3 warm-up rounds)."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 3):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= 3:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def context_on(vmfb: bytes, allocators: Optional[list[str]]):
    import iree.runtime as rt

    driver = rt.get_driver("local-task")
    device = driver.create_default_device(allocators=allocators) if allocators else driver.create_default_device()
    config = rt.Config(device=device)
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return config, ctx


def measure(p, rounds: int, seed: int) -> dict:
    import iree.runtime as rt

    host = random_inputs(p, seed=seed)
    kernel = get_kernel(p, "cpu")
    loaded = kernel.module.loaded
    dev = [loaded.upload(a) for a in host]
    into = loaded.into_call(p.name, dev, p.result_shape, p.result_dtype)
    packed = into.pack([a._buffer_view for a in dev])
    ways: dict[str, Callable[[], object]] = {"kept": lambda: into.call(packed)}
    keep = []
    for label, allocators in (("caching", ["caching"]), ("plain", None)):
        config, ctx = context_on(loaded.vmfb, allocators)
        args = [rt.asdevicearray(config.device, a) for a in host]
        fn = ctx.modules.module[p.name]
        keep.append((config, ctx, args))
        ways[label] = lambda fn=fn, args=args: fn(*args)
    ways["kernel"] = lambda: kernel(*host)
    host64 = [aligned(a) for a in host]
    ways["aligned"] = lambda: kernel(*host64)
    ref = kernel(*host)
    for label in ("caching", "plain"):  # each way computes the same bits
        assert np.array_equal(np.asarray(ways[label]().to_host()), ref), label
    assert np.array_equal(ways["aligned"](), ref)
    gc.collect()
    t = interleaved(ways, rounds)
    row = {"name": p.name, "describe": p.describe(), **{f"{k}_us": v * 1e6 for k, v in t.items()}}
    row.update({f"{k}_over_kept": t[k] / t["kept"] for k in t if k != "kept"})
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    rows = []
    for p in bench_problems(args.batch, "f32", args.cases.split(",")):
        row = measure(p, args.rounds, seed=1)
        rows.append(row)
        print(f"{row['name']:24s} kept {row['kept_us']:9.1f} us  caching {row['caching_us']:9.1f}  plain "
              f"{row['plain_us']:9.1f}  kernel {row['kernel_us']:9.1f}  aligned {row['aligned_us']:9.1f}  (x kept: caching "
              f"{row['caching_over_kept']:.2f}, plain {row['plain_over_kept']:.2f}, kernel "
              f"{row['kernel_over_kept']:.2f}, aligned {row['aligned_over_kept']:.2f})", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        cpu = "".join(c if c.isalnum() else "-" for c in cpu_model()).strip("-")
        path = args.out / (f"cpu-api-overhead-{cpu}-{datetime.now().date().isoformat()}"
                           + (f"-{args.tag}" if args.tag else "") + ".json")
        path.write_text(json.dumps({"command": command(), "date": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "machine": machine(), "versions": versions(), "batch": args.batch,
            "rounds": args.rounds, "cases": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
