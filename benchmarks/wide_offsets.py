"""What the 64-bit offset form (launch.needs_wide) costs: every stream kernel of the suite compiled both ways,
timed on one CUDA GPU on the same inputs, results compared bit for bit.

The kernels take 64-bit offsets only where a tensor they index has 2^30 elements or more; this benchmark forces
the form on the suite's problems (all but one far smaller) to show what the rule saves and what the large
problems pay.  Build where Triton is (no GPU needed), run on the GPU machine:

    python3 benchmarks/wide_offsets.py build --arch sm_90 --out build-wide/
    python3 benchmarks/wide_offsets.py run --build build-wide/ --out benchmarks/results/

`run` writes results/wide-offsets-<device>-<date>.json: per case the CUDA-event time per call of 100 queued calls
(median of 5) of the rule's form and of the forced 64-bit form, and whether the results are bitwise equal.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import load_suite  # noqa: E402
from convdsl.targets import Target  # noqa: E402

QUEUED = 100


def _forced_wide(kernel, arch: str):
    """The stream kernel with every launch's WIDE constant set (recompiled)."""
    from convdsl import stream
    from convdsl.kernels.compile import compile_launch

    def wide(sl):
        if sl is None:
            return None
        launch = replace(sl.launch, constants=tuple((k, True if k == "WIDE" else v) for k, v in sl.launch.constants))
        return stream.StreamLaunch(launch, compile_launch(launch, arch))

    return replace(kernel, launches=tuple(map(wide, kernel.launches)), sum=wide(kernel.sum),
                   rounds=tuple(map(wide, kernel.rounds)))


def build(arch: str, out: Path) -> int:
    from convdsl import stream

    target = Target("cuda", arch)
    rule, forced = [], []
    for case in load_suite():
        p = case.problem
        if stream.unsupported_reason(p, target) is not None:
            continue
        looked_up = stream.plan(p, target)
        knobs, source = looked_up.knobs, looked_up.knobs_source
        planned = stream.planned_stream_kernel(p, target, knobs, source, tma=False)
        rule.append(stream.compile_kernel(planned))
        forced.append(_forced_wide(planned, arch))
        print(f"{p.name}: compiled", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    stream.save_bundle(rule, out / "rule.convk")
    stream.save_bundle(forced, out / "wide.convk")
    print(f"wrote {out}/rule.convk and wide.convk: {len(rule)} kernels each")
    return 0


def _kernel_ms(fn) -> float:
    import torch

    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(QUEUED):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / QUEUED)
    return statistics.median(times)


def run(build_dir: Path, out_dir: Path) -> int:
    import torch

    from benchmarks.torch_bench import _case_dict
    from benchmarks.gpu_bench import random_args
    from convdsl import stream
    from convdsl.kernels.launch import needs_wide
    from convdsl.torch.stream import StreamRunner

    device = torch.device("cuda", 0)
    forced = {k.problem.name: k for k in stream.load_bundle(build_dir / "wide.convk")}
    rows = []
    for rule in stream.load_bundle(build_dir / "rule.convk"):
        p = rule.problem
        args = random_args(_case_dict(p), seed=1)
        runners = {"rule": StreamRunner(rule, device), "wide": StreamRunner(forced[p.name], device)}
        results = {name: r(*args).clone() for name, r in runners.items()}
        times = {name: _kernel_ms(lambda r=r: r(*args)) for name, r in runners.items()}
        row = {"name": p.name, "op": p.op, "rule_is_wide": needs_wide(p), "rule_ms": times["rule"],
               "wide_ms": times["wide"], "wide_over_rule": times["wide"] / times["rule"],
               "bitwise_equal": bool(torch.equal(results["rule"], results["wide"]))}
        rows.append(row)
        print(f"{p.name:<28} rule {times['rule']:.4f} ms{' (wide)' if row['rule_is_wide'] else ''}  forced wide "
              f"{times['wide']:.4f} ms  -> {row['wide_over_rule']:.3f}x  equal {row['bitwise_equal']}", flush=True)
        del args, results
        torch.cuda.empty_cache()
    narrow = [r["wide_over_rule"] for r in rows if not r["rule_is_wide"]]
    summary = {"cases": len(rows), "all_equal": all(r["bitwise_equal"] for r in rows),
               "geomean_wide_over_rule_32bit_cases": math.exp(statistics.fmean(map(math.log, narrow))) if narrow else None,
               "max_wide_over_rule": max(narrow, default=None)}
    versions = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": "python3 benchmarks/wide_offsets.py run --build DIR --out DIR"}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"wide-offsets-{versions['device'].replace(' ', '_')}-{versions['date'][:10]}.json"
    path.write_text(json.dumps({"versions": versions, "summary": summary, "results": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    print(f"wrote {path}")
    return 0 if summary["all_equal"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the suite's stream kernels in both forms (no GPU needed)")
    b.add_argument("--arch", default="sm_90", help="the CUDA arch to compile for")
    b.add_argument("--out", type=Path, required=True, help="directory for rule.convk and wide.convk")
    r = sub.add_parser("run", help="time both forms on the GPU")
    r.add_argument("--build", type=Path, required=True, help="the directory `build` wrote")
    r.add_argument("--out", type=Path, required=True, help="directory for the results JSON")
    args = ap.parse_args(argv)
    return build(args.arch, args.out) if args.cmd == "build" else run(args.build, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
