"""The CPU's rules: which forms IREE's llvm-cpu backend runs fastest (im2col, gather, named depthwise
convolutions), data tiling per module, the packed matmuls' workgroups, the im2col grad_weight's split, and the
workspaces the Python API keeps from call to call."""
from __future__ import annotations

import math
from typing import Optional, Sequence

from ..problem import ConvProblem
from ..targets import Target
from .common import MAX_GROUP_MACS, MAX_WEIGHT_SLICES, gather_applies


def cpu_gather_forward(p: ConvProblem, target: Target) -> bool:
    """CPU forward with few channels per group (not depthwise): the gather form, each output element reading its
    taps' X values, as the gradients with few channels do; the implicit-GEMM generic was slower
    (docs/decisions.md#cpu-gather-forward).  GPUs keep their forward forms."""
    return (target.backend == "cpu" and p.op == "forward" and p.groups > 1 and not p.depthwise
            and p.in_channels * p.out_channels <= MAX_GROUP_MACS and not p.dynamic_batch and not p.fp8_compute
            and math.prod(p.filter) * p.in_channels <= MAX_WEIGHT_SLICES)


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
