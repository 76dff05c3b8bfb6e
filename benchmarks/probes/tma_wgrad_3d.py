"""Probe: 3D 16-bit grad_weight on the TMA im2col grad_weight kernel (kernels/tma.grad_weight_tma, which the rule
keeps to 1D/2D) against the cp.async kernel and cuDNN, per tile variant.

    python3 benchmarks/probes/tma_wgrad_3d.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_wgrad_3d.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's CK 11 3D grouped grad_weight (f16) and U-Net's 3D grad_weight (bf16).  Variants:
"cp.async" (the rule before), "tma" (policy.tma_grad_weight_tiles as it was: 4 warps, 4 stages, 64 positions),
"tma-w8" (8 warps), "tma-w8s3", "tma-r128s3" (128 positions a step, 3 stages), "tma-w8s2r128", "tma-r128s4",
"tma-w8r128s3", and "tma-bytes" (16 KB of dY a step: 64 positions of a 128-wide tile with 8 warps, 128 of a
64-wide one with 4; 3 stages).  `--from BUNDLE` adds the bundle's grad_weights that take the TMA kernel (ResNet-50's
2D 3x3 ones from examples/train_resnet.py --bundle-out).
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["ck11_wgrad_3d_g8_f16", "unet3d_wgrad"]
VARIANTS = ("cp.async", "tma", "tma-w8", "tma-w8s3", "tma-r128s3", "tma-w8s2r128", "tma-r128s4", "tma-w8r128s3",
            "tma-bytes")


def _compile(job):
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rule_reason, rule_tiles = policy.tma_grad_weight_reason, policy.tma_grad_weight_tiles

    def reason(q, target):  # 3D too
        r = rule_reason(q, target)
        return None if r is not None and r.startswith("3D") else r

    def tiles(q, target):
        t = rule_tiles(q, target)
        if variant == "tma-bytes":  # a step of 16 KB of dY: 64 positions of a 128-wide tile, 128 of a 64-wide one
            wide = t.block_m * t.block_n >= 128 * 128
            return replace(t, block_k=8192 // max(t.block_m, t.block_n), warps=8 if wide else 4, stages=3)
        t = replace(t, warps=8) if "w8" in variant else t
        t = replace(t, block_k=128) if "r128" in variant else t
        for stages in (2, 3, 4):
            t = replace(t, stages=stages) if f"s{stages}" in variant else t
        return t

    with policy.overrides(tma_grad_weight_reason=reason, tma_grad_weight_tiles=tiles):
        return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), Target("cuda", "sm_90"), Knobs(),
                                  compile=True, tma=variant != "cp.async")


def build(out: Path, source: Path | None = None) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import policy, stream
    from convdsl.targets import Target

    found = [p for p in problems(CASES) if p.name in CASES]
    hopper = Target("cuda", "sm_90")
    for k in stream.load_bundle(source) if source else ():  # the bundle's 2D grad_weights on the TMA kernel
        q = k.problem
        if q.op == "grad_weight" and policy.tma_grad_weight_reason(q, hopper) is None:
            found.append(q.with_(name=f"r50_wgrad_c{q.in_channels}_k{q.out_channels}_{q.input[0]}_s{q.stride[0]}"))
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, v) for p in found for v in VARIANTS]))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_wgrad_3d.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--from", dict(type=Path, dest="source"))])


if __name__ == "__main__":
    sys.exit(main())
