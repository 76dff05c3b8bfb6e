"""Where IREE's per-call cost goes: the same kernels called synchronously, behind fences, and back to back.

Every convdsl module exports `<name>$into` (IREE's synchronous ABI: the call blocks on its result's fence, which
IREE's completion thread signals) and its fenced twin `<name>$into$async` (convdsl/abi.py), which returns once
the work is queued.  Through convdsl's IntoCall (backends/into_call.py), in one process on the same inputs:

  sync      `$into`, one synchronous call (IntoCall(wait="block"));
  wait      the fenced twin, then a blocking `HalFence.wait()` on its signal fence (IntoCall.submit);
  poll      the fenced twin, polled until its semaphore is signalled (IntoCall.call: convdsl's runtime call);
  queued    20 fenced calls, each after the one before, then one wait: the time per call of back-to-back calls;
  cudnn     PyTorch (cuDNN) with a synchronisation after each call, as in gpu_bench.py;
  cudnn-queued  20 PyTorch calls, then one synchronisation: cuDNN's time per call of back-to-back calls.

queued against cudnn-queued compares the kernels as a training step runs them (queued, no wait between
calls); poll against cudnn is the harness's host time, as issue 4 defines it.

Every method's result is checked against the float64 reference (gpu_bench.reference) before it is timed.

On a CUDA machine with the iree-base-runtime wheel installed and benchmarks/build copied there:
    python3 benchmarks/probes/runtime/async_call.py run --cases a,b --out RESULTS
Here, a table from its JSON:
    python3 benchmarks/probes/runtime/async_call.py table --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
QUEUED = 20
METHODS = ("sync", "wait", "poll", "queued", "cudnn", "cudnn-queued")


def run(cases: list[str], build_dir: Path, out: Path, rounds: int, reps: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    import torch

    from gpu_bench import Iree, TORCH_DTYPES, TorchConv, random_args, reference, rel_error, tolerance

    torch.backends.cudnn.benchmark = True
    by_name = {c["name"]: c for c in json.loads((build_dir / "cases.json").read_text())["cases"]}
    iree = Iree()
    results = []
    for name in cases:
        case = by_name[name]
        args = random_args(case, seed=7)
        conv = TorchConv(case)
        ref, _ = reference(case, conv, args)
        ctx, _ = iree.load(build_dir / case["vmfbs"]["convdsl"], case["function"])
        dsets = [[iree.upload(t, a["dtype"]) for t, a in zip(args, case["args"])]]
        blocking, (sync_fn,) = iree.into_calls(ctx, case, dsets, wait="block")
        polling, (poll_fn,) = iree.into_calls(ctx, case, dsets)
        packed = polling.pack([a._buffer_view for a in dsets[0]])

        def call_queued():
            for _ in range(QUEUED - 1):
                polling.submit(packed)
            polling.submit(packed).wait()

        tsets = conv.to_torch(args)
        tfn = conv.fn(conv.like(TORCH_DTYPES[case["args"][0]["dtype"]]))

        def call_cudnn():
            tfn(*tsets)
            torch.cuda.synchronize()

        def call_cudnn_queued():
            for _ in range(QUEUED):
                tfn(*tsets)
            torch.cuda.synchronize()

        methods = {"sync": sync_fn, "wait": lambda: polling.submit(packed).wait(), "poll": poll_fn,
                   "queued": call_queued, "cudnn": call_cudnn, "cudnn-queued": call_cudnn_queued}
        entry = {"name": name, "ms": {}, "min_ms": {}, "err": {}}
        tol = tolerance(case)
        for m in ("sync", "wait", "poll", "queued"):
            methods[m]()
            view = (blocking if m == "sync" else polling).out
            entry["err"][m] = rel_error(iree.download_view(view, case["result"]["dtype"]), ref)
            if not entry["err"][m] <= tol:
                raise AssertionError(f"{name} {m}: relative error {entry['err'][m]:.2e} over {tol:.1e}")
        call_cudnn()
        times = {m: [] for m in methods}
        for _ in range(rounds):  # interleaved, so that drift in the node hits every method alike
            for m, f in methods.items():
                for _ in range(3):
                    f()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    f()
                    times[m].append(time.perf_counter() - t0)
        for m, ts in times.items():
            per = QUEUED if m.endswith("queued") else 1
            entry["ms"][m] = statistics.median(ts) * 1e3 / per
            entry["min_ms"][m] = min(ts) * 1e3 / per
        print(name, " ".join(f"{m} {v:.4f}" for m, v in entry["ms"].items()), flush=True)
        results.append(entry)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async-call.json").write_text(json.dumps(results, indent=1))
    (out / "async-call.md").write_text(table(results))
    return results


def table(results: list[dict]) -> str:
    """Median ms per call of each method, what a synchronous (polled) call costs beyond back-to-back calls, and
    cuDNN / convdsl per call, synchronised (cudnn / poll) and back to back (cudnn-queued / queued).  A result file
    without a cudnn-queued column shows '–' there."""
    methods = [m for m in METHODS if any(m in e["ms"] for e in results)]
    lines = ["| case | " + " | ".join(f"{m} ms" for m in methods) + " | sync - queued µs | sync - poll µs"
             " | poll - queued µs | cuDNN/convdsl, synchronised | cuDNN/convdsl, back to back |",
             "|---" * (len(methods) + 6) + "|"]
    for e in results:
        ms = e["ms"]
        queued_ratio = f"{ms['cudnn-queued'] / ms['queued']:.2f}" if "cudnn-queued" in ms else "–"
        lines.append(f"| {e['name']} | " + " | ".join(f"{ms[m]:.4f}" if m in ms else "–" for m in methods)
                     + f" | {(ms['sync'] - ms['queued']) * 1e3:.0f} | {(ms['sync'] - ms['poll']) * 1e3:.1f}"
                     f" | {(ms['poll'] - ms['queued']) * 1e3:.0f} | {ms['cudnn'] / ms['poll']:.2f} | {queued_ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "table"))
    ap.add_argument("--cases", default="", help="run: comma-separated suite case names")
    ap.add_argument("--build", type=Path, default=ROOT / "benchmarks" / "build", help="the suite build")
    ap.add_argument("--out", type=Path, default=Path("."),
                    help="run: where async-call.json/.md go; table: the folder holding async-call.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    if a.mode == "table":
        print(table(json.loads((a.out / "async-call.json").read_text())), end="")
    else:
        run([c for c in a.cases.split(",") if c], a.build, a.out, a.rounds, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
