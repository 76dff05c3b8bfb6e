"""Knobs over IREE's GPU lowering configuration, applied through IREE's own mechanism.

Scaling a workgroup tile scales the matching subgroup tile too, so the number of subgroups (and the
workgroup size) stays the same and each subgroup does more work.
`--iree-hal-dump-executable-configurations-to` writes each configured executable, we edit the
contraction's attributes, and `--iree-hal-substitute-executable-configurations-from` compiles the
edited ones.  (The tuning-spec flag is ignored by IREE's CUDA backend.)

Scaling is bounded by the target's workgroup memory (GpuFacts.workgroup_memory): a scaled configuration whose
tiles would not fit is scaled less (fit_knobs), and an edited configuration IREE still rejects falls back to
IREE's own for that executable alone, recorded in the KnobResult that compile_with_knobs_reported returns
(docs/decisions.md#iree-knob-memory).  IREE's "NOTE: hal.executable ... substituted" lines go to the
"convdsl.iree_config" logger at DEBUG level, not to stderr.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from ..targets import Target
from ..tuning.knobs import Knobs
from . import iree as _iree


_LIST = r"\[([0-9, ]*)\]"

log = logging.getLogger("convdsl.iree_config")


def _get(text: str, key: str) -> Optional[list[int]]:
    m = re.search(rf"\b{key} = {_LIST}", text)
    return [int(v) for v in m.group(1).split(",")] if m and m.group(1).strip() else None


def _set(text: str, key: str, values: Sequence[int]) -> str:
    return re.sub(rf"\b{key} = {_LIST}", f"{key} = [{', '.join(str(v) for v in values)}]", text, count=1)


# Bytes per element of the matrix instructions' operand and accumulator types, as IREE names them in mma_kind
# (MFMA_F32_16x16x16_F16, NV_MMA_SYNC_F32_16x8x16_BF16, MFMA_F32_16x16x32_F8E4M3FNUZ, ...).
def _type_bytes(name: str) -> Optional[int]:
    name = name.upper()
    if name.startswith(("F8", "I8", "BF8", "FP8")):
        return 1
    if name in ("F16", "BF16", "I16"):
        return 2
    if name in ("F32", "XF32", "I32"):
        return 4
    return None


_MMA = re.compile(r"mma_kind = #iree_gpu\.\w*mma_layout<(?:\w+?_)?([A-Z0-9]+)_(\d+)x(\d+)x(\d+)_([A-Z0-9]+)>")

# IREE pipelines whose prefetch stages load the next tiles into registers and keep one shared-memory buffer per
# promoted operand (IREE 3.13: TileAndFuse with prefetch_num_stages = 3 at exactly 64 KB compiles for gfx942).
# For any other pipeline each stage is counted as a buffer of its own, the cautious reading.
SINGLE_BUFFER_PIPELINES = ("TileAndFuse", "VectorDistribute")


def _extents(config: str) -> list[int]:
    """The iteration extents of the contraction's leading (parallel) loops, the sizes of its result: the lists'
    leading entries follow the result's dims where the result's indexing map is the identity on the leading loops
    (IREE's convolutions, im2col form included, and matmuls); [] where it is not, or the op cannot be read."""
    line = next((ln for ln in config.splitlines() if "mma_kind" in ln), "")
    out = re.search(r"outs\(%[\w#]+ : tensor<([0-9x]+)x[a-z][a-z0-9]*>\)", line)
    maps = re.findall(r"affine_map<\(([^)]*)\) -> \(([^)]*)\)>", line)
    if out is None or not maps:
        return []
    dims, results = (part.replace(" ", "").split(",") for part in maps[-1])
    extents = [int(v) for v in out.group(1).split("x")]
    return extents if results == dims[:len(results)] and len(results) == len(extents) else []


def _overhang(config: str, workgroup: Sequence[int], tiled: Sequence[int]) -> bool:
    """Whether a workgroup tile of an unpadded configuration overhangs its loop (larger than its extent, or not
    dividing it).  IREE then stages the accumulator tile through shared memory (measured on gfx942 with IREE 3.13:
    a 3D forward with 64 output channels and a 128-column tile used 106,496 bytes: 256 x 64 bf16 + 64 x 64 bf16 +
    256 x 64 f32).  A configuration with `padding` pads its operands to the tiles instead."""
    if re.search(r"\bpadding = ", config):
        return False
    extents = _extents(config)
    return any(i < len(extents) and (workgroup[i] > extents[i] or extents[i] % workgroup[i]) for i in tiled)


def _promoted(config: str) -> list[int]:
    m = re.search(rf"\bpromote_operands = {_LIST}", config)
    return [int(v) for v in m.group(1).split(",")] if m and m.group(1).strip() else [0, 1]


def _buffers(config: str, prefetch: Optional[int]) -> int:
    pipeline = re.search(r"pipeline = #iree_gpu\.pipeline<(\w+)>", config) or \
        re.search(r"#iree_codegen\.translation_info<pipeline = (\w+)", config)
    if pipeline and any(name in pipeline.group(1) for name in SINGLE_BUFFER_PIPELINES):
        return 1
    if prefetch is None:
        stages = re.search(r"prefetch_num_stages = (\d+)", config)
        prefetch = int(stages.group(1)) if stages else 1
    return max(1, prefetch)


def _scaled_lists(config: str, knobs: Knobs) -> Optional[dict[str, Optional[list[int]]]]:
    """The workgroup, subgroup, reduction and padding lists with `knobs` applied; None without a matrix-unit config."""
    if "mma_kind" not in config:
        return None
    lists = {k: _get(config, k) for k in ("workgroup", "subgroup", "reduction", "padding", "padding_conv")}
    workgroup, subgroup, reduction = lists["workgroup"], lists["subgroup"], lists["reduction"]
    padding, padding_conv = lists["padding"], lists["padding_conv"]
    if not workgroup or not subgroup or not reduction:
        return None
    tiled = [i for i, (w, s) in enumerate(zip(workgroup, subgroup)) if w > 0 and s > 0]
    if not tiled:
        return None
    n_dim, m_dim = tiled[-1], tiled[0] if len(tiled) > 1 else None

    def scale(index: Optional[int], factor: int) -> None:
        if index is None or factor == 1:
            return
        workgroup[index] *= factor
        subgroup[index] *= factor
        if padding and index < len(padding) and padding[index]:
            padding[index] *= factor
        if padding_conv and index < len(padding_conv) and padding_conv[index]:
            padding_conv[index] *= factor

    scale(n_dim, knobs.n_scale)
    scale(m_dim, knobs.m_scale)
    if knobs.k_scale != 1 and any(r > 0 for r in reduction):
        k_dim = max(i for i, r in enumerate(reduction) if r > 0)
        new = max(1, int(reduction[k_dim] * knobs.k_scale))
        if padding and k_dim < len(padding) and padding[k_dim]:
            padding[k_dim] = padding[k_dim] * new // reduction[k_dim]
        reduction[k_dim] = new
    return lists


@dataclass(frozen=True)
class _Tile:
    """One workgroup's contraction tile as IREE allocates it: rows, columns and reduction depth in elements (each
    dim clamped to its loop where an unpadded tile overhangs it), whether the accumulator is staged, and the
    products that compute something (rows x columns x depth, each dim clamped to its loop)."""

    rows: int
    columns: int
    depth: int
    staged: bool
    useful: int


def _tile(config: str, knobs: Knobs) -> Optional[tuple[_Tile, re.Match]]:
    lists = _scaled_lists(config, knobs)
    mma = _MMA.search(config)
    if lists is None or mma is None:
        return None
    workgroup, subgroup, reduction = lists["workgroup"], lists["subgroup"], lists["reduction"]
    tiled = [i for i, (w, s) in enumerate(zip(workgroup, subgroup)) if w > 0 and s > 0]
    staged = _overhang(config, workgroup, tiled)
    extents = _extents(config)
    clamped = [min(workgroup[i], extents[i]) if i < len(extents) else workgroup[i] for i in tiled]
    sizes = clamped if staged else [workgroup[i] for i in tiled]
    reduced = [i for i, r in enumerate(reduction) if r > 0]
    depth = 1
    for i in reduced:
        depth *= reduction[i] * (int(mma.group(4)) if i == reduced[-1] else 1)
    return _Tile(math.prod(sizes[:-1]), sizes[-1], depth, staged, math.prod(clamped) * depth), mma


def workgroup_memory_bytes(config: str, knobs: Knobs = Knobs()) -> Optional[int]:
    """The shared memory the contraction's tiles take with `knobs` applied: A (rows x reduction) and B (reduction
    x columns) in the operands' element size and the accumulator (rows x columns) where it is promoted too, times
    the pipeline's buffers, plus the accumulator once where it is staged (_overhang).  Rows: the workgroup tile's
    dims other than the columns' (the innermost tiled one); reduction: the reduction tiles, the innermost in units
    of the instruction's K (IREE's units).  IREE pads the tiles' rows against bank conflicts only where the
    padding still fits, so it is not counted.  None where the config cannot be read (no matrix-unit config, an
    mma_kind not recognised)."""
    found = _tile(config, knobs)
    if found is None:
        return None
    tile, mma = found
    acc_bytes, operand_bytes = _type_bytes(mma.group(1)), _type_bytes(mma.group(5))
    if acc_bytes is None or operand_bytes is None:
        return None
    promoted = _promoted(config)
    operands = ((tile.rows * tile.depth if 0 in promoted else 0)
                + (tile.depth * tile.columns if 1 in promoted else 0)) * operand_bytes
    accumulator = tile.rows * tile.columns * acc_bytes
    total = (operands + (accumulator if 2 in promoted else 0)) * _buffers(config, knobs.prefetch)
    return total + (accumulator if tile.staged and 2 not in promoted else 0)


def _tile_volume(config: str, knobs: Knobs) -> int:
    """The products of one workgroup's tile with `knobs` that compute something (_Tile.useful)."""
    found = _tile(config, knobs)
    return 0 if found is None else found[0].useful


def _halvings(value: int) -> list[int]:
    out = [value]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def fit_knobs(config: str, knobs: Knobs, workgroup_memory: int) -> Knobs:
    """`knobs`, or the largest scaling below them whose tiles fit in `workgroup_memory` bytes (workgroup_memory_bytes):
    N, M and a K scale above 1 are halved down to 1, and of the fitting choices the one with the largest tile IREE
    computes (rows x columns x depth, each clamped to its loop) is taken, then the larger N x M x K scaling, N kept
    before M.  Knobs the config cannot be measured for are returned as they are."""
    asked = workgroup_memory_bytes(config, knobs)
    if asked is None or asked <= workgroup_memory or knobs.config_default:
        return knobs
    k_choices = [knobs.k_scale] + [k for k in _halvings(int(knobs.k_scale)) if k < knobs.k_scale]
    prefetches = [knobs.prefetch] if knobs.prefetch is None else _halvings(knobs.prefetch)
    fitting = []
    for n in _halvings(knobs.n_scale):
        for m in _halvings(knobs.m_scale):
            for k in k_choices:
                for p in prefetches:
                    candidate = replace(knobs, n_scale=n, m_scale=m, k_scale=float(k), prefetch=p)
                    size = workgroup_memory_bytes(config, candidate)
                    if size is not None and size <= workgroup_memory:
                        fitting.append(((_tile_volume(config, candidate), n * m * k, n, m, k, p or 0), candidate))
    if not fitting:
        # not even IREE's own tiles fit as measured here: keep IREE's configuration
        return replace(knobs, n_scale=1, m_scale=1, k_scale=1.0, prefetch=None)
    return max(fitting, key=lambda item: item[0])[1]


def apply_knobs(config: str, knobs: Knobs, workgroup_memory: Optional[int] = None) -> Optional[str]:
    """Edit one configured executable's contraction config; None when it has no matrix-unit config.
    With `workgroup_memory` the knobs are first fitted to it (fit_knobs)."""
    if "mma_kind" not in config or knobs.config_default:
        return None if "mma_kind" not in config else config
    if workgroup_memory is not None:
        knobs = fit_knobs(config, knobs, workgroup_memory)
    lists = _scaled_lists(config, knobs)
    if lists is None:
        return None
    out = config
    for key in ("workgroup", "subgroup", "reduction", "padding", "padding_conv"):
        if lists[key]:
            out = _set(out, key, lists[key])
    if knobs.prefetch is not None:
        out = re.sub(r"prefetch_num_stages = \d+", f"prefetch_num_stages = {knobs.prefetch}", out)
    return out


@dataclass(frozen=True)
class DispatchConfig:
    """One contraction dispatch of a kernel as compiled: its executable's name, the knobs applied to IREE's
    configuration of it (fitted to the target's workgroup memory), and the shared memory they take (None: not
    measurable), with the asked knobs' where they were scaled down; `rejected`: IREE's error where it rejected
    the edited configuration and compiled this executable with its own."""

    executable: str
    applied: Knobs
    memory_bytes: Optional[int]
    asked_memory_bytes: Optional[int] = None
    workgroup: tuple[int, ...] = ()
    reduction: tuple[int, ...] = ()
    rejected: Optional[str] = None

    def as_dict(self) -> dict:
        return {"executable": self.executable, "applied": self.applied.label(), "memory_bytes": self.memory_bytes,
                "asked_memory_bytes": self.asked_memory_bytes, "workgroup": list(self.workgroup),
                "reduction": list(self.reduction), "rejected": self.rejected}


@dataclass(frozen=True)
class KnobResult:
    """What became of one kernel's knobs over IREE's configuration in one compile: the knobs asked, each
    contraction dispatch's applied configuration, and, where IREE's own configuration was kept instead of
    an edited one, why (`default_kept`: IREE's error for the first such dispatch, or no matrix-unit dispatch
    to edit; which dispatches: DispatchConfig.rejected)."""

    kernel: str
    asked: Knobs
    workgroup_memory: int
    dispatches: tuple[DispatchConfig, ...] = ()
    default_kept: Optional[str] = None

    @property
    def fitted(self) -> bool:
        """Whether some dispatch took a smaller scaling than asked, to fit the workgroup memory."""
        return any(d.applied != self.asked for d in self.dispatches if d.rejected is None)

    def describe(self) -> str:
        """One line for `convdsl explain` and the log."""
        asked = self.asked.label()
        if self.default_kept is not None and not self.dispatches:
            return f"IREE configuration: knobs {asked} unused: {self.default_kept}"
        if self.dispatches and all(d.rejected is not None for d in self.dispatches):
            return f"IREE's default configuration kept (knobs {asked} not applied): {self.default_kept}"
        parts = []
        for d in self.dispatches:
            if d.rejected is not None:
                parts.append(f"{d.executable}: IREE's default configuration kept (knobs {asked} not applied): "
                             f"{d.rejected}")
            elif d.applied == self.asked:
                parts.append(f"{d.executable}: {asked} as asked" +
                             (f" ({d.memory_bytes} bytes of workgroup memory)" if d.memory_bytes is not None else ""))
            else:
                parts.append(f"{d.executable}: {asked} needs {d.asked_memory_bytes} bytes of workgroup memory, the "
                             f"target has {self.workgroup_memory}: scaled to {d.applied.label()} "
                             f"({d.memory_bytes} bytes)")
        return "IREE configuration: " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "asked": self.asked.label(), "workgroup_memory": self.workgroup_memory,
                "dispatches": [d.as_dict() for d in self.dispatches], "default_kept": self.default_kept,
                "note": self.describe()}


def _error_lines(message: str) -> list[str]:
    return [ln.strip() for ln in message.splitlines() if "error:" in ln]


def _first_error(message: str, executable: str) -> str:
    """IREE's first error line about `executable` (else its first error line), without the source location."""
    lines = _error_lines(message)
    about = [ln for ln in lines if _names(ln, executable)] or lines
    if not about:
        return "iree-compile rejected the edited configuration"
    return re.sub(r"^.*?error:\s*", "", about[0])[:400]


def _names(text: str, executable: str) -> bool:
    """Whether `text` names the executable or one of its functions (`<executable>_<op>`): c1_fwd_dispatch_1 is
    not named by fwd_dispatch_1 nor by c1_fwd_dispatch_10."""
    return re.search(rf"(?<![\w$]){re.escape(executable)}(?!\d)", text) is not None


def _executable(config: str) -> Optional[str]:
    m = re.search(r"hal\.executable public @([\w$.-]+)", config)
    return m.group(1) if m else None


def _kernel_of(executable: str, kernels: Sequence[str]) -> Optional[str]:
    """The kernel an executable belongs to: IREE names a function's dispatches <function>_dispatch_<n>."""
    return next((k for k in kernels if re.fullmatch(rf"{re.escape(k)}_dispatch_\d+", executable)), None)


# IREE prints one of these per substituted executable on every compile that substitutes one
_SUBSTITUTED_NOTE = re.compile(r"^NOTE: hal\.executable .* substituted with MLIR source at ")


@contextlib.contextmanager
def _substitution_notes_to_log():
    """IREE's substitution NOTE lines (which iree.compiler writes to sys.stderr after a successful compile) to
    the log at DEBUG level; every other line iree-compile printed still goes to stderr."""
    real, captured = sys.stderr, io.StringIO()
    sys.stderr = captured
    try:
        yield
    finally:
        sys.stderr = real
        for line in captured.getvalue().splitlines(keepends=True):
            if _SUBSTITUTED_NOTE.match(line):
                log.debug("%s", line.rstrip())
            else:
                real.write(line)


def _with_saved_configurations(err: _iree.CompileError, edited: Path) -> _iree.CompileError:
    """`err` with the edited configurations its reproducing command reads copied beside the saved input: the
    temporary folder they were compiled from goes away with the compile."""
    digest = hashlib.sha256()
    for path in sorted(edited.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    saved = _iree.failure_dir() / f"configurations-{digest.hexdigest()[:16]}"
    shutil.copytree(edited, saved, dirs_exist_ok=True)
    return _iree.CompileError(str(err).replace(str(edited), str(saved)))


def compile_with_knobs(mlir: str, target: Target, knobs_by_kernel: dict[str, Knobs],
                       extra_flags: Sequence[str] = (), strict: bool = False) -> bytes:
    """Compile `mlir` with each named kernel's contraction dispatch configured by its knobs.

    strict=False (compiles): knobs IREE rejects fall back to IREE's config; strict=True (tuning): raise.
    What became of each kernel's knobs: compile_with_knobs_reported.
    """
    return compile_with_knobs_reported(mlir, target, knobs_by_kernel, extra_flags, strict)[0]


def compile_with_knobs_reported(mlir: str, target: Target, knobs_by_kernel: dict[str, Knobs],
                                extra_flags: Sequence[str] = (), strict: bool = False
                                ) -> tuple[bytes, dict[str, KnobResult]]:
    """compile_with_knobs, and for each kernel with knobs over IREE's configuration a KnobResult: the scaling
    applied to each of its dispatches (fitted to the target's workgroup memory), or why IREE's own configuration
    was kept.  An executable whose edited configuration IREE rejects keeps IREE's (every other one keeps its
    edited configuration; all of them where IREE's error names none); each such fallback is logged as a warning
    on the "convdsl.iree_config" logger."""
    active = {k: v for k, v in knobs_by_kernel.items() if not v.config_default}
    if not active or target.backend == "cpu":
        return _iree.compile_mlir(mlir, target, extra_flags), {}
    limit = target.gpu.workgroup_memory
    results: dict[str, KnobResult] = {}
    with tempfile.TemporaryDirectory(prefix="convdsl-tune-") as tmp:
        dumped, edited = Path(tmp) / "dumped", Path(tmp) / "edited"
        edited.mkdir()
        _iree.compile_mlir(mlir, target, [*extra_flags, "--compile-to=executable-configurations",
                                          f"--iree-hal-dump-executable-configurations-to={dumped}"])
        files: dict[str, Path] = {}  # executable -> its edited configuration
        owner: dict[str, str] = {}  # executable -> kernel
        dispatches: dict[str, list[DispatchConfig]] = {k: [] for k in active}
        for path in sorted(dumped.glob("*.mlir")):
            config = path.read_text()
            executable = _executable(config)
            kernel = _kernel_of(executable, list(active)) if executable else None
            if kernel is None or "mma_kind" not in config:
                continue
            knobs = active[kernel]
            fitted = fit_knobs(config, knobs, limit)
            text = apply_knobs(config, fitted)
            if text is None:
                continue
            # the substitution looks executables up by name: configured_<module>_<name>.mlir -> <module>_<name>.mlir
            name = path.name.removeprefix("configured_")
            (edited / name).write_text(text)
            files[executable], owner[executable] = edited / name, kernel
            lists = _scaled_lists(config, fitted) or {}
            dispatches[kernel].append(DispatchConfig(
                executable, fitted, workgroup_memory_bytes(config, fitted),
                workgroup_memory_bytes(config, knobs) if fitted != knobs else None,
                tuple(lists.get("workgroup") or ()), tuple(lists.get("reduction") or ())))
        for kernel, knobs in active.items():
            if not dispatches[kernel]:
                results[kernel] = KnobResult(kernel, knobs, limit, default_kept=(
                    "no contraction dispatch on matrix instructions in IREE's configuration to edit"))
            else:
                results[kernel] = KnobResult(kernel, knobs, limit, tuple(dispatches[kernel]))
                if results[kernel].fitted:
                    log.info("%s: %s", kernel, results[kernel].describe())
        while True:
            if not files:
                vmfb = _iree.compile_mlir(mlir, target, extra_flags)
                break
            try:
                with _substitution_notes_to_log():
                    vmfb = _iree.compile_mlir(mlir, target, [
                        *extra_flags, f"--iree-hal-substitute-executable-configurations-from={edited}"])
                break
            except _iree.CompileError as err:
                if strict:
                    raise _with_saved_configurations(err, edited) from None
                # a configuration IREE cannot lower for this shape: IREE's own for the executables its errors
                # name (every edited one where they name none), the others kept
                message = str(err)
                errors = "\n".join(_error_lines(message))
                named = [ex for ex in files if _names(errors, ex)] or list(files)
                for executable in named:
                    files.pop(executable).unlink()
                    kernel = owner[executable]
                    reason = "iree-compile rejected the edited configuration: " + _first_error(message, executable)
                    result = results[kernel]
                    results[kernel] = replace(
                        result, default_kept=result.default_kept or reason,
                        dispatches=tuple(replace(d, rejected=reason) if d.executable == executable else d
                                         for d in result.dispatches))
                for kernel in sorted({owner[ex] for ex in named}, key=list(active).index):
                    log.warning("%s on %s: %s", kernel, target, results[kernel].describe())
    return vmfb, results
