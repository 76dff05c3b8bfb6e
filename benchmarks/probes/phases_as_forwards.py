"""Probe: would the stride phases of a strided grad_input run faster as stride-1 forwards over dY on the TMA forward
kernel (kernels/tma.forward_tma) than on the one-launch phases kernel (igemm.grad_input_phases)?

    python3 benchmarks/probes/phases_as_forwards.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/phases_as_forwards.py run P.convk OUT.json   # on an H100/H200

A stride-2 3x3 grad_input has four phases (docs/algebra.md): 2x2, 1x2, 2x1 and 1x1 taps of the weight over dY, each
writing every second row and column of dX.  Each phase is timed here as a forward over dY into a contiguous output,
which is a lower bound on such a path (it leaves out the strided stores and the launches between phases); the
1x1 phase takes the cp.async kernel (the TMA kernel does not take one tap).  Cases: CK 17's grad_input and
ResNet-50's stride-2 one (whose 2-tap phases, as many positions as dY, are padded by one on both sides here:
PyTorch's convolution takes one padding per dimension), each beside the grad_input itself ("gradinput").
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name: (batch, dY channels, dX channels, dY size, positions of the 2-tap phases), per suite case
SHAPES = {"ck17_dgrad_2d_s2": (128, 256, 128, 36, 35), "r50_3x3_s2_dgrad": (64, 128, 128, 28, 28)}
TILES = ("rule", "t128x128x64w8s4", "t256x128x64w8s3")


def jobs() -> list:
    from benchmarks.torch_bench import problems

    suite = {p.name: p for p in problems(list(SHAPES))}
    out = []
    for case, (n, k, c, o, q) in SHAPES.items():
        base = suite[case]
        out.append((base.with_(name=f"{case}_gradinput"), "cp.async"))
        for fy, fx in ((2, 2), (1, 2), (2, 1), (1, 1)):
            hy, hx = (1 if q == o and fy == 2 else 0), (1 if q == o and fx == 2 else 0)
            p = base.with_(op="forward", name=f"{case}_phase{fy}x{fx}", batch=n, in_channels=k, out_channels=c,
                           input=(o, o), filter=(fy, fx), stride=(1, 1), dilation=(1, 1), pad_lo=(hy, hx),
                           pad_hi=(hy, hx), split_k=None, out_dtype=None)
            out += [(p, "cp.async")] if fy * fx == 1 else [(p, t) for t in TILES]
    return out


def build(out: Path) -> None:
    from benchmarks.probes.tma_forward import _compile, build_jobs

    build_jobs(out, jobs(), _compile)


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/phases_as_forwards.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
