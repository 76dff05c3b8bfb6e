"""Where a training step's convolution time goes: every distinct convolution of one step (a bundle from
`examples/train_resnet.py --bundle-out`, which writes beside it how often each runs per step, `.calls.json`),
timed through convdsl's stream path and through cuDNN on the same tensors, summed over the step by those counts.
GPU time per call comes from CUDA-graph replays (no host time between kernels); the CUDA-event time of queued
eager calls is kept beside it.

    python3 examples/train_resnet.py --bundle-out resnet50.convk --arch sm_90        # where Triton is
    python3 benchmarks/torch_layers.py --bundle resnet50.convk --out results/          # on the GPU machine

Prints one row per distinct convolution (calls per step, CUDA-event ms per call of each, the step's difference)
sorted by that difference, and writes results/layers-<device>-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    from benchmarks.gpu_bench import TorchConv, random_args, reference, rel_error, tolerance
    from benchmarks.torch_bench import _case_dict, _queued, graph_ms
    from convdsl import stream
    from convdsl.problem import problem_from_spec
    from convdsl.torch.stream import StreamRunner

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True, help="one step's kernels, one per call")
    ap.add_argument("--out", type=Path, required=True, help="directory for the results JSON")
    args = ap.parse_args(argv)

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
        p = k.problem
        cd = _case_dict(p)
        conv = TorchConv(cd)
        runner = StreamRunner(k, device)
        inputs = random_args(cd, seed=1)
        got = runner(*inputs)
        ref, _ = reference(cd, conv, inputs)
        err = rel_error(got, ref)
        del ref
        targs = conv.to_torch(inputs)
        cudnn = conv.fn(conv.like(targs[0].dtype))
        mine = graph_ms(lambda: runner(*inputs))
        theirs = graph_ms(lambda: cudnn(*targs))
        row = {"describe": p.describe(), "op": p.op, "calls": calls[key], "convdsl_ms": mine, "cudnn_ms": theirs,
               "step_difference_ms": calls[key] * (mine - theirs), "error": err, "ok": err <= tolerance(cd),
               "queued_convdsl_ms": _queued(lambda: runner(*inputs))["kernel_ms"],
               "queued_cudnn_ms": _queued(lambda: cudnn(*targs))["kernel_ms"], "stream": k.describe()}
        rows.append(row)
        del inputs, targs, got
        torch.cuda.empty_cache()
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
                "command": "python3 benchmarks/torch_layers.py --bundle BUNDLE --out DIR", "bundle": args.bundle.name}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"layers-{versions['device'].replace(' ', '_')}-{versions['date'][:10]}.json"
    path.write_text(json.dumps({"versions": versions, "summary": summary, "results": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    print(f"wrote {path}")
    return 0 if summary["all_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
