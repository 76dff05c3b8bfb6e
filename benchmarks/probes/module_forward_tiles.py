"""Probe: the cp.async forward kernels `.vmfb` modules run (no TMA in an IREE dispatch: docs/decisions.md#tma-forward),
per tile candidate, against cuDNN, on the suite's 16-bit forwards that the GEMM kernel runs.

    python3 benchmarks/probes/module_forward_tiles.py build P.convk          # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/module_forward_tiles.py run P.convk OUT.json   # on an H100/H200

Kernels are named <case>:<label>: "cpasync" the module's plan (the rules without TMA kernels), "cp:<tiles>" forced
cp.async tiles, "rule" the stream path's plan (its TMA kernel, for reference).  `run` calls each through the stream
runner (the same binaries a module embeds), checks it against cuDNN on the same tensors and times both by CUDA-graph
replay, cuDNN with `cudnn.benchmark`.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TILES = ("t128x64x64w4s4", "t128x128x64w8s3", "t128x128x64w8s4", "t128x128x64w4s4", "t128x256x64w8s3",
         "t256x128x64w8s3", "t64x128x64w4s4", "t128x128x32w4s5", "t256x64x64w8s4")


def build(out: Path) -> None:
    from benchmarks.probes.tma_forward import build_jobs, compile_candidate
    from benchmarks.torch_bench import problems
    from convdsl.passes.plan import plan
    from convdsl.problem import problem_to_spec
    from convdsl.targets import Target

    target = Target("cuda", "sm_90")
    jobs = []
    for p in problems([]):
        if not p.name.endswith("_fwd") or p.dtype not in ("f16", "bf16"):
            continue
        ext = plan(p, target).extern
        if ext is None or ext.launches[-1].kernel != "grad_input_phases":  # the GEMM kernel only
            continue
        spec = problem_to_spec(p)
        jobs += [(spec, label) for label in ("rule", "cpasync", *(f"cp:{t}" for t in TILES))]
    print(f"{len(jobs)} kernels", flush=True)
    build_jobs(out, jobs, compile_candidate)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle, cudnn_benchmark=True)
    by_case = ms_by_case(rows)
    cudnn = {r["case"]: r["cudnn_ms"] for r in rows}
    summary = {}
    for case, times in by_case.items():
        cp = {k: v for k, v in times.items() if k != "rule"}
        best = min(cp, key=cp.get)
        summary[case] = {"cudnn_over_module": cudnn[case] / times["cpasync"] if "cpasync" in times else None,
                         "best": best, "cudnn_over_best": cudnn[case] / cp[best],
                         "cudnn_over_stream": cudnn[case] / times["rule"] if "rule" in times else None}
        print(case, summary[case], flush=True)
    write_record(result, "python3 benchmarks/probes/module_forward_tiles.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
