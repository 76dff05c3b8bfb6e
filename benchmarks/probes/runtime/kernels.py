"""Run each case's compiled kernels a few times, for a profiler to time the dispatches (ncu).

    ncu --clock-control none --kernel-name regex:'_dispatch_|grad_|spin_kernel' \
        --metrics gpu__time_duration.sum --csv --log-file RESULTS/ncu-convdsl.csv \
        python3 benchmarks/probes/runtime/kernels.py --impl convdsl
    python3 benchmarks/probes/runtime/kernels.py --summarize RESULTS/ncu-convdsl.csv [--results RUN.json]

IREE names its own dispatches `<function>_dispatch_<n>_<what it does>`, but convdsl's Triton kernels keep
their kernel's name (grad_input_phases, ...), the same in every case.  So before each case's calls this
launches a marker, torch's `spin_kernel` (torch.cuda._sleep), and the summary assigns the kernels between two
markers to the case run between them (the cases run in cases.json order: the same --build, --impl and
--cases must be given to --summarize).  Per case: each kernel's median time over the calls and their sum per
call, the device time of one call.  With --results (a gpu_bench.py JSON of the same build), it also sets that
device time against the call's host time and against cuDNN's CUDA-event time: what the kernels achieve, and
what the runtime adds per call.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
UNITS_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3,
            "s": 1e3}


def selected(build: Path, impl: str, names: list[str] | None) -> list[dict]:
    cases = json.loads((build / "cases.json").read_text())["cases"]
    return [c for c in cases if (not names or c["name"] in names) and c["vmfbs"].get(impl)]


def run(build: Path, impl: str, names: list[str] | None, calls: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from gpu_bench import Iree, random_args

    iree = Iree("cuda")
    for case in selected(build, impl, names):
        ctx, f = iree.load(build / case["vmfbs"][impl], case["function"])
        args = [iree.upload(t, a["dtype"]) for t, a in zip(random_args(case, 7), case["args"])]
        torch.cuda.synchronize()
        torch.cuda._sleep(1000)  # the marker: the kernels after it are this case's
        torch.cuda.synchronize()
        for _ in range(calls):
            f(*args)
        print(case["name"], flush=True)
        del ctx, f, args


def summarize(path: Path, calls: int, order: list[str]) -> dict:
    """Per case (in `order`, one per marker): {"kernels": {name: {"median_ms", "count"}}, "per_call_ms"}."""
    per_case: list[dict[str, list[float]]] = []
    rows = csv.DictReader(line for line in path.read_text().splitlines() if line.startswith('"'))
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        if MARKER in row["Kernel Name"]:
            per_case.append(defaultdict(list))
            continue
        if not per_case:
            raise ValueError(f"{path}: a kernel before the first marker ({row['Kernel Name'][:60]})")
        ms = float(row["Metric Value"].replace(",", "")) * UNITS_MS[row.get("Metric Unit", "nsecond")]
        per_case[-1][row["Kernel Name"]].append(ms)
    if len(per_case) != len(order):
        raise ValueError(f"{path}: {len(per_case)} markers for {len(order)} cases (same --build/--impl/--cases?)")
    out = {}
    for name, times in zip(order, per_case):
        kernels = {k: {"median_ms": statistics.median(ts), "count": len(ts)} for k, ts in times.items()}
        out[name] = {"kernels": kernels, "per_call_ms": sum(d["median_ms"] * d["count"] for d in kernels.values())
                     / calls}
    return out


def against_results(summary: dict, results: Path, impl: str) -> list[str]:
    """A Markdown table: device time (ncu) and host time of `impl`, cuDNN's event and host times."""
    run = json.loads(results.read_text())
    lines = ["| case | convdsl device ms (ncu) | convdsl host ms | host - device ms | cuDNN device ms (events) "
             "| cuDNN host ms | cuDNN/convdsl device | cuDNN/convdsl host |", "|---|---|---|---|---|---|---|---|"]
    ratios_device, ratios_host = [], []
    for r in run["results"]:
        s, mine, cudnn = summary.get(r["name"]), r["impls"].get(impl, {}), r["impls"].get("cudnn", {})
        if not s or not mine.get("ok") or not cudnn.get("ok") or "events_ms" not in cudnn:
            continue
        device, host = s["per_call_ms"], mine["ms"]
        ratios_device.append(cudnn["events_ms"] / device)
        ratios_host.append(cudnn["ms"] / host)
        lines.append(f"| {r['name']} | {device:.3f} | {host:.3f} | {host - device:.3f} | {cudnn['events_ms']:.3f} | "
                     f"{cudnn['ms']:.3f} | {ratios_device[-1]:.2f} | {ratios_host[-1]:.2f} |")
    if ratios_device:
        lines.append("")
        device, host = statistics.geometric_mean(ratios_device), statistics.geometric_mean(ratios_host)
        lines.append(f"Geometric means over {len(ratios_device)} cases: cuDNN/convdsl device time {device:.3f}, "
                     f"host time {host:.3f}.")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "benchmarks/build"))
    ap.add_argument("--impl", default="convdsl")
    ap.add_argument("--cases")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--summarize", help="an ncu --csv log: print per-case kernel times")
    ap.add_argument("--results", help="with --summarize: a gpu_bench.py JSON to set the device times against")
    args = ap.parse_args()
    names = args.cases.split(",") if args.cases else None
    if args.summarize:
        order = [c["name"] for c in selected(Path(args.build), args.impl, names)]
        summary = summarize(Path(args.summarize), args.calls, order)
        for case, s in summary.items():
            print(f"{case:28s} device {s['per_call_ms']:8.3f} ms/call")
            for k, d in sorted(s["kernels"].items(), key=lambda kv: -kv[1]["median_ms"]):
                print(f"    {d['median_ms']:8.3f} ms x{d['count'] // args.calls}  {k[:110]}")
        Path(args.summarize).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
        if args.results:
            print("\n".join(["", *against_results(summary, Path(args.results), args.impl)]))
        return 0
    run(Path(args.build), args.impl, names, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
