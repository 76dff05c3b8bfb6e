"""The tuning database shipped with convdsl, and the heuristic that carries shapes it has never seen.

db.json maps  "<target>|<iree version>"  ->  {problem signature: {"knobs": {...}, "ms": ..., "default_ms": ...}}.
`convdsl tune` writes it (convdsl/tuning/tune.py); `knobs_for` reads it in every compile.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from ..problem import ConvProblem, problem_to_spec
from ..targets import Target
from .knobs import Knobs

DB_PATH = Path(__file__).with_name("db.json")


def signature(p: ConvProblem) -> str:
    """Everything about a problem that changes its kernel, but not its name."""
    spec = problem_to_spec(p)
    spec.pop("name")
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def target_key(target: Target) -> str:
    from ..backends.iree import iree_version

    return f"{target}|{iree_version()}"


@lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def load_db(path: Path | None = None) -> dict:
    path = path or DB_PATH
    try:
        return _load(str(path), path.stat().st_mtime)
    except OSError:
        return {}


def lookup(p: ConvProblem, target: Target, path: Path | None = None) -> Knobs | None:
    entry = load_db(path).get(target_key(target), {}).get(signature(p))
    return Knobs(**entry["knobs"]) if entry else None


def heuristic(p: ConvProblem, target: Target) -> Knobs:
    """Knobs for a shape the database does not hold, generalised from the shapes tuned on an H200.

    What the tuning run showed (benchmarks/results/*run5*): IREE's default tiles 128 output pixels
    x 32 channels per workgroup.  Large f16/bf16 implicit GEMMs gained 1.3-2x from doubling both
    tiles (n2-m2) and a little more from a third prefetch stage when the reduction is long; GEMMs
    whose M is small per dispatch (a stride phase, a 1x1 layer at 14x14) gained only from n2 or m2;
    small-K grad_weight (64 output channels) and f32 (no matrix units) gained nothing.  A wider search
    on an H100 (results/*tune3*) moved the large grad_input GEMMs with 128+ dX channels to n4-m2.
    Depthwise kernels have no matrix-unit config, so knobs do not apply.
    """
    sixteen_bit = p.dtype in ("f16", "bf16") or p.fp8_compute or p.bf16x3  # tf32: f32 on the linalg form
    if target.backend == "cpu" or p.depthwise or not sixteen_bit:
        return Knobs()
    if p.op == "grad_weight":
        if p.out_channels >= 128 and p.in_channels * math.prod(p.filter) >= 2048:
            return Knobs(n_scale=2, m_scale=2)
        return Knobs()
    if p.op == "forward":
        m, n, reduction = p.batch * math.prod(p.output), p.out_channels, p.in_channels * math.prod(p.filter)
    else:
        # grad_input / transposed: one GEMM per stride phase, each over ~1/prod(s) of dX and of the taps
        m = p.batch * math.prod(-(-i // s) for i, s in zip(p.input, p.stride))
        n = p.in_channels
        reduction = p.out_channels * math.prod(p.filter) // math.prod(p.stride)
    if n < 64:
        return Knobs()
    if m >= 60_000 and n >= 128 and p.op != "forward" and all(s == 1 for s in p.stride):
        # the wider search on an H100 (results/*tune3*): with 128+ channels of dX, a 4x wider N tile
        # beat n2-m2-p3 on DeepLab atrous (1.38x) and CK 17 (1.10x), but CK 17 is strided, and with the
        # K-innermost phase weights that strided grad_input now uses it took 1.9x longer (run 12)
        return Knobs(n_scale=4, m_scale=2)
    if m >= 60_000:
        return Knobs(n_scale=2, m_scale=2, prefetch=3 if reduction >= 1024 else None)
    return Knobs(n_scale=2)


def knobs_for(p: ConvProblem, target: Target) -> Knobs:
    """The database's knobs for this problem on this target, else the heuristic's."""
    if target.backend == "cpu":
        return Knobs()
    found = lookup(p, target)
    return found if found is not None else heuristic(p, target)
