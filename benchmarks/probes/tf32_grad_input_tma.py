"""Probe: one-pass TF32 grad_input with stride 1 as the TMA forward over dY and the weight's K-innermost copy, its
taps read in reverse (policy.tma_stream_launch; kernels/tma.py FLIPPED 2), against the cp.async kernel it replaces
and cuDNN with TF32 allowed.

    python3 benchmarks/probes/tf32_grad_input_tma.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tf32_grad_input_tma.py run P.convk OUT.json   # on an H100/H200

Problems (f32, compute = tf32, NHWGC): the suite's CK 15 3D grad_input, U-Net's 3D one, ResNet-50's 3x3 ones
(batch 64; 64, 128, 256 and 512 channels) and DeepLab's dilated one, the last six outside the suite's TF32 cases.
Kernels: "cp" (the cp.async kernel), "rule", and the TMA forward with 256 x 64 tiles of two warp groups in 3 and 4
stages ("t256x64x32w8s3", "t256x64x32w8s4") where the output has 64 columns.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WIDE_ROWS = ("t256x64x32w8s3", "t256x64x32w8s4")


def _compile(job):
    from benchmarks.probes.tma_forward import plan_variant
    from convdsl.kernels.tiles import parse_tiles

    p, label = job
    if label == "cp":
        return plan_variant(p, label, tma_stream_launch=lambda q, t, k: None)
    if label == "rule":
        return plan_variant(p, label)
    return plan_variant(p, label, tma_forward_tiles=lambda q, t: parse_tiles(label))


def problems():
    from benchmarks.torch_bench import problems as suite

    found = {p.name: p for p in suite(["ck15_dgrad_3d_f32", "unet3d_dgrad", "r50_3x3_s1_dgrad",
                                        "deeplab_atrous_dgrad"])}
    out = [found["ck15_dgrad_3d_f32_tf32"],
           found["unet3d_dgrad"].with_(name="unet3d_dgrad_tf32", dtype="f32", compute="tf32")]
    r50 = found["r50_3x3_s1_dgrad"].with_(dtype="f32", compute="tf32")
    out += [r50.with_(name=f"r50_dgrad_c{c}_{size}_tf32", in_channels=c, out_channels=c, input=(size, size))
            for c, size in ((64, 56), (128, 28), (256, 14), (512, 7))]
    out.append(found["deeplab_atrous_dgrad"].with_(name="deeplab_dgrad_tf32", dtype="f32", compute="tf32"))
    return out


def jobs():
    return [(p, label) for p in problems()
            for label in ("cp", "rule") + (WIDE_ROWS if p.in_channels == 64 else ())]


def build(out: Path) -> None:
    from benchmarks.probes.tma_forward import build_jobs

    build_jobs(out, jobs(), _compile)


def run(bundle: Path, result: Path) -> None:
    import torch

    from benchmarks.probes.tma_forward import timed_rows, write_record

    torch.backends.cudnn.allow_tf32 = True  # cuDNN's one-pass TF32, PyTorch's default for convolutions
    write_record(result, "python3 benchmarks/probes/tf32_grad_input_tma.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
