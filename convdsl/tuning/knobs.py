"""Knobs over IREE's GPU lowering configuration of a kernel's contraction dispatch.

IREE picks a `lowering_config` (workgroup, subgroup and reduction tiles, padding) and a
`translation_info` (pipeline, prefetch stages) for each dispatch.  Rather than writing configs from
scratch, convdsl scales IREE's own choice:

  n_scale       the workgroup tile of the innermost output dimension (the GEMM N: output channels)
  m_scale       the workgroup tile of the outermost tiled M dimension (rows of output pixels)
  k_scale       the reduction tile of the innermost reduction dimension (input channels per step)
  prefetch      software-pipelining depth (prefetch_num_stages)
  pad           how the zero border is built (passes/plan.py PAD_FORMS); None: plan.default_pad_form
  k_inner       grad_input's phase weights with the reduction channel innermost (label "ki") or outermost
                ("ko"); None: plan.weight_k_inner's rule.  It interacts with the tiles (CK 17, run 12).
  extern        CUDA: the GEMM core as Triton kernels in IREE external dispatches (True) or IREE's own
                lowering of the linalg form (False, label "linalg"); None: kernels/launch.py's rule.
  relayout      NGCHW with external kernels: copy the activations to NHWGC and back around them (label
                "cl") or address NGCHW in place (label "ncl"); None: kernels/launch.relayout_ngchw's rule.
  tiles         the Triton kernels' tiles (a kernels.launch.TileConfig label, e.g. t128x128x64w8s4);
                None: the default tiles for the shape.

Scaling a workgroup tile scales the matching subgroup tile too, so the number of subgroups (and the
workgroup size) stays the same and each subgroup does more work.  The mechanism is IREE's own:
`--iree-hal-dump-executable-configurations-to` writes each configured executable, we edit the
contraction's attributes, and `--iree-hal-substitute-executable-configurations-from` compiles the
edited ones.  (The tuning-spec flag is ignored by IREE's CUDA backend.)
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..kernels.tiles import TILE_LABEL
from ..targets import Target


@dataclass(frozen=True)
class Knobs:
    n_scale: int = 1
    m_scale: int = 1
    k_scale: float = 1.0
    prefetch: Optional[int] = None
    pad: Optional[str] = None
    k_inner: Optional[bool] = None
    extern: Optional[bool] = None
    relayout: Optional[bool] = None
    tiles: Optional[str] = None

    @property
    def is_default(self) -> bool:
        return self == Knobs()

    @property
    def config_default(self) -> bool:
        """Whether IREE's own lowering configuration is kept (pad, k_inner, extern and tiles act on the IR or
        on the Triton kernels, not on it)."""
        return Knobs(**{**self.as_dict(), "pad": None, "k_inner": None, "extern": None, "relayout": None,
                                   "tiles": None}).is_default

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        parts = []
        if self.n_scale != 1:
            parts.append(f"n{self.n_scale}")
        if self.m_scale != 1:
            parts.append(f"m{self.m_scale}")
        if self.k_scale != 1:
            parts.append(f"k{self.k_scale:g}")
        if self.prefetch is not None:
            parts.append(f"p{self.prefetch}")
        if self.pad is not None:
            parts.append(f"w{self.pad}")
        if self.k_inner is not None:
            parts.append("ki" if self.k_inner else "ko")
        if self.extern is False:
            parts.append("linalg")
        if self.relayout is not None:
            parts.append("cl" if self.relayout else "ncl")
        if self.tiles is not None:
            parts.append(self.tiles)
        return "-".join(parts) or "default"


def parse_label(label: str) -> Knobs:
    """The inverse of Knobs.label(): 'n2-m2-k0.5-p3-wfuse' or 'default'."""
    fields: dict = {}
    for part in label.split("-"):
        if part == "default" or not part:
            continue
        if part in ("ki", "ko"):
            fields["k_inner"] = part == "ki"
            continue
        if part == "linalg":
            fields["extern"] = False
            continue
        if part in ("cl", "ncl"):
            fields["relayout"] = part == "cl"
            continue
        if part.startswith("t") and TILE_LABEL.fullmatch(part):
            fields["tiles"] = part
            continue
        key, value = part[0], part[1:]
        if key == "n":
            fields["n_scale"] = int(value)
        elif key == "m":
            fields["m_scale"] = int(value)
        elif key == "k":
            fields["k_scale"] = float(value)
        elif key == "p":
            fields["prefetch"] = int(value)
        elif key == "w" and value in ("insert", "gather", "fuse"):
            fields["pad"] = value
        else:
            raise ValueError(f"knobs: expected parts n<int>, m<int>, k<float>, p<int>, w<insert|gather|fuse>, ki, ko, "
                             f"linalg, cl, ncl, t<M>x<N>x<K>w<warps>s<stages>[k<split>][g<group>], got {part!r} in {label!r}")
    return Knobs(**fields)


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
    from ..backends.iree import CompileError, compile_mlir

    active = {k: v for k, v in knobs_by_kernel.items() if not v.config_default}
    if not active or target.backend == "cpu":
        return compile_mlir(mlir, target, extra_flags)
    with tempfile.TemporaryDirectory(prefix="convdsl-tune-") as tmp:
        dumped, edited = Path(tmp) / "dumped", Path(tmp) / "edited"
        edited.mkdir()
        compile_mlir(mlir, target, [*extra_flags, "--compile-to=executable-configurations",
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
            return compile_mlir(mlir, target, extra_flags)
        try:
            return compile_mlir(mlir, target, [*extra_flags,
                                               f"--iree-hal-substitute-executable-configurations-from={edited}"])
        except CompileError:
            if strict:
                raise
            # knobs that IREE cannot lower for this shape (a heuristic's guess): IREE's own config
            return compile_mlir(mlir, target, extra_flags)
