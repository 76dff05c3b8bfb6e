"""Where each stream kernel of the suite stands against its roofline floor, and what limits it, by Nsight Compute.

    python3 benchmarks/torch_bench.py build --out B.convk                  # where Triton 3.9 is
    python3 benchmarks/roofline.py run --bundle B.convk --torch T.json --out OUT.json   # on an H100, ncu on PATH

For each gradient kernel of the bundle a child process calls it twice on random inputs under
`ncu --clock-control none --section SpeedOfLight` (the second call profiled), and the launches' durations are
summed.  The floor is the larger of the products at the compute type's dense peak (fp8: 1979 TFLOP/s; 16-bit:
989; TF32: 495; exact f32 on the FMA units: 67) and the operands and result read and
written once at the memory's peak (3.35 TB/s) -- an H100 SXM's datasheet figures.  The limiter is the throughput
ncu reports highest for the longest launch (SM, or memory: DRAM or L2).  `--torch` takes a torch_bench result
file of the same code for cuDNN's times (CUDA-graph replay, kernel time) beside ncu's.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite import minimal_bytes  # noqa: E402

# H100 SXM datasheet peaks (dense): FLOP/s per compute type, and the memory's bytes/s
PEAK_FLOPS = {"fp8": 1979e12, "16-bit": 989e12, "tf32": 495e12, "f32": 67e12}
MEMORY_BYTES_PER_S = 3.35e12
SECTION_METRICS = {"Duration": "duration", "Compute (SM) Throughput": "sm_pct", "DRAM Throughput": "dram_pct",
                   "L2 Cache Throughput": "l2_pct", "Memory Throughput": "memory_pct"}


def floor_s(p) -> tuple[float, str, float]:
    """(floor in seconds, compute type, bytes moved at least) of problem p."""
    if p.dtype == "f32":
        kind = "tf32" if p.tf32 or p.bf16x3 else "f32"
    else:
        kind = "fp8" if p.fp8_compute else "16-bit"
    moved = minimal_bytes(p)
    return max(p.flops / PEAK_FLOPS[kind], moved / MEMORY_BYTES_PER_S), kind, moved


def call(bundle: Path, name: str) -> None:
    """Call the bundle's kernel `name` twice (ncu profiles the second call's launches)."""
    import torch

    from benchmarks.gpu_bench import random_args
    from benchmarks.torch_bench import _case_dict
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    (kernel,) = [k for k in stream.load_bundle(bundle) if k.problem.name == name]
    args = random_args(_case_dict(kernel.problem), seed=1)
    runner = StreamRunner(kernel, torch.device("cuda", 0))
    runner(*args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    runner(*args)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(bundle: Path, name: str) -> list[dict]:
    """ncu's SpeedOfLight metrics per launch of one kernel's second call."""
    done = subprocess.run(["ncu", "--clock-control", "none", "--profile-from-start", "off", "--section",
                           "SpeedOfLight", "--csv", sys.executable, __file__, "call", "--bundle", str(bundle), name],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    rows = [r for r in csv.DictReader(io.StringIO(done.stdout[done.stdout.find('"ID"'):]))] if '"ID"' in done.stdout \
        else []
    if not rows:
        raise RuntimeError(f"{name}: ncu gave no rows ({done.stderr[-500:]})")
    launches: dict = {}
    for r in rows:
        key = SECTION_METRICS.get(r["Metric Name"])
        if key is None:
            continue
        value = float(r["Metric Value"].replace(",", ""))
        if key == "duration":  # to ms
            value *= {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(r["Metric Unit"], 1e-6)
        launches.setdefault(r["ID"], {"kernel": r["Kernel Name"]})[key] = value
    return list(launches.values())


def run(bundle: Path, torch_results: Path | None, out: Path) -> None:
    import torch

    from convdsl import stream

    cudnn = {}
    if torch_results:
        for r in json.loads(torch_results.read_text())["results"]:
            cudnn[r["name"]] = r["cudnn"]["queued"]["kernel_ms"]
    rows = []
    for k in stream.load_bundle(bundle):
        p = k.problem
        if p.op == "forward":
            continue
        launches = profile(bundle, p.name)
        ms = sum(la["duration"] for la in launches)
        main = max(launches, key=lambda la: la["duration"])
        floor, kind, moved = floor_s(p)
        limits = {"SM": main.get("sm_pct", 0.0), "DRAM": main.get("dram_pct", 0.0), "L2": main.get("l2_pct", 0.0)}
        limiter = max(limits, key=limits.get)
        row = {"case": p.name, "op": p.op, "dtype": p.dtype, "compute": kind, "gflop": p.flops / 1e9,
               "floor_ms": floor * 1e3, "ncu_ms": ms, "share_of_floor": floor * 1e3 / ms,
               "cudnn_ms": cudnn.get(p.name), "main_launch": main["kernel"], "main_ms": main["duration"],
               "sm_pct": limits["SM"], "dram_pct": limits["DRAM"], "l2_pct": limits["L2"], "limiter": limiter,
               "launches": len(launches)}
        rows.append(row)
        print(f"{p.name:28s} {kind:6s} floor {row['floor_ms']:.4f} ms, ncu {ms:.4f} ms ({row['share_of_floor']:.0%} "
              f"of the floor), main {main['kernel'][:24]} SM {limits['SM']:.0f}% DRAM {limits['DRAM']:.0f}% "
              f"L2 {limits['L2']:.0f}% -> {limiter}", flush=True)
    record = {"versions": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "cudnn": torch.backends.cudnn.version(),
                           "command": "python3 benchmarks/roofline.py run --bundle B.convk --torch T.json "
                                      "--out OUT.json"},
              "peaks": {"flops": PEAK_FLOPS, "memory_bytes_per_s": MEMORY_BYTES_PER_S}, "results": rows}
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="on an H100 with ncu: every gradient kernel of the bundle")
    r.add_argument("--bundle", type=Path, required=True)
    r.add_argument("--torch", type=Path, help="a torch_bench result file of the same code (cuDNN's times)")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("call", help="(ncu's child) call one kernel twice, profiling the second call")
    c.add_argument("--bundle", type=Path, required=True)
    c.add_argument("name")
    args = ap.parse_args(argv)
    if args.mode == "run":
        run(args.bundle, args.torch, args.out)
    else:
        call(args.bundle, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
