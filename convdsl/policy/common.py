"""Rules every target family reads: the gather forms of few-channel groups, the 1x1 grad_weight's operand order,
and how a reduction is cut into split-K chunks."""
from __future__ import annotations

import math

from ..kernels.launch import reduction_steps
from ..kernels.tiles import TileConfig
from ..problem import ConvProblem
from ..targets import Target

# Backends whose NGCHW kernels run channels-last between layout copies (IREE's GPU backends miscompiled
# channel-first implicit GEMMs in f16/bf16).
CHANNELS_LAST_BACKENDS = ("cuda", "rocm")

# Channels per group (C*K) up to which the gather forms are used on GPUs; above it the GEMM forms win.
MAX_GROUP_MACS = 16
# The gather grad_input keeps one weight operand per (tap, k): a bound on the generic's operand count.
MAX_WEIGHT_SLICES = 64
# grad_weight: row blocks are chosen so that the partial sums number at least this many (enough
# threads to fill an H100/H200: 132 SMs x 2048 threads = 270k), measured best near 600k.
MIN_PARTIALS = 600_000


def gather_applies(p: ConvProblem) -> bool:
    """Is `p` a small-group gradient that the gather forms handle (static shapes, no fp8 compute)?  A split_k
    asked for keeps grad_weight off it: its partial sums are blocks of output rows of its own
    (gather_row_blocks), not split-K chunks."""
    if p.groups == 1 or p.in_channels * p.out_channels > MAX_GROUP_MACS or p.dynamic_batch or p.fp8_compute \
            or p.split_k is not None:
        return False
    if p.op in ("grad_input", "transposed"):
        return math.prod(p.filter) * p.out_channels <= MAX_WEIGHT_SLICES
    # 3D grad_weight: IREE 3.13's CUDA backend fails on the 11-loop partial-sum generic ("failed to
    # distribute"); it keeps the depthwise / GEMM form
    return p.op == "grad_weight" and p.dims <= 2


def gather_row_blocks(p: ConvProblem) -> int:
    """B, the number of blocks the first output dim is cut into for the gather grad_weight's partial sums.

    The smallest divisor B of O0 with N * B * |W| >= MIN_PARTIALS (all of O0 when none is enough):
    each partial then sums R = O0 / B rows, as long a serial reduction per thread as the GPU allows.
    """
    o0 = p.output[0]
    weights = math.prod(p.w_shape)
    for b in range(1, o0 + 1):
        if o0 % b == 0 and p.batch * b * weights >= MIN_PARTIALS:
            return b
    return o0


def dy_first(p: ConvProblem, target: Target) -> bool:
    """GPU 1x1 grad_weight: dY is the contraction's first operand.  With one tap it is IREE's plain matmul
    path, which computed garbage for it with X first; with dY first the same contraction is right."""
    return (p.op == "grad_weight" and math.prod(p.filter) == 1 and not p.depthwise
            and target.backend in CHANNELS_LAST_BACKENDS)


def even_chunks(steps: int, parts: int, most: int) -> tuple[int, int]:
    """(S, CHUNK): `steps` cut into about `parts` chunks of CHUNK steps (the last one shorter), at most `most`
    and at most one a step; S recounted so that no chunk is empty (7 steps in 3: chunks of 3, S = 3; 4 steps
    in 3: chunks of 2, S = 2)."""
    parts = max(1, min(parts, steps, most))
    chunk = -(-steps // parts)
    return -(-steps // chunk), chunk


def honoured_split(p: ConvProblem, split: tuple[int, int], most: int, kernel: str, cut: str) -> tuple[int, int]:
    """The split, where it is the problem's split_k or none was asked for; else a ValueError naming `kernel` and what
    it cuts (`cut`): a split_k is never silently changed."""
    if p.split_k is not None and split[0] != p.split_k:
        raise ValueError(f"kernel {p.name}: split_k = {p.split_k} cannot be honoured by the {kernel} (its split cuts "
                         f"{cut} into chunks of equal length, at most {most}: {split[0]} chunks of "
                         f"{split[1]} come nearest)")
    return split


def reduction_split(p: ConvProblem, tiles: TileConfig, parts: int, target: Target, kernel: str = "grad_weight kernel"
                    ) -> tuple[int, int]:
    """(S, CHUNK): grad_weight's reduction over N * prod(O) positions, in steps of the tiles' reduction block, cut
    into about `parts` chunks of whole steps (even_chunks; CHUNK in positions, the last chunk shorter).  A split_k
    this cut cannot give is refused (a ValueError naming `kernel`)."""
    steps = reduction_steps(p, tiles)
    most = target.max_grid[2]  # the chunks are the grid's z
    parts, chunk = honoured_split(p, even_chunks(steps, parts, most), most, kernel,
                                  f"{steps} reduction steps of {tiles.block_k} positions")
    return parts, chunk * tiles.block_k


# the weight layout the GEMM kernels read fast where they read the weight (forward, grad_input, transposed)
FAST_WEIGHT_LAYOUT = "GKYXC"
