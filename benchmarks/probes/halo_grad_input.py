"""Probe: 16-bit stride-1 3D grad_input on the halo kernel (kernels/halo.py: each dY plane copied once into shared
memory per row tile, every tap's operand gathered from it) against the TMA im2col kernel it replaces and cuDNN.

    python3 benchmarks/probes/halo_grad_input.py build P.convk [--labels halo ...]   # where Triton 3.9 is
    python3 benchmarks/probes/halo_grad_input.py run P.convk OUT.json   # on an H100/H200

Problems (NDHWGC, bf16): the suite's U-Net grad_input and 3D layers outside the suite: U-Net's level 2 at batch 4,
its level 1 (32 channels, 128^3), a video layer (batch 8, 16 x 56 x 56, 64 channels), 64 -> 32 channels, and
U-Net's level 2 as a forward.
Kernels: "tma" (the TMA im2col forward, the rule before), "halo" (the rule), "halo-s<n>b<m>" (n plane ranges, m weight
stages), "halo-whole" (the next window copied at once, not a part with each tap).
"""
from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("halo-whole", "halo-b4")


def _compile(job):
    from benchmarks.probes.tma_forward import plan_variant
    from convdsl import policy
    from convdsl.kernels.tma_launches import forward_halo_launch

    p, label = job
    if label == "tma":
        return plan_variant(p, label, halo_forward_reason=lambda q, t: "off")
    if label == "halo-whole":  # the next window copied at once
        return plan_variant(p, label, forward_halo_launch=lambda *a, **k: forward_halo_launch(*a, **k, spread=False))
    if label.startswith("halo-"):  # halo-s<split>b<weight stages>, either part optional
        match = re.fullmatch(r"halo-(?:s(\d+))?(?:b(\d+))?", label)
        split, stages = (int(v) if v else None for v in match.groups())
        rule_split, rule_tiles = policy.halo_forward_split, policy.halo_tiles
        return plan_variant(p, label, halo_forward_split=lambda q, t: split or rule_split(q, t),
                            halo_tiles=lambda q: replace(rule_tiles(q), stages=stages or rule_tiles(q).stages),
                            HALO_SHARED_BYTES=227 * 1024)
    return plan_variant(p, label)


def problems():
    from benchmarks.torch_bench import problems as suite

    unet = {p.name: p for p in suite(["unet3d_dgrad"])}["unet3d_dgrad"]
    return [unet,
            unet.with_(name="unet_l2_n4", batch=4),
            unet.with_(name="unet_l1_c32", batch=1, in_channels=32, out_channels=32, input=(128, 128, 128)),
            unet.with_(name="video_c64", batch=8, input=(16, 56, 56)),
            unet.with_(name="dgrad3d_k64_c32", batch=4, in_channels=32, input=(32, 32, 32)),
            unet.with_(name="unet_forward", op="forward")]


def jobs(labels=None):
    return [(p, label) for p in problems() for label in labels or ("tma", "halo") + VARIANTS]


def build(out: Path, labels=None) -> None:
    from benchmarks.probes.tma_forward import build_jobs

    build_jobs(out, jobs(labels), _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/halo_grad_input.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--labels", dict(nargs="*"))])


if __name__ == "__main__":
    sys.exit(main())
