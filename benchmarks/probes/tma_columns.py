"""Probe: the TMA forward kernel's tiles against the models' own convolutions where its rule's tiles fit them
badly, each against the cp.async kernel (with its output split-K where policy.output_split takes it) and cuDNN
(with cudnn.benchmark, as benchmarks/models.py trains).  From a problems file of `benchmarks/models.py record`,
every 16-bit channels-last forward, and stride-1 grad_input run as a forward over the flipped weight, that the
TMA forward takes and that falls in one of three classes:

- columns: 128 < K < 256 output channels with K mod 128 <= 64 (144 = 128 + 16: 128-wide column tiles compute 256
  columns where 64-wide ones compute 192); candidates 256 x 64 and 128 x 64 tiles;
- sixteen: a reduction over channels that are no multiple of 32 (16 a step) with more than one tap; the
  cp.async kernel (its steps of 64 masked);
- few: 128-row tiles that leave more than half the SMs without a program; 64-row tiles and the cp.async kernel.

    python3 benchmarks/probes/tma_columns.py build P.convk --problems models.problems.json  # where Triton 3.8+ is
    python3 benchmarks/probes/tma_columns.py run P.convk OUT.json                             # on an H100/H200

Kernels are named <case>:<label>; "rule" is the plan as policy makes it, "cpasync" the plan without TMA kernels,
t... a forced TMA forward tile (for a grad_input: of the forward over the flipped weight).
"""
from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def classes(p, target) -> dict[str, list[str]]:
    """The probe's classes p falls in, each with its candidates beside the rule's plan."""
    from convdsl.policy import hopper

    q = p if p.op == "forward" else hopper.grad_input_as_forward(p) if p.op == "grad_input" else None
    if q is None or p.layout != "NHWGC" or p.dtype not in ("f16", "bf16") or not hopper._weight_rows(p) \
            or hopper.tma_forward_reason(q, target) is not None:
        return {}
    tiles = hopper.tma_forward_tiles(q, target)
    bk = tiles.block_k
    found = {}
    if q.groups == 1 and 128 < q.out_channels < 256 and 0 < q.out_channels % 128 <= 64:
        found["columns"] = [f"t256x64x{bk}w8s4", f"t128x64x{bk}w4s4", "cpasync"]
    if bk == 16 and math.prod(q.filter) > 1:
        found["sixteen"] = ["cpasync"]
    programs = -(-q.batch * math.prod(q.output) // tiles.block_m) * -(-q.out_channels // tiles.block_n) * q.groups
    if 2 * programs < target.gpu.sm_count:
        found["few"] = [f"t64x64x{bk}w4s6", f"t64x128x{bk}w4s4", "cpasync"]
    return found


def _compile(job):
    from convdsl import policy
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.problem import problem_from_spec
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    spec, label = job
    p = problem_from_spec({**spec, "name": f"{spec['name']}:{label}"})
    target = Target("cuda", "sm_90")
    if label == "cpasync":
        return planned_stream_kernel(p, target, Knobs(), compile=True, tma=False)
    rule = policy.tma_forward_tiles
    forced = None if label == "rule" else parse_tiles(label)
    with policy.overrides(tma_forward_tiles=lambda q, t: forced or rule(q, t)):
        return planned_stream_kernel(p, target, Knobs(), compile=True)


def build(out: Path, problems: Path) -> None:
    from convdsl import stream
    from convdsl.problem import problem_from_spec
    from convdsl.targets import Target

    target = Target("cuda", "sm_90")
    jobs, seen = [], set()
    for entry in json.loads(problems.read_text())["problems"]:
        p = problem_from_spec(entry["problem"])
        found = classes(p, target)
        key = json.dumps(p.record(), sort_keys=True)
        if not found or key in seen:
            continue
        seen.add(key)
        name = f"{'+'.join(found)}#{len(seen)}"
        labels = dict.fromkeys(["rule", *(label for ls in found.values() for label in ls)])
        jobs += [({**entry["problem"], "name": name}, label) for label in labels]
    with ProcessPoolExecutor(4) as pool:
        kernels = list(pool.map(_compile, jobs))
    # a forced tile the TMA kernel cannot take falls back to cp.async: left out (the "cpasync" row has it)
    kernels = [k for k, (_, label) in zip(kernels, jobs)
               if label in ("rule", "cpasync") or "forward_tma" in k.describe()]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels of {len(seen)} problems")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_columns.py run P.convk OUT.json",
                 timed_rows(bundle, cudnn_benchmark=True))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--problems", dict(type=Path))])


if __name__ == "__main__":
    sys.exit(main())
