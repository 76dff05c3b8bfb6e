"""Compile the suite's convdsl kernels with each zero-border form, as extra variants in
benchmarks/build/cases.json (gpu_bench.py times every vmfb listed there).

    python benchmarks/probes/pad_forms/build.py [--cases a,b] [--variants pad-insert,pad-gather,pad-fuse]

The forms are plan.PAD_FORMS, forced per kernel with lower_to_mlir(knobs={name: Knobs(pad=...)}).  The run recorded in
benchmarks/results/*padforms* was made before the forms became plan choices, with environment switches
that also turned the stride-phase interleave on and off ("interleave" variants there; the interleave is
now always used for strided grad_input).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VARIANTS = {"pad-insert": "insert", "pad-gather": "gather", "pad-fuse": "fuse"}


def build(name: str, variant: str, out: str) -> tuple[str, str, str | None, str]:
    sys.path.insert(0, str(ROOT))
    from benchmarks.suite import load_suite
    from convdsl.passes import lower_to_mlir
    from convdsl.targets import Target
    from convdsl.tuning import Knobs, compile_with_knobs
    from convdsl.tuning.db import knobs_for

    target = Target.parse("cuda", "sm_80")
    p = load_suite(str(ROOT / "benchmarks/suite.toml"), names=[name])[0].problem
    mlir = lower_to_mlir([p], target, knobs={p.name: Knobs(pad=VARIANTS[variant])})
    if "tensor.insert_slice" not in lower_to_mlir([p], target, knobs={p.name: Knobs(pad="insert")}):
        return name, variant, None, "no padding"
    try:  # compile_mlir adds IREE's pad-fusion flag when the IR has a tensor.pad
        vmfb = compile_with_knobs(mlir, target, {p.name: knobs_for(p, target)}, strict=False)
    except Exception as err:  # noqa: BLE001
        return name, variant, None, f"compile failed: {str(err).splitlines()[0][:200]}"
    path = Path(out) / f"{name}.convdsl-{variant}.vmfb"
    path.write_bytes(vmfb)
    path.with_suffix(".mlir").write_text(mlir)
    return name, variant, path.name, "ok"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "benchmarks/build"))
    ap.add_argument("--cases")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    manifest_path = Path(args.build) / "cases.json"
    manifest = json.loads(manifest_path.read_text())
    names = args.cases.split(",") if args.cases else [c["name"] for c in manifest["cases"]]
    jobs = [(n, v) for n in names for v in args.variants.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(build, *zip(*jobs), [args.build] * len(jobs)))
    by_name = {c["name"]: c for c in manifest["cases"]}
    for name, variant, file, status in results:
        print(f"{name:24s} {variant:22s} {status}", flush=True)
        if file:
            by_name[name]["vmfbs"][f"convdsl:{variant}"] = file
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
