"""Tile sweep of the GEMMs of one ResNet-50 training step (batch 64, bf16 autocast, channels-last): forward,
grad_input and grad_weight, each distinct problem with every candidate tile shape; or of named suite cases.

    python3 benchmarks/step_tiles.py build BUNDLE [--ops forward,grad_input,grad_weight] [--jobs 2]   # where Triton is
    python3 benchmarks/step_tiles.py build BUNDLE --cases deeplab_atrous_dgrad ck15_dgrad_3d_f32 [--tf32]
    python3 benchmarks/step_tiles.py build BUNDLE --cases ck15_dgrad_3d_f32 --tf32 --tiles grad_input=t128x64x32w4s3,t256x64x32w8s3
    python3 benchmarks/step_tiles.py build BUNDLE --f32 --ops forward,grad_input     # the step in f32 (TF32)
    python3 benchmarks/step_tiles.py run BUNDLE OUT.json                                           # on a CUDA GPU

`--cases` takes suite cases and their forward convolutions as `benchmarks/torch_bench.py` builds them (`--tf32`:
the f32 cases with compute = tf32, as PyTorch runs them with TF32 allowed).
`build` records the problems of a traced training step and compiles each with every candidate into one bundle
(the cp.async kernels: on Hopper the stream path runs dense 16-bit forward and stride-1 grad_input on the TMA
kernel instead, whose tiles have their own rule, docs/decisions.md#tma-forward);
`run` times each candidate by CUDA-graph replay (20 calls a graph, median of 7 replays: no host time between
the kernels; small ResNet GEMMs take 10 to 30 us, less than a queued eager call's host time), checks it against
the first candidate's result, and times cuDNN on the same tensors.  docs/decisions.md#step-tiles holds what it
found.
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

CANDIDATES = {
    "forward": ["t128x128x64w8s3", "t256x128x64w8s3", "t128x256x64w8s3", "t128x64x64w4s4", "t64x128x64w4s4",
                "t128x128x64w4s4", "t64x64x64w4s4"],
    "grad_weight": ["t128x128x64w8s3", "t64x128x64w4s4", "t128x64x64w4s4", "t128x256x64w8s3", "t64x64x64w4s4",
                    "t128x128x64w4s4"],
}
CANDIDATES["grad_input"] = CANDIDATES["forward"]
# f32 operands (TF32 or three passes): 32-wide reduction steps
F32_CANDIDATES = ["t128x64x32w4s3", "t128x128x32w8s3", "t128x128x32w4s3", "t64x128x32w4s4", "t128x64x32w4s4",
                  "t256x64x32w8s3", "t64x64x32w4s4", "t128x32x32w4s4"]


def candidates(p, tiles: dict[str, list[str]]) -> list[str]:
    """tiles: candidates per op given on the command line (--tiles), else the lists above."""
    return tiles.get(p.op) or (F32_CANDIDATES if p.dtype == "f32" else CANDIDATES[p.op])


def problems(ops: list[str], f32: bool = False):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import convdsl.torch as ct
    import train_resnet as tr
    from convdsl.torch import runtime

    model = ct.convert(tr.ResNet(classes=100)).to(memory_format=torch.channels_last)
    with runtime.recording(as_cuda=True) as seen, FakeTensorMode(allow_non_fake_inputs=True):
        images = torch.randn(64, 3, 224, 224)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not f32):
            loss = torch.nn.CrossEntropyLoss()(model(images.contiguous(memory_format=torch.channels_last)),
                                               torch.zeros(64, dtype=torch.long))
        loss.backward()
    return [p for p in seen if p.op in ops]


def _compile(job):
    from convdsl import stream
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    index, p, tiles = job
    try:
        if tiles.startswith("split"):  # --splits: the default tiles, split_k forced ("split0": the rule's)
            split = int(tiles[5:])
            return stream.planned_stream_kernel(p.with_(name=f"s{index}_{tiles}", split_k=split or None),
                                             Target("cuda", "sm_90"), Knobs(), compile=True, tma=False)
        return stream.planned_stream_kernel(p.with_(name=f"s{index}_{tiles}"), Target("cuda", "sm_90"),
                                         Knobs(tiles=tiles), compile=True, tma=False)
    except Exception as e:  # a candidate the problem cannot take (say, a tile past its size): left out, said
        print("skip", index, tiles, type(e).__name__, str(e)[:100], flush=True)
        return None


def build(bundle: Path, ops: list[str], jobs: int, cases: list[str], tf32: bool, splits: list[int],
          tiles: dict[str, list[str]], f32: bool = False) -> None:
    from benchmarks.torch_bench import problems as suite_problems
    from convdsl import stream

    found = [p for p in suite_problems(cases, tf32) if p.op in ops] if cases else problems(ops, f32)
    print(len(found), "problems", flush=True)
    if splits:  # grad_weight's split-K chunks instead of tiles: the rule's first, then each forced count
        found = [p for p in found if p.op == "grad_weight"]
        work = [(i, p, f"split{s}") for i, p in enumerate(found) for s in [0, *splits]]
    else:
        work = [(i, p, c) for i, p in enumerate(found) for c in candidates(p, tiles)]
    with ProcessPoolExecutor(jobs) as pool:
        kernels = [k for k in pool.map(_compile, work, chunksize=4) if k is not None]
    stream.save_bundle(kernels, bundle)
    print(f"wrote {bundle}: {len(kernels)} kernels", flush=True)


def run(bundle: Path, out: Path) -> None:
    import torch

    from benchmarks.gpu_bench import TorchConv, random_args, rel_error
    from benchmarks.torch_bench import _case_dict, graph_ms
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    device = torch.device("cuda", 0)
    groups: dict[int, list] = {}
    for k in stream.load_bundle(bundle):
        index, tiles = k.problem.name[1:].split("_", 1)
        groups.setdefault(int(index), []).append((tiles, k))
    results = {}
    for index, candidates in sorted(groups.items()):
        p = candidates[0][1].problem
        case = _case_dict(p)
        args = random_args(case, seed=1)
        conv = TorchConv(case)
        targs = conv.to_torch(args)
        cudnn = conv.fn(conv.like(targs[0].dtype))
        row, first = {}, None
        for tiles, k in candidates:
            runner = StreamRunner(k, device)
            y = runner(*args)
            if first is None:
                first = y.double()
            row[tiles] = {"ms": graph_ms(lambda: runner(*args)), "err_vs_first": rel_error(y, first)}
        best = min(row, key=lambda c: row[c]["ms"])
        results[index] = {"problem": p.with_(name="kernel").record(), "describe": p.describe(), "times": row,
                          "best": best, "cudnn_ms": graph_ms(lambda: cudnn(*targs))}
        print(index, p.describe(), {c: round(v["ms"], 4) for c, v in row.items()}, "best", best,
              "cuDNN", round(results[index]["cudnn_ms"], 4), flush=True)
        del args, targs, first
        torch.cuda.empty_cache()
    versions = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "command": "python3 benchmarks/step_tiles.py run BUNDLE OUT"}
    out.write_text(json.dumps({"versions": versions, "results": results}, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("build", "run"))
    ap.add_argument("bundle", type=Path)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--ops", default="forward,grad_input,grad_weight")
    ap.add_argument("--jobs", type=int, default=2, help="build: compiling processes")
    ap.add_argument("--cases", nargs="*", help="build: these suite cases (and their forward convolutions) instead")
    ap.add_argument("--tf32", action="store_true", help="build --cases: the f32 cases with compute = tf32")
    ap.add_argument("--f32", action="store_true",
                    help="build: the training step in f32 (no autocast; TF32 convolutions, PyTorch's default)")
    ap.add_argument("--tiles", nargs="*", default=[], metavar="OP=TILES",
                    help="build: candidates of an op instead of the built-in lists, e.g. "
                         "grad_input=t128x64x32w4s3,t256x64x32w8s3")
    ap.add_argument("--splits", type=int, nargs="*", help="build: grad_weight with these split-K chunk counts "
                    "(and the rule's, 'split0') instead of tile candidates")
    args = ap.parse_args(argv)
    if args.mode == "build":
        tiles = {op: labels.split(",") for op, labels in (t.split("=", 1) for t in args.tiles)}
        build(args.bundle, args.ops.split(","), args.jobs, args.cases or [], args.tf32, args.splits or [], tiles,
              args.f32)
    else:
        if args.out is None:
            ap.error("run: OUT.json is required")
        run(args.bundle, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
