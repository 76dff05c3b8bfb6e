"""On-disk cache of compiled modules: it loads, stores and evicts bytes under a key, and compiles nothing.

    key = cache_key(material)          # sha256 of a canonical JSON description (compiler.key_material)
    vmfb = load(key)                   # None on a miss
    store(key, vmfb)

The compile driver (convdsl/compiler.py) says what the key describes: everything that changes the compiled
bytes.  An entry is one file, `<cache_dir>/<key[:2]>/<key>.vmfb`.

The file is a small header (magic + sha256 of the payload) followed by the .vmfb bytes.  `load` checks
the digest, so a truncated or overwritten entry is a miss (deleted and recompiled), never an error.
Writes go to a temporary file in the entry's folder and are renamed into place with `os.replace`, which
is atomic on POSIX and Windows: a reader sees the old entry, the new one, or none, never half of one.
Two processes compiling the same kernel both compile and both rename; the last rename wins with
identical bytes, so no lock is needed (a lock would add stale-lock failure modes for no gain).

`stats` counts compiles (the driver's, on misses), hits and damaged entries in this process, so tests and
users can see a hit.
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
from typing import Optional

__all__ = [
    "CacheStats",
    "cache_dir",
    "cache_key",
    "clear",
    "entry_path",
    "evict",
    "load",
    "loadable",
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

    compiles: int = 0  # modules compiled on a miss (counted by the compile driver)
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
def source_digest() -> str:
    """sha256 over convdsl's .py and .lark files: any edit to the compiler invalidates every entry (an editable
    install keeps __version__ fixed while the lowering changes)."""
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


def cache_key(material: dict) -> str:
    """sha256 hex of a canonical JSON description of everything that changes the compiled bytes."""
    text = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def entry_path(key: str, suffix: str = ".vmfb") -> Path:
    # A two-character fan-out keeps any one folder small once thousands of kernels are cached.
    return cache_dir() / key[:2] / f"{key}{suffix}"


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


def load(key: str, verify: bool = True, suffix: str = ".vmfb") -> Optional[bytes]:
    """The cached .vmfb for `key`, or None on a miss.  A damaged entry is deleted and reported as a miss.

    Damaged means: not our header, a payload whose sha256 differs (truncated, overwritten), or, with
    `verify`, bytes that IREE refuses to load (~1 ms, worth it next to a compile or a confusing crash).
    """
    path = entry_path(key, suffix)
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
        or (verify and suffix == ".vmfb" and not loadable(payload))
    ):
        stats.damaged += 1
        stats.misses += 1
        _unlink(path)
        return None
    stats.hits += 1
    return payload


def store(key: str, vmfb: bytes, suffix: str = ".vmfb") -> Optional[Path]:
    """Write the entry atomically; returns its path, or None (with a warning) if the cache is not writable.
    `suffix` names other kinds of entries (stream kernels: .stream.json)."""
    path = entry_path(key, suffix)
    tmp: Optional[str] = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The temporary file must be in the same folder: os.replace is only atomic within one filesystem.
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=suffix, dir=path.parent)
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


# What the compile of an entry decided beside its bytes (which IREE configuration each kernel took), read by
# `convdsl explain` and the manifest.  Kept out of the hit/miss/store counts: it is a note, not an entry.
NOTE_SUFFIX = ".notes.json"


def store_note(key: str, note: dict) -> None:
    path = entry_path(key, NOTE_SUFFIX)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=NOTE_SUFFIX, dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(note, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"convdsl cache: could not write {path}: {err}", RuntimeWarning, stacklevel=2)


def load_note(key: str) -> Optional[dict]:
    try:
        note = json.loads(entry_path(key, NOTE_SUFFIX).read_text())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def evict(key: str) -> None:
    """Delete the entry for `key` if there is one (e.g. it passed the checksum but IREE cannot load it)."""
    _unlink(entry_path(key))


def clear() -> int:
    """Delete every entry (and stray temporary file) under cache_dir(); returns how many files went."""
    root = cache_dir()
    removed = 0
    if not root.is_dir():
        return 0
    for path in root.glob("??/*"):
        _unlink(path)
        removed += 1
    return removed
