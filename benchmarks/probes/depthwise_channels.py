"""Probe: how many channels a program of the depthwise forward and grad_input kernels (forward_direct,
grad_input_direct) should take, where the channel count is no multiple of the rule's block (144 channels in blocks of
128: two programs a row, the second with 16 channels live), on the suite's and real models' depthwise layers.

    python3 benchmarks/probes/depthwise_channels.py build P.convk --problems models.problems.json  # where Triton is
    python3 benchmarks/probes/depthwise_channels.py run P.convk OUT.json                           # on an H100/H200

`--problems` is `benchmarks/models.py record`'s file; its channels-last 16-bit depthwise forwards and grad_inputs
are taken once each, with the suite's MobileNetV2 and ConvNeXt ones.  Kernels are named <case>:<label>: "rule" the
plan as policy makes it, "cp:t32x<B>x1w<W>s1" blocks of B channels over W warps.  `run` calls each through the
stream runner, checks it against cuDNN on the same tensors and times both by CUDA-graph replay (`cudnn.benchmark`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCKS = ("t32x128x1w2s1", "t32x64x1w1s1", "t32x32x1w1s1", "t32x16x1w1s1")


def _layers(problems: Path) -> list:
    from benchmarks.torch_bench import problems as suite_problems
    from convdsl.problem import problem_from_spec

    found, seen = [], set()
    entries = [problem_from_spec(e["problem"]) for e in json.loads(problems.read_text())["problems"]]
    for p in [*suite_problems(["mbv2_dw_dgrad", "convnext_dw7_wgrad"]), *entries]:
        if not (p.depthwise and p.op in ("forward", "grad_input") and p.dtype in ("f16", "bf16")
                and p.layout == "NHWGC"):
            continue
        key = repr(p.with_(name="").record())
        if key not in seen:
            seen.add(key)
            found.append(p.with_(name=f"{p.op}_g{p.groups}_{'x'.join(map(str, p.input))}_f{p.filter[0]}"
                                      f"s{p.stride[0]}_n{p.batch}_{len(found)}"))
    return found


def build(out: Path, problems: Path) -> None:
    from benchmarks.probes.tma_forward import build_jobs, compile_candidate
    from convdsl.problem import problem_to_spec

    layers = _layers(problems)
    jobs = [(problem_to_spec(p), label) for p in layers for label in ("rule", *(f"cp:{t}" for t in BLOCKS))]
    print(f"{len(layers)} layers, {len(jobs)} kernels", flush=True)
    build_jobs(out, jobs, compile_candidate)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle, cudnn_benchmark=True)
    summary = {}
    for case, times in ms_by_case(rows).items():
        best = min(times, key=times.get)
        summary[case] = {"best": best, "rule_over_best": times["rule"] / times[best]} if "rule" in times else {}
    write_record(result, "python3 benchmarks/probes/depthwise_channels.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--problems", dict(type=Path))])


if __name__ == "__main__":
    sys.exit(main())
