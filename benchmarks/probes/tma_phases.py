"""Probe: strided grad_inputs on the TMA phases kernel (kernels/tma.grad_input_phases_tma) against the cp.async phases
kernel and cuDNN, per tile variant.

    python3 benchmarks/probes/tma_phases.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_phases.py run P.convk OUT.json   # on an H100/H200
    python3 benchmarks/probes/tma_phases.py build P.convk --variants cp.async rule t128x128x64w4s3p2

Variants: "cp.async" (the one-launch phases kernel of igemm.py, its rule's tiles), "rule" (the TMA kernel with the
rule's tiles), tiles t<M>x<N>x<K>w<warps>s<stages> (programs as the shared memory of those tiles allows:
policy.tma_grad_input_phases_programs; with a suffix p<n>, n programs an SM whatever the rule's estimate). Cases:
the suite's strided 16-bit grad_inputs and strided grad_inputs outside it (ResNet-50's later stride-2 layers, a 3D
one, a 4x4 stride-2 one of a U-Net decoder).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SUITE = ["ck17_dgrad_2d_s2", "r50_3x3_s2_dgrad", "w2v2_conv1d_s2_dgrad", "dcgan_4x4_s2_dgrad"]
VARIANTS = ("cp.async", "rule", "t128x128x64w4s4", "t128x64x64w4s4", "t128x256x64w8s3", "t256x64x64w8s4")
# further variants on the command line: --variants rule t128x128x64w4s3p2 ... (p<n>: n programs an SM, forced)


def problems() -> list:
    from benchmarks.torch_bench import problems as suite

    found = [p for p in suite(SUITE) if p.name in SUITE]
    r50 = next(p for p in found if p.name == "r50_3x3_s2_dgrad")
    return found + [
        r50.with_(name="r50_3x3_s2_dgrad_c256_28", in_channels=256, out_channels=256, input=(28, 28)),
        r50.with_(name="r50_3x3_s2_dgrad_c512_14", in_channels=512, out_channels=512, input=(14, 14)),
        r50.with_(name="dgrad3d_s2_c64_32", dims=3, batch=4, in_channels=64, out_channels=128, input=(32, 32, 32),
                  filter=(3, 3, 3), stride=(2, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)),
        r50.with_(name="unet_4x4_s2_dgrad_c128_64", batch=16, in_channels=128, out_channels=256, input=(64, 64),
                  filter=(4, 4), pad_lo=(1, 1), pad_hi=(1, 1)),
    ]


def _compile(job):
    from convdsl import policy
    from convdsl.kernels.compile import compile_tma_launch
    from convdsl.kernels.tma_launches import grad_input_phases_tma_launch
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.stream import StreamKernel, StreamLaunch, planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    hopper = Target("cuda", "sm_90")
    named = p.with_(name=f"{p.name}:{variant}")
    if variant == "cp.async":
        return planned_stream_kernel(named, hopper, Knobs(), compile=True, tma=False)
    reason = policy.tma_grad_input_phases_reason(p, hopper)
    if reason is not None:
        print(f"{p.name}: not on the TMA phases kernel ({reason})", flush=True)
        return None
    label, _, per_sm = variant.partition("p")
    tiles = policy.tma_grad_input_phases_tiles(p) if label == "rule" else parse_tiles(label)
    if p.out_channels % tiles.block_k or (p.groups > 1 and p.in_channels % tiles.block_n):
        return None
    programs = hopper.gpu.sm_count * int(per_sm) if per_sm else policy.tma_grad_input_phases_programs(p, tiles, hopper)
    launch, maps = grad_input_phases_tma_launch(p, tiles, f"k_{variant.replace('.', '_')}", programs)
    binary, maps, kinds = compile_tma_launch(launch, maps, "sm_90")
    return StreamKernel(named, "sm_90", named, (), (StreamLaunch(launch, binary),), (), tiles.label(), "probe",
                        tma_maps=maps, tma_params=kinds)


def build(out: Path, variants: list[str] | None = None) -> None:
    from benchmarks.probes.tma_forward import build_variants

    build_variants(out, problems(), variants or VARIANTS, _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import geomean_ratio, ms_by_case, timed_rows, write_record

    rows = timed_rows(bundle)
    by_case = ms_by_case(rows)
    summary = {v: geomean_ratio(by_case, "cp.async", v) for v in sorted({r["kernel"] for r in rows} - {"cp.async"})}
    print("cp.async time / variant time, geomean:", summary)
    write_record(result, "python3 benchmarks/probes/tma_phases.py run P.convk OUT.json", rows, summary)


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--variants", dict(nargs="+"))])


if __name__ == "__main__":
    sys.exit(main())
