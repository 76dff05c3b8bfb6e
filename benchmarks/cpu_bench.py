"""convdsl's CPU kernels (IREE llvm-cpu) against PyTorch's CPU convolution gradients, on the suite's shapes.

In one process, on the machine that compiles (it needs IREE's compiler as well as its runtime):

    python3 benchmarks/cpu_bench.py --out benchmarks/results/            # every case, batch 4, f32
    python3 benchmarks/cpu_bench.py --cases r50_3x3_s1_dgrad rx50_g32_dgrad --batch 8
    python3 benchmarks/cpu_bench.py --dtype f16 --tag f16 --out benchmarks/results/

Or in two steps, compiled on any machine with the IREE compiler for the target CPU and run where the CPU is
(which needs only NumPy, PyTorch and iree.runtime):

    python3 benchmarks/cpu_bench.py build DIR --arch sapphirerapids [--cases ...] [--batch 4] [--dtype f32]
    python3 benchmarks/cpu_bench.py run DIR --out benchmarks/results/ [--tag T] [--seconds S] [--most M]

`build` compiles every case for the CPU named by --arch (an LLVM CPU name, or host) into DIR/<case>.vmfb, with
the module's manifest beside it (DIR/<case>.json), and the matmul that measures the machine's peak
(convdsl/peak.py) into DIR/matmul_peak.vmfb; DIR/cases.json records per case the problem, the function, its
arguments and result, the FLOPs and the compile time, and the arch, versions and command of the build.  `run`
loads those modules, measures the matmul peak and every case as the one-process mode does, and adds each
kernel's share of the peak; the compile times it reports are the build machine's.

Every suite case is run at a reduced batch (--batch) in one dtype (--dtype; the suite's compute types are
dropped, so its fp8 case folds into its f32 twin and is skipped), on random inputs.  Per case it:
  - compiles the kernel into an empty cache folder and records the compile time (lowering, iree-compile,
    loading the module) and the first call's (the compile, then one call with its uploads and first-touch pages;
    `run`: the build's compile time plus loading the module and that call here);
  - times convdsl's destination-passing call (result and workspace allocated once, as a framework calls it;
    inputs already on the device, which on the CPU is host memory) and PyTorch's
    `aten.convolution_backward` on the same values, in both of PyTorch's memory formats (contiguous and
    channels-last) taking the faster; medians over repeats of at least --seconds each side;
  - checks convdsl's result (the timed call's) against PyTorch's, in float64 (max |difference| / max |reference|).
It prints a table (ratio = PyTorch time / convdsl time; above 1 convdsl is faster) and writes
<out>/cpu-<cpu>-<date>[-tag].json with the machine, versions, the command and every number.
Run one benchmark at a time: both sides use every core (IREE's local-task device makes one worker per physical
core unless --runtime-flag says otherwise, e.g. --runtime-flag=--task_topology_group_count=16).
"""
from __future__ import annotations

import argparse
import contextlib
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
from typing import Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Only what runs modules is imported here (NumPy, iree.runtime): `run` works without IREE's compiler, lark
# and ml_dtypes; the compiler is imported where a kernel is compiled.
import convdsl  # noqa: E402
from benchmarks.suite import load_suite  # noqa: E402
from convdsl import peak, policy  # noqa: E402
from convdsl.backends.iree import LoadedModule, iree_version  # noqa: E402
from convdsl.problem import ConvProblem, problem_from_spec  # noqa: E402
from convdsl.targets import Target  # noqa: E402

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# largest relative error accepted per dtype (max |convdsl - torch| / max |torch|)
TOLERANCE = {"f32": 1e-4, "bf16": 2e-2, "f16": 5e-3}
CASES_FILE = "cases.json"  # what `build` wrote, for `run`
PEAK_FILE = "matmul_peak.vmfb"
BUILD_SCHEMA = 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> Optional[int]:
    """Distinct (socket, core) pairs in /proc/cpuinfo: IREE's local-task device makes one worker per physical
    core by default, PyTorch one thread per logical CPU."""
    cores, socket = set(), "0"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                socket = value.strip()
            elif key.strip() == "core id":
                cores.add((socket, value.strip()))
    except OSError:
        return None
    return len(cores) or None


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_version(name: str) -> str:
    return iree_version(name)  # importlib.metadata's, or "not installed"


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

def _to_torch_activation(p: ConvProblem, a: torch.Tensor, tensor: str) -> torch.Tensor:
    letters = p.layout_name(tensor)
    ch = "C" if tensor == "x" else "K"
    sp = [c for c in letters if c not in ("N", "G", ch)]
    t = a.permute(*[letters.index(c) for c in ["N", "G", ch, *sp]])
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:]).contiguous()


def _to_torch_weight(p: ConvProblem, w: torch.Tensor) -> torch.Tensor:
    letters = p.layout_name("w")
    taps = [c for c in letters if c not in ("G", "K", "C")]
    t = w.permute(*[letters.index(c) for c in ["G", "K", "C", *taps]])
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


def torch_call(p: ConvProblem, args: list[torch.Tensor], channels_last: bool) -> Callable[[], torch.Tensor]:
    """PyTorch's gradient of p on the same values (aten.convolution_backward, one output asked for); `args`
    in convdsl's layouts and the case's dtype."""
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


# --- inputs and results: torch tensors <-> the module's device arrays (bf16 as raw 16-bit words) -------------

def random_args(p: ConvProblem, rng: np.random.Generator) -> list[torch.Tensor]:
    """The kernel's arguments: standard normal values drawn in f32, rounded to the case's dtype."""
    return [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(TORCH_DTYPES[p.dtype])
            for s in p.arg_shapes]


def upload(loaded: LoadedModule, t: torch.Tensor):
    if t.dtype == torch.bfloat16:  # NumPy has no bf16: its words go up typed BFLOAT_16 (no ml_dtypes needed)
        return loaded.upload(t.view(torch.int16).numpy(), bf16_words=True)
    return loaded.upload(t.numpy())


def download(loaded: LoadedModule, view, dtype: str) -> np.ndarray:
    """A result buffer view (IntoCall.out) as a float64 array."""
    import iree.runtime as rt

    result = rt.DeviceArray(loaded.device, view, implicit_host_transfer=True)
    if dtype == "bf16":
        words = torch.from_numpy(loaded.download_bf16_words(result).view(np.int16))
        return words.view(torch.bfloat16).double().numpy()
    return np.asarray(result.to_host(), dtype=np.float64)


def case_row(p: ConvProblem) -> dict:
    return {"name": p.name, "op": p.op, "describe": p.describe(), "flops": p.flops}


def measure_case(p: ConvProblem, loaded: LoadedModule, args: list[torch.Tensor], seconds: float, most: int) -> dict:
    """convdsl's destination-passing call and PyTorch's gradient on the same values: timed, then compared."""
    row: dict = {}
    dev_args = [upload(loaded, a) for a in args]
    into = loaded.into_call(p.name, dev_args, p.result_shape, p.result_dtype)
    packed = into.pack([a._buffer_view for a in dev_args])
    row["convdsl_s"], row["convdsl_calls"] = timed(lambda: into.call(packed), seconds, most)
    got = download(loaded, into.out, p.result_dtype)  # what the last timed call wrote

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
    ref64 = ref_np.astype(np.float64)
    err = float(np.max(np.abs(got - ref64)) / max(float(np.max(np.abs(ref64))), 1e-30))
    row["rel_err"] = err
    row["agrees"] = err <= TOLERANCE[p.dtype]
    row["ratio"] = row["torch_s"] / row["convdsl_s"]
    row["convdsl_gflops"] = p.flops / row["convdsl_s"] / 1e9
    row["torch_gflops"] = p.flops / row["torch_s"] / 1e9
    return row


@contextlib.contextmanager
def empty_cache() -> Iterator[None]:
    """convdsl's cache pointed at a fresh folder meanwhile: what is compiled inside is compiled, not found."""
    saved = os.environ.get("CONVDSL_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="convdsl-cpu-bench-") as cache:
        os.environ["CONVDSL_CACHE_DIR"] = cache
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("CONVDSL_CACHE_DIR", None)
            else:
                os.environ["CONVDSL_CACHE_DIR"] = saved


def run_case(p: ConvProblem, seconds: float, most: int, rng: np.random.Generator) -> dict:
    """One case compiled and run here (the one-process mode)."""
    from convdsl.api import get_kernel
    from convdsl.reference import NUMPY_DTYPES

    row = case_row(p)
    args = random_args(p, rng)
    host_args = [a.float().numpy().astype(NUMPY_DTYPES[p.dtype]) for a in args]
    # first call into an empty cache: lowering + iree-compile + loading the module + one run
    with empty_cache():
        t0 = time.perf_counter()
        kernel = get_kernel(p, "cpu")
        row["compile_s"] = time.perf_counter() - t0  # lowering + iree-compile + loading
        kernel(*host_args)
        row["first_call_s"] = time.perf_counter() - t0
    row.update(measure_case(p, kernel.module.loaded, args, seconds, most))
    return row


def run_built_case(entry: dict, build: Path, target: Target, seconds: float, most: int,
                   rng: np.random.Generator) -> dict:
    """One case that `build` compiled, loaded and run here."""
    p = problem_from_spec(entry["spec"])
    if entry["function"] != p.name:
        raise ValueError(f"{entry['name']}: function {entry['function']!r} is not the problem's {p.name!r}")
    row = case_row(p)
    args = random_args(p, rng)
    row["compile_s"] = entry["compile_s"]  # on the build machine
    t0 = time.perf_counter()
    loaded = LoadedModule((build / entry["vmfb"]).read_bytes(), target)
    loaded.call_device(p.name, *[upload(loaded, a) for a in args])
    row["load_first_call_s"] = time.perf_counter() - t0
    row["first_call_s"] = row["compile_s"] + row["load_first_call_s"]
    row.update(measure_case(p, loaded, args, seconds, most))
    return row


# --- the table, the summary and the record --------------------------------------------------------------------

def print_header() -> None:
    print(f"{'case':24s} {'op':11s} {'compile s':>9s} {'convdsl ms':>11s} {'torch ms':>9s} {'ratio':>6s} "
          f"{'GFLOP/s':>8s} {'rel err':>8s}", flush=True)


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['name']:24s} {row['op']:11s} error: {row['error'][:200]}", flush=True)
        return
    flag = "" if row["agrees"] else "  MISMATCH"
    share = f" {100 * row['peak_share']:5.1f}% of peak" if "peak_share" in row else ""
    print(f"{row['name']:24s} {row['op']:11s} {row['compile_s']:9.2f} {row['convdsl_s'] * 1e3:11.2f} "
          f"{row['torch_s'] * 1e3:9.2f} {row['ratio']:6.2f} {row['convdsl_gflops']:8.1f} "
          f"{row['rel_err']:8.1e}{share}{flag}", flush=True)


def error_row(p: ConvProblem, err: BaseException) -> dict:
    return {**case_row(p), "error": f"{type(err).__name__}: {err}"}


def summarize(rows: list[dict]) -> dict:
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
    return summary


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "physical_cores": physical_cores(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    return {"convdsl": convdsl.__version__, "convdsl_commit": git_commit(), "iree": iree_version(),
            "iree_runtime": package_version("iree-base-runtime"), "torch": torch.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads()}


def command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def write_record(out: Path, tag: str, record: dict) -> Path:
    """<out>/cpu-<cpu>-<date>[-tag].json"""
    out.mkdir(parents=True, exist_ok=True)
    cpu = "".join(c if c.isalnum() else "-" for c in cpu_model()).strip("-")
    stem = f"cpu-{cpu}-{datetime.now().date().isoformat()}" + (f"-{tag}" if tag else "")
    path = out / f"{stem}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def record_of(settings: dict, summary: dict, rows: list[dict], **extra) -> dict:
    return {"command": command(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions(), "settings": settings, **extra, "summary": summary,
            "cases": rows}


def apply_runtime_flags(flags: list[str]) -> None:
    """IREE runtime flags (e.g. --task_topology_group_count=16), before the first device is made."""
    if flags:
        import iree.runtime as rt

        rt.flags.parse_flags(*flags)


# --- the three modes --------------------------------------------------------------------------------------------

def timing_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent timing each side of a case, at least")
    ap.add_argument("--most", type=int, default=20, help="most timed calls per side")
    ap.add_argument("--out", type=Path, help="folder for cpu-<cpu>-<date>[-tag].json")
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runtime-flag", action="append", default=[], metavar="FLAG",
                    help="an IREE runtime flag, e.g. --runtime-flag=--task_topology_group_count=16 (repeatable)")


def case_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", type=int, default=4, help="batch of every case (default 4)")
    ap.add_argument("--dtype", default="f32", choices=sorted(TORCH_DTYPES), help="dtype of every case")
    ap.add_argument("--cases", nargs="*", help="suite case names (default: every case)")


def in_process(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    case_options(ap)
    timing_options(ap)
    args = ap.parse_args(argv)
    apply_runtime_flags(args.runtime_flag)
    rng = np.random.default_rng(args.seed)
    rows = []
    print_header()
    for p in bench_problems(args.batch, args.dtype, args.cases):
        try:
            row = run_case(p, args.seconds, args.most, rng)
        except Exception as err:  # noqa: BLE001 - a failure is part of the record
            row = error_row(p, err)
        rows.append(row)
        print_row(row)
    summary = summarize(rows)
    if args.out:
        settings = {"batch": args.batch, "dtype": args.dtype, "seconds": args.seconds, "most": args.most,
                    "seed": args.seed, "runtime_flags": args.runtime_flag}
        write_record(args.out, args.tag, record_of(settings, summary, rows))
    return 0


def build(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="cpu_bench.py build", description="compile the cases for another "
                                 "machine's CPU (see the module's description)")
    ap.add_argument("dir", type=Path, help="the folder to write the modules and cases.json to")
    ap.add_argument("--arch", default="host", help="an LLVM CPU name (sapphirerapids, emeraldrapids, znver4, "
                    "x86-64-v4, ...) or host (default)")
    case_options(ap)
    args = ap.parse_args(argv)
    target = Target.parse("cpu", args.arch)
    args.dir.mkdir(parents=True, exist_ok=True)
    entries, flags = [], {}
    for p in bench_problems(args.batch, args.dtype, args.cases):
        flags[p.name] = target.compile_flags(policy.cpu_data_tiling([p], target))  # per case: policy decides
        try:
            with empty_cache():
                t0 = time.perf_counter()
                module = convdsl.compile([p], target=target)  # lowering + iree-compile (not loaded: other CPU)
                compile_s = time.perf_counter() - t0
            module.save(args.dir / f"{p.name}.vmfb")  # with its manifest, <case>.json
            kernel = module.manifest()["kernels"][0]
            entries.append({"name": p.name, "vmfb": f"{p.name}.vmfb", "compile_s": compile_s,
                            **{k: kernel[k] for k in ("function", "into_function", "op", "problem", "args",
                                                      "result", "flops", "spec")}})
            print(f"{p.name:24s} {p.op:11s} compiled in {compile_s:.2f} s", flush=True)
        except Exception as err:  # noqa: BLE001 - a failure is part of the record
            entries.append(error_row(p, err))
            print_row(entries[-1])
    (args.dir / PEAK_FILE).write_bytes(peak.compile_matmul(target))
    manifest = {
        "schema": BUILD_SCHEMA,
        "command": command(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": target.backend,
        "arch": target.arch,
        "flags": flags,
        "machine": machine(),
        "versions": {"convdsl": convdsl.__version__, "convdsl_commit": git_commit(), "iree_compiler": iree_version()},
        "settings": {"batch": args.batch, "dtype": args.dtype, "cases": args.cases},
        "peak": {"vmfb": PEAK_FILE, "function": peak.FUNCTION, "size": peak.MATMUL_SIZE},
        "cases": entries,
    }
    (args.dir / CASES_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.dir.iterdir() if f.is_file())
    print(f"wrote {len(entries)} cases and the matmul peak for cpu:{target.arch} to {args.dir} "
          f"({size / 2**20:.1f} MiB)")
    return 0


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="cpu_bench.py run", description="run what `build` compiled, here "
                                 "(see the module's description)")
    ap.add_argument("dir", type=Path, help="the folder `build` wrote")
    ap.add_argument("--cases", nargs="*", help="only these of the built cases (default: every one)")
    timing_options(ap)
    args = ap.parse_args(argv)
    built = json.loads((args.dir / CASES_FILE).read_text())
    if built.get("schema") != BUILD_SCHEMA:
        ap.error(f"{args.dir / CASES_FILE}: schema {built.get('schema')}, expected {BUILD_SCHEMA}: build again")
    entries = [e for e in built["cases"] if not args.cases or e["name"] in args.cases]
    missing = sorted(set(args.cases or ()) - {e["name"] for e in entries})
    if missing:
        ap.error(f"--cases: not built: {', '.join(missing)}")
    apply_runtime_flags(args.runtime_flag)
    target = Target.parse("cpu", built["arch"])
    spec = built["peak"]
    gflops, seconds = peak.time_matmul((args.dir / spec["vmfb"]).read_bytes(), target, spec["size"])
    matmul_peak = {"gflops": gflops, "seconds": seconds, "size": spec["size"], "repeat": peak.REPEAT,
                   "warmup": peak.WARMUP}
    print(f"matmul peak (f32 {spec['size']}^3, cpu:{target.arch}): {gflops:.1f} GFLOP/s", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    print_header()
    for entry in entries:
        if "error" in entry:  # the build failed: its error is this case's record
            row = dict(entry)
        else:
            try:
                row = run_built_case(entry, args.dir, target, args.seconds, args.most, rng)
                row["peak_share"] = row["convdsl_gflops"] / gflops
            except Exception as err:  # noqa: BLE001 - a failure is part of the record
                row = {"name": entry["name"], "op": entry["op"], "describe": entry["problem"], "flops": entry["flops"],
                       "error": f"{type(err).__name__}: {err}"}
        rows.append(row)
        print_row(row)
    summary = summarize(rows)
    if args.out:
        settings = {**built["settings"], "seconds": args.seconds, "most": args.most, "seed": args.seed,
                    "runtime_flags": args.runtime_flag, "arch": target.arch}
        build_info = {k: built[k] for k in ("command", "date", "arch", "flags", "machine", "versions")}
        write_record(args.out, args.tag, record_of(settings, summary, rows, build=build_info, matmul_peak=matmul_peak))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"build": build, "run": run}
    if argv and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    return in_process(argv)


if __name__ == "__main__":
    sys.exit(main())
