"""Tile sweep of the forward GEMMs of one ResNet-50 training step (batch 64, bf16 autocast, channels-last).

    python3 benchmarks/forward_tiles.py build BUNDLE          # where Triton is (no GPU needed)
    python3 benchmarks/forward_tiles.py run BUNDLE OUT.json   # on a CUDA GPU

`build` records the forward problems of a traced training step and compiles each with every candidate tile
shape into one bundle; `run` times each candidate with CUDA events (median of 5 x 20 calls) and checks it
against the first candidate's result.  docs/decisions.md#forward-tiles holds what it found.
"""
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import torch
CANDS = ["t128x128x64w8s3", "t128x256x64w8s3", "t256x128x64w8s3", "t128x64x64w4s4", "t64x128x64w4s4",
         "t128x128x32w4s4", "t256x64x64w8s3", "t64x64x64w4s4"]

def problems():
    from torch._subclasses.fake_tensor import FakeTensorMode
    import convdsl.torch as ct
    from convdsl.torch import runtime
    import train_resnet as tr
    model = ct.convert(tr.ResNet(classes=100)).to(memory_format=torch.channels_last)
    with runtime.recording(as_cuda=True) as probs, FakeTensorMode(allow_non_fake_inputs=True):
        images = torch.randn(64, 3, 224, 224)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.CrossEntropyLoss()(model(images.contiguous(memory_format=torch.channels_last)),
                                               torch.zeros(64, dtype=torch.long))
        loss.backward()
    return [p for p in probs if p.op == "forward"]

def build(bundle: Path) -> None:
    from convdsl import stream
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs
    t = Target("cuda", "sm_90")
    ks = []
    fwd = problems()
    print(len(fwd), "forward problems")
    for i, p in enumerate(fwd):
        for c in CANDS:
            q = p.with_(name=f"f{i}_{c}")
            try:
                ks.append(stream.plan_stream_kernel(q, t, Knobs(tiles=c), compile=True))
            except Exception as e:
                print("skip", i, c, type(e).__name__, str(e)[:100])
        print(i, p.describe(), flush=True)
    stream.save_bundle(ks, bundle)

def run(bundle: Path, out: Path) -> None:
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner
    from benchmarks.torch_bench import _case_dict
    from benchmarks.gpu_bench import random_args, rel_error
    ks = stream.load_bundle(bundle)
    dev = torch.device("cuda", 0)
    groups = {}
    for k in ks:
        i, c = k.problem.name[1:].split("_", 1)
        groups.setdefault(int(i), []).append((c, k))
    res = {}
    for i, lst in sorted(groups.items()):
        args = None; base = None; row = {}
        for c, k in lst:
            r = StreamRunner(k, dev)
            if args is None:
                args = random_args(_case_dict(k.problem), seed=1)
            y = r(*args); torch.cuda.synchronize()
            if base is None: base = y.clone()
            err = rel_error(y, base.double())
            for _ in range(5): r(*args)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(5):
                a.record()
                for _ in range(20): r(*args)
                b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / 20)
            ts.sort(); row[c] = {"ms": ts[2], "err_vs_first": err}
        p = lst[0][1].problem
        best = min(row, key=lambda c: row[c]["ms"])
        res[i] = {"problem": dataclasses.replace(p, name="kernel").record() if hasattr(p, "record") else None,
                  "describe": p.describe(), "times": row, "best": best}
        print(i, p.describe(), {c: round(v["ms"], 4) for c, v in row.items()}, "best", best, flush=True)
    Path(out).write_text(json.dumps(res, indent=1, default=str))

if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
