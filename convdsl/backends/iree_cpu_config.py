"""Workgroup tiles of data-tiled CPU matmuls, set in IREE's own configuration between two phases of one compile.

With data tiling, IREE's llvm-cpu backend runs a matmul as `linalg.mmt4d` (`batch_mmt4d` with a batch) on packed
operands: the row operand as [M1, K1, M0, K0] tiles, the column operand as [N1, K1, N0, K0], and a lowering config
whose `distribution` list says how many row and column tiles one workgroup computes.  iree-compile stops after it
has configured the executables (`--compile-to=executable-configurations`, MLIR text), each packed matmul's
distribution is set by a rule (convdsl/policy decides; this module only reads shapes and edits the list), and
the compile resumes from there (`--compile-from=executable-configurations`).  The rest of IREE's configuration
(vector tiles, the microkernel) is kept.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

# a packed matmul as it appears in the configured executables, e.g.
#   linalg.mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 1, 0, 0, 0, 0], ...>}
#     ins(%8, %9 : tensor<8x12544x8x1xf32>, tensor<72x12544x8x1xf32>) ...
PACKED_MATMUL = re.compile(
    r"linalg\.(?P<op>batch_mmt4d|mmt4d) \{lowering_config = #iree_cpu\.lowering_config<"
    r"distribution = \[(?P<distribution>[0-9, ]*)\](?P<rest>[^>]*)>\} "
    r"ins\([^:]*: tensor<(?P<rows>[0-9x]+)x(?P<elem>[a-z0-9]+)>, tensor<(?P<columns>[0-9x]+)x[a-z0-9]+>\)")

ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i8": 1, "i32": 4}

# (batch, row tiles, column tiles, one row tile's panel in bytes) -> (row tiles, column tiles) per workgroup, or
# None to keep IREE's distribution
DistributionRule = Callable[[int, int, int, int], Optional[tuple[int, int]]]


@dataclass(frozen=True)
class PackedMatmul:
    """One configured packed matmul: its batch (1 without), row and column tile counts, the bytes of one row tile's
    panel over the whole reduction (K1 x M0 x K0 elements), and IREE's distribution list."""

    batch: int
    row_tiles: int
    column_tiles: int
    row_panel_bytes: int
    distribution: tuple[int, ...]

    def with_tiles(self, rows: int, columns: int) -> tuple[int, ...]:
        """The distribution list with `rows` x `columns` tiles per workgroup (and one batch entry per workgroup)."""
        lead = len(self.distribution) - 6  # batch_mmt4d: (batch, M1, N1, K1, M0, N0, K0); mmt4d without the batch
        return (*([1] * lead), rows, columns, *self.distribution[lead + 2:])


def packed_matmul(match: re.Match) -> Optional[PackedMatmul]:
    """The PackedMatmul a PACKED_MATMUL match describes, or None where its shapes are not the expected ranks."""
    rows = [int(v) for v in match["rows"].split("x")]
    columns = [int(v) for v in match["columns"].split("x")]
    batched = match["op"] == "batch_mmt4d"
    if len(rows) != (5 if batched else 4) or len(columns) != len(rows) or match["elem"] not in ELEMENT_BYTES:
        return None
    if batched:
        batch, rows, columns = rows[0], rows[1:], columns[1:]
    else:
        batch = 1
    m1, k1, m0, k0 = rows
    return PackedMatmul(batch, m1, columns[0], k1 * m0 * k0 * ELEMENT_BYTES[match["elem"]],
                        tuple(int(v) for v in match["distribution"].split(",")))


def with_distribution(configured: str, rule: DistributionRule) -> tuple[str, list[tuple[PackedMatmul, tuple]]]:
    """`configured` (iree-compile's output at executable-configurations) with each packed matmul's distribution
    set by `rule`, and the changes made: (the matmul, its new distribution list)."""
    changes: list[tuple[PackedMatmul, tuple]] = []

    def edit(match: re.Match) -> str:
        found = packed_matmul(match)
        tiles = rule(found.batch, found.row_tiles, found.column_tiles, found.row_panel_bytes) if found else None
        if found is None or tiles is None or found.with_tiles(*tiles) == found.distribution:
            return match[0]
        new = found.with_tiles(*tiles)
        changes.append((found, new))
        return match[0].replace(f"distribution = [{match['distribution']}]",
                                f"distribution = [{', '.join(str(v) for v in new)}]", 1)

    return PACKED_MATMUL.sub(edit, configured), changes
