"""Tiles of a Triton GEMM core: the one knob family of the external kernels (the tuner's candidates)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# t<M>x<N>x<K>w<warps>s<stages>[k<split>][g<group>][p<pack>]: no "-", which separates the parts of a Knobs label
TILE_LABEL = re.compile(r"t(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:k(\d+))?(?:g(\d+))?(?:p(\d+))?")


# the matrix instructions' smallest block
MATRIX_BLOCK = 16


def matrix_block(n: int, largest: Optional[int] = None) -> int:
    """A GEMM block for an extent of n: the power of two that covers it, at least MATRIX_BLOCK, at most
    `largest` (if given)."""
    block = max(MATRIX_BLOCK, 1 << (max(n, 1) - 1).bit_length())
    return block if largest is None else min(block, largest)


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one launch: rows (M) x columns (N) x reduction step, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8  # grad_input: row tiles that share weight columns in L2
    split: int = 0  # grad_weight: reduction chunks S (0: from the shape)
    pack: int = 1  # grouped GEMMs: consecutive groups per GEMM (block-diagonal weight; policy.default_pack)

    def __post_init__(self) -> None:
        for key in ("block_m", "block_n", "block_k"):
            v = getattr(self, key)
            if v < 1 or v & (v - 1):
                raise ValueError(f"tiles: {key} must be a power of two, got {v}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"tiles: warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.stages < 1 or self.group_m < 1 or self.split < 0:
            raise ValueError(f"tiles: stages and group_m must be positive and split >= 0, got {self}")
        if self.pack < 1 or self.pack & (self.pack - 1):
            raise ValueError(f"tiles: pack must be a power of two, got {self.pack}")

    def check_matrix(self) -> None:
        """The GEMM kernels' tiles feed the matrix instructions: every block at least 16."""
        if min(self.block_m, self.block_n, self.block_k) < MATRIX_BLOCK:
            raise ValueError(f"tiles: a GEMM core's blocks must be at least 16 (the matrix instructions' size), "
                             f"got {self.label()}")

    def label(self) -> str:
        s = f"t{self.block_m}x{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"
        s += f"k{self.split}" if self.split else ""
        s += f"g{self.group_m}" if self.group_m != 8 else ""
        return s + (f"p{self.pack}" if self.pack != 1 else "")


def parse_tiles(label: str) -> TileConfig:
    match = TILE_LABEL.fullmatch(label)
    if not match:
        raise ValueError(f"tiles: expected t<M>x<N>x<K>w<warps>s<stages>[k<split>][g<group>][p<pack>], "
                         f"got {label!r}")
    m, n, k, w, s, split, group, pack = match.groups()
    return TileConfig(int(m), int(n), int(k), int(w), int(s), group_m=int(group or 8), split=int(split or 0),
                      pack=int(pack or 1))
