"""Probe: the TMA forward kernel on narrow outputs (64 columns) per tile candidate: the 16-bit stride-1 grad_inputs
of the suite whose C is 64 (CK 15's 3D and U-Net's 3D, run as forwards of dY over the flipped weight), and the
forwards of the same shapes, against cuDNN.

    python3 benchmarks/probes/tma_narrow.py build P.convk        # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_narrow.py run P.convk OUT.json     # on an H100/H200

Candidates: "rule" (policy.tma_forward_tiles: 128 x 64, 64 channels a step, 4 warps, 4 stages), two warp groups
of 128 rows each (256 x 64, 8 warps, 3 and 4 stages), deeper rings (6 stages), 128 channels a step (3 stages),
and 64 x 64 tiles (twice the programs, 6 stages); a candidate the kernel cannot take is left out.
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["ck15_dgrad_3d_f16", "unet3d_dgrad"]
TILES = ["rule", "t256x64x64w8s4", "t256x64x64w8s3", "t128x64x64w4s6", "t128x64x128w4s3", "t64x64x64w4s6"]


def _compile(job):
    from convdsl import policy
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, label = job
    rule = policy.tma_forward_tiles
    forced = None if label == "rule" else parse_tiles(label)
    with policy.overrides(tma_forward_tiles=lambda q, target: forced or rule(q, target)):
        return planned_stream_kernel(p.with_(name=f"{p.name}:{label}"), Target("cuda", "sm_90"), Knobs(),
                                  compile=True)


def build(out: Path) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import stream

    found = [p for p in problems(CASES) if p.name in CASES]
    found += [p.with_(op="forward", in_channels=p.out_channels, out_channels=p.in_channels, name=f"{p.name}_fwd64")
              for p in list(found)]
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, t) for p in found for t in TILES]))
    # a candidate the TMA kernel cannot take (128 channels a step over 64) falls back to cp.async: left out
    kernels = [k for k in kernels if "forward_tma" in k.describe()]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_narrow.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
