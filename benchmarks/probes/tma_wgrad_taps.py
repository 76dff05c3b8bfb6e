"""Probe: 16-bit grad_weight tiles that span filter taps where C is 64 (kernels/tma.grad_weight_tma: a tile wider
than C takes BLOCK_N / C taps, one im2col box each, all multiplied by the same dY box), against the rule's 64 x 64
tiles and cuDNN.

    python3 benchmarks/probes/tma_wgrad_taps.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_wgrad_taps.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's U-Net 3D grad_weight (64 channels), ResNet-50's 64-channel 3x3 grad_weight at 56 x 56 and a
3D 64-channel one at 32^3 (batch 4, outside the suite).  Variants: "rule", and tiles of 64 rows by 128 columns (two
taps) with 64 or 128 positions a step.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("rule", "t64x128x128w4s3", "t64x128x64w4s4", "t64x128x128w4s4")


def _compile(job):
    from benchmarks.probes.tma_forward import plan_variant
    from convdsl.kernels.tiles import parse_tiles

    p, label = job
    if label == "rule":
        return plan_variant(p, label)
    return plan_variant(p, label, tma_grad_weight_tiles=lambda q, t: parse_tiles(label))


def problems():
    from benchmarks.torch_bench import problems as suite

    found = {p.name: p for p in suite(["unet3d_wgrad", "r50_3x3_s1_wgrad"]) if p.op == "grad_weight"}
    unet = found["unet3d_wgrad"]
    r50 = found["r50_3x3_s1_wgrad"]
    return [unet, r50.with_(name="r50_wgrad_c64_56", in_channels=64, out_channels=64, input=(56, 56)),
            unet.with_(name="wgrad3d_c64_32", batch=4, input=(32, 32, 32))]


def build(out: Path) -> None:
    from benchmarks.probes.tma_forward import build_jobs

    build_jobs(out, [(p, v) for p in problems() for v in VARIANTS], _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_wgrad_taps.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
