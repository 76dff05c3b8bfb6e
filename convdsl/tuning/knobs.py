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
                ("ko"); None: policy.weight_k_inner's rule.  It interacts with the tiles.
  extern        CUDA: the GEMM core as Triton kernels in IREE external dispatches (True) or IREE's own
                lowering of the linalg form (False, label "linalg"); None: policy.extern_choice's rule.
  relayout      NGCHW with external kernels: copy the activations to NHWGC and back around them (label
                "cl") or address NGCHW in place (label "ncl"); None: policy.relayout_ngchw's rule.
  tiles         the Triton kernels' tiles (a kernels.tiles.TileConfig label, e.g. t128x128x64w8s4);
                None: the default tiles for the shape.

The fields left None defer to the rules of convdsl/policy.  How the configuration knobs reach IREE:
convdsl/backends/iree_config.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

from ..kernels.tiles import TILE_LABEL


# Knobs that act on the IR or on the Triton kernels rather than on IREE's configuration.
IR_CHOICES = ("pad", "k_inner", "extern", "relayout", "tiles")


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
        return replace(self, **{f: None for f in IR_CHOICES}).is_default

    def as_dict(self) -> dict:
        return asdict(self)

    def over(self, base: "Knobs") -> "Knobs":
        """These knobs (a tuning candidate's) laid over `base` (the tuned entry's): the IR and kernel choices
        left None here come from `base`; the IREE configuration scales are this set's alone."""
        return replace(self, **{f: getattr(base, f) for f in IR_CHOICES if getattr(self, f) is None})

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
