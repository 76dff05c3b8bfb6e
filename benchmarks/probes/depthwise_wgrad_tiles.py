"""Probe: tiles of the depthwise grad_weight kernels (kernels/igemm.grad_weight_depthwise_rows and
grad_weight_depthwise) over a sweep, against the rule's (policy.depthwise_grad_weight_tiles) and cuDNN.

    python3 benchmarks/probes/depthwise_wgrad_tiles.py build P.convk      # where Triton is (no GPU needed)
    python3 benchmarks/probes/depthwise_wgrad_tiles.py run P.convk OUT.json   # on a CUDA GPU

Problems: the suite's MobileNetV2 3x3 and ConvNeXt 7x7 depthwise grad_weights, and MobileNetV2's other depthwise
layers (batch 64, f16, NHWGC).  Candidates: positions per chunk (block_m) 4, 8, 16; channels per program
(block_n) 16, 32, 64; 1 or 2 warps; and the rule's tiles with half and twice its chunks of rows.
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LABELS = ["rule", "half", "twice"] + [f"t{m}x{n}x1w{w}s1" for m in (4, 8, 16) for n in (16, 32, 64) for w in (1, 2)]


def _compile(job):
    from dataclasses import replace

    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, label = job
    target = Target("cuda", "sm_90")
    tiles = None
    if label in ("half", "twice"):
        rule = policy.depthwise_grad_weight_tiles(p)
        parts = policy.depthwise_grad_weight_parts(p, rule, target)
        tiles = replace(rule, split=max(1, parts // 2 if label == "half" else parts * 2)).label()
    elif label != "rule":
        tiles = label
    return planned_stream_kernel(p.with_(name=f"{p.name}:{label}"), target, Knobs(tiles=tiles), compile=True)


def problems():
    from benchmarks.torch_bench import problems as suite

    found = {p.name: p for p in suite(["mbv2_dw_wgrad", "convnext_dw7_wgrad"]) if p.op == "grad_weight"}
    out = list(found.values())
    mbv2 = found["mbv2_dw_wgrad"]
    out += [mbv2.with_(name=f"mbv2_dw_wgrad_c{c}_{size}", groups=c, input=(size, size))
            for c, size in ((96, 112), (192, 28), (384, 14), (960, 7))]
    return out


def build(out: Path) -> None:
    from convdsl import stream

    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, t) for p in problems() for t in LABELS]))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/depthwise_wgrad_tiles.py run P.convk OUT.json",
                 timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
