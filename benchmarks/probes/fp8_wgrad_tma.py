"""Probe: fp8-compute grad_weight on the 16-bit TMA im2col kernel over X and dY rounded to their fp8 grids in f16
copies (policy.tma_stream_launch), against the flat-plane kernel on fp8 wgmma (docs/decisions.md#fp8-flat) or,
where that does not apply, the cp.async kernel over the same rounded operands, and against cuDNN's 16-bit
grad_weight.

    python3 benchmarks/probes/fp8_wgrad_tma.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/fp8_wgrad_tma.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's CK 11 3D grouped grad_weight in [bf8, fp8] compute, and ResNet-50's 3x3 grad_weights (batch
64, 64 to 512 channels) and U-Net's 3D one (64 channels) in the same compute.  Variants: "before" (the plan
before: no fp8 on the TMA im2col kernel), "tma16" (the plan now).
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("before", "tma16")


def _compile(job):
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rule = policy.tma_grad_weight_reason

    def before(q, target):
        return "fp8 compute: not on the TMA im2col kernel" if q.fp8_compute else rule(q, target)

    named = p.with_(name=f"{p.name}:{variant}")
    if variant == "before":
        with policy.overrides(tma_grad_weight_reason=before):
            return planned_stream_kernel(named, Target("cuda", "sm_90"), Knobs(), compile=True)
    return planned_stream_kernel(named, Target("cuda", "sm_90"), Knobs(), compile=True)


def build(out: Path) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import stream

    found = [p for p in problems(["ck11_wgrad_3d_g8_fp8", "r50_3x3_s1_wgrad", "unet3d_wgrad"])
             if p.op == "grad_weight" and p.name in ("ck11_wgrad_3d_g8_fp8", "r50_3x3_s1_wgrad", "unet3d_wgrad")]
    compute = ("bf8", "fp8")
    r50 = next(p for p in found if p.name == "r50_3x3_s1_wgrad")
    unet = next(p for p in found if p.name == "unet3d_wgrad")
    found = [next(p for p in found if p.name == "ck11_wgrad_3d_g8_fp8"),
             unet.with_(name="unet3d_wgrad_fp8", compute=compute)]
    found += [r50.with_(name=f"r50_wgrad_c{c}_{size}_fp8", in_channels=c, out_channels=c, input=(size, size),
                        compute=compute)
              for c, size in ((64, 56), (128, 28), (256, 14), (512, 7))]
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, v) for p in found for v in VARIANTS]))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/fp8_wgrad_tma.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
