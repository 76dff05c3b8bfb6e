"""Probe: grad_weight with fp8 compute ([bf8, fp8] as CK 11) on the flat-plane TMA kernel with fp8 wgmma
(kernels/tma.grad_weight_flat_tma over fp8 copies of X and dY) against the f16 cp.async kernel over operands
rounded to the fp8 grid, and cuDNN's f16 convolution.

    python3 benchmarks/probes/fp8_flat.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/fp8_flat.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's CK 11 3D grad_weight with fp8 compute, and shapes outside the suite with the same compute
types: U-Net's 3D grad_weight, ResNet-50's 3x3 stride-1 grad_weights with 128 and 256 channels, DeepLab's
dilated shape (f16, NHWGC).  Variants: "cp.async" (the f16 kernel, operands rounded first), "flat" (the rule:
policy.tma_flat_grad_weight_tiles, _parts and tma_fp8_promote), "flat-p128" (products summed in f32 every 128
positions, one step), "flat-p0" (all summed in wgmma's accumulator), "copy-BxF" (the rule with copy tiles of B
source bytes of channels x F positions; the rule's are 128 x 128).  "flat-s3" (3 stages) and
"flat-r64" (64 positions a step) measured slower (docs/decisions.md#fp8-flat).  `run` checks each against the float64 reference on the rounded operands and times it
and cuDNN's f16 convolution on the same tensors by CUDA-graph replay.
"""
from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SUITE_CASES = ["ck11_wgrad_3d_g8_fp8", "unet3d_wgrad", "deeplab_atrous_dgrad"]
RESNET_STAGES = [(128, 28), (256, 14)]
VARIANTS = ("cp.async", "flat", "flat-p128", "flat-p0", "copy-64x128", "copy-128x256", "copy-32x256")
COMPUTE = ("bf8", "fp8")


def problems() -> list:
    from benchmarks.torch_bench import problems as suite_problems

    out = []
    for p in suite_problems(SUITE_CASES):
        if p.op == "forward":
            continue
        out.append(p.with_(op="grad_weight", dtype="f16", compute=COMPUTE, out_dtype=None, split_k=None,
                           epilogue=type(p.epilogue)(),
                           name=f"{p.name.removesuffix('_dgrad').removesuffix('_fp8')}_fp8"))
    base = out[0]
    for channels, size in RESNET_STAGES:
        out.append(base.with_(dims=2, groups=1, batch=64, in_channels=channels, out_channels=channels,
                              input=(size, size), filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1),
                              pad_hi=(1, 1), layout="NHWGC", weight_layout="GKYXC",
                              name=f"r50_wgrad_c{channels}_{size}x{size}_fp8"))
    return out


def _compile(job):
    from convdsl import policy
    from convdsl.kernels import elementwise_launches
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    target = Target("cuda", "sm_90")
    rule_promote = policy.tma_fp8_promote

    def promote(q, t):
        return int(variant[6:]) if variant.startswith("flat-p") else rule_promote(q, t)

    with ExitStack() as patches:
        if variant.startswith("copy-"):  # the copies' tiles: source bytes of channels x positions
            row_bytes, positions = (int(v) for v in variant[5:].split("x"))
            patches.enter_context(mock.patch.object(elementwise_launches, "PAD_PLANES_ROW_BYTES", row_bytes))
            patches.enter_context(mock.patch.object(elementwise_launches, "PAD_PLANES_POSITIONS", positions))
        patches.enter_context(policy.overrides(tma_fp8_promote=promote))
        if variant != "cp.async" and policy.tma_flat_grad_weight_reason(p, target) is not None:
            return None
        return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), target, Knobs(), compile=True,
                                  tma=variant != "cp.async")


def build(out: Path) -> None:
    from convdsl import stream

    jobs = [(p, v) for p in problems() for v in VARIANTS]
    with ProcessPoolExecutor(2) as pool:
        kernels = [k for k in pool.map(_compile, jobs) if k is not None]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import geomean_ratio, ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle)
    by_case = ms_by_case(rows)
    cudnn = {r["case"]: r["cudnn_ms"] for r in rows}
    errors = {(r["case"], r["kernel"]): r["error_vs_reference"] for r in rows}
    summary = {case: {**{v: [round(ms, 4), f"{errors[case, v]:.1e}"] for v, ms in t.items()},
                      "cudnn_f16": cudnn[case]} for case, t in by_case.items()}
    summary["geomean_cp.async_over_flat"] = geomean_ratio(by_case, "cp.async", "flat")
    print(json.dumps(summary, indent=1))
    write_record(result, "python3 benchmarks/probes/fp8_flat.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
