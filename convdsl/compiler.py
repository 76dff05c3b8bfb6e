"""The compile driver: one entry point, `compile(problems, target, artifact=...)`, for every artifact.

    mod = convdsl.compile("examples/resnext.conv", target="cpu")                  # a loaded module
    vmfb = convdsl.compile(problems, "cuda", "sm_90", artifact="vmfb")            # the IREE module's bytes
    bundle = convdsl.compile(problems, "cuda", "sm_90", artifact="bundle")        # stream kernels for PyTorch
    bundle.write("kernels.convk")

Each problem is planned once (`plan` -> passes/plan.KernelPlan: its knobs, looked up once from the tuning
database's entry, else policy's rules, and every decision of both artifacts), and each artifact is built from
those plans by its backend, keyed on them:
  - "vmfb": 2. key (everything that changes the bytes, the knobs included; a hit ends here), 3. pipeline
    (the plans -> Triton GEMM cores -> linalg -> canonical IR, passes/pipeline.py), 4. iree-compile with the knobs' IREE
    configuration where they set one (backends/), fitted to the target's workgroup memory (a kernel whose edited
    configuration IREE rejects keeps IREE's own), 5. store, atomically, under the key (cache.py), beside it a note
    of what each kernel's knobs became (iree_config_notes: `convdsl explain` and the manifest say it);
  - "bundle": each plan's stream kernel (KernelPlan.stream), compiled by Triton (stream.py) and cached
    under its plan's key (stream.kernel_key: the launches with their constants, the knobs, the source, Triton);
  - "module" (the default): the "vmfb" artifact loaded as a CompiledModule.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence, Union, overload

import convdsl

from . import cache, policy, stream
from .cache import source_digest
from .backends import iree as _iree
from .backends.iree_config import compile_with_knobs_reported
from .frontend import ConvSyntaxError, parse, parse_file
from .kernels.compile import triton_version
from .module import CompiledModule, resolve_target
from .passes import lower_to_mlir
from .passes import plan as planner
from .passes.plan import KernelPlan
from .problem import ConvProblem
from .progress import CompileStep, ProgressFn
from .stream import StreamKernel
from .targets import Target
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


# --- 1. knobs and plans -------------------------------------------------------------------------------

def iree_version() -> str:
    """The IREE version in the cache key (backends.iree's, asked once).  Tests monkeypatch this name to simulate
    an upgrade."""
    return _iree.iree_version()


def tuned_knobs(p: ConvProblem, target: Target) -> tuple[Knobs, str]:
    """A kernel's knobs and where they come from (`convdsl explain` prints it): the stream path's too."""
    return planner.lookup_knobs(p, target)


def knobs_by_kernel(problems: Sequence[ConvProblem], target: Target) -> dict[str, Knobs]:
    return {p.name: tuned_knobs(p, target)[0] for p in problems}


def plan(p: ConvProblem, target: Target) -> KernelPlan:
    """One problem planned for a target (passes/plan.plan): its knobs looked up once, every decision of both
    artifacts (the module's form, phases, split and cp.async launches; the stream kernel's launches or why there
    is none)."""
    return planner.plan(p, target)


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
    return lower_to_mlir(problems, target, plans=[plan(p, target) for p in problems])


def compile_vmfb(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = (), *,
                 refresh: bool = False, progress: Optional[ProgressFn] = None) -> bytes:
    """The .vmfb for `problems` on `target` (compile(..., artifact="vmfb")'s bytes, for callers that pass IREE
    flags of their own or `refresh=True`: skip the lookup and overwrite the entry, used when a cached module
    failed to load).  `progress`, if given, is told each step of a compile; a cache hit has none."""
    target_plans = [plan(p, target) for p in problems]
    return _build_vmfb(target_plans, target, extra_flags, refresh, progress)[1]


def _build_vmfb(plans: Sequence[KernelPlan], target: Target, extra_flags: Sequence[str], refresh: bool,
                progress: Optional[ProgressFn]) -> tuple[str, bytes]:
    """The "vmfb" backend: the module's cache key and bytes, from the disk cache if present, else compiled and
    stored."""
    problems = [pl.problem for pl in plans]
    knobs = {pl.problem.name: pl.knobs for pl in plans}
    key = cache.cache_key(key_material(problems, target, knobs, extra_flags))
    if not refresh:
        cached = cache.load(key)
        if cached is not None:
            return key, cached
    mlir = lower_to_mlir(problems, target, knobs, progress, plans=plans, iree_flags=extra_flags)
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
    return key, vmfb


def _build_bundle(plans: Sequence[KernelPlan], target: Target) -> tuple[str, tuple[StreamKernel, ...],
                                                                    tuple[tuple[str, str], ...]]:
    """The "bundle" backend: each problem's stream kernel, compiled (or from the disk cache, stream.build_kernel),
    the problems without one with why, and the bundle's key: the kernels' plan keys in order."""
    kernels: list[StreamKernel] = []
    skipped: list[tuple[str, str]] = []
    keys: list[str] = []
    for pl in plans:
        if pl.stream is None:
            skipped.append((pl.problem.name, pl.stream_reason or "no stream kernel"))
            continue
        keys.append(stream.kernel_key(pl))
        kernels.append(stream.build_kernel(pl))
    key = cache.cache_key({"schema": KEY_SCHEMA, "artifact": "bundle", "kernels": keys})
    return key, tuple(kernels), tuple(skipped)


def iree_config_notes(problems: Sequence[ConvProblem], target: Target, extra_flags: Sequence[str] = ()
                      ) -> Optional[dict[str, dict]]:
    """What the compile of `problems` for `target` made of each kernel's knobs over IREE's configuration
    (KnobResult.as_dict by kernel name; kernels without such knobs absent), or None where that module has not
    been compiled into this cache."""
    note = cache.load_note(cache_key(list(problems), target, extra_flags))
    return None if note is None else note.get("iree_config", {})


ARTIFACTS = ("module", "vmfb", "bundle")


@dataclass(frozen=True)
class Artifact:
    """What compile() built: a module's bytes ("vmfb") or a bundle of stream kernels ("bundle"), from `plans`
    (one per problem), under `key` (it changes with anything that changes the bytes, the knobs included)."""

    kind: str
    target: Target
    plans: tuple[KernelPlan, ...]
    key: str
    data: bytes  # the .vmfb, or the bundle file (stream.bundle_bytes)
    kernels: tuple[StreamKernel, ...] = ()  # "bundle": the stream kernels, in the problems' order
    skipped: tuple[tuple[str, str], ...] = ()  # "bundle": (kernel name, why it has no stream kernel)

    @property
    def problems(self) -> list[ConvProblem]:
        return [pl.problem for pl in self.plans]

    def write(self, path: Union[str, Path]) -> Path:
        """The bytes to `path` (a bundle loads with stream.load_bundle; a module's manifest is CompiledModule.save's)."""
        path = Path(path)
        path.write_bytes(self.data)
        return path

    def module(self) -> CompiledModule:
        """The "vmfb" artifact as a module (loaded on first call), with what its knobs made of IREE's configuration."""
        if self.kind != "vmfb":
            raise ValueError(f"a {self.kind} artifact is no IREE module")
        note = cache.load_note(self.key)
        return CompiledModule(self.problems, self.target, self.data,
                              iree_config=None if note is None else note.get("iree_config", {}))


@overload
def compile(source: Union[str, Path, Sequence[ConvProblem]], target: Union[str, Target] = ..., arch: Optional[str] = ...,
            batch: Optional[int] = ..., kernels: Optional[Sequence[str]] = ..., progress: Optional[ProgressFn] = ..., *,
            artifact: Literal["module"] = ...) -> CompiledModule: ...


@overload
def compile(source: Union[str, Path, Sequence[ConvProblem]], target: Union[str, Target] = ..., arch: Optional[str] = ...,
            batch: Optional[int] = ..., kernels: Optional[Sequence[str]] = ..., progress: Optional[ProgressFn] = ..., *,
            artifact: Literal["vmfb", "bundle"]) -> Artifact: ...


def compile(
    source: Union[str, Path, Sequence[ConvProblem]],
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    batch: Optional[int] = None,
    kernels: Optional[Sequence[str]] = None,
    progress: Optional[ProgressFn] = None,
    *,
    artifact: str = "module",
) -> Union[CompiledModule, Artifact]:
    """Compile the kernels of a .conv file (path or text) or of problems already built for `target`, each planned
    once (`plan`), into one artifact: "module" (a CompiledModule, loaded on first call), "vmfb" (its bytes) or
    "bundle" (stream kernels for convdsl.torch; CUDA targets only; problems without one are listed in `skipped`).
    `kernels` keeps only the kernels so named; `progress`, if given, is told each step of a module's compile
    (convdsl.progress.CompileStep: a kernel lowered, then iree-compile)."""
    if artifact not in ARTIFACTS:
        raise ValueError(f"artifact: expected one of {', '.join(ARTIFACTS)}, got {artifact!r}")
    tgt = resolve_target(target, arch)
    problems = load_problems(source, batch)
    if kernels:
        unknown = [k for k in kernels if k not in {p.name for p in problems}]
        if unknown:
            raise ValueError(f"--kernel: no kernel named {', '.join(unknown)}; kernels: "
                             + ", ".join(p.name for p in problems))
        problems = [p for p in problems if p.name in kernels]
    plans = tuple(plan(p, tgt) for p in problems)
    if artifact == "bundle":
        if tgt.backend != "cuda":
            raise ValueError(f"artifact bundle: stream kernels are CUDA kernels; target is {tgt}")
        key, built, skipped = _build_bundle(plans, tgt)
        return Artifact("bundle", tgt, plans, key, stream.bundle_bytes(built), built, skipped)
    key, vmfb = _build_vmfb(plans, tgt, (), False, progress)
    built_vmfb = Artifact("vmfb", tgt, plans, key, vmfb)
    return built_vmfb.module() if artifact == "module" else built_vmfb
