"""Probe: the convolutions of real models that cost most against cuDNN (with cudnn.benchmark, as benchmarks/models.py
trains), each with generic candidates beside the rule's plan, checked against cuDNN on the same tensors.  From a
per-layer record (`benchmarks/torch_layers.py --cudnn-benchmark`), every 16-bit problem whose time over cuDNN's,
times its calls a step, is at least `--least-us` microseconds in some model; its candidates:

- forward, and grad_input run as a forward over the flipped weight, on the TMA forward: forced TMA tiles (64 to 256
  rows, 32 to 128 columns); every forward and grad_input: the cp.async kernel with its rule's tiles ("cpasync") and
  forced cp.async tiles;
- grad_weight: the TMA grad_weight where it applies ("tma", its own tiles), the cp.async kernel ("cpasync") and
  forced cp.async tiles (32 to 128 rows).

    python3 benchmarks/probes/layer_fit.py build P.convk --problems models.problems.json \\
        --layers model-layers-after-fits-cudnn-benchmark-H200-2026-11-28.json   # where Triton 3.9 is
    python3 benchmarks/probes/layer_fit.py run P.convk OUT.json                        # on an H100/H200

Kernels are named <case>:<label>; "rule" is the plan as policy makes it; tma:t... a forced TMA forward tile, cp:t...
a forced cp.async tile.  A candidate the problem cannot take is left out (said while building).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TMA_TILES = ("t64x64x{k}w4s6", "t128x64x{k}w4s4", "t64x128x{k}w4s4", "t128x128x{k}w4s4", "t256x64x{k}w8s4",
             "t128x32x{k}w4s4", "t64x32x{k}w4s4")
CP_FORWARD_TILES = ("t128x64x64w4s4", "t64x64x64w4s4", "t128x32x64w4s4", "t64x32x64w4s4", "t128x128x64w8s3")
CP_GRAD_WEIGHT_TILES = ("t32x128x64w4s4", "t32x256x64w4s3", "t64x128x64w4s4", "t64x256x64w8s3", "t128x128x64w8s3",
                        "t128x64x64w4s4")


def candidates(p, target) -> list[str]:
    """The labels compiled for p beside "rule"."""
    from convdsl.policy import hopper

    if p.op == "grad_weight":
        return ["tma", "cpasync", *(f"cp:{t}" for t in CP_GRAD_WEIGHT_TILES)]
    q = p if p.op == "forward" else hopper.grad_input_as_forward(p)
    tma = []
    if q is not None and hopper.tma_forward_reason(q, target) is None:
        k = hopper.tma_forward_tiles(q, target).block_k
        tma = [f"tma:{t.format(k=k)}" for t in TMA_TILES]
    return [*tma, "cpasync", *(f"cp:{t}" for t in CP_FORWARD_TILES)]


def build(out: Path, problems: Path, layers: Path, least_us: float = 10.0) -> None:
    from benchmarks.probes.tma_forward import build_jobs, compile_candidate
    from convdsl.problem import problem_from_spec
    from convdsl.targets import Target

    target = Target("cuda", "sm_90")
    costly = {r["describe"] for r in json.loads(layers.read_text())["results"]
              if max(r["calls"].values()) * (r["convdsl_ms"] - r["cudnn_ms"]) * 1000 >= least_us}
    jobs, seen = [], set()
    for entry in json.loads(problems.read_text())["problems"]:
        p = problem_from_spec(entry["problem"])
        if p.describe() not in costly or p.describe() in seen or p.dtype not in ("f16", "bf16"):
            continue
        seen.add(p.describe())
        spec = {**entry["problem"], "name": f"{p.op}#{len(seen)}"}
        jobs += [(spec, label) for label in ["rule", *candidates(p, target)]]
    print(f"{len(seen)} problems, {len(jobs)} kernels", flush=True)
    build_jobs(out, jobs, compile_candidate)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/layer_fit.py run P.convk OUT.json",
                 timed_rows(bundle, cudnn_benchmark=True))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv,
                      extra=[("--problems", dict(type=Path)), ("--layers", dict(type=Path)),
                             ("--least-us", dict(type=float, default=10.0))])


if __name__ == "__main__":
    sys.exit(main())
