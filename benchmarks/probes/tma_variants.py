"""Probe: variants of the TMA kernels (kernels/tma.py) against the cp.async stream kernels and cuDNN, on
ResNet-50's 1x1 forward and grad_input convolutions (which the TMA kernels leave to cp.async) and its 3x3
grad_weights (split into fewer chunks than the rule's).

    python3 benchmarks/probes/tma_variants.py build P.convk --from resnet50.convk   # where Triton 3.9 is
    python3 benchmarks/probes/tma_variants.py run P.convk OUT.json                  # on an H100/H200

`--from` names a stream bundle (examples/train_resnet.py --bundle-out makes ResNet-50's); the suite's ResNet
1x1 case joins its problems.  Each problem is planned as the stream path plans it (stream.planned_stream_kernel),
with one policy rule replaced per variant:
  1x1 forward / grad_input: "cp.async"; "tma" (the forward rule's tiles); "tma-s2" (2 stages: two programs
  resident per SM), "tma-w8" (8 warps), "tma-s2w8";
  grad_weight: "cp.async"; "tma" (the rule's split, policy.tma_grad_weight_parts); "tma-fill" (the cp.async
  kernel's, policy.grad_weight_parts); "tma-S1" .. "tma-S4" (that many chunks).
`run` calls each through the stream runner, checks it against cuDNN on the same tensors and times both by
CUDA-graph replay.
"""
from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SUITE_CASES = ["r50_1x1_dgrad", "r50_1x1_dgrad_fwd"]
VARIANTS = {"forward": ("cp.async", "tma", "tma-s2", "tma-w8", "tma-s2w8"),
            "grad_weight": ("cp.async", "tma", "tma-fill", "tma-S1", "tma-S2", "tma-S3", "tma-S4")}


def _variants(op: str) -> tuple[str, ...]:
    return VARIANTS["grad_weight" if op == "grad_weight" else "forward"]


def _compile(job):
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    common, rule_tiles = policy.hopper._tma_common_reason, policy.tma_forward_tiles

    def any_taps(q, target):  # 1x1 forward and grad_input on the TMA kernel
        reason = common(q, target)
        return None if reason is not None and reason.startswith("one tap") and q.op != "grad_weight" else reason

    def tiles(q, target):
        t = rule_tiles(q, target)
        t = replace(t, stages=2) if "s2" in variant else t
        return replace(t, warps=8) if "w8" in variant else t

    rules: dict[str, object] = {"_tma_common_reason": any_taps, "tma_forward_tiles": tiles}
    if variant.startswith("tma-S"):
        parts = int(variant.removeprefix("tma-S"))
        rules["tma_grad_weight_parts"] = lambda *_: parts
    if variant == "tma-fill":
        rules["tma_grad_weight_parts"] = policy.grad_weight_parts
    with policy.overrides(**rules):
        named = p.with_(name=f"{p.name}:{variant}")
        k = planned_stream_kernel(named, Target("cuda", "sm_90"), Knobs(), compile=True, tma=variant != "cp.async")
    if variant != "cp.async" and not k.tma_maps:
        return None  # the TMA kernels do not take it
    return k


def _from_bundle(path: Path) -> list:
    from convdsl import stream

    out = []
    for k in stream.load_bundle(path):
        p = k.problem
        if p.dtype not in ("f16", "bf16") or p.layout != "NHWGC":
            continue
        one_by_one = math.prod(p.filter) == 1 and all(s == 1 for s in p.stride) and p.op in ("forward", "grad_input")
        if one_by_one or (p.op == "grad_weight" and math.prod(p.filter) > 1 and p.in_channels % 64 == 0):
            size = "x".join(map(str, p.input))
            taps = "x".join(map(str, p.filter))
            out.append(p.with_(name=f"r50_{p.op}_c{p.in_channels}_k{p.out_channels}_{size}_f{taps}"
                                    f"_s{p.stride[0]}"))
    return out


def build(out: Path, source: Optional[Path], ops: Optional[list[str]]) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import stream

    found = [p for p in problems([c.removesuffix("_fwd") for c in SUITE_CASES]) if p.name in SUITE_CASES]
    if source is not None:
        found += _from_bundle(source)
    seen, unique = set(), []
    for p in found:
        if ops and p.op not in ops:
            continue
        key = repr(p.with_(name="").record())
        if key not in seen:
            seen.add(key)
            unique.append(p)
    jobs = [(p, v) for p in unique for v in _variants(p.op)]
    with ProcessPoolExecutor(2) as pool:
        kernels = [k for k in pool.map(_compile, jobs) if k is not None]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels for {len(unique)} problems")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import geomean_ratio, ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle)
    by_case = ms_by_case(rows)
    summary = {}
    for v in sorted({v for vs in VARIANTS.values() for v in vs} - {"cp.async"}):
        ratio = geomean_ratio(by_case, "cp.async", v)
        if ratio is not None:
            summary[f"geomean_cp.async_over_{v}"] = ratio
    print(json.dumps(summary))
    write_record(result, "python3 benchmarks/probes/tma_variants.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, lambda bundle, source, ops: build(bundle, source, ops), run, argv, extra=(
        ("--from", dict(dest="source", type=Path, help="a stream bundle whose problems join the suite's")),
        ("--ops", dict(nargs="*", help="only these ops (forward, grad_input, grad_weight)"))))


if __name__ == "__main__":
    sys.exit(main())
