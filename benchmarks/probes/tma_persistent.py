"""Probe: the TMA forward kernel (kernels/tma.forward_tma: forwards, and stride-1 grad_inputs run as forwards of dY)
persistent (kernels/tma.forward_tma_persistent: a grid of one or two programs per SM, each taking tiles in turn,
the copies of its next tile in flight while a tile's last products finish and its result is stored), against the
rule's one program per tile and against cuDNN.

    python3 benchmarks/probes/tma_persistent.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_persistent.py run P.convk OUT.json   # on an H100/H200

Why: a program per tile fills its ring of copies from empty and drains it before storing its result; with tens
of waves of short tiles (U-Net's 3D grad_input: 27 steps of 64 channels a tile) that fill and drain is paid once a
tile.  cuDNN's Hopper kernels are persistent.
Problems: the suite's kernels on the TMA forward kernel (forwards and stride-1 grad_inputs, every compute type)
and ResNet-50's stride-1 3x3 grad_input at other sizes.  Variants: "rule" (policy.tma_forward_tiles, one program
per tile), "p<n>" (the rule's tiles, n programs per SM of an H100's 132).

    python3 benchmarks/probes/tma_persistent.py build P.convk --tiles t128x64x32w4s8 ...

builds instead, for the problems on 64-column tiles, the rule as it is ("now") against those tiles, persistent as
the rule says (policy.tma_forward_programs).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("rule", "p1", "p2", "p4", "p8")
SMS = 132


def _compile(job):
    from convdsl import policy
    from convdsl.kernels import tma_launches
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rules: dict[str, object] = {}
    if variant.startswith("t"):  # these tiles, persistent as the rule says
        forced = parse_tiles(variant)
        rules["tma_forward_tiles"] = lambda q, target: forced
    elif variant != "now":
        programs = SMS * int(variant[1:]) if variant.startswith("p") else 0
        # in place of the rule's programs (policy.tma_forward_programs)
        rules["forward_tma_launch"] = lambda *args, **kw: (
            tma_launches.forward_tma_launch(*args, **{**kw, "programs": programs}))
    with policy.overrides(**rules):
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
    if p.op == "forward":
        return policy.tma_forward_reason(p, hopper) is None
    # stride-1 grad_inputs as forwards: 16-bit only (policy.tma_stream_launch)
    q = policy.grad_input_as_forward(p)
    return q is not None and p.dtype in ("f16", "bf16") and not p.fp8_compute \
        and policy.tma_forward_reason(q, hopper) is None


def build(out: Path, tiles: list[str] | None = None) -> None:
    from benchmarks.torch_bench import problems
    from benchmarks.probes.tma_forward import build_variants, narrow_grad_inputs_2d
    from convdsl import policy
    from convdsl.targets import Target

    found = [p for p in problems([]) if _takes_forward_tma(p)]
    found += narrow_grad_inputs_2d(next(p for p in found if p.name == "r50_3x3_s1_dgrad"))
    # 3D shapes outside the suite: a 128-channel forward and grad_input, and a grouped forward with fewer groups
    by_name = {p.name: p for p in found}
    found += [by_name["ck15_dgrad_3d_f16_fwd"].with_(name="fwd3d_c128_k128_16_n16", batch=16, in_channels=128,
                                                      out_channels=128, input=(16, 16, 16)),
              by_name["ck15_dgrad_3d_f16"].with_(name="dgrad3d_c128_k128_24_n4", batch=4, in_channels=128,
                                                  out_channels=128, input=(24, 24, 24)),
              by_name["ck11_wgrad_3d_g8_f16_fwd"].with_(name="fwd3d_g4_n32", batch=32, groups=4)]
    variants = VARIANTS
    if tiles:  # the rule now against other tiles, persistent as the rule says, where the rule takes 64 columns
        variants = ("now", *tiles)
        found = [p for p in found if policy.tma_forward_tiles(
            p if p.op == "forward" else policy.grad_input_as_forward(p), Target("cuda", "sm_90")).block_n == 64]
    build_variants(out, found, variants, _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_persistent.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--tiles", dict(nargs="+"))])


if __name__ == "__main__":
    sys.exit(main())
