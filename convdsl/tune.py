"""`convdsl tune`: candidates compiled here, timed where the GPU is, the fastest correct one kept.

Phase 1 (where iree-compile runs):  `convdsl tune candidates FILE.conv --target cuda --out DIR`
    writes DIR/<kernel>.<impl>.vmfb for IREE's default config ("convdsl") and each knob set
    ("convdsl@n2-m2", ...), and DIR/cases.json in the format benchmarks/gpu_bench.py reads.
Phase 2 (on the GPU machine, with iree.runtime, NumPy and PyTorch):
    python3 benchmarks/gpu_bench.py --build DIR --out RESULTS
    verifies every candidate against PyTorch and times it.
Phase 3 (here):  `convdsl tune collect RESULTS/<device>-<date>.json --cases DIR/cases.json`
    keeps, per kernel, the fastest candidate that was correct and beat IREE's default by 3% or more,
    in convdsl/tuning/db.json, keyed by problem signature, target and IREE version.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from . import policy
from .backends.iree import compile_mlir
from .backends.iree_config import compile_with_knobs
from .compiler import iree_version
from .kernels.tiles import TileConfig, matrix_block
from .module import manifest
from .passes import lower_to_mlir
from .passes.plan import plan_kernel
from .problem import ConvProblem, problem_from_spec, problem_to_spec
from .reference import NUMPY_DTYPES
from .targets import Target
from .tuning.db import DB_PATH, lookup, signature, target_key
from .tuning.knobs import Knobs, parse_label

# Knob sets tried for every kernel.  k-scaling up (k2) is left out: on an H200 it produced a kernel
# that faulted (illegal address) for the ResNet stem's grad_weight.
CANDIDATES: tuple[Knobs, ...] = (
    Knobs(n_scale=2), Knobs(m_scale=2), Knobs(n_scale=2, m_scale=2), Knobs(k_scale=0.5), Knobs(prefetch=3),
    Knobs(n_scale=2, m_scale=2, prefetch=3), Knobs(m_scale=2, k_scale=0.5),
    # the zero-border forms (policy.PAD_FORMS), alone and with the tiles that won most often
    Knobs(pad="insert"), Knobs(pad="gather"), Knobs(pad="fuse"),
    Knobs(n_scale=2, m_scale=2, pad="gather"), Knobs(n_scale=2, m_scale=2, pad="fuse"),
    # a quarter of the tiles larger and a fourth stage: the winners of the wider search; n4-m4 never won and
    # often failed to compile (docs/decisions.md#iree-knob-rules)
    Knobs(n_scale=4, m_scale=2), Knobs(n_scale=2, m_scale=4), Knobs(n_scale=2, m_scale=2, prefetch=4),
    # grad_input / transposed only: the phase weight order against the rule, alone and with CK 17's two bests
    Knobs(k_inner=True), Knobs(k_inner=False), Knobs(n_scale=4, m_scale=2, k_inner=False),
    Knobs(n_scale=2, m_scale=2, prefetch=3, k_inner=True),
)
MIN_GAIN = 0.03


def _minimal_bytes(p: ConvProblem) -> int:
    size = lambda shape, dt: int(np.prod(shape)) * np.dtype(NUMPY_DTYPES[dt]).itemsize  # noqa: E731
    return sum(size(s, d) for s, d in zip(p.arg_shapes, p.arg_dtypes)) + size(p.result_shape, p.result_dtype)


def tuned_base(p: ConvProblem, target: Target) -> Knobs:
    """The tuning database's knobs for p (candidates are laid over them), or none."""
    tuned = lookup(p, target, iree_version())
    return tuned.knobs if tuned is not None else Knobs()


def _compile_one(spec: dict, target: Target, out_dir: str, impl: str) -> tuple[str, Optional[str], Optional[str]]:
    p = problem_from_spec(spec)
    path = Path(out_dir) / f"{p.name}.{impl.replace('@', '-at-')}.vmfb"
    try:
        knobs = None if impl == "convdsl" else parse_label(impl.split("@", 1)[1])
        # a candidate's zero-border form and phase weight order change the IR (laid over the tuned entry's),
        # its scales IREE's configuration
        base = tuned_base(p, target)
        mlir = lower_to_mlir([p], target, knobs={p.name: knobs.over(base) if knobs else base})
        if knobs is None:
            vmfb = compile_mlir(mlir, target)
        else:
            vmfb = compile_with_knobs(mlir, target, {p.name: knobs}, strict=True)
        path.write_bytes(vmfb)
        return impl, path.name, None
    except Exception as err:  # noqa: BLE001 - a candidate IREE rejects is recorded, not fatal
        first = next((ln for ln in str(err).splitlines() if "error" in ln), str(err).splitlines()[0])
        return impl, None, first[:300]


# Tiles tried for the Triton GEMM cores (form "extern"): rows x columns x reduction step, warps, stages.
# Around the defaults (policy/cuda.py): smaller tiles for more blocks on small problems, wider ones
# for more reuse, a shorter reduction step with deeper pipelines.
EXTERN_TILES: tuple[TileConfig, ...] = (
    TileConfig(128, 128, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(128, 64, 64, 4, 4),
    TileConfig(128, 64, 64, 4, 5), TileConfig(64, 64, 64, 4, 4), TileConfig(64, 128, 64, 4, 4),
    TileConfig(128, 256, 64, 8, 3), TileConfig(256, 128, 64, 8, 3), TileConfig(128, 128, 32, 8, 5),
    TileConfig(128, 64, 32, 4, 6),
    # taller tiles for narrow C: more rows per shared-memory read of the weight tile (ncu on CK 15's dgrad,
    # 128x64 tiles: shared memory and L1 88% busy, the tensor pipe 50%)
    TileConfig(256, 64, 64, 8, 3), TileConfig(256, 64, 32, 8, 4),
)


# Depthwise kernels' tiles (kernels/igemm.py grad_weight_depthwise: positions per window chunk x channels, warps
# over [TAP_ROWS, channels]; grad_input_direct: positions per chunk x channels), around the winners of
# docs/decisions.md#depthwise-tiles
DEPTHWISE_TILES = {
    "grad_weight": tuple(TileConfig(m, n, 1, w, 1) for m in (8, 16, 32) for n in (32, 64) for w in (1, 2, 4, 8, 16)),
    "grad_input": (TileConfig(16, 64, 1, 1, 1), TileConfig(32, 64, 1, 1, 1), TileConfig(32, 64, 1, 2, 1),
                   TileConfig(32, 32, 1, 1, 1), TileConfig(16, 32, 1, 1, 1), TileConfig(8, 64, 1, 1, 1),
                   TileConfig(16, 128, 1, 2, 1), TileConfig(32, 128, 1, 2, 1), TileConfig(32, 128, 1, 4, 1)),
}


def depthwise_tiles(p: ConvProblem) -> tuple[TileConfig, ...]:
    """DEPTHWISE_TILES for p's op; grad_weight's only where every warp has elements of its own: warps x 32 at
    most TAP_ROWS x channels, at least half of that (two elements per thread)."""
    if p.op != "grad_weight":
        return DEPTHWISE_TILES["grad_input"]
    rows = policy.tap_rows(p)
    return tuple(t for t in DEPTHWISE_TILES["grad_weight"]
                 if rows * t.block_n // 64 <= t.warps and 32 * t.warps <= rows * t.block_n)


def few_channel_candidates(p: ConvProblem) -> tuple[Knobs, ...]:
    """Few channels per group.  Depthwise: the depthwise kernels' tiles.  Grouped (ResNeXt): packed GEMMs of
    PACK groups (policy.default_pack) and twice that, small tiles around the packed C and K.  Both:
    the linalg gather form where it applies (extern off), which they replaced."""
    out: list[Knobs] = [Knobs(extern=False)] if policy.gather_applies(p) else []
    if p.depthwise:
        return tuple(out + [Knobs(tiles=t.label()) for t in depthwise_tiles(p)])
    first = policy.default_pack(p)
    if first < 2:
        return tuple(out)
    for pack in (first, 2 * first):
        if p.groups % pack:
            continue
        c, k = matrix_block(pack * p.in_channels), matrix_block(pack * p.out_channels)
        if p.op == "grad_weight":
            cols = pack * p.in_channels * math.prod(p.filter)
            tiles = [TileConfig(k, n, r, 4, st, pack=pack) for n, r, st in
                     ((32, 128, 4), (64, 64, 4), (128, 64, 4), (256, 32, 3)) if n <= 2 * cols]
        else:
            tiles = [TileConfig(m, c, min(k, 64), w, st, pack=pack) for m, w, st in
                     ((64, 4, 4), (128, 4, 4), (128, 4, 2), (256, 8, 3))]
        out += [Knobs(tiles=t.label()) for t in tiles]
    return tuple(dict.fromkeys(out))


def extern_candidates(p: ConvProblem, target: Target) -> tuple[Knobs, ...]:
    """Tile sets for a kernel whose GEMM core is a Triton kernel: columns no wider than twice what the
    problem has (C for grad_input, taps x C for grad_weight), rows of grad_weight no taller than twice K;
    for grad_weight also the default tiles with half and twice the automatic split-K.  Few channels per
    group: few_channel_candidates."""
    if p.groups > 1 and min(p.in_channels, p.out_channels) < 32:
        return few_channel_candidates(p)
    wide = p.dtype == "f32"
    cols = p.in_channels * (math.prod(p.filter) if p.op == "grad_weight" else 1)
    out = []
    for t in EXTERN_TILES:
        if t.block_n > 2 * max(cols, 32) or (p.op == "grad_weight" and t.block_m > 2 * max(p.out_channels, 32)):
            continue
        if wide:  # f32 tiles take twice the shared memory per stage
            t = replace(t, block_k=min(t.block_k, 32), stages=min(t.stages, 3))
        out.append(t)
    if p.op == "grad_weight":
        base = policy.default_grad_weight_tiles(p, target)
        parts, _ = policy.grad_weight_split(p, base, target)
        out += [replace(base, split=s) for s in {max(1, parts // 2), min(64, parts * 2)} - {parts}]
    return tuple(dict.fromkeys(Knobs(tiles=t.label()) for t in out))


def candidates_for(p: ConvProblem, target: Optional[Target] = None) -> tuple[Knobs, ...]:
    """The knob sets worth compiling for `p` on `target`: tiles where the GEMM core is a Triton kernel,
    else IREE's knobs (the phase weight order only where there are phases)."""
    if target is not None and plan_kernel(p, target, tuned_base(p, target)).extern is not None:
        return extern_candidates(p, target)
    phased = p.op in ("grad_input", "transposed")
    return tuple(k for k in CANDIDATES if k.k_inner is None or phased)


def candidates(problems: Sequence[ConvProblem], target: Target, out_dir: Path, jobs: int = 2) -> Path:
    """Phase 1: compile IREE's default and every knob set for each kernel; write cases.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = []
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for p in problems:
            impls = ["convdsl", *(f"convdsl@{k.label()}" for k in candidates_for(p, target))]
            kernel = manifest([p], target)["kernels"][0]
            futures = [pool.submit(_compile_one, problem_to_spec(p), target, str(out_dir), i) for i in impls]
            results = [f.result() for f in futures]
            cases.append({
                "name": p.name, "source": "convdsl tune", "op": p.op, "problem": p.describe(),
                "spec": kernel["spec"], "function": p.name, "args": kernel["args"], "result": kernel["result"],
                "flops": p.flops, "bytes": _minimal_bytes(p),
                "vmfbs": {impl: name for impl, name, _ in results},
                "errors": {impl: err for impl, _, err in results if err},
            })
            print(f"{p.name}: " + ", ".join(f"{i}: {'ok' if n else 'failed'}" for i, n, _ in results), flush=True)
    path = out_dir / "cases.json"
    path.write_text(json.dumps({"target": str(target), "arch": target.arch, "cases": cases}, indent=1) + "\n")
    return path


def _json_field(path: Path, field: str) -> list:
    """`field` of the JSON object in `path`, or a ValueError naming the file, the place and what was expected."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: expected JSON, got a syntax error: {err.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get(field), list):
        raise ValueError(f"{path}: expected a JSON object with a list '{field}', got {type(data).__name__}"
                         + (f" with keys {sorted(data)[:5]}" if isinstance(data, dict) else ""))
    return data[field]


def _entries(path: Path, field: str, required: dict[str, type]) -> list[dict]:
    """The list `field` of the JSON object in `path`, each entry an object with the `required` keys of their
    types, or a ValueError naming the file, the entry and what was expected."""
    entries = _json_field(path, field)
    for i, entry in enumerate(entries):
        wrong = [k for k, kind in required.items() if not isinstance(entry, dict) or not isinstance(entry.get(k), kind)]
        if wrong:
            wants = ", ".join(f"'{k}' ({'an object' if required[k] is dict else 'a string'})" for k in required)
            got = f"keys {sorted(entry)[:6]}" if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{path}: {field}[{i}]: expected an object with {wants}, got {got}")
    return entries


def _timed(path: Path, index: int, impl: str, entry: Any) -> Optional[float]:
    """The milliseconds of one implementation's entry where it ran correctly, else None."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: results[{index}].impls[{impl!r}]: expected an object with 'ok' and 'ms', "
                         f"got {type(entry).__name__}")
    ms = entry.get("ms")
    if not entry.get("ok") or not ms:
        return None
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{path}: results[{index}].impls[{impl!r}].ms: expected a non-negative number of "
                         f"milliseconds, got {ms!r}")
    return float(ms)


def collect(results_path: Path, cases_path: Path, target: Target, db_path: Path = DB_PATH) -> dict:
    """Phase 3: the fastest correct candidate per kernel into the database; returns what changed."""
    # an entry without impls is a case that failed on the GPU machine (gpu_bench.py writes its error instead)
    results = _entries(results_path, "results", {"name": str})
    specs = {c["name"]: c["spec"] for c in _entries(cases_path, "cases", {"name": str, "spec": dict})}
    db = json.loads(db_path.read_text()) if db_path.exists() else {}
    section = db.setdefault(target_key(target, iree_version()), {})
    chosen = {}
    for index, case in enumerate(results):
        impls, spec = case.get("impls", {}), specs.get(case["name"])
        if not isinstance(impls, dict):
            raise ValueError(f"{results_path}: results[{index}].impls: expected an object, got {type(impls).__name__}")
        base_ms = _timed(results_path, index, "convdsl", impls.get("convdsl", {}))
        if spec is None or base_ms is None:
            continue
        timed = [(ms, impl) for impl, e in impls.items() if impl.startswith("convdsl@")
                 for ms in [_timed(results_path, index, impl, e)] if ms is not None]
        if not timed:
            continue
        best_ms, best = min(timed)
        if best_ms > base_ms * (1 - MIN_GAIN):
            continue
        try:
            knobs = parse_label(best.split("@", 1)[1])
            problem = problem_from_spec(spec)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{results_path}: results[{index}] ({case['name']}): {best!r} or its case's spec does "
                             f"not describe a kernel: {err}") from None
        previous = section.get(signature(problem), {})
        if knobs.pad is None and previous.get("knobs", {}).get("pad"):
            # the candidate was compiled with the entry's tuned zero-border form (tuned_base)
            knobs = replace(knobs, pad=previous["knobs"]["pad"])
        if knobs.k_inner is None and previous.get("knobs", {}).get("k_inner") is not None:
            knobs = replace(knobs, k_inner=previous["knobs"]["k_inner"])  # likewise the phase weight order
        # default_ms stays the time of IREE's own configuration when the entry had one
        section[signature(problem)] = {"knobs": knobs.as_dict(), "ms": round(best_ms, 4),
                                       "default_ms": previous.get("default_ms", round(base_ms, 4)),
                                       "case": case["name"]}
        chosen[case["name"]] = (knobs.label(), base_ms, best_ms)
    db_path.write_text(json.dumps(db, indent=1, sort_keys=True) + "\n")
    return chosen
