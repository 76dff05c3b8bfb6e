"""Probe: depthwise grad_weight on rows flattened with their channels (kernels/igemm.grad_weight_depthwise_flat)
against the kernel sliding along rows with a block of channels (grad_weight_depthwise_rows, the rule before) and
cuDNN.

    python3 benchmarks/probes/depthwise_flat.py build P.convk      # where Triton is (no GPU needed)
    python3 benchmarks/probes/depthwise_flat.py run P.convk OUT.json   # on a CUDA GPU

Problems (batch 64, f16, NHWGC, 3x3, stride 1): the suite's MobileNetV2 grad_weight, MobileNetV2's other stride-1
depthwise layers and EfficientNet-B0's (240 channels at 28x28, 672 at 14x14), which no rule was tuned on; and
ConvNeXt's 7x7, which the flat kernel does not take (the rule's kernel only).  Kernels: "rule"
(policy.depthwise_grad_weight_tiles), "rows" (the sliding kernel with the tiles it had before), the flat kernel
with 2, 4 and 8 warps, and the rule's tiles with half and twice its programs ("half", "twice").
"""
from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FLAT_LABELS = ["rows", "t1x512x1w2s1", "t1x1024x1w4s1", "t1x2048x1w8s1", "t1x512x1w2s2", "t1x1024x1w4s2",
               "t1x2048x1w8s2", "t1x256x1w1s2", "t1x1024x1w4s2k1000", "t1x1024x1w4s2k2000"]


def _compile(job):
    from dataclasses import replace

    from convdsl import policy
    from convdsl.stream import plan_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, label = job
    target = Target("cuda", "sm_90")
    tiles = None
    if label == "rows":
        tiles = "t8x32x1w1s1"  # the sliding kernel's tiles for 3x3 filters (every tap in a thread)
    elif label in ("half", "twice"):
        rule = policy.depthwise_grad_weight_tiles(p)
        parts = policy.depthwise_grad_weight_parts(p, rule, target)
        tiles = replace(rule, split=max(1, parts // 2 if label == "half" else parts * 2)).label()
    elif label != "rule":
        tiles = label
    return plan_stream_kernel(p.with_(name=f"{p.name}:{label}"), target, Knobs(tiles=tiles), compile=True)


def problems():
    from benchmarks.torch_bench import problems as suite

    found = {p.name: p for p in suite(["mbv2_dw_wgrad", "convnext_dw7_wgrad"]) if p.op == "grad_weight"}
    mbv2 = found["mbv2_dw_wgrad"]
    return [mbv2] + [mbv2.with_(name=f"{net}_dw_wgrad_c{c}_{size}", groups=c, input=(size, size))
                     for net, c, size in (("mbv2", 96, 112), ("mbv2", 192, 28), ("mbv2", 384, 14), ("mbv2", 960, 7),
                                          ("effnet", 240, 28), ("effnet", 672, 14))] + [found["convnext_dw7_wgrad"]]


def jobs():
    from convdsl import policy

    from convdsl.kernels.tiles import parse_tiles

    def fits(p, label):  # a flat slab holds at least one position's channels
        return not label.startswith("t1x") or parse_tiles(label).block_n >= p.groups

    return [(p, label) for p in problems()
            for label in ["rule"] + (FLAT_LABELS if policy.flat_depthwise_rows(p) else []) if fits(p, label)]


def build(out: Path) -> None:
    from convdsl import stream

    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, jobs()))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/depthwise_flat.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv)


if __name__ == "__main__":
    sys.exit(main())
