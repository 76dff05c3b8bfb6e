"""convdsl's CPU kernels (IREE llvm-cpu) against PyTorch's CPU convolution gradients, on the suite's shapes.

    python3 benchmarks/cpu_bench.py --out benchmarks/results/            # every case, batch 4, f32
    python3 benchmarks/cpu_bench.py --cases r50_3x3_s1_dgrad rx50_g32_dgrad --batch 8
    python3 benchmarks/cpu_bench.py --dtype bf16 --tag bf16 --out benchmarks/results/

Every suite case is run at a reduced batch (--batch) in one dtype (--dtype; the suite's compute types are
dropped, so its fp8 case folds into its f32 twin and is skipped), on random inputs.  Per case it:
  - compiles the kernel into an empty cache folder and records the compile time (lowering, iree-compile,
    loading the module) and the first call's (the compile, then one call with its uploads and first-touch pages);
  - times convdsl's destination-passing call (result and workspace allocated once, as a framework calls it;
    inputs already on the device, which on the CPU is host memory) and PyTorch's
    `aten.convolution_backward` on the same values, in both of PyTorch's memory formats (contiguous and
    channels-last) taking the faster; medians over repeats of at least --seconds each side;
  - checks convdsl's result against PyTorch's, in float64 (max |difference| / max |reference|).
It prints a table (ratio = PyTorch time / convdsl time; above 1 convdsl is faster) and writes
<out>/cpu-<cpu>-<date>[-tag].json with the machine, versions, the command and every number.
Run one benchmark at a time: both sides use every core.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import convdsl  # noqa: E402
from benchmarks.suite import load_suite  # noqa: E402
from convdsl.api import get_kernel  # noqa: E402
from convdsl.backends.iree import iree_version  # noqa: E402
from convdsl.problem import ConvProblem  # noqa: E402
from convdsl.reference import NUMPY_DTYPES  # noqa: E402

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# largest relative error accepted per dtype (max |convdsl - torch| / max |torch|)
TOLERANCE = {"f32": 1e-4, "bf16": 2e-2, "f16": 5e-3}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_problems(batch: int, dtype: str, names: Optional[list[str]]) -> list[ConvProblem]:
    """The suite's cases at `batch` in `dtype` (no compute type, no output dtype, split-K left to the planner);
    cases that become the same kernel as an earlier one are dropped."""
    out, seen = [], set()
    for case in load_suite(names=names or None):
        p = case.problem.with_(batch=batch, dtype=dtype, out_dtype=None, compute=None, split_k=None)
        key = repr(p.with_(name="").record())
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# --- layouts: convdsl's arrays <-> PyTorch's (N, G*C, spatial...) and (G*K, C, taps...) ---------------------

def _to_torch_activation(p: ConvProblem, a: np.ndarray, tensor: str) -> torch.Tensor:
    letters = p.layout_name(tensor)
    ch = "C" if tensor == "x" else "K"
    sp = [c for c in letters if c not in ("N", "G", ch)]
    t = torch.from_numpy(np.ascontiguousarray(a)).permute(*[letters.index(c) for c in ["N", "G", ch, *sp]])
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:]).contiguous()


def _to_torch_weight(p: ConvProblem, w: np.ndarray) -> torch.Tensor:
    letters = p.layout_name("w")
    taps = [c for c in letters if c not in ("G", "K", "C")]
    t = torch.from_numpy(np.ascontiguousarray(w)).permute(*[letters.index(c) for c in ["G", "K", "C", *taps]])
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).contiguous()


def _from_torch_activation(p: ConvProblem, t: torch.Tensor, tensor: str) -> np.ndarray:
    letters = p.layout_name(tensor)
    ch = "C" if tensor == "x" else "K"
    sp = [c for c in letters if c not in ("N", "G", ch)]
    g = p.groups
    t = t.reshape(t.shape[0], g, t.shape[1] // g, *t.shape[2:])
    order = ["N", "G", ch, *sp]
    return t.permute(*[order.index(c) for c in letters]).contiguous().float().numpy()


def _from_torch_weight(p: ConvProblem, t: torch.Tensor) -> np.ndarray:
    letters = p.layout_name("w")
    taps = [c for c in letters if c not in ("G", "K", "C")]
    t = t.reshape(p.groups, t.shape[0] // p.groups, *t.shape[1:])
    order = ["G", "K", "C", *taps]
    return t.permute(*[order.index(c) for c in letters]).contiguous().float().numpy()


def torch_call(p: ConvProblem, args: list[np.ndarray], channels_last: bool) -> Callable[[], torch.Tensor]:
    """PyTorch's gradient of p on the same values (aten.convolution_backward, one output asked for)."""
    if p.pad_lo != p.pad_hi:
        raise ValueError("PyTorch's convolution takes symmetric padding only")
    dt = TORCH_DTYPES[p.dtype]
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(p.dims) if channels_last else None

    def prepared(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dt)
        return t.contiguous(memory_format=fmt) if fmt is not None and t.dim() == p.dims + 2 else t.contiguous()

    common = dict(stride=list(p.stride), padding=list(p.pad_lo), dilation=list(p.dilation), transposed=False,
                  output_padding=[0] * p.dims, groups=p.groups)
    if p.op == "grad_input":
        dy, w = prepared(_to_torch_activation(p, args[0], "y")), prepared(_to_torch_weight(p, args[1]))
        x_meta = torch.empty((dy.shape[0], p.groups * p.in_channels, *p.input), dtype=dt)
        x_meta = prepared(x_meta)
        return lambda: torch.ops.aten.convolution_backward(dy, x_meta, w, None, **common,
                                                           output_mask=[True, False, False])[0]
    if p.op == "grad_weight":
        x, dy = prepared(_to_torch_activation(p, args[0], "x")), prepared(_to_torch_activation(p, args[1], "y"))
        w_meta = torch.empty((p.groups * p.out_channels, p.in_channels, *p.filter), dtype=dt)
        return lambda: torch.ops.aten.convolution_backward(dy, x, w_meta, None, **common,
                                                           output_mask=[False, True, False])[1]
    raise ValueError(f"op {p.op}: only gradients are compared")


def timed(fn: Callable[[], object], seconds: float, most: int) -> tuple[float, int]:
    """(median seconds, calls timed): one warm-up call, then repeats until `seconds` have passed (3 at least,
    `most` at most)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    reps = max(3, min(most, int(seconds / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), reps


def run_case(p: ConvProblem, seconds: float, most: int, rng: np.random.Generator) -> dict:
    row: dict = {"name": p.name, "op": p.op, "describe": p.describe(), "flops": p.flops}
    np_dt = NUMPY_DTYPES[p.dtype]
    args = [rng.standard_normal(s, dtype=np.float32).astype(np_dt) for s in p.arg_shapes]
    # first call into an empty cache: lowering + iree-compile + loading the module + one run
    with tempfile.TemporaryDirectory(prefix="convdsl-cpu-bench-") as cache:
        os.environ["CONVDSL_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        kernel = get_kernel(p, "cpu")
        row["compile_s"] = time.perf_counter() - t0  # lowering + iree-compile + loading
        result = kernel(*args)
        row["first_call_s"] = time.perf_counter() - t0
    loaded = kernel.module.loaded
    dev_args = [loaded.upload(a) for a in args]
    into = loaded.into_call(p.name, dev_args, p.result_shape, p.result_dtype)
    packed = into.pack([a._buffer_view for a in dev_args])
    row["convdsl_s"], row["convdsl_calls"] = timed(lambda: into.call(packed), seconds, most)

    best = None
    for channels_last in (False, True):
        fn = torch_call(p, args, channels_last)
        t, calls = timed(fn, seconds, most)
        row[f"torch_{'channels_last' if channels_last else 'contiguous'}_s"] = t
        if best is None or t < best[0]:
            best = (t, calls, fn)
    assert best is not None
    row["torch_s"], row["torch_calls"] = best[0], best[1]
    ref = best[2]()
    ref_np = (_from_torch_activation(p, ref, "x") if p.op == "grad_input" else _from_torch_weight(p, ref))
    got = np.asarray(result, dtype=np.float64)
    ref64 = ref_np.astype(np.float64)
    err = float(np.max(np.abs(got - ref64)) / max(float(np.max(np.abs(ref64))), 1e-30))
    row["rel_err"] = err
    row["agrees"] = err <= TOLERANCE[p.dtype]
    row["ratio"] = row["torch_s"] / row["convdsl_s"]
    row["convdsl_gflops"] = p.flops / row["convdsl_s"] / 1e9
    row["torch_gflops"] = p.flops / row["torch_s"] / 1e9
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="batch of every case (default 4)")
    ap.add_argument("--dtype", default="f32", choices=sorted(TORCH_DTYPES), help="dtype of every case")
    ap.add_argument("--cases", nargs="*", help="suite case names (default: every case)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent timing each side of a case, at least")
    ap.add_argument("--most", type=int, default=20, help="most timed calls per side")
    ap.add_argument("--out", type=Path, help="folder for cpu-<cpu>-<date>[-tag].json")
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    problems = bench_problems(args.batch, args.dtype, args.cases)
    rows = []
    print(f"{'case':24s} {'op':11s} {'compile s':>9s} {'convdsl ms':>11s} {'torch ms':>9s} {'ratio':>6s} "
          f"{'GFLOP/s':>8s} {'rel err':>8s}")
    for p in problems:
        try:
            row = run_case(p, args.seconds, args.most, rng)
        except Exception as err:  # noqa: BLE001 - a failure is part of the record
            row = {"name": p.name, "op": p.op, "describe": p.describe(), "error": f"{type(err).__name__}: {err}"}
            print(f"{p.name:24s} {p.op:11s} error: {row['error'][:200]}", flush=True)
            rows.append(row)
            continue
        rows.append(row)
        flag = "" if row["agrees"] else "  MISMATCH"
        print(f"{p.name:24s} {p.op:11s} {row['compile_s']:9.2f} {row['convdsl_s'] * 1e3:11.2f} "
              f"{row['torch_s'] * 1e3:9.2f} {row['ratio']:6.2f} {row['convdsl_gflops']:8.1f} "
              f"{row['rel_err']:8.1e}{flag}", flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    summary = {
        "geomean_ratio": geomean,
        "min_ratio": min(ratios) if ratios else None,
        "cases": len(rows),
        "mismatches": [r["name"] for r in rows if r.get("agrees") is False],
        "errors": [r["name"] for r in rows if "error" in r],
        "max_compile_s": max((r["compile_s"] for r in rows if "compile_s" in r), default=None),
    }
    print(f"geomean ratio (PyTorch / convdsl) {geomean:.3f}, lowest {summary['min_ratio']}, "
          f"mismatches {summary['mismatches']}, errors {summary['errors']}")
    if args.out:
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "versions": {"convdsl": convdsl.__version__, "convdsl_commit": git_commit(), "iree": iree_version(),
                         "torch": torch.__version__, "numpy": np.__version__,
                         "torch_threads": torch.get_num_threads()},
            "settings": {"batch": args.batch, "dtype": args.dtype, "seconds": args.seconds, "most": args.most,
                         "seed": args.seed},
            "summary": summary,
            "cases": rows,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        cpu = "".join(c if c.isalnum() else "-" for c in cpu_model()).strip("-")
        stem = f"cpu-{cpu}-{datetime.now().date().isoformat()}" + (f"-{args.tag}" if args.tag else "")
        path = args.out / f"{stem}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
