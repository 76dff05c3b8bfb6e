"""Probe: ResNet-50's stem forward (C = 3, K = 64, 7x7 stride 2, 224x224, N = 64, f16) as a stride-1 convolution
after space-to-depth: X padded by 3 and regrouped 2x2 -> 115x115 with 12 channels (here padded to 16), the filter
padded to 8x8 and regrouped to 4x4 with 16 channels, output 112x112 as before.  Times the GEMM of that
convolution (not the copies) on the TMA forward kernel and the cp.async kernel, against cuDNN on the same
transformed problem and on the stem itself.

    python3 benchmarks/probes/stem_s2d.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/stem_s2d.py run P.convk OUT.json   # on an H100/H200
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LABELS = ["cp.async", "rule", "t128x64x16w4s6", "t64x64x16w4s6", "t128x64x32w4s4", "t128x64x64w4s4"]


def problems() -> list:
    from benchmarks.torch_bench import problems as suite_problems

    (stem,) = [p for p in suite_problems(["r50_stem_wgrad"]) if p.op == "forward"]
    s2d = stem.with_(in_channels=16, input=(115, 115), filter=(4, 4), stride=(1, 1), pad_lo=(0, 0),
                     pad_hi=(0, 0), name="stem_s2d_c16")
    return [stem, s2d, s2d.with_(in_channels=12, name="stem_s2d_c12")]


def build(out: Path) -> None:
    from benchmarks.probes.tma_forward import _compile
    from convdsl import stream

    jobs = [(p, label) for p in problems() for label in LABELS
            if label == "cp.async" or p.in_channels % 16 == 0 and p.in_channels % int(label.split("x")[2][:2] if
                                                                                      label != "rule" else 16) == 0]
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, jobs))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/stem_s2d.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
