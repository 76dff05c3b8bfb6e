"""Run each case's compiled kernels a few times, for a profiler to time the dispatches (ncu).

    ncu --clock-control none --kernel-name regex:_dispatch_ --metrics gpu__time_duration.sum --csv \
        --log-file $OUT/ncu-convdsl.csv python3 benchmarks/probes/runtime/kernels.py --impl convdsl
    python3 benchmarks/probes/runtime/kernels.py --summarize $OUT/ncu-convdsl.csv

IREE names each dispatch `<function>_dispatch_<n>_<what it does>`, and a case's function is named after the
case, so the profile maps back to cases by name.  The summary gives, per case, each dispatch's median time
over the calls and the sum per call: the device time of one call, to set against the host time of a call.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(build: Path, impl: str, names: list[str] | None, calls: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from gpu_bench import Iree, random_args

    iree = Iree("cuda")
    for case in json.loads((build / "cases.json").read_text())["cases"]:
        if names and case["name"] not in names or not case["vmfbs"].get(impl):
            continue
        ctx, f = iree.load(build / case["vmfbs"][impl], case["function"])
        args = [iree.upload(t, a["dtype"]) for t, a in zip(random_args(case, 7), case["args"])]
        torch.cuda.synchronize()
        for _ in range(calls):
            f(*args)
        print(case["name"], flush=True)
        del ctx, f, args


def summarize(path: Path, calls: int) -> dict:
    times: dict[str, list[float]] = defaultdict(list)
    text = path.read_text()
    rows = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        ms = value * {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}[unit]
        times[row["Kernel Name"]].append(ms)
    cases: dict[str, dict] = defaultdict(lambda: {"dispatches": {}, "per_call_ms": 0.0})
    for kernel, ts in times.items():
        m = re.match(r"(.+?)_dispatch_(\d+)", kernel)
        case = m.group(1) if m else kernel
        med = statistics.median(ts[1:] if len(ts) > 1 else ts)  # the first call's kernels include JIT warm-up
        cases[case]["dispatches"][kernel] = {"median_ms": med, "count": len(ts)}
        cases[case]["per_call_ms"] += med * len(ts) / calls
    return dict(cases)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "benchmarks/build"))
    ap.add_argument("--impl", default="convdsl")
    ap.add_argument("--cases")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--summarize", help="an ncu --csv log: print per-case dispatch times")
    args = ap.parse_args()
    if args.summarize:
        summary = summarize(Path(args.summarize), args.calls)
        for case, s in summary.items():
            print(f"{case:28s} device {s['per_call_ms']:8.3f} ms/call")
            for k, d in sorted(s["dispatches"].items(), key=lambda kv: -kv[1]["median_ms"]):
                print(f"    {d['median_ms']:8.3f} ms x{d['count'] // args.calls}  {k[:110]}")
        Path(args.summarize).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
        return 0
    run(Path(args.build), args.impl, args.cases.split(",") if args.cases else None, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
