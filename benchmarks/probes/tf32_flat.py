"""Probe: f32 grad_weight in one-pass TF32 on the flat-plane TMA kernel (kernels/tma.grad_weight_flat_tma, with
its copies of X and dY) against the cp.async kernel that rounds its operands in registers, and cuDNN with TF32.

    python3 benchmarks/probes/tf32_flat.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tf32_flat.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's CK 11 3D grad_weight (TF32 twin), U-Net's 3D grad_weight and DeepLab's dilated shape in
f32, and ResNet-50's 3x3 stride-1 grad_weights in f32 at batch 64 (NHWGC).  Variants: "staged" (the cp.async
kernel, policy.tf32_staged), "flat" (the rule: policy.tma_flat_grad_weight_tiles and _parts), "flat-r64s3" and
"flat-r64s2" (64 positions a step, 3 or 2 stages), "flat-s3" (3 stages).  `run` calls
each through the stream runner, checks it against cuDNN on the same tensors and times both by CUDA-graph replay.
"""
from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SUITE_CASES = ["ck11_wgrad_3d_g8_f32", "unet3d_wgrad", "deeplab_atrous_dgrad"]
RESNET_STAGES = [(64, 56), (128, 28), (256, 14), (512, 7)]
VARIANTS = ("staged", "flat", "flat-r64s3", "flat-r64s2", "flat-s3")


def problems() -> list:
    from benchmarks.torch_bench import problems as suite_problems

    out = []
    for p in suite_problems(SUITE_CASES):
        if p.op == "forward" or p.name.endswith("_tf32"):
            continue
        out.append(p.with_(op="grad_weight", dtype="f32", compute="tf32", out_dtype=None, split_k=None,
                           epilogue=type(p.epilogue)(), name=f"{p.name.removesuffix('_dgrad').removesuffix('_f32')}_f32_tf32"))
    base = out[0]
    for channels, size in RESNET_STAGES:
        out.append(base.with_(dims=2, groups=1, batch=64, in_channels=channels, out_channels=channels,
                              input=(size, size), filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1),
                              pad_hi=(1, 1), layout="NHWGC", weight_layout="GKYXC",
                              name=f"r50_wgrad_c{channels}_{size}x{size}_f32_tf32"))
    seen, unique = set(), []
    for p in out:
        key = repr(p.with_(name="").record())
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def _compile(job):
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    target = Target("cuda", "sm_90")
    rule_tiles, rule_parts = policy.tma_flat_grad_weight_tiles, policy.tma_flat_grad_weight_parts

    def tiles(q):
        t = rule_tiles(q)
        t = replace(t, block_k=64) if "r64" in variant else t
        return replace(t, stages=int(variant[-1])) if variant[-2] == "s" else t

    def parts(q, t, tgt):
        s = rule_parts(q, t, tgt)
        return max(1, s // 2) if variant.endswith("S/2") else s

    with policy.overrides(tma_flat_grad_weight_tiles=tiles, tma_flat_grad_weight_parts=parts):
        named = p.with_(name=f"{p.name}:{variant}")
        if variant != "staged" and policy.tma_flat_grad_weight_reason(p, target) is not None:
            return None
        k = planned_stream_kernel(named, target, Knobs(), compile=True, tma=variant != "staged")
    return k


def build(out: Path) -> None:
    from convdsl import stream

    jobs = [(p, v) for p in problems() for v in VARIANTS]
    with ProcessPoolExecutor(2) as pool:
        kernels = [k for k in pool.map(_compile, jobs) if k is not None]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    import torch

    from benchmarks.probes.tma_forward import geomean_ratio, ms_by_case, timed_rows, write_record

    torch.backends.cudnn.allow_tf32 = True  # cuDNN's one-pass TF32, PyTorch's default for convolutions
    rows = timed_rows(bundle)
    by_case = ms_by_case(rows)
    cudnn = {r["case"]: r["cudnn_ms"] for r in rows}
    summary = {case: {**{v: round(ms, 4) for v, ms in t.items()}, "cudnn": cudnn[case]}
               for case, t in by_case.items()}
    summary["geomean_staged_over_flat"] = geomean_ratio(by_case, "staged", "flat")
    print(json.dumps(summary, indent=1))
    write_record(result, "python3 benchmarks/probes/tf32_flat.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
