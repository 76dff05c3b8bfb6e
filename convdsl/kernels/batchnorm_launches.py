"""The launches of the fused BatchNorm + activation (kernels/batchnorm.py) for one tensor: its view as
y[n, c, s], its blocks and how many programs share a channel block's rows, as data.  Every size is a
constant of the kernels, so a launch passes only pointers (the stream runner's calling convention)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .launch import Launch

# activations by name, as the kernels number them
ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2, "silu": 3, "hardswish": 4}
# the activations a residual block end takes (their derivative is a mask of the output: the sum is not kept)
RESIDUAL_ACTIVATIONS = (None, "relu", "relu6")
# Triton's element type names of torch's dtypes (by their names)
ELEMENTS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64"}
# programs of a statistics pass per streaming multiprocessor: enough rows in flight to cover memory latency
PROGRAMS_PER_SM = 4
# elements per block of the elementwise passes (and per merge step of the partials, half of it)
BLOCK_ELEMENTS = 4096


def _pow2_at_most(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class BatchNormLaunches:
    """The four launches of one tensor's BatchNorm + activation and the f32 workspaces they take."""

    stats: Launch       # (y, work, counter, running_mean, running_var, batches); work starts with the stats
    apply: Launch       # (y, stats, weight, bias, residual, out)
    apply_running: Launch  # (y, running_mean, running_var, weight, bias, residual, out): eval mode
    grad_stats: Launch  # (dout, y, stats, weight, bias, out, work, counter, grads)
    grad_apply: Launch  # (dout, y, stats, weight, bias, out, grads, dy, grad_residual)
    # without a residual, its pointers (residual, out in the backward, grad_residual) are never read: pass y
    channels: int
    channels_last: bool
    channel_blocks: int  # the counters the statistics passes take
    programs: int       # P: programs along the rows per channel block
    work_elements: int  # f32 stats and partials of the statistics pass (2 C + 3 P C; the gradient pass takes 2 P C)


def batch_norm_launches(shape: tuple[int, ...], channels_last: bool, dtype: str, weight_dtype: str,
                        running_dtype: str, activation: str | None, update: bool, momentum: float | None,
                        eps: float, sm_count: int, residual: bool = False) -> BatchNormLaunches:
    """shape (N, C, *spatial) of the convolution's output, stored channels-last or contiguous; dtype names
    torch's ("bfloat16"); momentum None: the cumulative average (num_batches_tracked read by the kernel);
    residual: act(BatchNorm(y) + r), the activation none, relu or relu6."""
    if residual and activation not in RESIDUAL_ACTIVATIONS:
        raise ValueError(f"a residual takes {RESIDUAL_ACTIVATIONS} as its activation, not {activation!r}")
    n, c = shape[0], shape[1]
    hw = math.prod(shape[2:])
    rows = n * hw
    if channels_last:  # [rows, channels] blocks, the channels contiguous
        block_c = _pow2_at_most(c, 64)
        block_r = max(1, BLOCK_ELEMENTS // block_c)
        blocks = -(-rows // block_r)
    else:  # [channels, positions] blocks of one image, the positions contiguous
        block_r = _pow2_at_most(hw, 256)
        block_c = _pow2_at_most(c, max(1, BLOCK_ELEMENTS // block_r))
        blocks = n * -(-hw // block_r)
    channel_blocks = -(-c // block_c)
    wanted = max(1, PROGRAMS_PER_SM * sm_count // channel_blocks)
    per = max(1, -(-blocks // wanted))
    programs = -(-blocks // per)
    block_p = max(1, BLOCK_ELEMENTS // 2 // block_c)
    act = ACTIVATIONS[activation]
    y, w, r = ELEMENTS[dtype], ELEMENTS[weight_dtype], ELEMENTS[running_dtype]
    shape_name = "x".join(str(d) for d in shape) + ("_cl" if channels_last else "")
    sizes = dict(C=c, HW=hw, ROWS=rows)
    tiles = dict(BLOCK_R=block_r, BLOCK_C=block_c, CL=channels_last)
    reduce = dict(BLOCKS=blocks, PER=per, P=programs)
    grid_rows, grid_all = (programs, channel_blocks, 1), (blocks, channel_blocks, 1)

    def launch(kernel: str, types: tuple[str, ...], consts: dict, grid: tuple[int, int, int]) -> Launch:
        name = f"bn_{kernel}_{shape_name}_{y}_a{act}{'r' if residual else ''}"
        return Launch(kernel, name, types, tuple(consts.items()), grid, 4, 1)

    stats = launch("batch_stats", (y, "fp32", "i32", r, r, "i64"),
                   dict(sizes, **reduce, EPS=float(eps), MOMENTUM=-1.0 if momentum is None else float(momentum),
                        UPDATE=update, **tiles, BLOCK_P=block_p), grid_rows)
    fused = dict(ACT=act, RESIDUAL=residual)
    apply = launch("apply_act", (y, "fp32", w, w, y, y), dict(sizes, **tiles, **fused), grid_all)
    apply_running = launch("apply_running", (y, r, r, w, w, y, y), dict(sizes, EPS=float(eps), **tiles, **fused),
                           grid_all)
    grad_stats = launch("grad_stats", (y, y, "fp32", w, w, y, "fp32", "i32", "fp32"),
                        dict(sizes, **reduce, **tiles, BLOCK_P=block_p, **fused), grid_rows)
    grad_apply = launch("grad_apply", (y, y, "fp32", w, w, y, "fp32", y, y), dict(sizes, **tiles, **fused),
                        grid_all)
    return BatchNormLaunches(stats, apply, apply_running, grad_stats, grad_apply, c, channels_last, channel_blocks,
                             programs,
                             2 * c + 3 * programs * c)
