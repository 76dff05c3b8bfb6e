"""Where a training step's convolution time goes: every distinct convolution of one step (a bundle from
`examples/train_resnet.py --bundle-out`, which writes beside it how often each runs per step, `.calls.json`),
timed through convdsl's stream path and through cuDNN on the same tensors, summed over the step by those counts.
GPU time per call comes from CUDA-graph replays (no host time between kernels); the CUDA-event time of queued
eager calls is kept beside it.

    python3 examples/train_resnet.py --bundle-out resnet50.convk --arch sm_90        # where Triton is
    python3 benchmarks/torch_layers.py --bundle resnet50.convk --out results/          # on the GPU machine

Prints one row per distinct convolution (calls per step, CUDA-event ms per call of each, the step's difference)
sorted by that difference, and writes results/layers-<device>-<date>.json.

The models of `benchmarks/models.py` instead: their recorded problems (`models.py record`, with each problem's
calls per step by model and memory format) and their bundles (CONVDSL_STREAM_BUNDLES), one row per distinct
convolution and a calls-weighted sum per model:

    CONVDSL_STREAM_BUNDLES=build/models.convk python3 benchmarks/torch_layers.py \
        --problems build/models.problems.json --models resnet50,r2plus1d_18 --format channels_last --out results/
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    from convdsl import stream
    from convdsl.problem import problem_from_spec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--bundle", type=Path, help="one step's kernels, one per call")
    source.add_argument("--problems", type=Path, help="benchmarks/models.py record's problems (kernels from "
                        "CONVDSL_STREAM_BUNDLES, else compiled here)")
    ap.add_argument("--models", type=lambda s: s.split(","), help="with --problems: these models (default all)")
    ap.add_argument("--format", default="channels_last", help="with --problems: contiguous or channels_last")
    ap.add_argument("--no-reference", action="store_true",
                    help="check each result against cuDNN's instead of a float64 reference (faster)")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="let cuDNN time its algorithms for each shape (torch.backends.cudnn.benchmark, as "
                         "benchmarks/models.py trains) instead of PyTorch's default heuristics")
    ap.add_argument("--out", type=Path, required=True, help="directory for the results JSON")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if args.problems is not None:
        return _models(args)

    kernels = stream.load_bundle(args.bundle)
    counts = args.bundle.with_suffix(".calls.json")
    if not counts.exists():
        raise SystemExit(f"--bundle: {counts} is missing (examples/train_resnet.py --bundle-out writes it)")
    calls = {json.dumps(problem_from_spec(c["problem"]).record(), sort_keys=True): c["calls"]
             for c in json.loads(counts.read_text())}
    first = {}
    for k in kernels:
        first.setdefault(json.dumps(k.problem.record(), sort_keys=True), k)
    # the bundle also holds kernels that a step's other path runs in their place (runtime.note's counted=False:
    # the grad_weight into f32 of an eager plan under autocast); they have no calls of their own in the step
    uncounted = [key for key in first if key not in calls]
    for key in uncounted:
        del first[key]
    if uncounted:
        print(f"{len(uncounted)} kernels of the bundle with no counted calls in the step, left out")
    device = torch.device("cuda", 0)
    rows = []
    for key, k in first.items():
        row = {"describe": k.problem.describe(), "op": k.problem.op, "calls": calls[key],
               **_timed(k, device, float64=True, queued=True)}
        row["step_difference_ms"] = calls[key] * (row["convdsl_ms"] - row["cudnn_ms"])
        rows.append(row)
    rows.sort(key=lambda r: -r["step_difference_ms"])
    for r in rows:
        print(f"{r['calls']:2d} x {r['describe'][:92]:<92} convdsl {r['convdsl_ms']:.4f} cuDNN {r['cudnn_ms']:.4f} "
              f"-> {r['step_difference_ms']:+.3f} ms/step {'ok' if r['ok'] else 'BAD'}")
    total = {name: sum(r["calls"] * r[f"{name}_ms"] for r in rows) for name in ("convdsl", "cudnn")}
    by_op = {op: {name: sum(r["calls"] * r[f"{name}_ms"] for r in rows if r["op"] == op) for name in ("convdsl", "cudnn")}
             for op in sorted({r["op"] for r in rows})}
    summary = {"calls_per_step": sum(r["calls"] for r in rows), "distinct": len(rows), "step_ms": total,
               "by_op_ms": by_op, "all_correct": all(r["ok"] for r in rows)}
    versions = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": "python3 benchmarks/torch_layers.py --bundle BUNDLE"
                           + (" --cudnn-benchmark" if args.cudnn_benchmark else "") + " --out DIR",
                "bundle": args.bundle.name}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"layers-{versions['device'].replace(' ', '_')}-{versions['date'][:10]}.json"
    path.write_text(json.dumps({"versions": versions, "summary": summary, "results": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    print(f"wrote {path}")
    return 0 if summary["all_correct"] else 1


def _timed(k, device, float64: bool, queued: bool = False) -> dict:
    """One stream kernel through the stream runner and the same convolution through cuDNN on the same random
    tensors, each timed by CUDA-graph replay; its error against the float64 reference (float64), else against
    cuDNN's result at twice the tolerance (both round); queued: also the CUDA-event time of queued eager calls."""
    import torch

    from benchmarks.gpu_bench import TorchConv, random_args, reference, rel_error, tolerance
    from benchmarks.torch_bench import _case_dict, _queued, graph_ms
    from convdsl.torch.stream import StreamRunner

    cd = _case_dict(k.problem)
    conv = TorchConv(cd)
    runner = StreamRunner(k, device)
    inputs = random_args(cd, seed=1)
    got = runner(*inputs)
    targs = conv.to_torch(inputs)
    cudnn = conv.fn(conv.like(targs[0].dtype))
    if float64:
        ref, limit = reference(cd, conv, inputs)[0], tolerance(cd)
    else:
        ref, limit = conv.from_torch(cudnn(*targs)), 2 * tolerance(cd)
    err = rel_error(got, ref)
    del ref
    row = {"convdsl_ms": graph_ms(lambda: runner(*inputs)), "cudnn_ms": graph_ms(lambda: cudnn(*targs)),
           "error": err, "ok": err <= limit, "stream": k.describe()}
    if queued:
        row.update(queued_convdsl_ms=_queued(lambda: runner(*inputs))["kernel_ms"],
                   queued_cudnn_ms=_queued(lambda: cudnn(*targs))["kernel_ms"])
    del inputs, targs, got
    torch.cuda.empty_cache()
    return row


def _models(args) -> int:
    """Every distinct convolution the chosen models call per step in one memory format, timed once; each model's
    convolution time per step is the calls-weighted sum over its own problems."""
    import torch

    from convdsl import stream
    from convdsl.problem import problem_from_spec
    from convdsl.targets import Target
    from convdsl.torch import runtime

    # the bundles training registers: without them every kernel compiles here, with the installed Triton (PyTorch
    # 2.11's 3.6 has no Gluon TMA kernels: the cp.async ones only)
    runtime.register_bundles()
    bundles = [path for path in os.environ.get(runtime.BUNDLES_ENV, "").split(os.pathsep) if path]
    data = json.loads(args.problems.read_text())
    models = args.models or sorted({key.split("/")[0] for key in data["calls_per_step"]})
    keys = [f"{m}/{args.format}" for m in models]
    missing = [k for k in keys if k not in data["calls_per_step"]]
    if missing:
        raise SystemExit(f"--models: {', '.join(missing)} not recorded in {args.problems}")
    major, minor = torch.cuda.get_device_capability()
    target = Target("cuda", f"sm_{major}{minor}")
    device = torch.device("cuda", 0)
    rows = []
    for entry in data["problems"]:
        calls = {k.split("/")[0]: n for k, n in entry["calls"].items() if k in keys and n}
        if not calls:
            continue
        p = problem_from_spec(entry["problem"])
        row = {"describe": p.describe(), "op": p.op, "calls": calls}
        try:
            k = stream.stream_kernel(p, target)
        except Exception as err:  # noqa: BLE001 - a layer without a kernel runs cuDNN's in training: say so
            row["no_kernel"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            rows.append(row)
            print(f"no kernel: {p.describe()}: {row['no_kernel']}", flush=True)
            continue
        row.update(_timed(k, device, float64=not args.no_reference))
        rows.append(row)
    timed = [r for r in rows if "convdsl_ms" in r]
    per_model = {}
    for m in models:
        mine = [r for r in timed if m in r["calls"]]
        step = {name: sum(r["calls"][m] * r[f"{name}_ms"] for r in mine) for name in ("convdsl", "cudnn")}
        by_op = {op: {name: round(sum(r["calls"][m] * r[f"{name}_ms"] for r in mine if r["op"] == op), 4)
                      for name in ("convdsl", "cudnn")} for op in sorted({r["op"] for r in mine})}
        per_model[m] = {"distinct": len(mine), "calls_per_step": sum(r["calls"][m] for r in mine),
                        "step_ms": {k: round(v, 4) for k, v in step.items()},
                        "speedup": round(step["cudnn"] / step["convdsl"], 3) if step["convdsl"] else None,
                        "by_op_ms": by_op, "no_kernel": sum(1 for r in rows if m in r["calls"] and "no_kernel" in r)}
        print(f"{m:<30} {per_model[m]['calls_per_step']:4d} calls, conv ms/step convdsl {step['convdsl']:.3f} "
              f"cuDNN {step['cudnn']:.3f} -> {per_model[m]['speedup']}x", flush=True)
    for r in sorted(timed, key=lambda r: -sum(r["calls"].values()) * (r["convdsl_ms"] - r["cudnn_ms"]))[:25]:
        n = sum(r["calls"].values())
        print(f"{n:3d} x {r['describe'][:90]:<90} convdsl {r['convdsl_ms']:.4f} cuDNN {r['cudnn_ms']:.4f} "
              f"{'ok' if r['ok'] else 'BAD'}")
    speedups = [v["speedup"] for v in per_model.values() if v["speedup"]]
    summary = {"format": args.format, "models": per_model, "all_correct": all(r["ok"] for r in timed),
               "bundles": len(bundles),
               "geomean_speedup": round(statistics.geometric_mean(speedups), 3) if speedups else None}
    versions = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": "python3 benchmarks/torch_layers.py --problems PROBLEMS --format "
                           f"{args.format} --models {','.join(models)}" + (" --no-reference" if args.no_reference else "")
                           + (" --cudnn-benchmark" if args.cudnn_benchmark else "") + " --out DIR"}
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "-cudnn-benchmark" if args.cudnn_benchmark else ""
    device = versions["device"].replace(" ", "_")
    path = args.out / f"model-layers-{args.format}{tag}-{device}-{versions['date'][:10]}.json"
    path.write_text(json.dumps({"versions": versions, "summary": summary, "results": rows}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "models"}))
    print(f"wrote {path}")
    return 0 if summary["all_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
