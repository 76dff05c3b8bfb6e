"""Probe: 16-bit grad_weight on the TMA im2col kernel (kernels/tma.grad_weight_tma) with 256-column tiles, which
span two taps where C = 128 (four where C = 64) and share each dY box among them, against the rule's tiles and
cuDNN.

    python3 benchmarks/probes/tma_wgrad_wide.py build P.convk      # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_wgrad_wide.py run P.convk OUT.json   # on an H100/H200

Problems: the suite's grad_weights that take the TMA kernel (CK 11's 3D grouped, U-Net's 3D, ResNet-50's 3x3
ones, wav2vec2's 1D), ResNet-50's 3x3 grad_weights at 128, 256 and 512 channels, and a 3D 256-channel one outside
the suite.  Variants: "rule" (policy.tma_grad_weight_tiles as it was before 256-column tiles), "n256s3" (256
columns, 3 stages; two warp groups where the tile has 128 rows), "n256s4", "n256r32s4" (32 positions a step, 4
stages), "n256s3k-rule" (the split-K chunks S that the rule's tiles take, instead of the estimate's for the wider
tile); "ws-..." the same tiles on the warp-specialised kernel (a copy warp of its own), "ws-n128s6" 128 x 128 tiles
of two warp groups in 6 stages; "new": the policy as it is.  `--variants` picks some; `--extra` adds 3D shapes of
128 to 512 channels, a 1D 256-channel one with 5 taps and ResNet-50's 512-channel 3x3 at 14x14, batch 128.
"""
from __future__ import annotations

import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["ck11_wgrad_3d_g8_f16", "unet3d_wgrad", "r50_3x3_s1_wgrad", "r50_3x3_s2_wgrad", "w2v2_conv1d_s2_wgrad"]
VARIANTS = ("rule", "n256s3", "ws-rule", "ws-n256s3", "ws-n256s4", "ws-n128s4", "ws-n128s6")
EXTRA = False


def _extra_problems(base):
    # ResNet-50's stride-1 3x3 grad_weights past the first stage (batch 64), and a dense 3D one outside the suite
    for c, size in ((128, 28), (256, 14), (512, 7)):
        yield base.with_(name=f"r50_wgrad_c{c}_{size}", in_channels=c, out_channels=c, input=(size, size))
    vol = base.with_(name="vol256_wgrad_3d", dims=3, batch=8, in_channels=256, out_channels=256, input=(16, 16, 16),
                     filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1))
    yield vol
    if EXTRA:  # further shapes outside the suite (`--extra`)
        yield vol.with_(name="vol128_wgrad_3d", in_channels=128, out_channels=128, input=(32, 32, 32))
        yield vol.with_(name="vol128_256_wgrad_3d", in_channels=128, out_channels=256, input=(16, 32, 32))
        yield vol.with_(name="vol512_wgrad_3d", batch=4, in_channels=512, out_channels=512, input=(8, 16, 16))
        yield base.with_(name="seq256_wgrad_1d", dims=1, batch=32, in_channels=256, out_channels=256, input=(2000,),
                         filter=(5,), stride=(1,), dilation=(1,), pad_lo=(2,), pad_hi=(2,))
        yield base.with_(name="r50_wgrad_c512_14", batch=128, in_channels=512, out_channels=512, input=(14, 14))


def _tiles(variant, rule_tiles, q, target):
    # "rule": the rule before 256-column tiles; n256 / n128: that many columns (two warp groups where the tile
    # has 128 rows), 3 stages unless s<N> says; r32: 32 positions a step
    t = rule_tiles(q, target)
    if t.block_m == 128 and t.block_n >= 128:  # the rule before: 3D two warp groups in 3 stages, else one in 4
        t = replace(t, block_n=128, warps=8, stages=3) if q.dims == 3 else replace(t, block_n=128, warps=4, stages=4)
    for columns in (128, 256):
        if f"n{columns}" in variant:
            t = replace(t, block_n=columns, warps=8 if t.block_m == 128 else 4, stages=3, block_k=64)
    stages = re.search(r"s(\d)", variant)
    t = replace(t, stages=int(stages.group(1))) if stages else t
    return replace(t, block_k=32) if "r32" in variant else t


def _compile(job):
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, variant = job
    rule_tiles, rule_parts = policy.tma_grad_weight_tiles, policy.tma_grad_weight_parts
    target = Target("cuda", "sm_90")

    def parts(q, tiles, target):
        if variant.endswith("k-rule"):
            return rule_parts(q, _tiles("rule", rule_tiles, q, target), target)
        return rule_parts(q, tiles, target)

    if variant == "new":  # the policy as it is
        return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), target, Knobs(), compile=True, tma=True)
    with policy.overrides(tma_grad_weight_tiles=lambda q, target: _tiles(variant, rule_tiles, q, target),
                          tma_grad_weight_parts=parts,
                          tma_grad_weight_specialised=lambda tiles: variant.startswith("ws-")):
        return planned_stream_kernel(p.with_(name=f"{p.name}:{variant}"), target, Knobs(), compile=True, tma=True)


def build(out: Path, variants: list[str] | None = None, extra: bool = False) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import stream

    global EXTRA
    EXTRA = extra

    found = [p for p in problems(CASES) if p.name in CASES and p.op == "grad_weight"]
    found += list(_extra_problems(next(p for p in found if p.name == "r50_3x3_s1_wgrad")))
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, [(p, v) for p in found for v in variants or VARIANTS]))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def run(bundle: Path, result: Path) -> None:
    from benchmarks.probes.tma_forward import timed_rows, write_record

    write_record(result, "python3 benchmarks/probes/tma_wgrad_wide.py run P.convk OUT.json", timed_rows(bundle))


def main(argv=None) -> int:
    from benchmarks.probes.tma_forward import probe_main

    return probe_main(__doc__, build, run, argv, extra=[("--variants", dict(nargs="*")),
                                                         ("--extra", dict(action="store_true"))])


if __name__ == "__main__":
    sys.exit(main())
