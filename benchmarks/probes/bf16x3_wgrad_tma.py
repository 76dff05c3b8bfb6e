"""Probe: f32 grad_weight in one-pass TF32 (and compute = "bf16x3") on the 16-bit TMA im2col kernel over bf16 hi /
lo operands stacked three times along N (policy.tma_split_grad_weight), against the plan before (the flat-plane
TF32 kernel, or the cp.async kernel rounding its operands to TF32 in registers; bf16x3 on the cp.async kernel)
and cuDNN with TF32 allowed.

    python3 benchmarks/probes/bf16x3_wgrad_tma.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/bf16x3_wgrad_tma.py run P.convk OUT.json   # on an H100/H200

Problems: CK 11's 3D grouped grad_weight in TF32 and in bf16x3, U-Net's 3D one, ResNet-50's 3x3 grad_weights
(batch 64, 64 to 512 channels, and 128 at stride 2) and DeepLab's dilated shape, all f32 with compute = tf32.
Variants: "before" (no bf16 splits on the TMA kernel), "split" (the splits with wgmma's accumulator throughout;
named "bf16x3" in the first run's result file), "split-p<n>" (wgmma's sums added in f32 every n steps, on tiles
whose two accumulators fit: policy.promoted_tiles).  `--exact` (build and run): the same problems in exact f32
(TF32 off on both sides), the splits as bf16x6, against three-pass TF32 on the cp.async kernel ("before").
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("before", "split", "split-p1", "split-p2", "split-p4", "split-p8")


def _compile(job):
    from benchmarks.probes.tma_forward import plan_variant
    from convdsl import policy

    p, variant = job
    if variant == "before":
        return plan_variant(p, variant, tma_split_grad_weight=lambda q, target: None)
    promote = int(variant.split("-p")[1]) if "-p" in variant else 0
    tiles_rule = policy.tma_grad_weight_tiles

    def tiles(q, target):  # promoted: tiles whose two accumulators fit
        return policy.promoted_tiles(tiles_rule(q, target)) if promote else tiles_rule(q, target)

    return plan_variant(p, variant, tma_grad_weight_tiles=tiles, tma_grad_weight_promote=lambda q, t: promote)


def problems(exact: bool = False):
    from benchmarks.torch_bench import problems as suite

    found = {p.name: p for p in suite(["ck11_wgrad_3d_g8_f32", "unet3d_wgrad", "r50_3x3_s1_wgrad",
                                        "deeplab_atrous_dgrad"])}
    ck11 = found["ck11_wgrad_3d_g8_f32_tf32"]
    out = [ck11, ck11.with_(name="ck11_wgrad_3d_g8_f32_bf16x3", compute="bf16x3"),
           found["unet3d_wgrad"].with_(name="unet3d_wgrad_tf32", dtype="f32", compute="tf32")]
    r50 = found["r50_3x3_s1_wgrad"].with_(dtype="f32", compute="tf32")
    out += [r50.with_(name=f"r50_wgrad_c{c}_{size}_s{s}_tf32", in_channels=c, out_channels=c, input=(size, size),
                      stride=(s, s))
            for c, size, s in ((64, 56, 1), (128, 28, 1), (256, 14, 1), (512, 7, 1), (128, 56, 2))]
    out.append(found["deeplab_atrous_dgrad"].with_(name="deeplab_wgrad_tf32", op="grad_weight", dtype="f32",
                                                   compute="tf32"))
    if exact:  # the same in exact f32 (bf16x6), but CK 11's bf16x3 twin
        out = [p.with_(name=p.name.removesuffix("_tf32"), compute=None) for p in out if not p.bf16x3]
    return out


def build(out: Path, exact: bool = False) -> None:
    from convdsl import stream

    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, v) for p in problems(exact) for v in VARIANTS]))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


EXACT = False


def run(bundle: Path, result: Path) -> None:
    import torch

    from benchmarks.probes.tma_forward import timed_rows, write_record

    # cuDNN's one-pass TF32 (PyTorch's default for convolutions); exact f32 (--exact bundles) without it
    torch.backends.cudnn.allow_tf32 = not EXACT
    write_record(result, "python3 benchmarks/probes/bf16x3_wgrad_tma.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    global EXACT
    EXACT = "--exact" in (argv if argv is not None else sys.argv)
    if EXACT and "run" in (argv if argv is not None else sys.argv):
        argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--exact"]
    return probe_main(__doc__, build, run, argv, extra=[("--exact", dict(action="store_true"))])


if __name__ == "__main__":
    sys.exit(main())
