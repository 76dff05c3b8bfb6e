"""Knobs over IREE's GPU lowering configuration, applied through IREE's own mechanism.

Scaling a workgroup tile scales the matching subgroup tile too, so the number of subgroups (and the
workgroup size) stays the same and each subgroup does more work.
`--iree-hal-dump-executable-configurations-to` writes each configured executable, we edit the
contraction's attributes, and `--iree-hal-substitute-executable-configurations-from` compiles the
edited ones.  (The tuning-spec flag is ignored by IREE's CUDA backend.)
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ..targets import Target
from ..tuning.knobs import Knobs
from . import iree as _iree


_LIST = r"\[([0-9, ]*)\]"


def _get(text: str, key: str) -> Optional[list[int]]:
    m = re.search(rf"\b{key} = {_LIST}", text)
    return [int(v) for v in m.group(1).split(",")] if m and m.group(1).strip() else None


def _set(text: str, key: str, values: Sequence[int]) -> str:
    return re.sub(rf"\b{key} = {_LIST}", f"{key} = [{', '.join(str(v) for v in values)}]", text, count=1)


def apply_knobs(config: str, knobs: Knobs) -> Optional[str]:
    """Edit one configured executable's contraction config; None when it has no matrix-unit config."""
    if "mma_kind" not in config or knobs.config_default:
        return None if "mma_kind" not in config else config
    workgroup, subgroup = _get(config, "workgroup"), _get(config, "subgroup")
    reduction, padding = _get(config, "reduction"), _get(config, "padding")
    padding_conv = _get(config, "padding_conv")
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
    if knobs.k_scale != 1:
        k_dim = max(i for i, r in enumerate(reduction) if r > 0)
        new = max(1, int(reduction[k_dim] * knobs.k_scale))
        if padding and k_dim < len(padding) and padding[k_dim]:
            padding[k_dim] = padding[k_dim] * new // reduction[k_dim]
        reduction[k_dim] = new
    out = _set(_set(_set(config, "workgroup", workgroup), "subgroup", subgroup), "reduction", reduction)
    if padding:
        out = _set(out, "padding", padding)
    if padding_conv:
        out = _set(out, "padding_conv", padding_conv)
    if knobs.prefetch is not None:
        out = re.sub(r"prefetch_num_stages = \d+", f"prefetch_num_stages = {knobs.prefetch}", out)
    return out


def compile_with_knobs(mlir: str, target: Target, knobs_by_kernel: dict[str, Knobs],
                       extra_flags: Sequence[str] = (), strict: bool = False) -> bytes:
    """Compile `mlir` with each named kernel's contraction dispatch configured by its knobs.

    strict=False (compiles): knobs IREE rejects fall back to IREE's config; strict=True (tuning): raise.
    """
    active = {k: v for k, v in knobs_by_kernel.items() if not v.config_default}
    if not active or target.backend == "cpu":
        return _iree.compile_mlir(mlir, target, extra_flags)
    with tempfile.TemporaryDirectory(prefix="convdsl-tune-") as tmp:
        dumped, edited = Path(tmp) / "dumped", Path(tmp) / "edited"
        edited.mkdir()
        _iree.compile_mlir(mlir, target, [*extra_flags, "--compile-to=executable-configurations",
                                    f"--iree-hal-dump-executable-configurations-to={dumped}"])
        for path in dumped.glob("*.mlir"):
            kernel = next((k for k in active if f"_{k}_dispatch_" in path.name), None)
            if kernel is None:
                continue
            text = apply_knobs(path.read_text(), active[kernel])
            if text is not None:
                # the substitution looks executables up by name: configured_<name>.mlir -> <name>.mlir
                (edited / path.name.removeprefix("configured_")).write_text(text)
        if not any(edited.iterdir()):
            return _iree.compile_mlir(mlir, target, extra_flags)
        try:
            return _iree.compile_mlir(mlir, target, [*extra_flags,
                                               f"--iree-hal-substitute-executable-configurations-from={edited}"])
        except _iree.CompileError:
            if strict:
                raise
            # knobs that IREE cannot lower for this shape (a heuristic's guess): IREE's own config
            return _iree.compile_mlir(mlir, target, extra_flags)
