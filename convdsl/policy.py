"""Every planning decision in one place: which form a kernel takes, its tiles, packed groups, split-K, the
zero-border form, the operand precision, and the knobs over IREE's own GPU configuration.

The decisions are plain functions of the problem, the target (whose hardware facts, `Target.gpu`, size the
grids) and the kernel's knobs (tuned or asked for; convdsl/tuning).  The passes ask these functions and build
IR; convdsl/kernels builds the launches they decide; nothing here builds IR or reads the tuning database.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Iterator, NamedTuple, Optional, Sequence, Union

from dataclasses import dataclass, replace

from .algebra import grad_input_phases
from .kernels.compile import gluon_tma_im2col, triton_version
from .kernels.elementwise_launches import (SPLIT_PRODUCTS, pad_planes_launch, round_fp8_launch, split_bf16_launch,
                                           sum_partials_launch)
from .kernels.igemm_launches import (forward_direct_launch, forward_launch, grad_input_direct_launch,
                                     grad_input_launch, grad_weight_depthwise_launch, grad_weight_launch)
from .kernels.launch import (ELEMENT, ELEMENT_BYTES, Launch, TmaMap, depthwise_channel_blocks, flat_elements,
                             flat_planes, geometry, grad_input_phases_tiles, halo_grid, im2col_box, output_tiles, pad3,
                             packable, packed_sizes, phases_window, reduction_steps, tiles_within_images)
from .kernels.tma_launches import (forward_halo_launch, forward_tma_launch, grad_input_phases_tma_launch,
                                   grad_weight_flat_tma_launch, grad_weight_tma_launch)
from .kernels.tiles import MATRIX_BLOCK, TileConfig, matrix_block, parse_tiles
from .problem import ConvProblem, weight_axes
from .targets import Target
from .tuning.knobs import Knobs

# --- which form ------------------------------------------------------------------------------------

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


def cpu_gather_forward(p: ConvProblem, target: Target) -> bool:
    """CPU forward with few channels per group (not depthwise): the gather form, each output element reading its
    taps' X values, as the gradients with few channels do; the implicit-GEMM generic was slower
    (docs/decisions.md#cpu-gather-forward).  GPUs keep their forward forms."""
    return (target.backend == "cpu" and p.op == "forward" and p.groups > 1 and not p.depthwise
            and p.in_channels * p.out_channels <= MAX_GROUP_MACS and not p.dynamic_batch and not p.fp8_compute
            and math.prod(p.filter) * p.in_channels <= MAX_WEIGHT_SLICES)


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


def cpu_im2col(p: ConvProblem, target: Target) -> bool:
    """CPU convolutions with channels, forward and gradients: the form "im2col" (a window gather, then a named
    linalg.matmul / batch_matmul per group, passes/gemm.py), which IREE's llvm-cpu backend runs through data tiling
    and its matmul microkernels; its implicit-GEMM generics ran 3 to 30x slower than PyTorch
    (docs/decisions.md#cpu-im2col, #cpu-forward-im2col).
    Depthwise kernels (no GEMM) and few-channel groups (the gather form) keep their forms; fp8 compute, bf16x3
    (whose split operands feed the implicit-GEMM form), `batch = ?` and a split_k the im2col grad_weight cannot cut
    (cpu_im2col_split_reason) keep the implicit-GEMM form, which cuts the batch (algebra.plan_split_k)."""
    return (target.backend == "cpu" and not p.depthwise and not gather_applies(p) and not cpu_gather_forward(p, target)
            and not p.fp8_compute and not p.bf16x3 and not p.dynamic_batch and cpu_im2col_split_reason(p) is None)


def cpu_depth_to_space(p: ConvProblem, target: Target) -> bool:
    """CPU im2col grad_input (and transposed) whose windows do not overlap: stride = filter (more than one tap),
    dilation 1.  Each dX position is then reached by one (output position q, tap j) only, and grad_input is one
    matmul over dY as it lies and W as it lies (no window gather, no weight copy) followed by a depth-to-space
    transpose:  R[g, (n, q), (j, c)] = sum_k dY[n, q, g, k] W[g, k, j, c],  dX[n, s*q + j - lo, g, c] = R[...]
    (zeros where no window reaches, positions past the last window; form "im2col", passes/lower.py).
    The stride-phase form made one 1-tap GEMM per phase, each over the same dY and a strided slice W[:, j, :]; with
    data tiling (more than CPU_UNPACKED_MOST_COLUMNS columns, or any module with a data-tiled kernel, e.g. a
    grad_weight beside it) IREE 3.13 fused that slice's packing into the matmul's dispatch with the whole
    reduction in one tile on the stack, past the CPU's 32,768 bytes: ConvNeXt's downsampling grad_input
    (Conv2d(384, 768, 2, stride=2): 768 x 64 f32 + the 8 x 16 accumulator = 197,120 bytes) and every such
    grad_input measured (C = 96 to 384) failed to compile (issue 45)."""
    return (cpu_im2col(p, target) and p.op in ("grad_input", "transposed") and tuple(p.stride) == tuple(p.filter)
            and math.prod(p.filter) > 1 and all(d == 1 for d in p.dilation))


# im2col forward and grad_input on the CPU: the most columns (K, C per group) their matmul runs unpacked
# (cpu_data_tiling)
CPU_UNPACKED_MOST_COLUMNS = 128


def _unpacked_matmul(p: ConvProblem, target: Target) -> bool:
    """An im2col kernel whose matmul multiplies a window gather by a narrow weight: forward (columns K) or
    grad_input (columns C) with more than one tap and at most CPU_UNPACKED_MOST_COLUMNS columns.  A grad_input
    of non-overlapping windows (cpu_depth_to_space: dY as it lies, no gather, taps x C columns) keeps the rule by
    C: unpacked it ran about as fast as the phase form, packed 1.2-1.4x slower (C = 32 to 96, 2x2 stride 2)."""
    columns = p.out_channels if p.op == "forward" else p.in_channels
    return (cpu_im2col(p, target) and p.op in ("forward", "grad_input", "transposed") and math.prod(p.filter) > 1
            and columns <= CPU_UNPACKED_MOST_COLUMNS)


def cpu_data_tiling(problems: Sequence[ConvProblem], target: Target) -> bool:
    """Whether a CPU module is compiled with IREE's data tiling and matmul microkernels (Target.compile_flags).

    Data tiling packs both matmul operands into tiles first: a copy of each.  Where the large operand is a window
    gather against a narrow weight (_unpacked_matmul: im2col forward or grad_input with more than one tap and at
    most CPU_UNPACKED_MOST_COLUMNS columns, e.g. grad_input's dYcol of N x O x taps x K values times a
    taps x K x C weight), that copy costs more than the packed GEMM saves, and IREE's unpacked matmul, reading the
    gather as it lies, is faster; with more channels, for a long reduction (grad_weight) and for a plain matmul
    (1x1), data tiling is (docs/decisions.md#cpu-tap-slices, #cpu-forward-im2col).  Flags are per module, so one
    kernel of another kind keeps it on."""
    return target.backend == "cpu" and not (problems and all(_unpacked_matmul(p, target) for p in problems))


# data-tiled CPU matmuls (IREE's mmt4d): the shortest reduction panel (K x M0 values of one row tile, in bytes)
# whose workgroups cpu_packed_matmul_distribution sets, the most bytes of row panels one workgroup takes, and the
# fewest workgroups it leaves
CPU_LONG_PANEL_BYTES = 64 * 1024
CPU_WORKGROUP_ROW_BYTES = 4 * 1024 * 1024
CPU_LEAST_WORKGROUPS = 64


def cpu_packed_matmul_distribution(batch: int, row_tiles: int, column_tiles: int,
                                   row_panel_bytes: int) -> Optional[tuple[int, int]]:
    """The workgroup tile (row tiles, column tiles) of a data-tiled CPU matmul with a long reduction, or None to keep
    IREE's.  IREE 3.13 gives such a matmul (grad_weight's reduction over every position, DeepLab's over 2304 values)
    one row tile x one column tile per workgroup, so each workgroup streams a row panel and a column panel of the
    whole reduction, from memory: both are re-read once per tile of the other operand.  A workgroup of all the row
    tiles by one column tile streams its column panel once and takes the row panels from cache, where the others
    read them too (docs/decisions.md#cpu-packed-matmul-workgroups).
    `row_panel_bytes`: one row tile's packed panel over the whole reduction (K x M0 values).  The row tiles per
    workgroup: the most that divide row_tiles, hold at most CPU_WORKGROUP_ROW_BYTES and leave at least
    CPU_LEAST_WORKGROUPS workgroups (batch x column tiles x row tiles / taken)."""
    if row_panel_bytes < CPU_LONG_PANEL_BYTES:
        return None
    fitting = [d for d in range(1, row_tiles + 1)
               if row_tiles % d == 0 and d * row_panel_bytes <= CPU_WORKGROUP_ROW_BYTES
               and batch * column_tiles * (row_tiles // d) >= CPU_LEAST_WORKGROUPS]
    return (max(fitting), 1) if fitting else None


# im2col grad_weight on the CPU: positions per split-K chunk at least, and chunks at most
CPU_SPLIT_POSITIONS = 512
CPU_SPLIT_MOST = 64


def cpu_im2col_row_chunks(p: ConvProblem) -> int:
    """The im2col grad_weight's chunks per image along its first output dimension (1: no split).  Its matmul
    reduces over all N * O positions into a G x K x (taps * C) result; where that result is small against the
    reduction (the ResNet stem: 64 x 147 over 50176 positions at batch 4), IREE's matmul streams both operands
    once per output tile and keeps few cores busy.  Split into chunks of rows (at least CPU_SPLIT_POSITIONS
    positions each, N x chunks at most CPU_SPLIT_MOST), the chunks are the batch of a batch_matmul and their f32
    partials are summed after (docs/decisions.md#cpu-split-k).  A split_k asked for is honoured: S / N chunks
    per image (cpu_im2col_split_reason says which S the form can cut; 1: one GEMM over every position)."""
    if p.split_k is not None:
        return max(1, p.split_k // p.batch)
    positions = p.batch * math.prod(p.output)
    if p.dynamic_batch or positions < 2 * p.out_channels * p.in_channels * math.prod(p.filter):
        return 1
    row = math.prod(p.output[1:])
    best = 1
    for rows in range(1, p.output[0] + 1):
        chunks = p.output[0] // rows
        if p.output[0] % rows == 0 and rows * row >= CPU_SPLIT_POSITIONS and p.batch * chunks <= CPU_SPLIT_MOST:
            best = max(best, chunks)
    return best


def cpu_im2col_split_reason(p: ConvProblem) -> Optional[str]:
    """Why the im2col grad_weight cannot cut p's split_k into its chunks (None: it can, or none is asked).  Its
    chunks are H blocks of whole output rows in each image (cpu_im2col_row_chunks), N x H partials, or one GEMM
    over every position: split_k = 1, or N x H with H > 1 dividing the first output dimension."""
    if p.op != "grad_weight" or p.split_k is None or p.split_k == 1:
        return None
    rows, o0 = p.split_k // p.batch, p.output[0]
    if p.split_k % p.batch or rows < 2 or o0 % rows:
        return (f"kernel {p.name}: split_k = {p.split_k} cannot be honoured by the CPU im2col grad_weight form (its "
                f"split is N x H blocks of whole output rows, N = {p.batch} images and H > 1 dividing the first output "
                f"dimension {o0}; or split_k = 1)")
    return None


def cpu_depthwise_named(p: ConvProblem, target: Target) -> bool:
    """CPU depthwise gradients in NHWGC as IREE's named depthwise convolution (form "depthwise-named"), which its
    CPU pipeline vectorises along the channels.  grad_input: one per stride phase; the stencil generic with the
    taps innermost was 6x slower than PyTorch (docs/decisions.md#cpu-depthwise).  grad_weight: one per image,
    X as its image and dY as its filter; the gather form ran at 0.06x PyTorch (docs/decisions.md#cpu-depthwise-wgrad);
    with a few channels per group (ResNeXt's 4), one per image and output channel k over the G*C channels, dY's
    channel k repeated along c.  `batch = ?` (grad_weight has one convolution per image), fp8 compute and a
    split_k asked for (grad_weight sums its images in one loop, no split-K chunks) keep their forms."""
    if target.backend != "cpu" or p.layout != "NHWGC" or p.fp8_compute or p.dynamic_batch or p.split_k is not None:
        return False
    if p.depthwise:
        return p.op in ("grad_input", "transposed", "grad_weight")
    return p.op == "grad_weight" and p.groups > 1 and p.in_channels * p.out_channels <= MAX_GROUP_MACS


# Channels of IREE's CPU depthwise convolution with the taps as output positions: its tiles follow the channel
# count, and 144 ran 2 to 4x faster per channel than 128 or 160; grouped few-channel 2D grad_weight pads its G*C
# channels up to it (measured in 2D; a 1D f16 module padded so failed in IREE's CPU codegen;
# docs/decisions.md#cpu-depthwise-wgrad)
CPU_DEPTHWISE_CHANNELS = 144


# The innermost output width of IREE's CPU depthwise convolution: its pipeline takes a small output width whole and
# vectorises it some positions at a time, 2 with 3-tap filters and 4 with image-sized ones (grad_weight's, 14 taps
# and more); where the width is not a multiple of that step it ran 3-20x slower (docs/decisions.md#cpu-depthwise-width)
CPU_DEPTHWISE_WIDENED = 8


def cpu_depthwise_width(width: int, filter_width: int) -> int:
    """The innermost output width a depthwise-named convolution computes for `width` wanted with a filter
    `filter_width` wide: 8 for the widths measured slow (5 and 7 with 3-tap filters, 5-7 with filters of 14 taps
    or more; the extra positions read zeros and are dropped), else `width` (5-tap filters were vectorised whole
    and 14-wide outputs 2 at a time: widening those measured 15-30% slower)."""
    if filter_width <= 3 and width in (5, 7) or filter_width >= 14 and 4 < width < CPU_DEPTHWISE_WIDENED:
        return CPU_DEPTHWISE_WIDENED
    return width


def cpu_depthwise_channels(channels: int) -> int:
    """The channel count the grouped depthwise-named grad_weight convolves over: `channels` padded with zeros up
    to CPU_DEPTHWISE_CHANNELS (more stay as they are)."""
    return max(channels, CPU_DEPTHWISE_CHANNELS)


# CPU calls through the Python API (module.CompiledModule.call): the smallest workspace a kernel keeps from call to
# call, and the share of the machine's memory a module's kept workspaces may take at most
CPU_KEPT_WORKSPACE_LEAST = 32 * 2**20
CPU_KEPT_WORKSPACE_SHARE = 0.25


def cpu_keeps_workspace(workspace_bytes: int, kept_bytes: int, memory_bytes: int) -> bool:
    """Whether a CPU kernel called from the Python API keeps its workspace (the transients of its destination-passing
    twin, convdsl/abi.py) from one call to the next, given the bytes its module keeps already and the machine's.

    The allocating function takes a fresh workspace each call, and memory freshly mapped is faulted in again by
    the kernel: CK 15's 3D grad_input (1.2 GB of transients at batch 4) took 1.46 s a call against 0.74 s with
    the workspace kept.  Below CPU_KEPT_WORKSPACE_LEAST (glibc's largest mmap threshold) malloc serves the next
    call from the memory the last one freed, and a kept workspace measured slower: it leaves malloc's threshold
    low, so that the inputs and the result are mapped afresh every call (MobileNetV2's depthwise grad_input, 7 MB,
    5-8 ms -> 17-20 ms).  Kept workspaces stop at CPU_KEPT_WORKSPACE_SHARE of the memory, so that a module of
    large kernels (U-Net's 3D grad_weight keeps 7.7 GB at batch 4) does not hold it all
    (docs/decisions.md#kept-workspace)."""
    return (workspace_bytes >= CPU_KEPT_WORKSPACE_LEAST
            and kept_bytes + workspace_bytes <= CPU_KEPT_WORKSPACE_SHARE * memory_bytes)


# The zero border around X or dY: the forms, and what each builds.
PAD_FORMS = {
    "insert": "zeros + tensor.insert_slice",
    "gather": "one elementwise generic reading the interior with a guarded tensor.extract",
    "fuse": "tensor.pad, fused by IREE into the contraction's dispatch",
}


def default_pad_form(problem: ConvProblem, target: Target) -> str:
    # IREE copies an unfused border element by element; a fused tensor.pad costs no pass but only pays on
    # matrix units (docs/decisions.md#zero-border-forms)
    if target.backend == "cpu":
        # depthwise-named grad_weight pads each image for its own convolution, which IREE fuses: an unfused
        # padded X cost as much as the convolutions (docs/decisions.md#cpu-depthwise-wgrad)
        return "fuse" if problem.op == "grad_weight" and cpu_depthwise_named(problem, target) else "insert"
    sixteen_bit = problem.dtype in ("f16", "bf16") or problem.fp8_compute
    if sixteen_bit and problem.op in ("grad_input", "transposed") and all(s == 1 for s in problem.stride):
        return "fuse"
    return "gather"


# Why the phase weights of grad_input may be stored K-innermost.  The contraction is dX = dY . Wphase, with
# the reduction over (taps, K).  IREE 3.13 lowers it to mma.sync m16n8k16.row.col without ldmatrix: each
# thread loads its B fragment (pairs along the reduction) straight from shared memory, one 16-bit load per
# element when Wphase is stored [G, K, taps, C] (the PTX of CK 3D dgrad: 64 ld.shared.b16 + 64 st.shared.b16
# per 32 mma), 32-bit loads and 64-bit stores when K is innermost.  The weights are small and rebuilt by the
# flip gather anyway, so the order costs nothing.  It pays only where there is more than one stride phase, and
# only on CUDA (docs/decisions.md#weight-k-inner).
WEIGHT_K_INNER_BACKENDS = ("cuda",)


def weight_k_inner(problem: ConvProblem, target: Target) -> bool:
    strided = any(s > 1 for s in problem.stride)
    return target.backend in WEIGHT_K_INNER_BACKENDS and not problem.depthwise and strided


def pad_form(problem: ConvProblem, target: Target, knobs: Knobs) -> str:
    """The zero-border form: the knobs' (tuned or a candidate's), else the rule's."""
    if knobs.pad is not None and knobs.pad not in PAD_FORMS:
        raise ValueError(f"pad: expected one of {', '.join(PAD_FORMS)}, got {knobs.pad!r}")
    return knobs.pad if knobs.pad is not None else default_pad_form(problem, target)


# --- the Triton GEMM cores (CUDA) -------------------------------------------------------------------

def unsupported_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why this kernel keeps the linalg form on this target (None: the Triton GEMM core applies)."""
    if target.backend != "cuda":
        return f"the external kernels are CUDA kernels; target is {target.backend}"
    if not target.has_cp_async:
        return f"the kernels need sm_80 or newer (cp.async, bf16 mma); target is {target.arch}"
    if p.dynamic_batch:
        return "batch = ?: the kernels are specialised to every size"
    if p.epilogue.kind == "bilinear":
        return "the bilinear epilogue's tensor is added by the linalg form"
    if not p.depthwise and gather_applies(p) and default_pack(p) == 1:
        return "few channels per group in a layout whose groups cannot be packed: the gather form is used"
    if triton_version() is None:
        return "triton is not installed"
    # tensors of any size (64-bit offsets where needed: launch.needs_wide), within CUDA's grid limits: the plan
    # itself says, planned once (extern_launches reads the same plan)
    planned = launches_or_reason(p, None, target, None, ())
    return planned if isinstance(planned, str) else None


def extern_choice(problem: ConvProblem, target: Target, knobs: Knobs) -> tuple[bool, Optional[TileConfig], str]:
    """(use, tiles, reason): whether the Triton GEMM cores are used, with which tiles (None: the kernel's
    defaults), else why not.  The rule (unsupported_reason) decides unless the knobs' `extern` says otherwise."""
    reason = unsupported_reason(problem, target) if target.backend == "cuda" else "cpu"
    use = reason is None
    if knobs.extern is not None:
        if knobs.extern and reason is not None:
            raise ValueError(f"extern: kernel {problem.name} cannot use the external kernels: {reason}")
        use = knobs.extern
        if not use:
            reason = "extern = false (tuned or asked for)"
    tiles = parse_tiles(knobs.tiles) if knobs.tiles is not None else None
    return use, tiles, ("" if use else reason or "")


# --- TMA forward (kernels/tma.py): the stream path on Hopper ------------------------------------------

def _tma_common_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """What every TMA kernel needs: Hopper, 16-bit exact products, NHWGC, a fixed batch, more than one tap, the
    im2col box in range, and Gluon's TMA im2col in the installed Triton."""
    if not (target.has_tma and target.has_wgmma):
        return f"TMA im2col with wgmma is Hopper's (sm_90); target is {target.arch}"
    fp8 = p.op in ("forward", "grad_weight") and p.dtype in ("f16", "bf16") and p.fp8_compute
    if not (p.dtype in ("f16", "bf16") and p.compute is None) and not (p.dtype == "f32" and p.tf32) and not fp8:
        return ("the TMA kernels compute in f16/bf16 with exact products, f32 in one-pass TF32, or forward and "
                "grad_weight in fp8 compute")
    if p.layout != "NHWGC" or p.dynamic_batch:
        return "the TMA kernels read NHWGC activations of a fixed batch"
    if math.prod(p.filter) == 1:
        # a 1x1 convolution is a plain GEMM, which the cp.async kernel's one-tap loop runs faster on ResNet-50's
        # shapes (up to 1.7x; the TMA kernel won only past 1024 reduction channels; docs/decisions.md#tma-forward)
        return "one tap: the cp.async kernel's one-tap loop"
    lower, upper = im2col_box(p)
    low, high = target.tma_im2col_corners(p.dims + 2)
    if any(not low <= v <= high for v in (*lower, *upper)) or max(p.stride) > target.tma_most_stride:
        return f"padding or stride past TMA im2col's range (corners {low}..{high}, strides up to {target.tma_most_stride})"
    if max(t * d for t, d in zip(p.filter, p.dilation)) >= 2**15:
        return "tap offsets past 16 bits"
    if not gluon_tma_im2col():
        return "the installed Triton has no Gluon TMA im2col copies (Triton 3.9 has)"
    return None


# a wide tile's (two warp groups on 128 x 256) rate of products against 128 x 128's: 1.07 to 1.18 measured (ResNet-50's
# 512-channel 7x7 forward, one wave either way; CK 17's forward, 10 waves against 20; docs/decisions.md#tma-wide)
WIDE_TILE_GAIN = 1.15


def tma_grad_weight_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """128 x 128 where K and C allow, else 64; 64 pixels a step, 4 stages, 4 warps (docs/decisions.md#tma-forward).
    64 x 64 tiles take 128 pixels a step in 3 stages: their long reductions gained 15-30% (#tma-wgrad-3d).
    3D 128 x 128 tiles: two product warp groups and a copy warp of their own (tma_grad_weight_specialised), 4
    stages: CK 11's 3D grad_weight 2.14 -> 1.45 ms (#tma-wgrad-specialised).  3D with 64 channels C and K: 64 x 128
    tiles of two taps (#tma-wgrad-taps).  128 x 256 tiles (two product warp
    groups, specialised, 4 stages) where C is a multiple of 256, so that a tile holds whole C tiles of one tap, and
    their least estimated time, products WIDE_TILE_GAIN faster, beats the 128-column tile's: wav2vec2's 1D
    grad_weight 0.073 -> 0.063 ms, a 3D 256-channel one 0.180 -> 0.167 (#tma-wgrad-specialised)."""
    block_m, block_n = (128 if p.out_channels % 128 == 0 else 64), (128 if p.in_channels % 128 == 0 else 64)
    if block_m == block_n == 64 and p.dims == 3 and p.in_channels == 64:
        # two taps a tile, each dY box shared by both: U-Net's 3D grad_weight 0.270 -> 0.238 ms; in 2D (ResNet-50's
        # 64-channel 3x3) 0.035 -> 0.041 (docs/decisions.md#tma-wgrad-taps)
        return TileConfig(64, 128, 128, warps=4, stages=3)
    if block_m == block_n == 64:
        return TileConfig(64, 64, 128, warps=4, stages=3)
    if block_m == block_n == 128 and p.dims == 3:
        tiles = TileConfig(128, 128, 64, warps=8, stages=4)
    else:
        tiles = TileConfig(block_m, block_n, 64, warps=4, stages=4)
    wide = TileConfig(128, 256, 64, warps=8, stages=4)
    if block_m == 128 and p.in_channels % 256 == 0:
        steps = reduction_steps(p, tiles)
        if (_least_time(p, wide, target, steps, 2, WIDE_TILE_GAIN)[1]
                < _least_time(p, tiles, target, steps, 2, 1.0)[1]):
            return wide
    return tiles


def tma_grad_weight_specialised(tiles: TileConfig) -> bool:
    """Whether the TMA grad_weight issues its copies from a warp of its own: with two product warp groups.  Where
    the product warps issue them, every step's copies wait at a barrier of all the warps for the stage's last
    product (70% of the issue stalls by ncu on CK 11's 3D grad_weight); one warp group loses nothing by it
    (docs/decisions.md#tma-wgrad-specialised)."""
    return tiles.warps == 8


# rows of the reduction wgmma sums before the TMA grad_weight adds them in f32 (promoted sums)
PROMOTED_ROWS = 512
# f32 registers a thread may give each of the two accumulators of promoted sums
PROMOTED_ACCUMULATOR_MOST = 64


def tma_grad_weight_promote(p: ConvProblem, tiles: TileConfig) -> int:
    """Steps wgmma sums at a time before the TMA grad_weight adds them in f32 (0: wgmma's accumulator
    throughout): PROMOTED_ROWS rows of the reduction for f32-accurate splits (exact f32 as bf16x6, compute =
    "bf16x3"), never for one-pass TF32 or 16-bit operands.  wgmma's own long sums drift from f32's: bf16x6 was 15x
    further from cuDNN's f32 result than three-pass TF32 on CK 11's 3D grad_weight, and as close with its runs
    summed in f32, at 1.8x three-pass TF32's speed (docs/decisions.md#promoted-sums)."""
    if p.dtype != "f32" or p.tf32:
        return 0
    return max(1, PROMOTED_ROWS // tiles.block_k)


def promoted_tiles(tiles: TileConfig) -> TileConfig:
    """Tiles whose two accumulators (wgmma's runs and their f32 sum) fit: at most PROMOTED_ACCUMULATOR_MOST
    registers a thread each; wider ones become 128 x 128 over two product warp groups (the 128 x 256 and the
    one-warp-group 128 x 128 tiles, where K and C are multiples of 128)."""
    if tiles.block_m * tiles.block_n // (32 * tiles.warps) <= PROMOTED_ACCUMULATOR_MOST:
        return tiles
    return TileConfig(128, 128, 64, warps=8, stages=4)


def tma_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The TMA grad_weight's split-K chunks S asked for: the problem's split_k, else the tiles' split (a knob), else
    the S of least estimated time, waves x chunk steps of products at the SM's peak plus S f32 partials of the
    weight written and read back at the memory's peak.  Each program stores a [BLOCK_M, BLOCK_N] f32 tile through shared
    memory, so fewer are resident than for the cp.async kernel, and fewer, longer chunks than grad_weight_parts
    gives won: ResNet-50's 512-channel 3x3 at 7x7 0.065 -> 0.041 ms (docs/decisions.md#tma-forward)."""
    return p.split_k or tiles.split or _least_time_parts(p, tiles, target, reduction_steps(p, tiles), 2, 1.0)


def tma_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK positions) of the TMA grad_weight: tma_grad_weight_parts cut into whole reduction steps."""
    return reduction_split(p, tiles, tma_grad_weight_parts(p, tiles, target), target, "TMA grad_weight kernel")


def _least_time_parts(p: ConvProblem, tiles: TileConfig, target: Target, steps: int, element_bytes: int,
                      rate: float) -> int:
    return _least_time(p, tiles, target, steps, element_bytes, rate)[0]


def _least_time(p: ConvProblem, tiles: TileConfig, target: Target, steps: int, element_bytes: int,
                rate: float) -> tuple[int, float]:
    # the split-K chunks S of least estimated time, and that time in seconds.  `rate`: the products' share of
    # the matrix peak (TF32 runs at half the 16-bit rate)
    gpu = target.gpu
    shared = (tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * element_bytes
              + tiles.block_m * tiles.block_n * 4)
    slots = gpu.sm_count * max(1, min(gpu.shared_per_sm // (shared + gpu.shared_reserved_per_block),
                                      gpu.warps_per_sm // tiles.warps))
    tiles_out = output_tiles(p, tiles)
    step_s = 2 * tiles.block_m * tiles.block_n * tiles.block_k / (rate * gpu.matrix_flops / gpu.sm_count)
    partial_s = 2 * 4 * math.prod(p.w_shape) / gpu.memory_bandwidth

    def estimate(s: int) -> float:
        chunk = -(-steps // s)
        chunks = -(-steps // chunk)
        return -(-tiles_out * chunks // slots) * chunk * step_s + chunks * partial_s

    best = min(range(1, min(256, steps) + 1), key=estimate)
    return best, estimate(best)


# --- one-pass TF32 grad_weight on flat planes (kernels/tma.grad_weight_flat_tma) ----------------------

# the copies of X and dY it makes, most bytes (a fraction of an 80 GB GPU's memory)
FLAT_PLANES_MOST_BYTES = 8 << 30


def tma_flat_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """128 x 128 where K and C allow (the rule's case), else 64; a 128-byte row of positions a step (32 of f32,
    128 of fp8), 4 stages, 8 warps: two warp groups measured up to 7% faster than one
    (docs/decisions.md#tf32-flat, #fp8-flat)."""
    return TileConfig(128 if p.out_channels % 128 == 0 else 64, 128 if p.in_channels % 128 == 0 else 64,
                      128 // ELEMENT_BYTES[flat_elements(p)[0]], warps=8, stages=4)


def tma_flat_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The flat kernel's split-K chunks asked for: the problem's split_k, else the tiles', else as
    tma_grad_weight_parts estimates them, over its own steps (images x position blocks) at TF32's rate (half the
    16-bit one) or fp8's (twice)."""
    steps = p.batch * flat_planes(p, tiles.block_k).blocks
    element_bytes = ELEMENT_BYTES[flat_elements(p)[0]]
    return p.split_k or tiles.split or _least_time_parts(p, tiles, target, steps, element_bytes,
                                                         2.0 / element_bytes)


def tma_flat_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK steps) of the flat kernel: tma_flat_grad_weight_parts cut into whole steps (images x position
    blocks)."""
    steps = p.batch * flat_planes(p, tiles.block_k).blocks
    most = target.max_grid[2]  # the chunks are the grid's z
    return _honoured(p, even_chunks(steps, tma_flat_grad_weight_parts(p, tiles, target), most), most,
                     "flat-plane TMA grad_weight kernel", f"{steps} steps of images x position blocks")


def tma_fp8_promote(p: ConvProblem, tiles: TileConfig) -> int:
    """fp8 on the TMA kernels: the reduction elements whose products wgmma sums in its own accumulator, which
    keeps fewer bits than f32, before they join the f32 sum (0: all of them).  One step's: CK 11's fp8
    grad_weight 4.2e-3 -> 2.2e-4 relative error (the f16 kernel's), for 1-6% more time (docs/decisions.md#fp8-flat)."""
    return tiles.block_k if p.fp8_compute else 0


def tma_flat_grad_weight_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a grad_weight in one-pass TF32 or fp8 compute does not run on the flat-plane TMA kernel (None: it
    does)."""
    if p.op != "grad_weight":
        return "not grad_weight"
    if not (target.has_tma and target.has_wgmma):
        return f"TMA with TF32 or fp8 wgmma is Hopper's (sm_90); target is {target.arch}"
    if not (p.dtype == "f32" and p.tf32 or p.fp8_compute) or p.out_dtype is not None:
        return "the flat-plane kernel is grad_weight in one-pass TF32 (f32) or fp8 compute"
    if any(s != 1 for s in p.stride) or min(p.pad_lo) < 0 or min(p.pad_hi) < 0:
        return "a tap is one shift of the flat positions with stride 1 and no negative padding only"
    if p.dynamic_batch:
        return "the flat-plane kernel is planned for a fixed batch"
    if p.in_channels % 128 or p.out_channels % 128:
        # with 64-channel tiles its copies cost more than they save: ResNet-50's 64-channel 3x3 grad_weight
        # 0.24 -> 0.31 ms, U-Net's 3D one 1.71 -> 1.84 ms on an H100 (docs/decisions.md#tf32-flat)
        return "the flat-plane kernel takes K and C in whole 128-channel tiles"
    if math.prod(p.filter) == 1:
        return "one tap: the positions need no shift, the cp.async kernel reads them as they are"
    tiles = tma_flat_grad_weight_tiles(p)
    planes = flat_planes(p, tiles.block_k)
    copies = ELEMENT_BYTES[flat_elements(p)[0]] * sum(math.prod(pad_planes_launch(p, planes, name, "k")[1])
                                                     for name in ("x", "dy"))
    if copies > FLAT_PLANES_MOST_BYTES:
        return f"its copies of X and dY would take {copies / 2**30:.1f} GiB"
    if max(planes.x_length, planes.dy_length) + max(t * d for t, d in zip(p.filter, p.dilation)) * \
            max(planes.plane[0] * planes.plane[1], 1) >= 2**31:
        return "flat positions past 32 bits"
    if not gluon_tma_im2col():
        return "the installed Triton has no Gluon TMA copies (Triton 3.9 has)"
    return None


def tma_grad_weight_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why grad_weight does not run on the TMA kernel (None: it does)."""
    if p.op != "grad_weight":
        return "not grad_weight"
    reason = _tma_common_reason(p, target)
    if reason is not None:
        return reason
    if p.dtype == "f32":
        # TF32 wgmma reads K-major operands only, and this kernel's are position-major (tma_flat_grad_weight_reason)
        return "f32 in one-pass TF32: the flat-plane kernel's, or the cp.async kernel's"
    if p.in_channels % 64 or p.out_channels % 64:
        return "the TMA grad_weight's tiles take K and C in whole 64-channel blocks"
    return None


def tma_split_grad_weight(p: ConvProblem, target: Target) -> Optional[tuple[ConvProblem, str]]:
    """An f32 grad_weight as the 16-bit TMA grad_weight over bf16 parts of X and dY stacked along N
    (launch.SPLIT_PRODUCTS): one-pass TF32 (compute = "tf32", PyTorch's default) and compute = "bf16x3" as three
    products per product, exact f32 as six (bf16x6, leaving out terms of about 2^-24 of a product, f32's own
    rounding); the stacked problem and the split, or None where the TMA kernel does not take it.  On the 16-bit
    kernel with its copy warp it is faster than the TF32 kernels, whose operands TF32 wgmma must read K-major: CK
    11's 3D TF32 grad_weight 7.39 -> 5.24 ms (cuDNN in TF32 5.56); exact f32 18.9 -> 10.6 ms against three-pass
    TF32, with wgmma's sums added in f32 every run of steps (tma_grad_weight_promote), as close to the exact result.
    Stride 1 only: the split copies all of X, s^dims times the positions a strided problem's products read
    (ResNet-50's stride-2 3x3 0.158 -> 0.196 ms) (docs/decisions.md#bf16x3-grad-weight-tma, #promoted-sums)."""
    if p.op != "grad_weight" or p.dtype != "f32" or p.dynamic_batch or any(s != 1 for s in p.stride) \
            or not (p.tf32 or p.bf16x3 or p.compute is None):
        return None
    split = "bf16x6" if p.compute is None else "bf16x3"
    stacked = p.with_(batch=len(SPLIT_PRODUCTS[split]) * p.batch, dtype="bf16", compute=None, out_dtype=None)
    return (stacked, split) if tma_grad_weight_reason(stacked, target) is None else None


def _weight_rows(p: ConvProblem) -> bool:
    """Is the weight a [G*K, taps*C] matrix in memory?  GKYXC is; a 1x1 GKCYX weight is the same memory."""
    return p.weight_layout == FAST_WEIGHT_LAYOUT or math.prod(p.filter) == 1


def tma_forward_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why forward does not run on the TMA im2col kernel (None: it does).  The kernel's descriptors are made at
    call time and passed by value, which the stream runner does and an IREE module's dispatch cannot: modules
    keep the cp.async kernels (docs/decisions.md#tma-forward)."""
    if p.op != "forward" or p.out_dtype is not None:
        return "the TMA kernel computes forward in the input's dtype"
    reason = _tma_common_reason(p, target)
    if reason is not None:
        return reason
    if not _weight_rows(p):
        return "the TMA kernel reads GKYXC weights"
    if p.epilogue.kind != "none":
        return "the TMA kernel has no epilogue"
    tiles = tma_forward_tiles(p, target)
    if p.in_channels % tiles.block_k or p.out_channels % 8:
        return (f"the TMA kernel reads channels in whole {tiles.block_k}-element steps (C a multiple of "
                f"{tiles.block_k}, K of 8)")
    if p.groups > 1 and p.out_channels % tiles.block_n:
        return "with several groups the TMA kernel's column tiles must not cross into the next group"
    return None


# one-pass TF32 forward with at most 64 columns: reduction steps a tile from which 256-row tiles pay
TF32_NARROW_STEPS = 32


def tma_forward_tiles(p: ConvProblem, target: Target) -> TileConfig:
    """128 rows, columns as wide as K up to 128 (a wider tile than K doubles the products for nothing), 128
    bytes of channels a step where C allows (64 of 16-bit, 32 of f32), 4 stages and 4 warps
    (docs/decisions.md#tma-forward, #tf32-flat).  16-bit with K >= 256: 128 x 256 tiles of two warp groups (3
    stages to fit) where the waves they take, each WIDE_TILE_GAIN faster per product, beat 128 x 128's: they
    lose where the wide tiles leave SMs idle (ResNet-50's 512-channel 7x7 layers: 50 tiles on 132 SMs)
    (docs/decisions.md#tma-wide).  16-bit with K <= 64 over C >= 128: 256 x 64 tiles of two warp groups
    (docs/decisions.md#tma-narrow); one-pass TF32 likewise where a tile's reduction takes TF32_NARROW_STEPS steps
    or more (#tf32-grad-input-tma)."""
    # 128 bytes of channels a step where C allows; fp8 wgmma takes at least 32 bytes a product
    steps = (32, 16, 8) if p.dtype == "f32" else (128, 64, 32) if p.fp8_compute else (64, 32, 16)
    block_k = next((b for b in steps if p.in_channels % b == 0), steps[-1])
    narrow = TileConfig(128, 64 if p.out_channels <= 64 else 128, block_k, warps=4, stages=4)
    sixteen_bit = p.dtype in ("f16", "bf16") and not p.fp8_compute
    if sixteen_bit and p.groups == 1 and p.out_channels <= 64 and p.in_channels >= 128:
        # 64 columns over a reduction of 128 channels a tap or more: 256 rows in two warp groups, CK 15's 3D
        # grad_input 12% faster; over 64 channels a tap no change (docs/decisions.md#tma-narrow)
        return replace(narrow, block_m=256, warps=8)
    if p.dtype == "f32" and p.groups == 1 and p.out_channels <= 64 \
            and math.prod(p.filter) * (p.in_channels // block_k) >= TF32_NARROW_STEPS:
        # one-pass TF32, 64 columns over a long reduction: 256 rows in two warp groups, CK 15's and U-Net's 3D
        # grad_inputs (108 and 54 steps) 13% and 9% faster, ResNet-50's 3x3 (18) 4% slower
        # (docs/decisions.md#tf32-grad-input-tma)
        return replace(narrow, block_m=256, warps=8)
    if p.dtype == "f32" or p.out_channels < 256 or (p.groups > 1 and p.out_channels % 256):
        return narrow
    rows = -(-p.batch * math.prod(p.output) // 128) * p.groups
    sms = target.gpu.sm_count

    def waves(columns: int) -> int:
        return -(-rows * -(-p.out_channels // columns) // sms)

    if waves(256) * 2 / WIDE_TILE_GAIN < waves(128):
        return replace(narrow, block_n=256, warps=8, stages=3)
    return narrow


def tma_forward_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    """Shared memory of the persistent TMA forward kernel (kernels/tma.forward_tma_persistent): its ring of
    copies (a window and a weight tile a stage, fp8 compute in fp8), the result tile it stores from, and a
    barrier per stage with room for alignment."""
    operand = 1 if p.fp8_compute else ELEMENT_BYTES[ELEMENT[p.dtype]]
    ring = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * operand
    return ring + tiles.block_m * tiles.block_n * ELEMENT_BYTES[ELEMENT[p.dtype]] + 8 * tiles.stages + 128


def tma_forward_programs(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """Programs of the TMA forward kernel (and of the stride-1 grad_inputs it runs): as many as the SMs hold at
    once (two where two fit their shared memory), each taking tiles in turn, so that a tile's copies are in
    flight while the tile before it finishes and stores; 0 (a program per tile) where the tiles are no more than
    that, and in one-pass TF32, which ran 2-7% slower persistent (docs/decisions.md#tma-persistent)."""
    if p.dtype == "f32":
        return 0
    gpu = target.gpu
    per_sm = min(2, gpu.shared_per_sm // (tma_forward_shared_bytes(p, tiles) + gpu.shared_reserved_per_block))
    programs = gpu.sm_count * max(per_sm, 1)
    count = -(-p.batch * math.prod(p.output) // tiles.block_m) * -(-p.out_channels // tiles.block_n) * p.groups
    return programs if count > programs else 0


def grad_input_as_forward(p: ConvProblem) -> Optional[ConvProblem]:
    """Stride-1 grad_input (and transposed) as a forward convolution over dY, or None where p has a stride.

    dX[n, i, c] = sum over taps t, channels k of dY[n, i + lo - t*d, k] * W[k, t, c]; with t' = F - 1 - t this is
    sum over t', k of dY[n, i - lo' + t'*d, k] * W'[c, t', k], a forward convolution of dY with padding
    lo' = d*(F-1) - lo (hi' likewise), C and K swapped, and the weight flipped along its taps with K innermost:
    W'[g, c, t', k] = W[g, k, F-1-t', c], which the TMA kernel reads from W itself (GKYXC: tap F-1-t' of its
    [G*K, taps*C] matrix; kernels/tma.py's FLIPPED).  Its output size is I."""
    if p.op not in ("grad_input", "transposed") or any(s != 1 for s in p.stride):
        return None
    lo = tuple(d * (f - 1) - v for d, f, v in zip(p.dilation, p.filter, p.pad_lo))
    hi = tuple(d * (f - 1) - v for d, f, v in zip(p.dilation, p.filter, p.pad_hi))
    if min(lo + hi) < 0:  # padding wider than the filter's reach: reads past dY on both sides
        return None
    return p.with_(op="forward", in_channels=p.out_channels, out_channels=p.in_channels, input=p.output, pad_lo=lo,
                   pad_hi=hi, weight_layout=FAST_WEIGHT_LAYOUT)


def phases_forward(p: ConvProblem) -> ConvProblem:
    """The forward of dY the TMA phases kernel runs for a strided grad_input's phases, as the tile and program
    rules see it (launch.grad_input_phases_tma_launch): dY's channels in, dX's out, the most taps of any phase
    over a window of QM positions per dimension (launch.phases_window)."""
    most, lom = phases_window(p)
    phases = grad_input_phases(p)
    taps = tuple(max(ph.dims[i].J for ph in phases) for i in range(p.dims))
    step = tuple(ph.o_step for ph in phases[0].dims)
    hi = tuple(max(0, q - o - lo + d * (j - 1)) for q, o, lo, d, j in zip(most, p.output, lom, step, taps))
    return p.with_(op="forward", in_channels=p.out_channels, out_channels=p.in_channels, input=p.output, filter=taps,
                   stride=(1,) * p.dims, dilation=step, pad_lo=lom, pad_hi=hi, weight_layout=FAST_WEIGHT_LAYOUT)


def tma_grad_input_phases_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a strided grad_input does not run its stride phases on the TMA kernel (kernels/tma.grad_input_phases_tma;
    None: it does).  Measured against the cp.async phases kernel in docs/decisions.md#tma-phases."""
    if p.op not in ("grad_input", "transposed") or all(s == 1 for s in p.stride) or p.out_dtype is not None:
        return "the TMA phases kernel runs strided grad_inputs in the operands' dtype"
    if p.dtype not in ("f16", "bf16") or p.compute is not None:
        return "the TMA phases kernel reads the weight in N-major tiles, which only 16-bit wgmma takes"
    if not _weight_rows(p):
        return "the TMA kernel reads GKYXC weights"
    if p.epilogue.kind != "none":
        return "the TMA kernel has no epilogue"
    phases = grad_input_phases(p)
    if len(phases) < math.prod(p.stride) or any(ph.empty for ph in phases):
        return "a stride phase without taps or positions (the cp.async phases kernel writes its zeros)"
    q = phases_forward(p)
    reason = _tma_common_reason(q, target)
    if reason is not None:
        return reason
    most, lom = phases_window(p)
    low, high = target.tma_im2col_corners(p.dims + 2)
    if any(not low <= v <= high for v in (*(-v for v in lom), *(m - o - v for m, o, v in zip(most, p.output, lom)))):
        return f"the phases' window past TMA im2col's range (corners {low}..{high})"
    tiles = tma_grad_input_phases_tiles(p)
    if p.out_channels % tiles.block_k or p.in_channels % 8:
        return (f"the TMA kernel reads channels in whole {tiles.block_k}-element steps (dY's channels a multiple of "
                f"{tiles.block_k}, dX's of 8)")
    if p.groups > 1 and p.in_channels % tiles.block_n:
        return "with several groups the TMA kernel's column tiles must not cross into the next group"
    programs = tma_grad_input_phases_programs(p, tiles, target)
    if grad_input_phases_tiles(p, tiles) <= programs:
        # what a persistent program gains is the overlap of its tiles; with a tile a program the cp.async kernel's
        # smaller programs ran faster (DCGAN's 4x4 grad_input: docs/decisions.md#tma-phases)
        return f"no more tiles than programs ({programs}): the cp.async phases kernel"
    return None


def tma_grad_input_phases_tiles(p: ConvProblem) -> TileConfig:
    """The TMA phases kernel's tiles: 128 rows x 128 columns in 3 stages, two programs an SM (one program's stores
    overlap the other's products), or 128 x 64 in 4 stages where dX has at most 64 channels (two an SM as well);
    128 bytes of dY's channels a step, 4 warps.  128 x 128 in 4 stages (one program an SM), and the forward's wide
    (128 x 256) and narrow (256 x 64) tiles of two warp groups, ran slower (docs/decisions.md#tma-phases)."""
    block_k = next((b for b in (64, 32, 16) if p.out_channels % b == 0), 16)
    if p.in_channels <= 64:
        return TileConfig(128, 64, block_k, warps=4, stages=4)
    return TileConfig(128, 128, block_k, warps=4, stages=3)


# shared memory the phases kernel's store takes besides its ring: convert_layout's staging of the result tile to
# 16-byte rows a thread, which Triton does in slabs of 8 KiB (sm_90 binaries of 128 x 64 and 128 x 128 tiles)
PHASES_STORE_SCRATCH = 8192


def tma_grad_input_phases_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    """Shared memory of the TMA phases kernel: its ring of copies (a window of dY and a weight tile a stage), the
    store's staging, and a barrier per stage with room for alignment."""
    operand = ELEMENT_BYTES[ELEMENT[p.dtype]]
    ring = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * operand
    return ring + PHASES_STORE_SCRATCH + 8 * tiles.stages + 128


def tma_grad_input_phases_programs(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """Programs of the TMA phases kernel: as many as the SMs hold at once (two where two fit), each taking tiles of
    all the phases in turn."""
    gpu = target.gpu
    per_sm = gpu.shared_per_sm // (tma_grad_input_phases_shared_bytes(p, tiles) + gpu.shared_reserved_per_block)
    return gpu.sm_count * min(2, max(per_sm, 1))


# space-to-depth: the regrouped channels, most (a few-channel strided forward; the stem's 3 x 2 x 2 = 12)
SPACE_TO_DEPTH_MOST_CHANNELS = 16


def space_to_depth_forward(p: ConvProblem) -> Optional[ConvProblem]:
    """A few-channel strided forward (an RGB stem) as a stride-1 forward over X and W regrouped space-to-depth,
    or None where p is not one.

    With stride s per dimension, input position i = o*s + t - lo (dilation 1) splits as t = t'*s + r with
    0 <= r < s: i = (o + t')*s + r - lo.  So X'[n, j, (r, c)] = X[n, j*s + r - lo, c] (0 outside X) and
    W'[k, t', (r, c)] = W[k, t'*s + r, c] (0 for taps past F) give Y[n, o, k] = sum over t', (r, c) of
    X'[n, o + t', (r, c)] * W'[k, t', (r, c)]: a stride-1 convolution with C*s channels, ceil(F/s) taps and
    no padding over an input of O + ceil(F/s) - 1 positions.  ResNet-50's stem (C = 3, 7x7 stride 2) becomes
    12 channels and 4x4 taps, whose reduction steps read 12 contiguous channels a tap instead of 3
    (docs/decisions.md#stem-space-to-depth).  The regrouping is two copies on the stream path
    (kernels/launch.space_to_depth_launch)."""
    if (p.op != "forward" or p.groups != 1 or all(s == 1 for s in p.stride) or any(d != 1 for d in p.dilation)
            or p.in_channels * math.prod(p.stride) > SPACE_TO_DEPTH_MOST_CHANNELS or p.layout != "NHWGC"
            or p.dynamic_batch or p.dtype not in ("f16", "bf16") or p.compute is not None
            or p.epilogue.kind != "none"
            or min(p.pad_lo) < 0 or min(p.pad_hi) < 0 or max(p.batch, p.out_channels) > 65535):
        return None
    taps = tuple(-(-f // s) for f, s in zip(p.filter, p.stride))
    return p.with_(in_channels=p.in_channels * math.prod(p.stride), filter=taps,
                   input=tuple(o + t - 1 for o, t in zip(p.output, taps)), stride=(1,) * p.dims,
                   pad_lo=(0,) * p.dims, pad_hi=(0,) * p.dims, weight_layout=FAST_WEIGHT_LAYOUT)


# shared memory the halo kernel may take for its ring of windows and weight tiles (the rest: Triton's scratch)
HALO_SHARED_BYTES = 200 * 1024
# the least share of the halo kernel's sweeps that computes output for it to run (halo_forward_efficiency), where
# the TMA kernel's tiles compute no dead columns (fewer columns of K than its tile: in proportion)
HALO_LEAST_EFFICIENCY = 0.75


def halo_tiles(p: ConvProblem) -> TileConfig:
    """The halo kernel's tiles: 128 rows in two warp groups, columns as wide as K (at least 16, at most 64) for
    each of F0 output planes, a tap's C channels a step; 4 weight stages where they fit beside the windows, else 3
    (docs/decisions.md#halo-grad-input)."""
    tiles = TileConfig(128, matrix_block(p.out_channels, 64), p.in_channels, warps=8, stages=4)
    return tiles if _halo_shared_bytes(p, tiles) <= HALO_SHARED_BYTES else replace(tiles, stages=3)


def _halo_shared_bytes(p: ConvProblem, tiles: TileConfig) -> int:
    # the ring of windows and the three filter planes' rings of weight tiles
    rows = halo_grid(p, tiles.block_m).ring_rows
    return (rows * p.in_channels + tiles.stages * 3 * p.in_channels * tiles.block_n) * ELEMENT_BYTES[ELEMENT[p.dtype]]


def halo_forward_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why a stride-1 forward (or a grad_input as one, grad_input_as_forward) does not run on the halo kernel
    (kernels/halo.forward_halo; None: it does)."""
    if p.op != "forward" or p.dims != 3 or p.groups != 1 or p.dtype not in ("f16", "bf16") or p.fp8_compute:
        return "the halo kernel computes 16-bit dense 3D forwards"
    reason = _tma_common_reason(p, target)  # Hopper's wgmma and TMA, NHWGC of a fixed batch, Gluon
    if reason is not None:
        return reason
    if any(s != 1 for s in p.stride) or p.dilation[0] != 1 or p.filter[0] != 3:
        return "the halo kernel sweeps output planes at stride 1 with three filter planes in flight"
    if p.out_channels > 64 or p.out_channels % 8 or p.in_channels not in (16, 32, 64):
        return "the halo kernel takes C of 16, 32 or 64 channels (its window's column blocks) and K up to 64"
    if not _weight_rows(p) or p.epilogue.kind != "none" or p.out_dtype is not None:
        return "the halo kernel reads GKZYXC weights and has no epilogue"
    if _halo_shared_bytes(p, halo_tiles(p)) > HALO_SHARED_BYTES:
        return "the halo kernel's windows do not fit in shared memory"
    if p.batch * math.prod(p.input) * p.in_channels >= 2**31 or p.batch * math.prod(p.output) * p.out_channels >= 2**31:
        return "the halo kernel addresses X and Y with 32-bit offsets"
    efficiency = halo_forward_efficiency(p, target)
    # against the TMA im2col kernel, whose tiles spend their columns' products on K of them
    least = HALO_LEAST_EFFICIENCY * min(1.0, p.out_channels / tma_forward_tiles(p, target).block_n)
    if efficiency < least:
        # short sweeps, partial waves or padded rows: the TMA im2col kernel wins (a video layer of 16 planes at
        # 0.66 ran 5% slower on it; docs/decisions.md#halo-grad-input)
        return f"the halo kernel would compute output in {efficiency:.0%} of its sweeps (at least {least:.0%})"
    return None


def _halo_plane_waves(p: ConvProblem, target: Target, split: int) -> int:
    # the halo kernel's time in plane sweeps: waves of programs, each sweeping its range and F0 - 1 planes more
    columns = p.batch * halo_grid(p, halo_tiles(p).block_m).row_tiles
    return -(-columns * split // target.gpu.sm_count) * (-(-p.output[0] // split) + p.filter[0] - 1)


def halo_forward_split(p: ConvProblem, target: Target) -> int:
    """Output-plane ranges per (image, row tile) of the halo kernel: each range sweeps F0 - 1 planes more than it
    has tiles, so the fewest ranges whose programs fill the SMs' waves best."""
    return min(range(1, p.output[0] + 1), key=lambda s: (_halo_plane_waves(p, target, s), s))


def halo_forward_efficiency(p: ConvProblem, target: Target) -> float:
    """The share of the halo kernel's sweeps that computes output: plane sweeps of whole waves against the output
    planes spread over the SMs, times the valid rows of the padded grid's row tiles."""
    block_m = halo_tiles(p).block_m
    grid = halo_grid(p, block_m)
    columns = p.batch * grid.row_tiles
    waves = _halo_plane_waves(p, target, halo_forward_split(p, target))
    rows = p.output[1] * p.output[2] / (grid.row_tiles * block_m)
    return p.output[0] * columns / (waves * target.gpu.sm_count) * rows


class TmaPlan(NamedTuple):
    """A TMA kernel for the stream runner: its launch and maps, whether it reads the weight flipped
    (grad_input_as_forward), grad_weight's partials shape (else ()), the tiles the rule chose (grad_weight's with
    the split-K chunks it resolved), the copies its
    operands are staged through first (per operand in order: the copy's launch and its shape; empty: the operands
    as they come), and the axis order of the weight copy it reads (weight_copy_axes; empty: the weight itself)."""

    launch: Launch
    maps: tuple[TmaMap, ...]
    flipped: bool
    partials: tuple[int, ...]
    tiles: TileConfig
    staging: tuple[tuple[Launch, tuple[int, ...]], ...] = ()
    weight_axes: tuple[str, ...] = ()


def _halo_plan(p: ConvProblem, target: Target, base: str, flipped: bool) -> TmaPlan:
    # a stride-1 forward, or a grad_input as one over the flipped weight, each input plane copied into shared
    # memory once per row tile (docs/decisions.md#halo-grad-input)
    tiles = halo_tiles(p)
    return TmaPlan(*forward_halo_launch(p, tiles, base, halo_forward_split(p, target), flipped=flipped), flipped, (),
                   tiles)


def tma_stream_launch(p: ConvProblem, target: Target, knobs: Knobs) -> Optional[TmaPlan]:
    """The TMA plan of p for the stream runner; None where the kernel keeps its cp.async form (tma_forward_reason,
    tma_grad_input_phases_reason, tma_grad_weight_reason, tma_flat_grad_weight_reason).  Tiles in the knobs (the
    tuning database's, or a sweep's) are the cp.async kernel's: the TMA kernels take their own rules' tiles, and a
    sweep of cp.async tiles plans without them (stream.plan_stream_kernel's `tma`)."""
    if knobs.extern is False:
        return None
    base = re.sub(r"\W", "_", p.name)
    if halo_forward_reason(p, target) is None:
        return _halo_plan(p, target, base, flipped=False)
    if tma_forward_reason(p, target) is None:
        tiles = tma_forward_tiles(p, target)
        # fp8 compute: X and W rounded into fp8 copies first, which the kernel reads with fp8 wgmma
        staging = tuple((round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}", as_fp8=True), shape)
                        for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute))
                        ) if p.fp8_compute else ()
        return TmaPlan(*forward_tma_launch(p, tiles, base, promote=tma_fp8_promote(p, tiles),
                                           programs=tma_forward_programs(p, tiles, target)), False, (), tiles, staging)
    q = grad_input_as_forward(p)
    # f32 and fp8 keep their cp.async grad_input: the flipped weight tiles are N-major, which TF32 and fp8 wgmma
    # cannot read
    if q is not None and _weight_rows(p) and p.dtype != "f32" and not p.fp8_compute \
            and tma_forward_reason(q, target) is None:
        if halo_forward_reason(q, target) is None:
            return _halo_plan(q, target, base, flipped=True)
        tiles = tma_forward_tiles(q, target)
        programs = tma_forward_programs(q, tiles, target)
        return TmaPlan(*forward_tma_launch(q, tiles, base, flipped=True, programs=programs), True, (), tiles)
    # one-pass TF32 reads B K-major only: the same forward over the weight's K-innermost copy, which the cp.async
    # kernel reads too (weight_copy_axes), its taps taken in reverse: CK 15's 3D grad_input 3.33 -> 3.07 ms (cuDNN
    # 2.76), U-Net's 0.640 -> 0.527 (docs/decisions.md#tf32-grad-input-tma)
    if q is not None and p.tf32 and p.weight_layout == FAST_WEIGHT_LAYOUT and tma_forward_reason(q, target) is None:
        tiles = tma_forward_tiles(q, target)
        return TmaPlan(*forward_tma_launch(q, tiles, base, reversed_copy=True), True, (), tiles,
                       weight_axes=weight_copy_axes(p))
    if tma_grad_input_phases_reason(p, target) is None:
        tiles = tma_grad_input_phases_tiles(p)
        programs = tma_grad_input_phases_programs(p, tiles, target)
        return TmaPlan(*grad_input_phases_tma_launch(p, tiles, base, programs), False, (), tiles)
    split = tma_split_grad_weight(p, target)
    if split is not None:  # X's parts as operand A, dY's as B, one stacked block per product
        stacked, how = split
        tiles = tma_grad_weight_tiles(stacked, target)
        if tma_grad_weight_promote(p, tiles):
            tiles = promoted_tiles(tiles)
        split = tma_grad_weight_split(stacked, tiles, target)
        launch, maps, partials = grad_weight_tma_launch(stacked, tiles, base, split,
                                                        specialised=tma_grad_weight_specialised(tiles),
                                                        promote=tma_grad_weight_promote(p, tiles))
        staging = ((split_bf16_launch(math.prod(p.x_shape), how, 0, f"{base}_0"), stacked.x_shape),
                   (split_bf16_launch(math.prod(p.y_shape), how, 1, f"{base}_1"), stacked.y_shape))
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]), staging)
    if tma_grad_weight_reason(p, target) is None:
        tiles = tma_grad_weight_tiles(p, target)
        split = tma_grad_weight_split(p, tiles, target)
        launch, maps, partials = grad_weight_tma_launch(p, tiles, base, split,
                                                        specialised=tma_grad_weight_specialised(tiles))
        # fp8 compute: X and dY rounded to their fp8 grids in f16 copies, the 16-bit products then exact
        # (docs/decisions.md#fp8-grad-weight-tma)
        staging = tuple((round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}"), shape)
                        for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute))
                        ) if p.fp8_compute else ()
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]), staging)
    if tma_flat_grad_weight_reason(p, target) is None:
        tiles = tma_flat_grad_weight_tiles(p)
        split = tma_flat_grad_weight_split(p, tiles, target)
        launch, maps, partials, planes = grad_weight_flat_tma_launch(p, tiles, base, split, tma_fp8_promote(p, tiles))
        return TmaPlan(launch, maps, False, partials, replace(tiles, split=split[0]),
                       tuple(pad_planes_launch(p, planes, name, base) for name in ("x", "dy")))
    return None


def relayout_ngchw(p: ConvProblem, knobs: Knobs) -> bool:
    """NGCHW with the Triton kernels: run them on NHWGC copies of the activations (the knobs' `relayout` may
    ask for NGCHW read in place through its strides instead).  The copies win: channels strided by D*H*W
    defeat the tiles' vector loads (docs/decisions.md#ngchw-copies)."""
    return knobs.relayout if knobs.relayout is not None else True


def dot_precision(p: ConvProblem) -> str:
    """Triton's dot precision for the GEMM cores (one-pass TF32 where allowed)."""
    # f32: three-pass TF32 on the tensor cores (about f32's accuracy; error measured against the f64
    # reference in the GPU tests); compute = "bf16x3": three bf16 products, as the linalg form does;
    # compute = "tf32": one-pass TF32 (cuDNN's default for f32 convolutions), a third of the products, its
    # operands stored the wrong way for TF32 wgmma rounded in registers (docs/decisions.md#tf32-staged)
    if p.dtype != "f32":
        return "ieee"  # 16-bit operands: exact products, f32 accumulation
    if p.bf16x3:
        return "bf16x3"
    return "tf32" if p.tf32 else "tf32x3"


def default_pack(p: ConvProblem) -> int:
    """Groups per GEMM for grouped kernels with few channels (C or K under 32, depthwise excepted: it has
    its own kernels): enough that the packed C and K reach 32, as far as the group count divides, in layouts
    where consecutive groups' channels are adjacent (packable) (docs/decisions.md#packed-groups)."""
    small = min(p.in_channels, p.out_channels)
    if p.groups == 1 or p.depthwise or small >= 32 or not packable(p):
        return 1
    pack = 1
    while pack * small < 32 and p.groups % (2 * pack) == 0:
        pack *= 2
    return pack


def direct_grad_input(p: ConvProblem) -> bool:
    """Depthwise grad_input: direct sums (docs/decisions.md#depthwise-direct)."""
    return p.op in ("grad_input", "transposed") and p.depthwise


def direct_forward(p: ConvProblem) -> bool:
    """Depthwise forward: direct sums (forward_direct), as depthwise grad_input takes them: one product per tap
    and channel leaves a GEMM's matrix units idle (docs/decisions.md#depthwise-direct)."""
    return p.op == "forward" and p.depthwise


# _dense_16bit_tiles: rows from which 128 x 256 tiles beat 128 x 128 on multi-tap filters, measured on an H100
# (ResNet-50's 3x3 GEMMs at 14x14: 12544 rows, 29 against 35 us; at 7x7: 3136 rows, 52 against 40 us)
DENSE_WIDE_ROWS = 8192


def _dense_16bit_tiles(p: ConvProblem, rows: int, columns: int, reduction: int) -> Optional[TileConfig]:
    """forward's and grad_input's tiles for one dense 16-bit GEMM (one group, no packing, no fp8 compute) with at
    least 128 columns, as a CUDA-graph sweep of ResNet-50's step chose them (docs/decisions.md#step-tiles):
    a reduction of one step (64) takes 128 x 64 tiles (the kernel is bound by its loads and stores); filters of
    several taps with 256 columns or more and at least DENSE_WIDE_ROWS rows take 128 x 256 (measured faster
    there, though fewer programs than SMs); the rest 128 x 128 (256-wide tiles leave most SMs idle on the 7x7
    maps).  None outside that domain."""
    if p.dtype not in ("f16", "bf16") or p.compute is not None or p.groups != 1 or columns < 128:
        return None
    if reduction <= 64:
        return TileConfig(128, 64, 64, warps=4, stages=4)
    if math.prod(p.filter) > 1 and columns >= 256 and rows >= DENSE_WIDE_ROWS:
        return TileConfig(128, 256, 64, warps=8, stages=3)
    return TileConfig(128, 128, 64, warps=8, stages=3)


def default_grad_input_tiles(p: ConvProblem) -> TileConfig:
    """Tiles for shapes the tuning database does not hold: dense 16-bit GEMMs as _dense_16bit_tiles says (rows:
    the positions of one stride phase), else columns as wide as C up to 256 (f32: 128), three stages for the widest;
    few-channel groups packed (default_pack) (docs/decisions.md#default-tiles)."""
    taps = math.prod(p.filter)
    dense = _dense_16bit_tiles(p, p.batch * math.prod(p.input) // math.prod(p.stride), p.in_channels,
                               p.out_channels * taps)
    if dense is not None and default_pack(p) == 1:
        return dense
    pack = default_pack(p)
    _, c, k = packed_sizes(p, pack)
    wide = p.dtype == "f32"
    # f32 columns up to 128: a 128 x 256 f32 tile with 4 warps spills its accumulator (docs/decisions.md#f32-tiles)
    block_n = matrix_block(c, 128 if wide else 256)
    block_k = matrix_block(k, 32 if wide else 64)
    # one-pass TF32 keeps 4 warps on wide columns (CK 15's 3D forward shapes: 2.46 against 2.71 ms with 8,
    # docs/decisions.md#tf32-staged)
    return TileConfig(128, block_n, block_k, warps=8 if block_n >= 128 and not p.tf32 else 4,
                      stages=3 if wide or block_n >= 128 else 4, pack=pack)


def default_forward_tiles(p: ConvProblem) -> TileConfig:
    """Forward runs on grad_input's GEMM kernel with the channels' roles swapped (columns K, reduction C x taps):
    dense 16-bit GEMMs with C >= 64 as _dense_16bit_tiles says (docs/decisions.md#step-tiles), else grad_input's
    tiles of the swapped problem."""
    swapped = default_grad_input_tiles(p.with_(in_channels=p.out_channels, out_channels=p.in_channels))
    if swapped.pack == 1 and p.in_channels < MATRIX_BLOCK and math.prod(p.filter) > 1:
        # few input channels (an RGB stem): the reduction over (taps, C) flattened (launch.flat_reduction),
        # up to 64 of them per step, 64 rows (docs/decisions.md#flat-reduction)
        return replace(swapped, block_m=64, block_k=matrix_block(p.in_channels * math.prod(p.filter), 64),
                       warps=4, stages=3)
    dense = _dense_16bit_tiles(p, p.batch * math.prod(p.output), p.out_channels,
                               p.in_channels * math.prod(p.filter))
    if dense is None or swapped.pack != 1 or p.in_channels < 64:
        return swapped
    return dense


def direct_grad_input_tiles(p: ConvProblem) -> TileConfig:
    """grad_input_direct and forward_direct: chunks of at most block_m positions along the innermost dimension x
    block_n channels over the warps (block_k unused), two channels per thread (docs/decisions.md#depthwise-tiles;
    chosen on grad_input, the forward kernel's loads and sums are alike)."""
    block_n = 128 if p.groups >= 128 else 64 if p.groups >= 64 else 32
    return TileConfig(32, block_n, 1, warps=max(1, block_n // 64), stages=1)


def default_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """Rows (K) as tall as K up to 128, 128 columns (taps x C); f32 with 64 columns and 4 warps, which
    pays most for f32 (docs/decisions.md#default-tiles); few-channel groups packed (default_pack).  Dense 16-bit
    GEMMs: 4 warps and 4 stages, 64 x 64 tiles below 128 rows (docs/decisions.md#step-tiles)."""
    pack = default_pack(p)
    _, _, k = packed_sizes(p, pack)
    block_m = matrix_block(k, 128)
    if p.dtype == "f32":
        return TileConfig(block_m, 64, 32, warps=4, stages=3, pack=pack)
    if pack == 1 and p.groups == 1 and p.compute is None:
        return TileConfig(128, 128, 64, warps=4, stages=4) if block_m >= 128 else \
            TileConfig(64, 64, 64, warps=4, stages=4)
    return TileConfig(block_m, 128, 64, warps=8 if block_m >= 128 else 4, stages=3 if block_m >= 128 else 4,
                      pack=pack)


def resident_programs(tiles: TileConfig, element_bytes: int, target: Target) -> int:
    """Programs of a GEMM kernel resident on one SM at once, as its pipeline's shared memory (stages x (A + B)
    tiles; as ncu reported for these kernels) and its warps allow (registers are not known before compiling)."""
    gpu = target.gpu
    shared = tiles.stages * (tiles.block_m + tiles.block_n) * tiles.block_k * element_bytes
    return max(1, min(gpu.shared_per_sm // (shared + gpu.shared_reserved_per_block),
                      gpu.warps_per_sm // tiles.warps))


def fullest_split(tiles_out: int, slots: int, most: int) -> int:
    """The fewest chunks S <= most (the longest chunks) whose tiles_out x S programs keep the slots within 2% as
    busy as the best S does."""
    fill = {s: last_wave_fill(tiles_out * s, slots) for s in range(1, most + 1)}
    best = max(fill.values())
    return min(s for s, f in fill.items() if f >= best - 0.02)


def last_wave_fill(programs: int, slots: int) -> float:
    """The share of the resident slots the programs keep busy over their waves: 1.0 when they come in whole
    waves (a last wave of a few programs leaves the GPU idle: docs/decisions.md#split-k-waves)."""
    waves = -(-programs // slots)
    return programs / (waves * slots)


def grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The split-K chunks S asked for: the problem's split_k (the user's), else the tiles' split (a knob: tuned or
    a candidate's), else the fewest chunks whose programs fill the GPU's resident slots best (last_wave_fill), at
    most 256 chunks of at least 8 reduction steps (each chunk adds a weight-sized f32 partial to write and sum)."""
    parts = p.split_k or tiles.split
    if not parts:
        slots = target.gpu.sm_count * resident_programs(tiles, 4 if p.dtype == "f32" else 2, target)
        parts = fullest_split(output_tiles(p, tiles), slots, max(1, min(256, reduction_steps(p, tiles) // 8)))
    return parts


def grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int]:
    """(S, CHUNK positions) of grad_weight's split-K: grad_weight_parts cut into whole reduction steps."""
    return reduction_split(p, tiles, grad_weight_parts(p, tiles, target), target, "grad_weight GEMM kernel")


def even_chunks(steps: int, parts: int, most: int) -> tuple[int, int]:
    """(S, CHUNK): `steps` cut into about `parts` chunks of CHUNK steps (the last one shorter), at most `most`
    and at most one a step; S recounted so that no chunk is empty (7 steps in 3: chunks of 3, S = 3; 4 steps
    in 3: chunks of 2, S = 2)."""
    parts = max(1, min(parts, steps, most))
    chunk = -(-steps // parts)
    return -(-steps // chunk), chunk


def _honoured(p: ConvProblem, split: tuple[int, int], most: int, kernel: str, cut: str) -> tuple[int, int]:
    # the split, where it is the problem's split_k or none was asked for: a split_k is never silently changed
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
    parts, chunk = _honoured(p, even_chunks(steps, parts, most), most, kernel,
                             f"{steps} reduction steps of {tiles.block_k} positions")
    return parts, chunk * tiles.block_k


# grad_weight_depthwise's filters with more taps than this spread their tap rows across threads (a thread
# holding every tap of ConvNeXt's 7x7 needed 254 registers)
TAPS_PER_THREAD_MOST = 16


def tap_rows(p: ConvProblem) -> int:
    """grad_weight_depthwise's TAP_ROWS: 1 (every tap in each thread) for small filters, else the filter's rows
    (f0, f1) padded to a power of two (one thread per tap row and channel) (docs/decisions.md#depthwise-tiles)."""
    f = pad3(p.filter, 1)
    if f[0] * f[1] * f[2] <= TAPS_PER_THREAD_MOST:
        return 1
    return 1 << (f[0] * f[1] - 1).bit_length()


def depthwise_grad_weight_tiles(p: ConvProblem) -> TileConfig:
    """grad_weight_depthwise: chunks of at most block_m positions along the innermost dimension (unrolled, cut
    evenly: depthwise_chunk) x block_n channels, one element of the [TAP_ROWS, block_n] tensors per thread.
    (docs/decisions.md#depthwise-tiles)."""
    rows = tap_rows(p)
    return TileConfig(8 if rows == 1 else 32, 32, 1, warps=min(16, rows), stages=1)


def depthwise_grad_weight_parts(p: ConvProblem, tiles: TileConfig, target: Target) -> int:
    """The chunks of dY rows asked for: the problem's split_k, else tiles.split, else programs for 16 warps per SM
    (bound by memory and latency: many loads in flight, and the partials few enough for one linalg sum)."""
    blocks = depthwise_channel_blocks(p, tiles)
    return p.split_k or tiles.split or 16 * target.gpu.sm_count // (blocks * tiles.warps)


def depthwise_grad_weight_split(p: ConvProblem, tiles: TileConfig, target: Target) -> tuple[int, int, bool]:
    """(S, run, slide) of grad_weight_depthwise: S chunks of `run` dY rows each, about depthwise_grad_weight_parts
    of them.  slide (slides_along_rows): the chunks are segments of `run` rows o1 within each plane (n, o0), as
    many per plane as the parts ask, cut evenly; else runs of the N x O0 x O1 rows (even_chunks).  A split_k the
    segments cannot give takes the runs; one neither can give is refused (a ValueError)."""
    out3 = pad3(p.output, 1)
    rows = p.batch * out3[0] * out3[1]
    asked = depthwise_grad_weight_parts(p, tiles, target)
    most = target.max_grid[1]  # the chunks are the grid's y
    if slides_along_rows(p):
        planes = p.batch * out3[0]
        per_plane = min(out3[1], -(-max(1, min(rows, asked, most)) // planes))
        seg = -(-out3[1] // per_plane)
        parts = planes * -(-out3[1] // seg)  # no segment empty
        if p.split_k is None or parts == p.split_k:
            return parts, seg, True
    parts, rows_per = _honoured(p, even_chunks(rows, asked, most), most, "depthwise grad_weight kernel",
                                f"the {rows} rows of dY (N x O0 x O1)")
    return parts, rows_per, False


def slides_along_rows(p: ConvProblem) -> bool:
    """grad_weight_depthwise_rows applies: every tap in each thread (tap_rows 1), and consecutive dY rows o1
    share X rows (stride and dilation 1 along that dimension, at least two filter rows)."""
    g = geometry(p)
    return tap_rows(p) == 1 and g["S"][1] == 1 and g["D"][1] == 1 and g["F"][1] >= 2


def dy_read_in_place(p: ConvProblem, tiles: TileConfig) -> bool:
    """NGCHW grad_weight: whether the GEMM kernel reads dY in place, with only X copied channels-last.
    X must be copied: its taps shift it along NGCHW's contiguous axis, which no vector load can follow.
    dY is not shifted: where its reduction tiles lie within images, each is contiguous (the kernel's DY_IMAGE
    addressing), so it needs no copy."""
    return (p.op == "grad_weight" and p.layout == "NGCHW" and not (p.depthwise and tiles.pack == 1)
            and tiles_within_images(p, tiles))


def kernel_tiles(p: ConvProblem, tiles: Optional[TileConfig]) -> TileConfig:
    """The tiles plan_launches uses for p: `tiles`, else the defaults of the kernel p runs on."""
    if tiles is not None:
        return tiles
    if direct_forward(p):
        return direct_grad_input_tiles(p)
    if p.op == "forward":
        return default_forward_tiles(p)
    if p.op == "grad_weight":
        return depthwise_grad_weight_tiles(p) if p.depthwise else default_grad_weight_tiles(p)
    return direct_grad_input_tiles(p) if direct_grad_input(p) else default_grad_input_tiles(p)


LaunchPlan = tuple[TileConfig, tuple[Launch, ...], tuple[int, ...]]


def plan_launches(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str] = None,
                  weight_axes: tuple[str, ...] = ()) -> LaunchPlan:
    """(tiles, launches, f32 partials' shape for grad_weight) of one kernel, symbols named after it;
    tiles None: the defaults of the kernel it uses (kernel_tiles).  x_layout: grad_weight's GEMM kernel reads
    a copy of X in that layout (dy_read_in_place).  weight_axes: the GEMM kernel reads a copy of the weight with
    its axes in this order (weight_copy_axes).  A ValueError where the kernels cannot take p
    (launches_or_reason says why)."""
    planned = launches_or_reason(p, tiles, target, x_layout, weight_axes)
    if isinstance(planned, str):
        raise ValueError(planned)
    return planned


@functools.lru_cache(maxsize=1024)
def launches_or_reason(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str],
                       weight_axes: tuple[str, ...]) -> Union[LaunchPlan, str]:
    """plan_launches' plan, or why the kernels cannot take p (a grid past CUDA's limits, a split_k they cannot
    cut, tiles that do not fit): a pure function of frozen arguments, so each kernel is planned once however many
    rules ask (unsupported_reason, extern_launches, the stream path)."""
    try:
        return _plan_launches(p, tiles, target, x_layout, weight_axes)
    except ValueError as err:
        return str(err)


def _plan_launches(p: ConvProblem, tiles: Optional[TileConfig], target: Target, x_layout: Optional[str],
                   weight_axes: tuple[str, ...]) -> LaunchPlan:
    base = re.sub(r"\W", "_", p.name)
    packed = tiles is not None and tiles.pack > 1  # depthwise too, as packed GEMMs, where tiles ask for it
    if x_layout and (p.op != "grad_weight" or (p.depthwise and not packed)):
        raise ValueError(f"x_layout: only grad_weight's GEMM kernel reads a copy of X ({p.name})")
    tiles = kernel_tiles(p, tiles)
    if p.op == "grad_weight" and p.depthwise and not packed:
        launch, partials = grad_weight_depthwise_launch(p, tiles, base, *depthwise_grad_weight_split(p, tiles, target),
                                                        tap_rows(p))
        return tiles, (launch,), partials
    if p.op == "grad_weight":
        launch, partials = grad_weight_launch(p, tiles, base, grad_weight_split(p, tiles, target), dot_precision(p),
                                              x_layout)
        return tiles, (launch,), partials
    if direct_forward(p) and not packed:
        return tiles, (forward_direct_launch(p, tiles, base),), ()
    if p.op == "forward":
        return tiles, (forward_launch(p, tiles, base, dot_precision(p), weight_axes),), ()
    if direct_grad_input(p) and not packed:
        return tiles, (grad_input_direct_launch(p, tiles, base),), ()
    return tiles, (grad_input_launch(p, tiles, base, dot_precision(p), weight_axes),), ()


# the weight layout the GEMM kernels read fast where they read the weight (forward, grad_input, transposed)
FAST_WEIGHT_LAYOUT = "GKYXC"


def weight_copy_axes(p: ConvProblem) -> tuple[str, ...]:
    """The axis order (problem.weight_axes' names) of the weight copy the GEMM kernels read, or () where they read
    the weight as it lies (forward, grad_input and transposed read the weight; grad_weight writes it).  The copy
    is the weight's size, once per call:
      - grad_input and transposed in one-pass TF32: K innermost (GYXCK, GCYXK).  Their GEMM reduces over K, and
        TF32 wgmma reads shared memory K-major only; K-strided weight tiles were rounded in registers on the way
        (launch.tf32_staged), which halved the kernel's speed (docs/decisions.md#tf32-staged);
      - GKCYX weights: a GKYXC copy.  In GKCYX a tile's reduction channels lie a filter's taps apart and its
        columns C*taps apart, so every element is a load of its own: 1.25 ms against 0.19 for cuDNN on CK's
        NGCHW forward shape (docs/decisions.md#weight-copy).  Where the filter has one tap or a group one
        channel the two layouts coincide."""
    axes = weight_axes(p)
    if p.op in ("grad_input", "transposed") and dot_precision(p) == "tf32" and not p.depthwise:  # depthwise: no GEMM
        return tuple(a for a in axes if a != "k") + ("k",)
    if p.weight_layout != FAST_WEIGHT_LAYOUT and p.op != "grad_weight" and math.prod(p.filter) > 1 \
            and p.in_channels > 1:
        return tuple(weight_axes(p.with_(weight_layout=FAST_WEIGHT_LAYOUT)))
    return ()


@dataclass(frozen=True)
class ExternLaunches:
    """The Triton launches of one kernel and what surrounds them: the tiles, the launches (one per kernel:
    grad_input covers all its stride phases in one), the shape of grad_weight's f32 split-K partials
    [S, G, K, taps(3D), C], and the NGCHW activations (by argument name) that are copied to NHWGC for the
    launches (`problem` is then the NHWGC problem the launches were planned for, where every activation
    is copied; the result is copied back)."""

    problem: ConvProblem
    tiles: TileConfig
    launches: tuple[Launch, ...]
    partials_shape: tuple[int, ...] = ()
    copied_channels_last: tuple[str, ...] = ()
    # the launches read a copy of the weight with its axes in this order (weight_copy_axes; empty: none)
    weight_axes: tuple[str, ...] = ()


def extern_launches(problem: ConvProblem, target: Target, knobs: Knobs) -> Optional[ExternLaunches]:
    """The Triton GEMM cores' launches for `problem` on `target` with `knobs`, or None where the kernel keeps
    the linalg form (extern_choice says why)."""
    use, tiles, _ = extern_choice(problem, target, knobs)
    if not use:
        return None
    copy_axes = weight_copy_axes(problem)
    if problem.layout == "NGCHW" and relayout_ngchw(problem, knobs):
        # the kernels on NHWGC copies of the activations (contiguous channels)
        inner = problem.with_(layout="NHWGC")
        tiles = kernel_tiles(inner, tiles)
        if dy_read_in_place(problem, tiles):
            # grad_weight: only X copied; dY is read where it lies (one copy fewer)
            _, launches, partials = plan_launches(problem, tiles, target, x_layout=inner.layout)
            return ExternLaunches(problem, tiles, launches, partials, copied_channels_last=("x",))
        _, launches, partials = plan_launches(inner, tiles, target, weight_axes=copy_axes)
        copied = tuple(n for n, s in zip(problem.arg_names, problem.arg_shapes) if s != problem.w_shape)
        return ExternLaunches(inner, tiles, launches, partials, copied_channels_last=copied, weight_axes=copy_axes)
    tiles, launches, partials = plan_launches(problem, tiles, target, weight_axes=copy_axes)
    return ExternLaunches(problem, tiles, launches, partials, weight_axes=copy_axes)



def split_k_sum(p: ConvProblem, partials_shape: tuple[int, ...], base: str, target: Target) -> Launch:
    """The stream runner's sum of grad_weight's f32 partials (kernels/elementwise.sum_partials), spread over the
    programs the target's sum aims for (Target.sum_programs)."""
    return sum_partials_launch(p, partials_shape, base, target.sum_programs)

# --- knobs over IREE's own GPU configuration ------------------------------------------------------

def iree_knobs(p: ConvProblem, target: Target) -> Knobs:
    """Knobs for a shape the tuning database does not hold, generalised from the shapes tuned on an H200.

    Large f16/bf16 GEMMs take doubled tiles (and a third prefetch stage for long reductions), small ones a
    doubled N tile, f32 and depthwise none (docs/decisions.md#iree-knob-rules).  They are fitted to the target's
    workgroup memory where IREE's configuration is known (backends/iree_config.fit_knobs reads
    Target.gpu.workgroup_memory: 64 KB per workgroup on gfx942, gfx90a and gfx1100).
    """
    sixteen_bit = p.dtype in ("f16", "bf16") or p.fp8_compute or p.bf16x3  # tf32: f32 on the linalg form
    if target.backend == "cpu" or p.depthwise or not sixteen_bit:
        return Knobs()
    if p.op == "grad_weight":
        if p.out_channels >= 128 and p.in_channels * math.prod(p.filter) >= 2048:
            return Knobs(n_scale=2, m_scale=2)
        return Knobs()
    if p.op == "forward":
        m, n, reduction = p.batch * math.prod(p.output), p.out_channels, p.in_channels * math.prod(p.filter)
    else:
        # grad_input / transposed: one GEMM per stride phase, each over ~1/prod(s) of dX and of the taps
        m = p.batch * math.prod(-(-i // s) for i, s in zip(p.input, p.stride))
        n = p.in_channels
        reduction = p.out_channels * math.prod(p.filter) // math.prod(p.stride)
    if n < 64:
        return Knobs()
    if m >= 60_000 and n >= 128 and p.op != "forward" and all(s == 1 for s in p.stride):
        # stride 1 only: with K-innermost phase weights a strided GEMM lost with it (docs/decisions.md#iree-knob-rules)
        return Knobs(n_scale=4, m_scale=2)
    if m >= 60_000:
        return Knobs(n_scale=2, m_scale=2, prefetch=3 if reduction >= 1024 else None)
    return Knobs(n_scale=2)


def knobs_for(p: ConvProblem, target: Target, tuned: Optional[Knobs]) -> Knobs:
    """A kernel's knobs: the tuning database's entry where it has one (`tuned`), else the rules'.  The CPU has
    no knobs (IREE's CPU configuration is kept)."""
    if target.backend == "cpu":
        return Knobs()
    return tuned if tuned is not None else iree_knobs(p, target)


# --- overrides: a rule's variant, for probes and tests ---------------------------------------------------

_generation = 0


def overrides_generation() -> int:
    """Changes whenever `overrides` replaces or restores rules: plans cached outside this module (stream.py) key
    on it, so that none planned under other rules is served."""
    return _generation


@contextlib.contextmanager
def overrides(**rules: object) -> Iterator[None]:
    """Replace policy's rules (functions or constants, by name) while the block runs.  The rules read each other
    through this module, so a replaced one is what every planner sees (plan_kernel, stream.plan_stream_kernel,
    the launches); plans cached before are not served inside the block, nor those made inside after it.

        with policy.overrides(tma_grad_weight_parts=lambda p, tiles, target: 4):
            kernel = stream.plan_stream_kernel(p, target, Knobs(), compile=True)
    """
    global _generation
    namespace = globals()
    unknown = sorted(name for name in rules if name not in namespace or name.startswith("__"))
    if unknown:
        raise ValueError(f"policy.overrides: expected names of convdsl/policy.py's rules, got {', '.join(unknown)}")
    saved = {name: namespace[name] for name in rules}
    namespace.update(rules)
    _generation += 1
    launches_or_reason.cache_clear()
    try:
        yield
    finally:
        namespace.update(saved)
        _generation += 1
        launches_or_reason.cache_clear()
