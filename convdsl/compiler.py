"""The compile driver: `.conv` text or problems -> knobs -> pipeline -> iree-compile -> `.vmfb`, cached.

    mod = convdsl.compile("examples/resnext.conv", target="cpu")
    dx = mod.dgrad(dy, w)

The stages, in order (compile_vmfb):
  1. knobs      each kernel's knobs, looked up once: the tuning database's entry, else policy's rules
  2. key        the cache key of everything that changes the bytes; a hit ends here
  3. pipeline   plan -> Triton GEMM cores -> linalg -> canonical IR (passes/pipeline.py)
  4. backend    iree-compile, with the knobs' IREE configuration where they set one (backends/), fitted to the
                target's workgroup memory; a kernel whose edited configuration IREE rejects keeps IREE's own
  5. store      the bytes, atomically, under the key (cache.py), and beside them a note of what each kernel's
                knobs became (iree_config_notes: `convdsl explain` and the manifest say it)
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import convdsl

from . import cache, policy
from .cache import source_digest
from .backends import iree as _iree
from .backends.iree_config import compile_with_knobs_reported
from .frontend import ConvSyntaxError, parse, parse_file
from .kernels.compile import triton_version
from .module import CompiledModule, resolve_target
from .passes import lower_to_mlir
from .problem import ConvProblem
from .progress import CompileStep, ProgressFn
from .targets import Target
from .tuning import resolve
from .tuning.knobs import Knobs

log = logging.getLogger("convdsl.compiler")

# Bump when the key's JSON changes, so old entries are never misread.
KEY_SCHEMA = 1


def load_problems(source: Union[str, Path, Sequence[ConvProblem]], batch: Optional[int] = None) -> list[ConvProblem]:
    """A path to a .conv file, .conv source text, or problems already built; at least one kernel."""
    problems = _problems_of(source, batch)
    if not problems:
        name = str(source) if isinstance(source, Path) or (isinstance(source, str) and "{" not in source) \
            else "<string>"
        raise ConvSyntaxError("no kernels: expected at least one line `kernel NAME = OP(CONV)`", name, 1, 1)
    return problems


def _problems_of(source: Union[str, Path, Sequence[ConvProblem]], batch: Optional[int]) -> list[ConvProblem]:
    if isinstance(source, (list, tuple)):
        return list(source)
    if isinstance(source, Path) or (isinstance(source, str) and "{" not in source and source.endswith(".conv")):
        return parse_file(source, batch=batch)
    if isinstance(source, str) and "{" not in source and "conv" not in source.split():
        # no declaration in it: a path (without .conv, or a folder), not source text
        path = Path(source)
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory", source)
        if not path.exists():
            raise FileNotFoundError(2, "No such file", source)
        if not path.is_file():
            # reading a device or pipe would block or never end
            raise ConvSyntaxError("expected a regular .conv file, got a device, pipe or socket", source, 1, 1)
        return parse_file(path, batch=batch)
    return parse(str(source), batch=batch)


# --- 1. knobs -----------------------------------------------------------------------------------------

def iree_version() -> str:
    """The IREE version in the cache key (backends.iree's, asked once).  Tests monkeypatch this name to simulate
    an upgrade."""
    return _iree.iree_version()


def tuned_knobs(p: ConvProblem, target: Target) -> tuple[Knobs, str]:
    """A kernel's knobs and where they come from (`convdsl explain` prints it): the stream path's too."""
    return resolve.lookup(p, target)


def knobs_by_kernel(problems: Sequence[ConvProblem], target: Target) -> dict[str, Knobs]:
    return {p.name: tuned_knobs(p, target)[0] for p in problems}


# --- 2. key ----------------------------------------------------------------------------------------------

def key_material(problems: Sequence[ConvProblem], target: Target, knobs: dict[str, Knobs],
                 extra_flags: Sequence[str] = ()) -> dict:
    """Everything that changes the compiled module: every field of every problem (the kernel name is the
    function name in the module), the target and its flags, convdsl's version and source, IREE's version,
    Triton's for CUDA (the modules embed Triton-compiled kernels), and each kernel's knobs."""
    return {
        "schema": KEY_SCHEMA,
        "problems": [p.record() for p in problems],
        "backend": target.backend,
        "arch": target.arch,
        "flags": [*target.compile_flags(policy.cpu_data_tiling(problems, target)), *extra_flags],
        "convdsl_version": convdsl.__version__,  # read at call time: a monkeypatched version is seen
        "convdsl_source": source_digest(),
        "iree_version": iree_version(),
        "triton_version": triton_version() if target.backend == "cuda" else None,
        "knobs": [knobs[p.name].as_dict() for p in problems],
    }


def cache_key(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = ()) -> str:
    """The cache key of `problems` compiled for `target` (knobs looked up as compile_vmfb does)."""
    problems = list(problems)
    return cache.cache_key(key_material(problems, target, knobs_by_kernel(problems, target), extra_flags))


# --- 3-5. pipeline, backend, store -------------------------------------------------------------------------

def lower_with_tuned_knobs(problems: Sequence[ConvProblem], target: Target) -> str:
    """The MLIR that compile() hands to iree-compile (with each kernel's tuned or rule-given knobs)."""
    return lower_to_mlir(problems, target, knobs_by_kernel(problems, target))


def compile_vmfb(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = (), *,
                 refresh: bool = False, progress: Optional[ProgressFn] = None) -> bytes:
    """The .vmfb for `problems` on `target`: from the disk cache if present, else compiled and stored.
    `refresh=True` skips the lookup and overwrites the entry (used when a cached module failed to load).
    `progress`, if given, is told each step of a compile (convdsl.progress.CompileStep); a cache hit has none."""
    problems = list(problems)
    knobs = knobs_by_kernel(problems, target)
    key = cache.cache_key(key_material(problems, target, knobs, extra_flags))
    if not refresh:
        cached = cache.load(key)
        if cached is not None:
            return cached
    mlir = lower_to_mlir(problems, target, knobs, progress)
    if progress is not None:
        progress(CompileStep("backend", len(problems), len(problems), "iree-compile"))
    if target.backend == "cpu" or all(k.config_default for k in knobs.values()):
        # through the module: a patched compile_mlir is seen
        # the packed matmuls' workgroup tiles: only the im2col form has matmuls (the others skip the two phases)
        tiles = (policy.cpu_packed_matmul_distribution if any(policy.cpu_im2col(p, target) for p in problems)
                 else None)
        vmfb = _iree.compile_mlir(mlir, target, extra_flags, policy.cpu_data_tiling(problems, target),
                                  packed_matmul_tiles=tiles)
    else:
        vmfb, results = compile_with_knobs_reported(mlir, target, knobs, extra_flags)
        # recorded with the entry: a cache hit compiles nothing, yet explain and the manifest can still say it
        cache.store_note(key, {"iree_config": {k: r.as_dict() for k, r in results.items()}})
        kept = [k for k, r in results.items() if r.default_kept is not None and r.dispatches]
        if kept:
            log.warning("%s: IREE's default configuration kept for %s (convdsl explain says why)", target,
                        ", ".join(kept))
    cache.stats.compiles += 1
    cache.store(key, vmfb)
    return vmfb


def iree_config_notes(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = ()
                      ) -> Optional[dict[str, dict]]:
    """What the compile of `problems` for `target` made of each kernel's knobs over IREE's configuration
    (KnobResult.as_dict by kernel name; kernels without such knobs absent), or None where that module has not
    been compiled into this cache."""
    note = cache.load_note(cache_key(list(problems), target, extra_flags))
    return None if note is None else note.get("iree_config", {})


def compile(
    source: Union[str, Path, Sequence[ConvProblem]],
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    batch: Optional[int] = None,
    kernels: Optional[Sequence[str]] = None,
    progress: Optional[ProgressFn] = None,
) -> CompiledModule:
    """Compile every kernel of a .conv file (path or text) into one module for `target`; `progress`, if
    given, is told each step (convdsl.progress.CompileStep: a kernel lowered, then iree-compile)."""
    tgt = resolve_target(target, arch)
    problems = load_problems(source, batch)
    if kernels:
        unknown = [k for k in kernels if k not in {p.name for p in problems}]
        if unknown:
            raise ValueError(f"--kernel: no kernel named {', '.join(unknown)}; kernels: "
                             + ", ".join(p.name for p in problems))
        problems = [p for p in problems if p.name in kernels]
    vmfb = compile_vmfb(problems, tgt, progress=progress)
    return CompiledModule(problems, tgt, vmfb, iree_config=iree_config_notes(problems, tgt))
