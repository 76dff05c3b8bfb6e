"""convdsl's stream kernels called from PyTorch, against cuDNN on the same tensors, on one CUDA GPU.

Build the kernels where Triton is (no GPU needed), then run the comparison on the GPU machine:

    python3 benchmarks/torch_bench.py build --arch sm_90 --out build-torch/suite.convk
    python3 benchmarks/torch_bench.py run --bundle build-torch/suite.convk --out results/

`run` checks every result against a float64 reference (cuDNN on upcast inputs) and times, per case (f32 cases
with TF32 off on both sides, their _tf32 twins with one-pass TF32 on both):
  - queued: 100 calls back to back and one synchronisation, per call (convdsl and cuDNN);
  - synchronised: one call then a synchronisation, median (convdsl and cuDNN);
  - kernels: CUDA-event time of the queued calls, per call; host overhead = queued - kernels;
  - enqueue: host time to queue one call (no synchronisation).
It writes results/torch-<device>-<date>.json and prints a table; the ratios are cuDNN time / convdsl time.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import forward_of, load_suite  # noqa: E402
from convdsl.problem import ConvProblem  # noqa: E402
from convdsl.targets import Target  # noqa: E402

QUEUED = 100


def problems(names: list[str], tf32: bool = False) -> list[ConvProblem]:
    """The suite's kernels, each f32 kernel also with compute = "tf32" (named <case>_tf32, as a PyTorch user with
    TF32 allowed runs it), then the forward convolution of each distinct shape (named <case>_fwd).  tf32: only
    the f32 kernels' TF32 twins."""
    suite = [case.problem for case in load_suite(names=names or None)]
    twins = [p.with_(compute="tf32", name=f"{p.name}_tf32") for p in suite if p.dtype == "f32"]
    out = twins if tf32 else [*suite, *twins]
    seen = set()
    for p in list(out):
        fwd = forward_of(p)
        key = fwd.with_(name="").record()
        key = repr(key)
        if key not in seen:
            seen.add(key)
            out.append(fwd)
    return out


def build(arch: str, out: Path, names: list[str], tf32: bool = False) -> int:
    from convdsl.compiler import compile as compile_artifact

    built = compile_artifact(problems(names, tf32), Target("cuda", arch), artifact="bundle")
    out.parent.mkdir(parents=True, exist_ok=True)
    built.write(out)
    print(f"wrote {out}: {len(built.kernels)} stream kernels for {arch}")
    for name, reason in built.skipped:
        print(f"  no stream kernel for {name}: {reason}")
    return 0


def _case_dict(p: ConvProblem) -> dict:
    from convdsl.module import manifest

    kernel = manifest([p], Target("cuda", "sm_90"))["kernels"][0]
    return {"name": p.name, "op": p.op, "spec": kernel["spec"], "args": kernel["args"], "result": kernel["result"],
            "flops": p.flops}


def _median_ms(fn, reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


GRAPH_CALLS = 20


def graph_ms(fn, reps: int = 7) -> float:
    """GPU time per call of `fn`, GRAPH_CALLS calls captured in one CUDA graph and replayed: no host time between
    the kernels, for either side (queued eager calls of small convolutions wait on the host, cuDNN's most)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (workspace, algorithm choice)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / GRAPH_CALLS)
    del graph
    return statistics.median(times)


def _queued(fn, reps: int = 5) -> dict:
    """Per call: wall time of QUEUED calls and one synchronisation, their CUDA-event time, and the host time to
    queue them (median over reps)."""
    import torch

    walls, events, enqueues = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        for _ in range(QUEUED):
            fn()
        b.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        walls.append((t2 - t0) / QUEUED * 1e3)
        enqueues.append((t1 - t0) / QUEUED * 1e3)
        events.append(a.elapsed_time(b) / QUEUED)
    return {"ms": statistics.median(walls), "kernel_ms": statistics.median(events),
            "enqueue_ms": statistics.median(enqueues)}


def run(bundle: Path, out_dir: Path, names: list[str], tf32: bool = False) -> int:
    import torch

    from benchmarks.gpu_bench import TorchConv, random_args, reference, rel_error, tolerance
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    kernels = {k.problem.name: k for k in stream.load_bundle(bundle)}
    device = torch.device("cuda", 0)
    rows = []
    for problem in problems(names, tf32):
        k = kernels.get(problem.name)
        if k is None:
            rows.append({"name": problem.name, "skipped": "no stream kernel in the bundle"})
            continue
        cd = _case_dict(problem)
        try:
            conv = TorchConv(cd)
        except NotImplementedError as err:
            rows.append({"name": problem.name, "skipped": str(err)})
            continue
        runner = StreamRunner(k, device)
        args = random_args(cd, seed=1)
        got = runner(*args)
        torch.cuda.synchronize()
        ref, ref_dtype = reference(cd, conv, args)
        err = rel_error(got, ref)
        del ref
        targs = conv.to_torch(args)
        like = conv.like(targs[0].dtype)
        cudnn = conv.fn(like)
        # like for like: cuDNN may use TF32 exactly where the kernel does (f32 cases: f32-accurate on both sides;
        # their _tf32 twins: one-pass TF32 on both, PyTorch's default)
        torch.backends.cudnn.allow_tf32 = problem.tf32
        row = {"name": problem.name, "op": problem.op, "dtype": problem.dtype, "flops": problem.flops,
               "error": err, "tolerance": tolerance(cd), "ok": err <= tolerance(cd), "ref_dtype": ref_dtype,
               "stream": k.describe()}
        for name, fn in (("convdsl", lambda: runner(*args)), ("cudnn", lambda: cudnn(*targs))):
            fn()
            row[name] = {"queued": _queued(fn), "sync_ms": _median_ms(fn, 20)}
        row["queued_ratio"] = row["cudnn"]["queued"]["ms"] / row["convdsl"]["queued"]["ms"]
        row["sync_ratio"] = row["cudnn"]["sync_ms"] / row["convdsl"]["sync_ms"]
        row["host_overhead_us"] = (row["convdsl"]["queued"]["ms"] - row["convdsl"]["queued"]["kernel_ms"]) * 1e3
        rows.append(row)
        q = row["convdsl"]["queued"]
        print(f"{problem.name:<28} err {err:.1e} {'ok ' if row['ok'] else 'BAD'} queued {q['ms']:.4f} ms "
              f"(kernels {q['kernel_ms']:.4f}, enqueue {q['enqueue_ms'] * 1e3:.1f} us) cuDNN "
              f"{row['cudnn']['queued']['ms']:.4f} -> {row['queued_ratio']:.2f}x; sync {row['sync_ratio']:.2f}x",
              flush=True)
        del args, targs, got
        torch.cuda.empty_cache()
    timed = [r for r in rows if "queued_ratio" in r]
    grads = [r for r in timed if r["op"] != "forward"]
    forwards = [r for r in timed if r["op"] == "forward"]
    geo = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")  # noqa: E731
    summary = {"cases": len(rows), "timed": len(timed), "correct": sum(r["ok"] for r in timed),
               "geomean_queued": geo([r["queued_ratio"] for r in grads]),
               "geomean_sync": geo([r["sync_ratio"] for r in grads]),
               "min_queued": min((r["queued_ratio"] for r in grads), default=float("nan")),
               "forward_geomean_queued": geo([r["queued_ratio"] for r in forwards]),
               "forward_geomean_sync": geo([r["sync_ratio"] for r in forwards]),
               "forward_min_queued": min((r["queued_ratio"] for r in forwards), default=float("nan")),
               "max_host_overhead_us": max((r["host_overhead_us"] for r in timed), default=float("nan")),
               "median_enqueue_us": statistics.median(r["convdsl"]["queued"]["enqueue_ms"] * 1e3 for r in timed)
               if timed else float("nan")}
    versions = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = versions["device"].replace(" ", "_")
    path = out_dir / f"torch-{device_name}-{versions['date'][:10]}{'-tf32' if tf32 else ''}.json"
    path.write_text(json.dumps({"versions": versions, "summary": summary, "results": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    print(f"wrote {path}")
    return 0 if summary["correct"] == summary["timed"] else 1


def profile(bundle: Path, name: str) -> int:
    """Where the host time of a queued call goes: cProfile over 2000 calls of one case, top 25 by own time."""
    import cProfile
    import pstats

    import torch

    from benchmarks.gpu_bench import random_args
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    k = {k.problem.name: k for k in stream.load_bundle(bundle)}[name]
    runner = StreamRunner(k, torch.device("cuda", 0))
    args = random_args(_case_dict(k.problem), seed=1)
    for _ in range(20):
        runner(*args)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(2000):
        runner(*args)
    prof.disable()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name}: {(t1 - t0) / 2000 * 1e6:.1f} us per call queued (under cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="plan and compile the suite's stream kernels into one bundle file")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--cases", nargs="*", default=[])
    b.add_argument("--tf32", action="store_true", help="the f32 kernels with compute = tf32 (PyTorch's default)")
    r = sub.add_parser("run", help="on a CUDA GPU: check and time the bundle's kernels against cuDNN")
    r.add_argument("--bundle", type=Path, required=True)
    r.add_argument("--out", type=Path, default=Path("results"))
    r.add_argument("--cases", nargs="*", default=[])
    r.add_argument("--tf32", action="store_true", help="as build --tf32; cuDNN with TF32 allowed, its default")
    pr = sub.add_parser("profile", help="on a CUDA GPU: where one case's host time per call goes")
    pr.add_argument("--bundle", type=Path, required=True)
    pr.add_argument("case")
    args = ap.parse_args(argv)
    if args.command == "profile":
        return profile(args.bundle, args.case)
    if args.command == "build":
        return build(args.arch, args.out, args.cases, args.tf32)
    return run(args.bundle, args.out, args.cases, args.tf32)


if __name__ == "__main__":
    sys.exit(main())
