"""Launches of the cp.async Triton kernels (kernels/igemm.py): the implicit GEMMs of grad_input (every stride
phase in one launch), forward and grad_weight's split-K partials, and the direct kernels of depthwise
convolutions.  The tiles, the split and the precision arrive decided (convdsl/policy/cuda.py).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from ..algebra import Phase, grad_input_phases
from ..problem import ConvProblem
from .launch import (ELEMENT, Launch, activation_strides, check_grid, depthwise_channel_blocks, depthwise_chunk,
                     flat_positions, flat_reduction, geometry, image_flat_positions, needs_wide, operand_element,
                     pack_strides, packed_sizes, pad3, tf32_staged, tiles_within_images, weight_strides)
from .tiles import TileConfig


def grad_input_launch(p: ConvProblem, tiles: TileConfig, base: str, precision: str,
                      weight_axes: Sequence[str] = (), split: int = 1) -> Launch:
    """One launch for every stride phase (all-zero phases too: their programs store zeros): phase p's programs
    write the dX positions i = r + s*q of its residue r; together they write every element of dX once.
    Phases are ordered by taps, heaviest first, so that the short ones fill the last wave.  One launch rather
    than a dispatch per phase, because phases tied into one dX made IREE copy dX into the caller's buffer
    afterwards (docs/decisions.md#one-launch-for-all-phases).  precision: Triton's dot precision.  weight_axes: the
    axis order of the weight copy the launch reads (policy.weight_copy_axes; empty: p's weight layout).  split > 1
    (one phase only): split-K, the launch writing `split` f32 partials of dX (output_split_shape) for a sum launch."""
    tiles.check_matrix()
    phases = sorted(grad_input_phases(p), key=lambda ph: -math.prod(d.J for d in ph.dims))
    groups, c, k = packed_sizes(p, tiles.pack)
    dy_str = pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    dx_str = pack_strides(activation_strides(p, p.input, p.in_channels), tiles.pack)
    w_str = weight_strides(p, weight_axes)  # the kernel finds each sub-group's weight block itself
    padded = [_pad_phase(ph) for ph in phases]
    # per phase: its tiles over rows (n, q...) times column tiles; FIRST[p] is its first program
    first = [0]
    for ph in phases:
        rows = p.batch * math.prod(ph.sizes)
        first.append(first[-1] + -(-rows // tiles.block_m) * -(-c // tiles.block_n))
    # per dimension d, a tuple over the phases: Q[d][p] ...
    per_phase = {name: tuple(tuple(pd[d][key] for pd in padded) for d in range(3))
                 for name, key in (("Q", "Q"), ("J", "J"), ("R", "r"), ("OFF", "off"), ("OSTEP", "o_step"),
                                   ("Y0", "y0"), ("TSTEP", "tap_step"))}
    consts = dict(
        C=c, K=k, N=p.batch, O=pad3(p.output, 1), S=pad3(p.stride, 1),
        PHASES=len(phases), FIRST=tuple(first), RS=(1, 1, 1), **per_phase,
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        PRECISION=precision, PACK=tiles.pack,
        # A = dY reduces over its K channels, B = W over its k
        ROUND_A=tf32_staged(precision, dy_str[2]), ROUND_B=tf32_staged(precision, w_str[1]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_STAGES=tiles.stages, WIDE=needs_wide(p),
        ONE_TAP=all(math.prod(d.J for d in ph.dims) <= 1 for ph in phases), FLAT=False,
        **_split_constants(p, split, len(phases)),
    )
    elem = operand_element(p)
    return Launch("grad_input_phases", f"{base}_phases", (elem, elem, _result_element(p, split)),
                  tuple(consts.items()), check_grid(base, (first[-1], groups, split)), tiles.warps, tiles.stages)


def output_split_shape(p: ConvProblem, split: int) -> tuple[int, ...]:
    """The f32 partials of a split forward / grad_input: [split, the result's elements] (each in the result's own
    memory order, so that the sum is elementwise)."""
    return (split, math.prod(p.result_shape)) if split > 1 else ()


def _split_constants(p: ConvProblem, split: int, phases: int) -> dict:
    if split > 1 and phases != 1:
        raise ValueError(f"kernel {p.name}: split-K of forward / grad_input takes one stride phase, not {phases}")
    return dict(SPLIT=split, PART=math.prod(p.result_shape) if split > 1 else 0)


def _result_element(p: ConvProblem, split: int) -> str:
    return "fp32" if split > 1 else ELEMENT[p.result_dtype]


def forward_launch(p: ConvProblem, tiles: TileConfig, base: str, precision: str,
                   weight_axes: Sequence[str] = (), split: int = 1) -> Launch:
    """Forward as grad_input_phases with one phase: rows are Y's positions q (written at i = q), columns its K
    channels, the reduction runs over taps j and the C channels of X, read at s*q - lo + j*d (the read stride RS
    = s, off = -lo, o_step = -d).  The kernel's dY is X, its dX is Y, and the weight's k and c strides swap so
    that W[g, k, y, c] is read as the kernel's W[g, c, y, k].  weight_axes and split: as grad_input_launch's."""
    tiles.check_matrix()
    groups, k_out, c_red = packed_sizes(p.with_(in_channels=p.out_channels, out_channels=p.in_channels), tiles.pack)
    x_str = pack_strides(activation_strides(p, p.input, p.in_channels), tiles.pack)
    y_str = pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    w = weight_strides(p, weight_axes)
    w_swapped = (w[0], w[2], w[1], w[3], w[4], w[5])
    taps, out3 = pad3(p.filter, 1), pad3(p.output, 1)
    lo, dil = pad3(p.pad_lo, 0), pad3(p.dilation, 1)
    rows = p.batch * math.prod(out3)
    programs = -(-rows // tiles.block_m) * -(-k_out // tiles.block_n)
    one = lambda values: tuple((v,) for v in values)  # noqa: E731 - one phase: Q[d][0] ...
    consts = dict(
        C=k_out, K=c_red, N=p.batch, O=pad3(p.input, 1), S=(1, 1, 1),
        PHASES=1, FIRST=(0, programs), RS=pad3(p.stride, 1),
        Q=one(out3), J=one(taps), R=one((0, 0, 0)), OFF=one(tuple(-v for v in lo)), OSTEP=one(tuple(-d for d in dil)),
        Y0=one((0, 0, 0)), TSTEP=one((1, 1, 1)),
        DY=x_str, W=w_swapped, DX=y_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        PRECISION=precision, PACK=tiles.pack,
        # A = X and B = W both reduce over the C channels
        ROUND_A=tf32_staged(precision, x_str[2]), ROUND_B=tf32_staged(precision, w_swapped[1]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_STAGES=tiles.stages, WIDE=needs_wide(p), ONE_TAP=math.prod(taps) == 1,
        FLAT=flat_reduction(p, tiles), **_split_constants(p, split, 1),
    )
    elem = operand_element(p)
    return Launch("grad_input_phases", f"{base}_forward", (elem, elem, _result_element(p, split)),
                  tuple(consts.items()), check_grid(base, (programs, groups, split)), tiles.warps, tiles.stages)


def _pad_phase(ph: Phase) -> list[dict[str, int]]:
    # leading unit dimensions: one residue, one tap at y = 0 reading o = q
    unit = dict(r=0, y0=0, J=1, tap_step=1, off=0, o_step=1, Q=1)
    dims = [dict(r=d.r, y0=d.y0, J=d.J, tap_step=d.tap_step, off=d.off, o_step=d.o_step, Q=d.Q)
            for d in ph.dims]
    return [unit] * (3 - len(dims)) + dims


# grad_input_direct unrolls BLOCK_W x F[2] products per filter row and channel: chunks are cut shorter for wide
# filters so that this stays bounded (a 31x31 filter: chunks of 4 positions)
UNROLLED_PRODUCTS = 128


def grad_input_direct_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """Depthwise: one launch, a program per dX row (n, i0, i1) and block of channels; the row's chunks are a
    multiple of the stride along it (every chunk starts on stride phase 0)."""
    dy_str = activation_strides(p, p.output, p.out_channels)
    dx_str = activation_strides(p, p.input, p.in_channels)
    w_str = weight_strides(p)
    in3, stride, f2 = pad3(p.input, 1), pad3(p.stride, 1)[2], pad3(p.filter, 1)[2]
    chunk = depthwise_chunk(in3[2], min(tiles.block_m, max(1, UNROLLED_PRODUCTS // f2)))
    consts = dict(
        G=p.groups, N=p.batch,
        **geometry(p),
        DY=dy_str, W=w_str, DX=dx_str,
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        BLOCK_W=-(-chunk // stride) * stride, BLOCK_CH=tiles.block_n, WIDE=needs_wide(p),
    )
    grid = (p.batch * in3[0] * in3[1], -(-p.groups // tiles.block_n), 1)
    elem = operand_element(p)
    return Launch("grad_input_direct", f"{base}_direct", (elem, elem, ELEMENT[p.result_dtype]), tuple(consts.items()),
                  check_grid(base, grid), tiles.warps, tiles.stages)


# forward_direct holds a chunk's X window (SPAN = (BLOCK_W - 1) * S + (F - 1) * D + 1 values per channel) in
# registers beside its BLOCK_W sums: strided rows get shorter chunks so that the window stays this wide at most
FORWARD_WINDOW_MOST = 64


def forward_direct_launch(p: ConvProblem, tiles: TileConfig, base: str) -> Launch:
    """Depthwise forward: one launch, a program per Y row (n, o0, o1) and block of channels; the row cut into
    chunks of at most tiles.block_m positions, fewer where the filter is wide (UNROLLED_PRODUCTS) or the
    stride long (FORWARD_WINDOW_MOST)."""
    out3, f2 = pad3(p.output, 1), pad3(p.filter, 1)[2]
    stride, dil = pad3(p.stride, 1)[2], pad3(p.dilation, 1)[2]
    # the longest chunk whose window (BLOCK_W - 1) * stride + (f2 - 1) * dil + 1 fits FORWARD_WINDOW_MOST
    window_chunk = max(1, (FORWARD_WINDOW_MOST - 1 - (f2 - 1) * dil) // stride + 1)
    chunk = depthwise_chunk(out3[2], min(tiles.block_m, max(1, UNROLLED_PRODUCTS // f2), window_chunk))
    consts = dict(
        G=p.groups, N=p.batch,
        **geometry(p),
        X=activation_strides(p, p.input, p.in_channels), W=weight_strides(p),
        Y=activation_strides(p, p.output, p.out_channels),
        ALPHA=float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0,
        BLOCK_W=chunk, BLOCK_CH=tiles.block_n, WIDE=needs_wide(p),
    )
    grid = (p.batch * out3[0] * out3[1], depthwise_channel_blocks(p, tiles), 1)
    elem = operand_element(p)
    return Launch("forward_direct", f"{base}_direct", (elem, elem, ELEMENT[p.result_dtype]), tuple(consts.items()),
                  check_grid(base, grid), tiles.warps, tiles.stages)


def grad_weight_depthwise_launch(p: ConvProblem, tiles: TileConfig, base: str, parts: int, run: int,
                                 slide_rows: bool, tap_rows: int) -> tuple[Launch, tuple[int, ...]]:
    """Depthwise grad_weight: f32 partials [S, G, 1, taps, 1] of S = `parts` chunks of `run` dY rows (n, o0, o1)
    each (policy.depthwise_grad_weight_split), summed like grad_weight_launch's.  slide_rows: the chunks are
    segments of `run` rows o1 within a plane (n, o0) and the kernel slides along them
    (grad_weight_depthwise_rows); tap_rows: the other kernel's TAP_ROWS (1: every tap in each thread)."""
    out3 = pad3(p.output, 1)
    blocks = depthwise_channel_blocks(p, tiles)
    x_str = activation_strides(p, p.input, p.in_channels)
    dy_str = activation_strides(p, p.output, p.out_channels)
    common = dict(G=p.groups, N=p.batch, **geometry(p), X=x_str, DY=dy_str)
    block_w = depthwise_chunk(out3[2], tiles.block_m)
    elem = operand_element(p)
    if slide_rows:
        consts = dict(common, SEG=run, BLOCK_W=block_w, BLOCK_CH=tiles.block_n)
        kernel = "grad_weight_depthwise_rows"
    else:
        consts = dict(common, ROWS_PER=run, BLOCK_W=block_w, BLOCK_CH=tiles.block_n, TAP_ROWS=tap_rows)
        kernel = "grad_weight_depthwise"
    consts["WIDE"] = needs_wide(p, parts * p.groups * math.prod(p.filter))
    launch = Launch(kernel, f"{base}_depthwise", (elem, elem, "fp32"), tuple(consts.items()),
                    check_grid(base, (blocks, parts, 1)), tiles.warps, tiles.stages)
    return launch, (parts, p.groups, 1, *pad3(p.filter, 1), 1)


def grad_weight_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int], precision: str,
                       x_layout: Optional[str] = None) -> tuple[Launch, tuple[int, ...]]:
    """The launch and the shape of its f32 partials [S, G, K, F0, F1, F2, C] (filter padded to 3D; packed
    groups store their diagonal blocks there, so the shape is the same), the reduction cut into the split-K
    chunks `split` = (S, CHUNK positions) (policy.grad_weight_split).  x_layout: the layout of the copy of X the
    kernel reads (policy.dy_read_in_place), where it is not p's."""
    tiles.check_matrix()
    parts, chunk = split
    groups, c, k = packed_sizes(p, tiles.pack)
    x_problem = p.with_(layout=x_layout) if x_layout else p
    x_str = pack_strides(activation_strides(x_problem, p.input, p.in_channels), tiles.pack)
    dy_str = pack_strides(activation_strides(p, p.output, p.out_channels), tiles.pack)
    f3 = pad3(p.filter, 1)
    dy_flat = flat_positions(dy_str, pad3(p.output, 1))
    consts = dict(
        C=c, K=k, N=p.batch,
        **geometry(p),
        X=x_str, DY=dy_str,
        CHUNK=chunk, G=groups,
        DY_FLAT=dy_flat,
        X_FLAT=p.input == p.output and all(s == 1 for s in p.stride) and flat_positions(x_str, pad3(p.input, 1)),
        DY_IMAGE=not dy_flat and image_flat_positions(dy_str, pad3(p.output, 1)) and tiles_within_images(p, tiles),
        PRECISION=precision, PACK=tiles.pack,
        # both reduce over the positions (n, o0, o1, o2), the innermost of which decides the copies' width
        ROUND_A=tf32_staged(precision, dy_str[5]), ROUND_B=tf32_staged(precision, x_str[5]),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_k, NUM_STAGES=tiles.stages,
        WIDE=needs_wide(p, parts * math.prod(p.w_shape)),
    )
    cols = c * math.prod(p.filter)
    grid = (-(-k // tiles.block_m) * -(-cols // tiles.block_n), groups, parts)
    elem = operand_element(p)
    launch = Launch("grad_weight_partials", f"{base}_partials", (elem, elem, "fp32"), tuple(consts.items()),
                    check_grid(base, grid), tiles.warps, tiles.stages)
    return launch, (parts, p.groups, p.out_channels, *f3, p.in_channels)
