"""The tuning database shipped with convdsl: the knobs the tuner found fastest, per problem and target.

db.json maps  "<target>|<iree version>"  ->  {problem signature: {"knobs": {...}, "ms": ..., "default_ms": ...}}.
`convdsl tune collect` writes it (convdsl/tune.py); the compile driver (convdsl/compiler.py) reads it once
per kernel.  An entry tuned with another IREE version still serves (the same problem on the same target
tends to want the same tiles), and says so in `convdsl explain`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from ..problem import ConvProblem, problem_to_spec
from ..targets import Target
from .knobs import Knobs

DB_PATH = Path(__file__).with_name("db.json")


@dataclass(frozen=True)
class Tuned:
    """A database entry's knobs, and where they come from (for `convdsl explain`)."""

    knobs: Knobs
    source: str


def signature(p: ConvProblem) -> str:
    """Everything about a problem that changes its kernel, but not its name.  Fused epilogue steps and prologues
    leave the GEMM as it is: a problem with them takes its unfused twin's entry."""
    spec = problem_to_spec(p.without_fused())
    spec.pop("name")
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def target_key(target: Target, iree_version: str) -> str:
    return f"{target}|{iree_version}"


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def load_db(path: Optional[Path] = None) -> dict:
    """The database at `path` (default DB_PATH), read again whenever the file changes (its mtime or size)."""
    path = path or DB_PATH
    try:
        stat = path.stat()
    except OSError:
        return {}
    return _load(str(path), stat.st_mtime_ns, stat.st_size)


def _version_order(version: str) -> tuple:
    return tuple(int(v) if v.isdigit() else 0 for v in version.split("."))


def lookup(p: ConvProblem, target: Target, iree_version: str, path: Optional[Path] = None) -> Optional[Tuned]:
    """The entry for `p` on `target` tuned with this IREE version, else the newest other version's entry for
    the same problem and target, else None."""
    db = load_db(path)
    sig = signature(p)
    entry = db.get(target_key(target, iree_version), {}).get(sig)
    if entry:
        return Tuned(Knobs(**entry["knobs"]), f"tuning database ({target}, IREE {iree_version})")
    prefix = f"{target}|"
    others = sorted((key.removeprefix(prefix) for key in db if key.startswith(prefix)), key=_version_order,
                    reverse=True)
    for version in others:
        entry = db[prefix + version].get(sig)
        if entry:
            return Tuned(Knobs(**entry["knobs"]),
                         f"tuning database ({target}), tuned with IREE {version}; this is IREE {iree_version}")
    return None
