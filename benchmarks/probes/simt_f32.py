"""Probe: f32 convolutions through IREE's own CUDA code generation (no Triton kernels, no matrix units) with
hand-set workgroup and per-thread tiles on the contraction dispatch, against IREE's configuration.

IREE 3.13 configures an f32 convolution for TileAndFuse with one output per thread and 32 outputs per workgroup
(e.g. workgroup [1, 1, 1, 1, 32], thread [1, 1, 1, 1, 1] for CK 15's 3D grad_input), so every loaded value feeds
one FMA.  Larger per-thread tiles (4 x 4: 4 output positions by 4 channels) reuse each load in registers.

    python3 benchmarks/probes/simt_f32.py DIR          # where iree-compile is (no GPU needed)
    python3 benchmarks/gpu_bench.py --build DIR --impls iree-today,convdsl+linalg-rules,<variants> \
        --skip-allocating --tag simt                    # on the GPU machine

The variants are named "convdsl@simt-<label>"; DIR/cases.json lists them per case.
"""
from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["ck15_dgrad_3d_f32", "ck11_wgrad_3d_g8_f32"]
# per case: label -> (workgroup, thread, reduction or None, promote operands) of the contraction dispatch
VARIANTS = {
    # dims: n, d, h, w, c | k, t0, t1, t2 (output 64 x 28 x 28 x 28 x 64)
    "ck15_dgrad_3d_f32": {
        "w4c4": ([1, 1, 2, 4, 64], [1, 1, 1, 4, 4], None, False),
        "w4c4x64": ([1, 1, 4, 4, 64], [1, 1, 1, 4, 4], None, False),
        "w4c4x128": ([1, 2, 4, 4, 64], [1, 1, 1, 4, 4], None, False),
        "w4c4k4": ([1, 1, 2, 4, 64], [1, 1, 1, 4, 4], [0, 0, 0, 0, 0, 4, 3, 3, 3], False),
        "w4c4x64p": ([1, 1, 4, 4, 64], [1, 1, 1, 4, 4], None, True),
        "w4c8": ([1, 1, 4, 4, 64], [1, 1, 1, 4, 8], None, False),
        "w2c4": ([1, 1, 2, 4, 64], [1, 1, 1, 2, 4], None, False),
    },
    # dims: g, k, t0, t1, t2, c | (split) n, h, w, d (output 8 x 128 x 3 x 3 x 3 x 128)
    "ck11_wgrad_3d_g8_f32": {
        "k4c4": ([1, 4, 1, 1, 1, 128, 0, 0, 0, 0], [1, 4, 1, 1, 1, 4, 0, 0, 0, 0], None, False),
        "k4c4x64": ([1, 8, 1, 1, 1, 128, 0, 0, 0, 0], [1, 4, 1, 1, 1, 4, 0, 0, 0, 0], None, False),
        "k4c4x64p": ([1, 8, 1, 1, 1, 128, 0, 0, 0, 0], [1, 4, 1, 1, 1, 4, 0, 0, 0, 0], None, True),
        "k4t3c4": ([1, 8, 1, 1, 3, 64, 0, 0, 0, 0], [1, 4, 1, 1, 3, 4, 0, 0, 0, 0], None, False),
        "k8c4": ([1, 16, 1, 1, 1, 128, 0, 0, 0, 0], [1, 8, 1, 1, 1, 4, 0, 0, 0, 0], None, False),
        "k4c4r8": ([1, 8, 1, 1, 1, 128, 0, 0, 0, 0], [1, 4, 1, 1, 1, 4, 0, 0, 0, 0],
                   [0, 0, 0, 0, 0, 0, 1, 1, 4, 3], False),
    },
}


def _set(text: str, key: str, values: list[int]) -> str:
    return re.sub(rf"\b{key} = \[[0-9, ]*\]", f"{key} = [{', '.join(str(v) for v in values)}]", text, count=1)


def _edit(config: str, workgroup: list[int], thread: list[int], reduction, promote: bool) -> str:
    out = _set(_set(config, "workgroup", workgroup), "thread", thread)
    if reduction is not None:
        out = _set(out, "reduction", reduction)
    if promote:
        out = out.replace("lowering_config<{", "lowering_config<{promote_operands = [0, 1], ", 1)
    threads = math.prod(w // t for w, t in zip(workgroup, thread) if t > 0)
    return re.sub(r"workgroup_size = \[[0-9, ]*\]", f"workgroup_size = [{threads}, 1, 1]", out, count=1)


def build(out: Path) -> None:
    from benchmarks.compile_suite import compile_case
    from convdsl import policy
    from convdsl.backends.iree import CompileError, compile_mlir
    from convdsl.passes import lower_to_mlir
    from convdsl.targets import Target
    from benchmarks.suite import load_suite

    out.mkdir(parents=True, exist_ok=True)
    target = Target.parse("cuda", "sm_90")
    entries = []
    for name in CASES:
        entry = compile_case(name, "sm_90", str(out), impls=("iree-today", "convdsl+linalg-rules"))
        p = load_suite(str(ROOT / "benchmarks" / "suite.toml"), names=[name])[0].problem
        knobs = replace(policy.knobs_for(p, target, None), extern=False)
        mlir = lower_to_mlir([p], target, knobs={p.name: knobs})
        with tempfile.TemporaryDirectory() as tmp:
            dumped = Path(tmp) / "dumped"
            compile_mlir(mlir, target, ["--compile-to=executable-configurations",
                                        f"--iree-hal-dump-executable-configurations-to={dumped}"])
            contraction = [f for f in sorted(dumped.glob("*.mlir")) if "reduction = " in f.read_text() and "_reduce_" not in f.read_text()]
            assert len(contraction) == 1, [f.name for f in dumped.glob("*.mlir")]
            config = contraction[0].read_text()
            for label, (wg, th, red, promote) in VARIANTS[name].items():
                impl = f"convdsl@simt-{label}"
                edited = Path(tmp) / label
                edited.mkdir()
                (edited / contraction[0].name.removeprefix("configured_")).write_text(
                    _edit(config, wg, th, red, promote))
                try:
                    vmfb = compile_mlir(mlir, target, [
                        f"--iree-hal-substitute-executable-configurations-from={edited}"])
                except CompileError as err:
                    entry["vmfbs"][impl] = None
                    entry["errors"][impl] = str(err).splitlines()[1][:300]
                    print(f"{name} {label}: failed: {entry['errors'][impl]}", flush=True)
                    continue
                path = out / f"{name}.simt-{label}.vmfb"
                path.write_bytes(vmfb)
                entry["vmfbs"][impl] = path.name
                print(f"{name} {label}: ok", flush=True)
        entries.append(entry)
    manifest = {"target": "cuda", "arch": "sm_90", "suite": "benchmarks/suite.toml", "cases": entries,
                "iree_today_flags": list(__import__("benchmarks.iree_today", fromlist=["TODAY_FLAGS"]).TODAY_FLAGS)}
    from importlib.metadata import version
    manifest["iree_compiler_version"] = version("iree-base-compiler")
    (out / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out / 'cases.json'}")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
