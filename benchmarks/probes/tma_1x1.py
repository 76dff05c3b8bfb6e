"""Probe: 1x1 forwards and stride-1 grad_inputs (plain GEMMs) of real models on the TMA forward kernel
(kernels/tma.forward_tma, persistent as policy.tma_forward_programs says) against the rule's cp.async one-tap loop
and cuDNN (whose Hopper 1x1 kernels are cuBLAS's).

    python3 benchmarks/probes/tma_1x1.py build P.convk --problems models.problems.json   # where Triton 3.9 is
    python3 benchmarks/probes/tma_1x1.py run P.convk OUT.json                            # on an H100/H200

Why: the rule keeps every 1x1 on the cp.async kernel (docs/decisions.md#tma-forward, measured before the TMA
forward became persistent); ResNet-50's 1x1 layers ran 1.3-1.5x cuDNN's time through it.  Problems: the distinct
16-bit channels-last 1x1 stride-1 forwards and grad_inputs of `--models` in a `models.py record` file (default
resnet50, densenet121), most calls first, at most `--most`.  Variants: "cp.async" (the rule), "tma" (the TMA forward
kernel with its own rules' tiles).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("cp.async", "tma")


def _without_one_tap(original):
    # the TMA kernels' common conditions with a 1x1 filter let through: checked as a 3x3 of the same problem with
    # padding 1 (the same channels, layout, dtype and batch; a 1x1 reads no padding, so its box is within range)
    def reason(p, target):
        if math.prod(p.filter) == 1:
            p = p.with_(filter=(3,) * p.dims, pad_lo=(1,) * p.dims, pad_hi=(1,) * p.dims)
        return original(p, target)
    return reason


def _compile(job):
    from benchmarks.probes.tma_forward import plan_variant
    from convdsl.policy import hopper

    p, variant = job
    try:
        if variant == "cp.async":
            return plan_variant(p, variant)
        return plan_variant(p, variant, _tma_common_reason=_without_one_tap(hopper._tma_common_reason))
    except Exception as e:  # noqa: BLE001 - a variant the kernels cannot take
        print(f"{p.name}:{variant}: not built ({str(e).splitlines()[0][:160]})", flush=True)
        return None


def build(out: Path, problems: Path | None, models: str = "resnet50,densenet121", most: int = 24) -> None:
    from benchmarks.probes.tma_forward import build_variants
    from convdsl.problem import problem_from_spec

    if problems is None:
        raise SystemExit("build: --problems (a models.py record file) is required")
    keys = {f"{m}/channels_last" for m in models.split(",")}
    found = []
    for i, entry in enumerate(json.loads(problems.read_text())["problems"]):
        calls = sum(n for k, n in entry["calls"].items() if k in keys)
        p = problem_from_spec(entry["problem"])
        if (calls and math.prod(p.filter) == 1 and all(s == 1 for s in p.stride) and p.op in ("forward", "grad_input")
                and p.dtype in ("f16", "bf16") and p.layout == "NHWGC" and p.out_dtype is None):
            found.append((calls, p.with_(name=f"{p.op}_{p.in_channels}_{p.out_channels}_{p.input[-1]}_n{p.batch}_{i}")))
    found = [p for _, p in sorted(found, key=lambda cp: -cp[0])[:most]]
    build_variants(out, found, VARIANTS, _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import geomean_ratio, ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle)
    by_case = ms_by_case(rows)
    write_record(result, "python3 benchmarks/probes/tma_1x1.py run P.convk OUT.json", rows,
                 {"tma_over_cp_async": geomean_ratio(by_case, "cp.async", "tma")})


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--problems", dict(type=Path)),
                                                        ("--models", dict(default="resnet50,densenet121")),
                                                        ("--most", dict(type=int, default=24))])


if __name__ == "__main__":
    sys.exit(main())
