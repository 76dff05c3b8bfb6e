"""On-disk cache of compiled modules, keyed by everything that changes the compiled bytes.

    vmfb = compile_cached(problems, target)        # compiles on a miss, reads the disk on a hit

An entry is one file, `<cache_dir>/<key[:2]>/<key>.vmfb`, where the key is the sha256 of a canonical JSON
description of: every field of every `ConvProblem` (the kernel name included: it is the function name in
the module), the target backend and arch, the iree-compile flags, convdsl's `__version__`, a digest of
convdsl's own source files, and the IREE compiler version.  The source digest is there because an
editable install keeps `__version__` fixed while the lowering changes; without it a stale kernel would
be served after an edit.

The file is a small header (magic + sha256 of the payload) followed by the .vmfb bytes.  `load` checks
the digest, so a truncated or overwritten entry is a miss (deleted and recompiled), never an error.
Writes go to a temporary file in the entry's folder and are renamed into place with `os.replace`, which
is atomic on POSIX and Windows: a reader sees the old entry, the new one, or none, never half of one.
Two processes compiling the same kernel both compile and both rename; the last rename wins with
identical bytes, so no lock is needed (a lock would add stale-lock failure modes for no gain).

`stats` counts compiles, hits and damaged entries in this process, so tests and users can see a hit.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .backends import iree as _iree
from .kernels import launch
from .problem import ConvProblem
from .targets import Target

__all__ = [
    "CacheStats",
    "cache_dir",
    "cache_key",
    "clear",
    "compile_cached",
    "entry_path",
    "evict",
    "iree_version",
    "load",
    "loadable",
    "source_digest",
    "stats",
    "store",
]

# Bump when the key's JSON or the entry's file format changes, so old entries are never misread.
KEY_SCHEMA = 1
_MAGIC = b"CONVDSL-VMFB\x00\x01"
_DIGEST_LEN = 32
_HEADER_LEN = len(_MAGIC) + _DIGEST_LEN
_TMP_PREFIX = ".tmp-"


@dataclasses.dataclass
class CacheStats:
    """Per-process counters: `compiles` only grows on a miss, so an unchanged count proves a hit."""

    compiles: int = 0  # iree-compile runs made by compile_cached
    hits: int = 0  # entries served from disk
    misses: int = 0  # lookups that found no usable entry
    damaged: int = 0  # entries that existed but failed the checksum (deleted, then recompiled)
    stores: int = 0  # entries written

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


stats = CacheStats()


def cache_dir() -> Path:
    """$CONVDSL_CACHE_DIR, else ~/.cache/convdsl; read on every call so a changed env var takes effect."""
    env = os.environ.get("CONVDSL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "convdsl"


@functools.lru_cache(maxsize=None)
def iree_version() -> str:
    # importlib.metadata costs ~0.5 ms a call and the installed compiler cannot change under a running
    # process, so ask once.  Tests monkeypatch this name to simulate an upgrade.
    return _iree.iree_version()


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 over convdsl's .py and .lark files: any edit to the compiler invalidates every entry."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    try:
        files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".lark") and "__pycache__" not in p.parts)
        for path in files:
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    except OSError:  # e.g. a zipped install: fall back to __version__ alone rather than fail every compile
        return "unavailable"
    return h.hexdigest()


def _convdsl_version() -> str:
    # Read the attribute at call time (not `from . import __version__`) so a monkeypatched or reloaded
    # version is seen; importing the package here also avoids a cycle at import time.
    import convdsl

    return convdsl.__version__


def _problem_record(p: ConvProblem) -> dict:
    # asdict recurses into the Epilogue; tuples become JSON lists and floats keep their exact repr, so
    # the record is canonical for equal problems and differs for any changed field.
    return dataclasses.asdict(p)


def key_material(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = ()) -> dict:
    """The exact description that `cache_key` hashes; useful to see why two keys differ."""
    return {
        "schema": KEY_SCHEMA,
        "problems": [_problem_record(p) for p in problems],
        "backend": target.backend,
        "arch": target.arch,
        "flags": [*target.compile_flags(), *extra_flags],
        "convdsl_version": _convdsl_version(),
        "convdsl_source": source_digest(),
        "iree_version": iree_version(),
        # CUDA kernels embed Triton-compiled binaries (kernels/launch.py): another Triton, other binaries
        "triton_version": launch.triton_version() if target.backend == "cuda" else None,
        # the tuned (or heuristic) lowering knobs of each kernel: a new tuning database misses
        "knobs": [_knobs_for(p, target) for p in problems],
    }


def _knobs_for(p: ConvProblem, target: Target) -> dict:
    from .tuning.db import knobs_for

    return knobs_for(p, target).as_dict()


def cache_key(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = ()) -> str:
    """sha256 hex of everything that changes the compiled module for `problems` on `target`."""
    text = json.dumps(key_material(problems, target, extra_flags), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def entry_path(key: str) -> Path:
    # A two-character fan-out keeps any one folder small once thousands of kernels are cached.
    return cache_dir() / key[:2] / f"{key}.vmfb"


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as err:  # a read-only cache must not break compilation
        warnings.warn(f"convdsl cache: could not remove {path}: {err}", RuntimeWarning, stacklevel=3)


def loadable(vmfb: bytes) -> bool:
    """Whether IREE accepts the bytes as a module (it verifies the bytecode; no device is needed)."""
    import iree.runtime as rt

    try:
        rt.VmModule.copy_buffer(rt.VmInstance(), vmfb)
    except (ValueError, RuntimeError):
        return False
    return True


def load(key: str, verify: bool = True) -> Optional[bytes]:
    """The cached .vmfb for `key`, or None on a miss.  A damaged entry is deleted and reported as a miss.

    Damaged means: not our header, a payload whose sha256 differs (truncated, overwritten), or, with
    `verify`, bytes that IREE refuses to load (~1 ms, worth it next to a compile or a confusing crash).
    """
    path = entry_path(key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        stats.misses += 1
        return None
    except OSError as err:  # unreadable file or folder: compile instead of failing
        warnings.warn(f"convdsl cache: could not read {path}: {err}", RuntimeWarning, stacklevel=2)
        stats.misses += 1
        return None
    payload = data[_HEADER_LEN:]
    if (
        len(data) <= _HEADER_LEN
        or not data.startswith(_MAGIC)
        or hashlib.sha256(payload).digest() != data[len(_MAGIC):_HEADER_LEN]
        or (verify and not loadable(payload))
    ):
        stats.damaged += 1
        stats.misses += 1
        _unlink(path)
        return None
    stats.hits += 1
    return payload


def store(key: str, vmfb: bytes) -> Optional[Path]:
    """Write the entry atomically; returns its path, or None (with a warning) if the cache is not writable."""
    path = entry_path(key)
    tmp: Optional[str] = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temporary file must be in the same folder: os.replace is only atomic within one filesystem.
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".vmfb", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(vmfb).digest() + vmfb)
            f.flush()
            os.fsync(f.fileno())  # a crash after the rename must not leave a renamed but empty file
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        warnings.warn(f"convdsl cache: could not write {path}: {err}", RuntimeWarning, stacklevel=2)
        return None
    finally:
        if tmp is not None:
            _unlink(Path(tmp))
    stats.stores += 1
    return path


def evict(key: str) -> None:
    """Delete the entry for `key` if there is one (e.g. it passed the checksum but IREE cannot load it)."""
    _unlink(entry_path(key))


def clear() -> int:
    """Delete every entry (and stray temporary file) under cache_dir(); returns how many files went."""
    root = cache_dir()
    removed = 0
    if not root.is_dir():
        return 0
    for path in root.glob("??/*.vmfb"):
        _unlink(path)
        removed += 1
    return removed


def _compile(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str]) -> bytes:
    """lower -> iree-compile, with each kernel's tuned knobs on GPU targets."""
    from .passes import lower_to_mlir
    from .tuning.db import knobs_for

    mlir = lower_to_mlir(problems, target)
    knobs = {p.name: knobs_for(p, target) for p in problems}
    if target.backend == "cpu" or all(k.config_default for k in knobs.values()):
        # looked up through the module so that a monkeypatched compile_mlir (tests, tracing) is honoured
        return _iree.compile_mlir(mlir, target, extra_flags)
    from .tuning.knobs import compile_with_knobs

    return compile_with_knobs(mlir, target, knobs, extra_flags)


def compile_cached(
    problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = (), *, refresh: bool = False
) -> bytes:
    """The .vmfb for `problems` on `target`: from the disk cache if present, else compiled and stored.

    `refresh=True` skips the lookup and overwrites the entry (used when a cached module failed to load).
    """
    problems = list(problems)
    key = cache_key(problems, target, extra_flags)
    if not refresh:
        cached = load(key)
        if cached is not None:
            return cached
    vmfb = _compile(problems, target, extra_flags)
    stats.compiles += 1
    store(key, vmfb)
    return vmfb
