"""What an IREE call costs beyond its kernels, under several runtime configurations.

Run on a CUDA machine with the iree-base-runtime wheel installed and benchmarks/build copied there:

    python3 benchmarks/probes/runtime/overhead.py --cases a,b,c --out RESULTS

Each configuration runs in its own process (runtime flags and allocators are fixed when the CUDA device is
created): IREE's defaults; a caching allocator over the device's; the caching allocator with stream-ordered
(async) allocations off, so that every allocation goes through the cache.  Per case: median host time of 30
synchronous calls after 5 warm-up calls, and a checksum of the result so that the configurations can be seen
to compute the same thing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = {
    "default": {"flags": [], "allocators": []},
    "caching": {"flags": [], "allocators": ["caching"]},
    "caching+sync_alloc": {"flags": ["--cuda_async_allocations=false"], "allocators": ["caching"]},
    "sync_alloc": {"flags": ["--cuda_async_allocations=false"], "allocators": []},
}


def measure(config: str, build: Path, names: list[str], reps: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import iree.runtime as rt
    import torch

    from gpu_bench import Iree, random_args

    cfg = CONFIGS[config]
    if cfg["flags"]:
        rt.flags.parse_flags(*cfg["flags"])
    iree = Iree("cuda", tuple(cfg["allocators"]))
    cases = {c["name"]: c for c in json.loads((build / "cases.json").read_text())["cases"]}
    out = {}
    for name in names:
        case = cases[name]
        for impl, vmfb in case["vmfbs"].items():
            if not vmfb or impl != "convdsl":
                continue
            ctx, f = iree.load(build / vmfb, case["function"])
            args = [iree.upload(t, a["dtype"]) for t, a in zip(random_args(case, 7), case["args"])]
            torch.cuda.synchronize()
            for _ in range(5):
                r = f(*args)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r = f(*args)
                times.append((time.perf_counter() - t0) * 1e3)
            host = iree.download(r, case["result"]["dtype"]).double()
            out[f"{name}/{impl}"] = {"median_ms": statistics.median(times), "min_ms": min(times),
                                     "checksum": float(host.abs().sum()), "reps": reps}
            del ctx, f, args, r
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "benchmarks/build"))
    ap.add_argument("--cases", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: measure one configuration
    args = ap.parse_args()
    names = args.cases.split(",")
    if args.one:
        print(json.dumps(measure(args.one, Path(args.build), names, args.reps)))
        return 0
    results = {}
    for config in args.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--cases", args.cases,
                               "--build", args.build, "--reps", str(args.reps)], capture_output=True, text=True)
        if proc.returncode:
            results[config] = {"error": proc.stderr[-2000:]}
            print(f"{config}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        results[config] = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = sorted({k for r in results.values() if "error" not in r for k in r})
    configs = [c for c in results if "error" not in results[c]]
    print(f"{'case/impl':44s} " + " ".join(f"{c:>20s}" for c in configs))
    for k in keys:
        cells = [f"{results[c][k]['median_ms']:9.3f} ({results[c][k]['checksum']:.4g})" if k in results[c] else "–"
                 for c in configs]
        print(f"{k:44s} " + " ".join(f"{x:>20s}" for x in cells))
    Path(args.out, "runtime-overhead.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
