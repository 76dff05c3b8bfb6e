"""Probe: the TMA forward kernel (kernels/tma.forward_tma: forwards, and stride-1 grad_inputs run as forwards of dY)
warp-specialised, one warp of its own issuing the copies, against the kernel that issues them from its product
warps and against cuDNN, per stage count.

    python3 benchmarks/probes/tma_specialised.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_specialised.py run P.convk OUT.json   # on an H100/H200

Problems: every kernel of the suite (and its forwards, benchmarks/torch_bench.problems) that takes the TMA forward
kernel, and ResNet-50's stride-1 3x3 grad_inputs at 128, 256 and 512 channels.  Variants: "rule" (policy as it
was: copies issued by the product warps), "ws" (the rule's tiles, warp-specialised), "ws-s<N>" (N stages; left
out where the ring does not fit shared memory).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("rule", "ws", "ws-s3", "ws-s5", "ws-s6")


def _compile(job):
    from convdsl import policy
    from convdsl.kernels import tma_launches
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rule_tiles = policy.tma_forward_tiles
    stages = int(variant.split("-s")[1]) if "-s" in variant else None

    def tiles(q, target):
        t = rule_tiles(q, target)
        return replace(t, stages=stages) if stages else t

    on = variant.startswith("ws")
    # the persistent kernel (the rule's where its tiles outnumber the SMs) has no such option: a program per tile
    with policy.overrides(tma_forward_tiles=tiles, forward_tma_launch=lambda *args, **kw: (
            tma_launches.forward_tma_launch(*args, **{**kw, "specialised": on,
                                                "programs": 0 if on else kw.get("programs", 0)}))):
        try:
            return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), Target("cuda", "sm_90"), Knobs(),
                                      compile=True, tma=True)
        except Exception as e:  # a ring too deep for shared memory
            print(f"{p.name}:{variant}: not built ({str(e).splitlines()[0][:120]})", flush=True)
            return None


def _takes_forward_tma(p) -> bool:
    from convdsl import policy
    from convdsl.targets import Target

    hopper = Target("cuda", "sm_90")
    if policy.tma_forward_reason(p, hopper) is None:
        return True
    q = policy.grad_input_as_forward(p)
    return (q is not None and p.dtype != "f32" and not p.fp8_compute
            and policy.tma_forward_reason(q, hopper) is None)


def build(out: Path) -> None:
    from benchmarks.torch_bench import problems
    from benchmarks.probes.tma_forward import build_variants

    found = [p for p in problems([]) if _takes_forward_tma(p)]
    base = next(p for p in found if p.name == "r50_3x3_s1_dgrad")
    found += [base.with_(name=f"r50_dgrad_c{c}_{size}", in_channels=c, out_channels=c, input=(size, size))
              for c, size in ((128, 28), (256, 14), (512, 7))]
    build_variants(out, found, VARIANTS, _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_specialised.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
