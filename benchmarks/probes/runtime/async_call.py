"""Where IREE's per-call cost goes: a synchronous call against the same kernels behind fences.

The synchronous ABI (every convdsl module today) submits the call's command buffer and then blocks the
calling thread on the result's fence; the CUDA HAL learns of completion on its own thread, which then wakes
the caller.  With `--iree-execution-model=async-external` the same function takes a wait fence and a signal
fence and returns once the work is queued, so the caller chooses how to wait.  This probe times, in one
process and on the same inputs:

  sync      the `$into` function of the module as built (benchmarks/build), one synchronous call;
  wait      the async module's `$into`, then `HalFence.wait()` on its signal fence;
  spin      the async module's `$into`, then polling the signal semaphore (as a CUDA stream synchronise
            spins under CUDA's default scheduling);
  queued    20 async calls chained by fences, then one wait: the time per call of back-to-back calls;
  cudnn     PyTorch (cuDNN) with a synchronisation after each call, as in gpu_bench.py.

Every async result is checked against the float64 reference (gpu_bench.reference) before its time counts.

Here (iree-compile):     python benchmarks/probes/runtime/async_call.py build --cases a,b --out DIR
GPU machine:             python3 benchmarks/probes/runtime/async_call.py run --cases a,b --async-build DIR --out $OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ASYNC_FLAG = "--iree-execution-model=async-external"
QUEUED = 20


def build(cases: list[str], build_dir: Path, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from convdsl.backends.iree import compile_mlir
    from convdsl.targets import Target

    meta = json.loads((build_dir / "cases.json").read_text())
    target = Target.parse(meta["target"], meta["arch"])
    out.mkdir(parents=True, exist_ok=True)
    for name in cases:
        mlir = (build_dir / f"{name}.convdsl.mlir").read_text()
        (out / f"{name}.async.vmfb").write_bytes(compile_mlir(mlir, target, extra_flags=[ASYNC_FLAG]))
        print(f"{name}: built", flush=True)


def run(cases: list[str], build_dir: Path, async_dir: Path, out: Path, rounds: int, reps: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    import torch

    from convdsl.backends.into_call import IntoCall, allocate_result
    from gpu_bench import Iree, TorchConv, TORCH_DTYPES, random_args, reference, rel_error, tolerance

    torch.backends.cudnn.benchmark = True
    meta = json.loads((build_dir / "cases.json").read_text())
    by_name = {c["name"]: c for c in meta["cases"]}
    iree = Iree()
    rt = iree.rt
    results = []
    for name in cases:
        case = by_name[name]
        rdtype = case["result"]["dtype"]
        elem, width = iree.elem[rdtype], 4 if rdtype == "f32" else 2
        args = random_args(case, seed=7)
        conv = TorchConv(case)
        ref, _ = reference(case, conv, args)
        dev_args = [iree.upload(t, a["dtype"])._buffer_view for t, a in zip(args, case["args"])]

        # synchronous: the module as built
        ctx_s, _ = iree.load(build_dir / case["vmfbs"]["convdsl"], case["function"])
        out_s = allocate_result(iree.device, case["result"]["shape"], elem, width)
        sync_call = IntoCall(ctx_s, ctx_s.modules.module.vm_module, case["function"], dev_args, out_s)
        sync_packed = sync_call.pack(dev_args)

        # async-external: the same MLIR compiled with coarse fences
        ctx_a, _ = iree.load(async_dir / f"{name}.async.vmfb", case["function"])
        vm_a = ctx_a.modules.module.vm_module
        fn_a = vm_a.lookup_function(case["function"] + "$into")
        out_a = allocate_result(iree.device, case["result"]["shape"], elem, width)
        workspace = sync_call.workspace  # same transients layout: same MLIR
        semaphore = iree.device.create_semaphore(0)
        state = {"value": 0}

        def submit():
            packed = rt.VmVariantList(len(dev_args) + 4)
            for v in dev_args:
                packed.push_ref(v)
            packed.push_ref(out_a)
            packed.push_ref(workspace)
            packed.push_ref(rt.HalFence.create_at(semaphore, state["value"]))  # after the previous call
            state["value"] += 1
            signal = rt.HalFence.create_at(semaphore, state["value"])
            packed.push_ref(signal)
            ctx_a.vm_context.invoke(fn_a, packed, rt.VmVariantList(1))
            return signal

        def call_wait():
            submit().wait()

        def call_spin():
            submit()
            target = state["value"]
            while semaphore.query() < target:
                pass

        def call_queued():
            for _ in range(QUEUED - 1):
                submit()
            submit().wait()

        tsets = conv.to_torch(args)
        tfn = conv.fn(conv.like(TORCH_DTYPES[case["args"][0]["dtype"]]))

        def call_cudnn():
            tfn(*tsets)
            torch.cuda.synchronize()

        methods = {"sync": lambda: sync_call.call(sync_packed), "wait": call_wait, "spin": call_spin,
                   "queued": call_queued, "cudnn": call_cudnn}
        entry = {"name": name, "ms": {}, "min_ms": {}, "err": {}}
        tol = tolerance(case)
        for m in ("sync", "wait", "spin", "queued"):
            methods[m]()
            got = iree.download_view(out_s if m == "sync" else out_a, rdtype)
            entry["err"][m] = rel_error(got, ref)
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
            per = QUEUED if m == "queued" else 1
            entry["ms"][m] = statistics.median(ts) * 1e3 / per
            entry["min_ms"][m] = min(ts) * 1e3 / per
        print(name, " ".join(f"{m} {v:.4f}" for m, v in entry["ms"].items()), flush=True)
        results.append(entry)
        del ctx_a, ctx_s, sync_call
    out.mkdir(parents=True, exist_ok=True)
    (out / "async-call.json").write_text(json.dumps(results, indent=1))
    (out / "async-call.md").write_text(table(results))
    return results


def table(results: list[dict]) -> str:
    """Median ms per call of each method, and what a synchronous call costs beyond back-to-back calls."""
    methods = ("sync", "wait", "spin", "queued", "cudnn")
    lines = ["| case | " + " | ".join(f"{m} ms" for m in methods) + " | sync - queued µs | sync - spin µs |",
             "|---" * (len(methods) + 3) + "|"]
    for e in results:
        ms = e["ms"]
        lines.append(f"| {e['name']} | " + " | ".join(f"{ms[m]:.4f}" for m in methods)
                     + f" | {(ms['sync'] - ms['queued']) * 1e3:.0f} | {(ms['sync'] - ms['spin']) * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("build", "run", "table"))
    ap.add_argument("--cases", required=True, help="comma-separated suite case names")
    ap.add_argument("--build", type=Path, default=ROOT / "benchmarks" / "build", help="the suite build")
    ap.add_argument("--async-build", type=Path, default=ROOT / "benchmarks" / "build-async")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    if a.mode == "table":  # --cases is ignored; --out: the folder holding async-call.json
        print(table(json.loads(((a.out or Path(".")) / "async-call.json").read_text())), end="")
    elif a.mode == "build":
        build(names, a.build, a.out or a.async_build)
    else:
        run(names, a.build, a.async_build, a.out or Path("."), a.rounds, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
