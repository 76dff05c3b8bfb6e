"""Compile the benchmark suite where iree-compile exists; the GPU machine then only loads .vmfb files.

For each case (or --cases a,b) this writes to benchmarks/build/:
  <case>.convdsl.vmfb   convdsl's kernel for --target cuda --arch ARCH
  <case>.iree.vmfb      the "IREE as a user gets it today" forms (benchmarks/iree_today.py), compiled with
                        IREE's defaults plus --iree-dispatch-creation-enable-split-reduction
  <case>.convdsl.mlir / <case>.iree.mlir   the linalg each was compiled from
  cases.json            per case: spec, op, args (kernel order, shapes, dtypes, layouts), result, flops, minimal
                        bytes, the function name, which vmfbs exist and, for a form that failed, its first error line

    python -m benchmarks.compile_suite [--cases a,b] [--arch sm_80] [--jobs 2] [--out benchmarks/build]
                                       [--suite benchmarks/suite.toml] [--also-channel-major]

--also-channel-major adds <case>.iree-chmajor.vmfb (impl "iree-today-channel-major"): the iree-today forms
with torch-mlir's NCHW loop order on any layout, which IREE 3.13's CUDA backend miscompiled (see README.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.suite import SUITE_PATH, forward_of, load_suite  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "build"


def _first_error(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln[:400]
    return (lines[0] if lines else type(err).__name__)[:400]


def _git(*args: str) -> str:
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return ""


IMPL_FILES = {
    "convdsl": "convdsl",
    "iree-today": "iree",
    "iree-today-channel-major": "iree-chmajor",
    # experiments: convdsl with IREE's own split reduction, and with split-K off (grad_weight)
    "convdsl+sr": "convdsl-sr",
    "convdsl-sk1+sr": "convdsl-sk1-sr",
    # f32 cases computed as three bf16 products per product on the matrix units (compute = "bf16x3")
    "convdsl+bf16x3": "convdsl-bf16x3",
    # the linalg form under the knob rules a target without the Triton kernels gets (ROCm): IREE's own code
    # generation of convdsl's IR, as it would run there
    "convdsl+linalg-rules": "convdsl-linalg-rules",
}
# experiments: convdsl's IR under IREE's default configuration with other codegen paths of IREE 3.13
# (variant "convdsl+flag:<name>"; compare with "convdsl@default", the same without the flags)
FLAG_SETS = {
    "vd": ("--iree-codegen-llvmgpu-use-vector-distribution",),
    "direct": ("--iree-codegen-llvmgpu-use-direct-convolution",),
    "igemmpad": ("--iree-codegen-llvmgpu-igemm-pad-convolution",),
    "ptxas": ("--iree-cuda-use-ptxas",),
}


def compile_case(name: str, arch: str, out_dir: str, suite: str = str(SUITE_PATH),
                 impls: tuple[str, ...] = ("convdsl", "iree-today"), forward: bool = False) -> dict:
    """Both forms of one case; never raises: a failure is recorded in the returned entry.  `forward`: the
    forward convolution of the case's shape instead, named `<case>_fwd` (as benchmarks/torch_bench.py names it)."""
    import convdsl
    from benchmarks.iree_today import TODAY_FLAGS, today_mlir
    from convdsl.backends.iree import compile_mlir
    from convdsl.module import manifest
    from convdsl.passes import lower_to_mlir
    from convdsl.targets import Target

    out = Path(out_dir)
    case = load_suite(suite, names=[name])[0]
    p = case.problem
    if forward:
        p = forward_of(p)
        name = p.name
    target = Target.parse("cuda", arch)
    kernel = manifest([p], target)["kernels"][0]
    entry = {
        "name": name,
        "source": case.source,
        "op": p.op,
        "problem": p.describe(),
        "spec": kernel["spec"],
        "function": kernel["function"],
        "args": kernel["args"],
        "result": kernel["result"],
        "flops": case.flops,
        "bytes": case.bytes,
        "vmfbs": {},
        "errors": {},
        "compile_s": {},
    }
    for impl in impls:
        suffix = IMPL_FILES.get(impl) or impl.replace("@", "-at-").replace(":", "-")
        vmfb_path, mlir_path = out / f"{name}.{suffix}.vmfb", out / f"{name}.{suffix}.mlir"
        for stale in (vmfb_path, mlir_path):
            stale.unlink(missing_ok=True)
        if impl == "convdsl+bf16x3" and p.dtype != "f32":
            entry["vmfbs"][impl], entry["errors"][impl] = None, f"{impl}: not an f32 case"
            continue
        t0 = time.perf_counter()
        try:
            if impl == "convdsl":
                mlir = lower_to_mlir([p], target)
                mlir_path.write_text(mlir)
                vmfb = convdsl.compile([p], target=target).vmfb
            elif impl.startswith("convdsl:"):
                # the same kernel for another chip (convdsl:sm_90: the Hopper target described in IR)
                other = Target.parse("cuda", impl.split(":", 1)[1])
                mlir = lower_to_mlir([p], other)
                mlir_path.write_text(mlir)
                vmfb = convdsl.compile([p], target=other).vmfb
            elif impl == "convdsl+bf16x3":
                q = p.with_(compute="bf16x3")
                mlir = lower_to_mlir([q], target)
                mlir_path.write_text(mlir)
                vmfb = convdsl.compile([q], target=target).vmfb
            elif impl == "convdsl+linalg-rules":
                from dataclasses import replace

                from convdsl import policy
                from convdsl.backends.iree_config import compile_with_knobs

                knobs = replace(policy.knobs_for(p, target, None), extern=False)
                mlir = lower_to_mlir([p], target, knobs={p.name: knobs})
                mlir_path.write_text(mlir)
                vmfb = compile_with_knobs(mlir, target, {p.name: knobs})
            elif impl.startswith("convdsl@"):
                # a tuning candidate: IREE's configuration scaled by knobs (convdsl/tuning/knobs.py)
                from convdsl.backends.iree_config import compile_with_knobs
                from convdsl.tuning.knobs import parse_label

                knobs = parse_label(impl.split("@", 1)[1])
                mlir = lower_to_mlir([p], target, knobs={p.name: knobs})
                mlir_path.write_text(mlir)
                vmfb = compile_with_knobs(mlir, target, {p.name: knobs}, strict=True)
            elif impl.startswith("convdsl+partials:"):
                # experiment: the gather grad_weight form with another target count of partial sums
                from convdsl.passes import gather

                saved, gather.MIN_PARTIALS = gather.MIN_PARTIALS, int(impl.split(":", 1)[1])
                try:
                    mlir = lower_to_mlir([p], target)
                finally:
                    gather.MIN_PARTIALS = saved
                mlir_path.write_text(mlir)
                vmfb = compile_mlir(mlir, target)
            elif impl.startswith("convdsl+flag:"):
                mlir = lower_to_mlir([p], target)
                mlir_path.write_text(mlir)
                vmfb = compile_mlir(mlir, target, extra_flags=FLAG_SETS[impl.split(":", 1)[1]])
            elif impl.startswith("convdsl"):
                q = p.with_(split_k=1) if "sk1" in impl and p.op == "grad_weight" else p
                mlir = lower_to_mlir([q], target)
                mlir_path.write_text(mlir)
                vmfb = compile_mlir(mlir, target, extra_flags=TODAY_FLAGS if impl.endswith("+sr") else ())
            else:
                mlir = today_mlir([p], "channel-major" if impl == "iree-today-channel-major" else "layout")
                mlir_path.write_text(mlir)
                vmfb = compile_mlir(mlir, target, extra_flags=TODAY_FLAGS)
            vmfb_path.write_bytes(vmfb)
            entry["vmfbs"][impl] = vmfb_path.name
        except Exception as err:  # noqa: BLE001 - record and go on
            entry["vmfbs"][impl] = None
            entry["errors"][impl] = f"{impl}: compile failed: {_first_error(err)}"
            (out / f"{name}.{suffix}.error.txt").write_text(
                "".join(traceback.format_exception(type(err), err, err.__traceback__))
            )
        entry["compile_s"][impl] = round(time.perf_counter() - t0, 2)
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--arch", default="sm_80", help="CUDA architecture for both forms (default sm_80)")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default benchmarks/build)")
    ap.add_argument("--suite", default=str(SUITE_PATH), help="suite file (default benchmarks/suite.toml)")
    ap.add_argument("--also-channel-major", action="store_true",
                    help="also compile the iree-today forms in channel-major loop order")
    ap.add_argument("--variants", default="", help="extra convdsl variants, comma-separated: convdsl+sr, convdsl-sk1+sr, "
                         "convdsl:<arch> (another chip, e.g. convdsl:sm_90), convdsl@<knobs> (e.g. convdsl@n2-m2-p3), "
                         "convdsl+flag:<name> (IREE codegen flags: " + ", ".join(FLAG_SETS) + "), "
                         "convdsl+partials:<n> (gather grad_weight with gather.MIN_PARTIALS = n)")
    ap.add_argument("--forwards", action="store_true",
                    help="the forward convolution of each distinct shape of the cases instead (<case>_fwd)")
    ap.add_argument("--keep-today", action="store_true",
                    help="compile convdsl only; keep the iree-today vmfbs of the existing cases.json (its forms "
                         "and flags do not depend on convdsl)")
    args = ap.parse_args(argv)

    cases = load_suite(args.suite, names=args.cases.split(",") if args.cases else None)
    names = [c.name for c in cases]
    if args.forwards:  # one forward per distinct shape: the gradients of one layer share it
        shapes: dict[str, str] = {}
        for c in cases:
            shapes.setdefault(repr(forward_of(c.problem).with_(name="").record()), c.name)
        names = list(shapes.values())
    impls = ("convdsl",) + (() if args.keep_today else ("iree-today",))
    impls += ("iree-today-channel-major",) if args.also_channel_major else ()
    impls += tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in impls if v not in IMPL_FILES and not v.startswith(("convdsl@", "convdsl:", "convdsl+partials:"))
               and v.removeprefix("convdsl+flag:") not in FLAG_SETS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(IMPL_FILES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.error.txt"):
        if stale.name.split(".")[0] in {f"{n}_fwd" if args.forwards else n for n in names}:
            stale.unlink()

    from importlib.metadata import version

    t0 = time.perf_counter()
    entries: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(compile_case, n, args.arch, str(out), args.suite, impls, args.forwards): n
                   for n in names}
        for fut in as_completed(futures):
            n = futures[fut]
            try:
                e = fut.result()
            except Exception as err:  # noqa: BLE001 - a crashed worker
                e = {"name": n, "vmfbs": {"convdsl": None, "iree-today": None},
                     "errors": {"harness": f"compile_case crashed: {_first_error(err)}"}}
            entries[n] = e
            status = ", ".join(
                f"{k}: {'ok' if v else 'FAILED'} ({e.get('compile_s', {}).get(k, '?')} s)"
                for k, v in e["vmfbs"].items()
            )
            print(f"{n:24s} {status}", flush=True)
            for msg in e.get("errors", {}).values():
                print(f"    {msg}", flush=True)

    manifest = {
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": "cuda",
        "suite": str(Path(args.suite).resolve().relative_to(ROOT)) if Path(args.suite).resolve().is_relative_to(ROOT)
        else args.suite,
        "arch": args.arch,
        "iree_compiler_version": version("iree-base-compiler"),
        "convdsl_commit": _git("rev-parse", "HEAD"),
        "convdsl_dirty": bool(_git("status", "--porcelain", "--", "convdsl")),
        "iree_today_flags": list(__import__("benchmarks.iree_today", fromlist=["TODAY_FLAGS"]).TODAY_FLAGS),
        "cases": [entries[n] for n in names],
    }
    path = out / "cases.json"
    if args.keep_today:
        old = {c["name"]: c for c in json.loads(path.read_text()).get("cases", [])} if path.exists() else {}
        for n, e in entries.items():
            prev = old.get(n, {})
            e["vmfbs"]["iree-today"] = prev.get("vmfbs", {}).get("iree-today")
            if "iree-today" in prev.get("errors", {}):
                e["errors"]["iree-today"] = prev["errors"]["iree-today"]
    # merge with an existing manifest when only some cases were rebuilt
    if args.cases and path.exists() and not args.forwards:
        old = json.loads(path.read_text())
        if old.get("arch") == args.arch:
            merged = {c["name"]: c for c in old.get("cases", [])}
            merged.update(entries)
            order = [c.name for c in load_suite(args.suite)]
            manifest["cases"] = [merged[n] for n in order if n in merged]
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    failed = sum(1 for e in entries.values() for v in e["vmfbs"].values() if not v)
    print(f"wrote {path}: {len(manifest['cases'])} cases, {failed} form(s) failed to compile, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
