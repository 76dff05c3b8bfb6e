"""Probe: candidates for the 16-bit grad_weights of real models that lose to cuDNN (with cudnn.benchmark, as
benchmarks/models.py trains): the TMA grad_weight on 1x1 layers (which the rule kept on the cp.async kernel's
one-tap GEMM before docs/decisions.md#grad-weight-fit), the cp.async kernel's tiles, and split-K at half and
twice the rule's chunks; each against cuDNN on the same tensors, checked against it.

    python3 benchmarks/probes/wgrad_fit.py build P.convk --problems models.problems.json \\
        --layers model-layers-channels_last-cudnn-benchmark-H200-2026-11-28.json   # where Triton 3.9 is
    python3 benchmarks/probes/wgrad_fit.py build P.convk --problems models.problems.json --family one-by-one
    python3 benchmarks/probes/wgrad_fit.py run P.convk OUT.json                        # on an H100/H200

The grad_weights probed are those of `--layers` (benchmarks/torch_layers.py --cudnn-benchmark) slower than cuDNN
by more than 5%, taken from `--problems` (benchmarks/models.py record).  Kernels are named <case>:<label>: "rule"
the plan as policy makes it, "tma" the TMA grad_weight with its own rule's tiles and split, "cpasync" the plan
without TMA kernels, t... cp.async tiles, split<S> the cp.async kernel's rule tiles with S chunks.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TILES = ["t128x256x64w8s3", "t128x64x64w4s4", "t64x128x64w4s4", "t128x128x64w8s3"]
SLOWER_THAN_CUDNN = 1.05


def _rule_split(spec: dict) -> int:
    """The rule's split-K chunks on the cp.async kernel: its grad_weight_partials launch's third grid axis."""
    from convdsl.problem import problem_from_spec
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    kernel = planned_stream_kernel(problem_from_spec(spec), Target("cuda", "sm_90"), Knobs(), tma=False)
    return next((sl.launch.grid[2] for sl in kernel.launches if sl.launch.kernel == "grad_weight_partials"), 1)


def _one_by_one(p) -> bool:
    """A 16-bit one-group 1x1 grad_weight in whole 64-channel blocks: what the TMA grad_weight could take."""
    return (p.op == "grad_weight" and math.prod(p.filter) == 1 and p.dtype in ("bf16", "f16") and p.groups == 1
            and p.in_channels % 64 == 0 and p.out_channels % 64 == 0)


def _cp_async_taps(p) -> bool:
    """A 16-bit one-group grad_weight over several taps that the rule leaves on the cp.async kernel."""
    from convdsl import policy
    from convdsl.targets import Target

    return (p.op == "grad_weight" and math.prod(p.filter) > 1 and p.dtype in ("bf16", "f16") and p.groups == 1
            and policy.tma_grad_weight_reason(p, Target("cuda", "sm_90")) is not None)


# --family: which grad_weights of --problems, and which candidates of each
FAMILIES = {"one-by-one": (_one_by_one, ["rule", "tma"]),
            "cp-async-taps": (_cp_async_taps, ["rule", "t128x128x64w8s3"])}


def build(out: Path, problems: Path, layers: Path | None = None, family: str | None = None) -> None:
    """The grad_weights of `layers` slower than cuDNN with every candidate; family: every grad_weight of FAMILIES'
    kind with that family's candidates (does a candidate lose anywhere?)."""
    from benchmarks.probes.tma_forward import build_jobs, compile_candidate
    from convdsl.problem import problem_from_spec

    slow = set() if family else {
        r["describe"] for r in json.loads(layers.read_text())["results"]
        if r["op"] == "grad_weight" and r["convdsl_ms"] > SLOWER_THAN_CUDNN * r["cudnn_ms"]}
    specs, seen = [], set()
    for entry in json.loads(problems.read_text())["problems"]:
        p = problem_from_spec(entry["problem"])
        wanted = FAMILIES[family][0](p) if family else p.describe() in slow
        if wanted and p.describe() not in seen:
            seen.add(p.describe())
            specs.append({**entry["problem"], "name": f"wgrad#{len(seen)}"})
    jobs = []
    for spec in specs:
        if family:
            jobs += [(spec, label) for label in FAMILIES[family][1]]
            continue
        split = _rule_split(spec)
        splits = sorted({s for s in (split // 2, split * 2) if s > 1} - {split})
        jobs += [(spec, label) for label in ["rule", "tma", "cpasync", *TILES, *(f"split{s}" for s in splits)]]
    print(f"{len(specs)} grad_weights, {len(jobs)} kernels", flush=True)
    build_jobs(out, jobs, compile_candidate)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/wgrad_fit.py run P.convk OUT.json",
                 timed_rows(bundle, cudnn_benchmark=True))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv,
                      extra=[("--problems", dict(type=Path)), ("--layers", dict(type=Path)),
                             ("--family", dict(choices=sorted(FAMILIES)))])


if __name__ == "__main__":
    sys.exit(main())
