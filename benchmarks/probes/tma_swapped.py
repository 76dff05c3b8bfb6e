"""Probe: the TMA forward kernel (kernels/tma.forward_tma: forwards, and stride-1 grad_inputs run as forwards of dY)
with its product transposed (SWAPPED: the weight tile as wgmma's A, the pixels as its N), against the rule's tiles
and against cuDNN, per tile.

    python3 benchmarks/probes/tma_swapped.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_swapped.py run P.convk OUT.json   # on an H100/H200

Why: with 64 output columns each wgmma is m64 n64 k16, which reads as many bytes of shared memory per product
(A's 64 x 16 and B's 16 x 64) as the SM's shared memory delivers at the tensor cores' rate; transposed, the 64
columns are wgmma's M and the pixels its N (up to 256), a third fewer bytes per product.
Problems: the suite's 16-bit kernels on the TMA forward kernel with at most 128 output columns (and their
forwards, benchmarks/torch_bench.problems), and ResNet-50's stride-1 3x3 grad_input at 64 channels.  Variants:
"rule" (policy.tma_forward_tiles), "sw-t<M>x<N>x<K>w<warps>s<stages>" (transposed, those tiles: M pixels, N
output columns); a variant that does not fit shared memory is left out.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("rule", "sw-t256x64x64w4s4", "sw-t256x64x64w4s3", "sw-t256x64x64w8s4", "sw-t128x64x64w4s4",
            "sw-t256x128x64w8s3", "sw-t128x128x64w4s4")


def _compile(job):
    from convdsl import policy
    from convdsl.kernels import tma_launches
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rule_tiles = policy.tma_forward_tiles
    forced = parse_tiles(variant[3:]) if variant.startswith("sw-") else None
    on = forced is not None
    # the persistent kernel (the rule's where its tiles outnumber the SMs) has no such option: a program per tile
    with policy.overrides(tma_forward_tiles=lambda q, target: forced or rule_tiles(q, target),
                          forward_tma_launch=lambda *args, **kw: (
                              tma_launches.forward_tma_launch(*args, **{**kw, "swapped": on,
                                                                  "programs": 0 if on else kw.get("programs", 0)}))):
        try:
            return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), Target("cuda", "sm_90"), Knobs(),
                                      compile=True, tma=True)
        except Exception as e:  # a ring too deep for shared memory, a layout the kernel cannot take
            print(f"{p.name}:{variant}: not built ({str(e).splitlines()[0][:160]})", flush=True)
            return None


def _takes_forward_tma(p) -> bool:
    from convdsl import policy
    from convdsl.targets import Target

    hopper = Target("cuda", "sm_90")
    if p.dtype not in ("f16", "bf16") or p.fp8_compute:
        return False
    q = p if p.op == "forward" else policy.grad_input_as_forward(p)
    return q is not None and q.out_channels <= 128 and policy.tma_forward_reason(q, hopper) is None


def build(out: Path) -> None:
    from benchmarks.torch_bench import problems
    from benchmarks.probes.tma_forward import build_variants, narrow_grad_inputs_2d

    found = [p for p in problems([]) if _takes_forward_tma(p)]
    found += narrow_grad_inputs_2d(next(p for p in found if p.name == "r50_3x3_s1_dgrad"))
    build_variants(out, found, VARIANTS, _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_swapped.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
