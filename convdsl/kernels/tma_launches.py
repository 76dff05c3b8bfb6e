"""Launches of Hopper's TMA kernels (kernels/tma.py, kernels/halo.py: sm_90, launched by the stream runner only)
with the TMA descriptors (`TmaMap`) the runner makes for them at call time.  Tiles, splits and programs arrive
decided (convdsl/policy/hopper.py).
"""
from __future__ import annotations

import math

from ..problem import ConvProblem
from .launch import (ELEMENT, FP8_ELEMENT, FlatPlanes, Launch, TmaMap, check_grid, flat_elements, flat_planes,
                     grad_input_phases_tiles, halo_grid, im2col_box, operand_element, pad3, phases_heaviest_first,
                     phases_window)
from .tiles import TileConfig


def forward_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, flipped: bool = False, promote: int = 0,
                       specialised: bool = False, swapped: bool = False, programs: int = 0,
                       reversed_copy: bool = False) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Forward (NHWGC, GKYXC) on kernels/tma.forward_tma: X through an im2col map over (N, *spatial, G*C), W as a
    [G*K, taps*C] matrix, Y as [N*O, G*K]; one program per (row tile, column tile, group).  flipped: p is a
    stride-1 grad_input as forward (policy.grad_input_as_forward), whose weight the kernel reads as grad_input's
    own GKYXC weight, [G*C, taps*K] in p's terms, in [BLOCK_K, BLOCK_N] tiles.  fp8 compute: X and W come as fp8
    copies (policy.tma_stream_launch stages them); promote: the channels whose products wgmma sums in its own
    accumulator before adding them to the f32 one (0: all; policy.tma_fp8_promote).  specialised: a warp of its
    own issues the copies (measured no faster on the suite's forwards; the rules leave it off,
    docs/decisions.md#tma-wgrad-specialised).  swapped (16-bit): the product transposed, the weight tile as wgmma's A
    (measured no faster; the rules leave it off, docs/decisions.md#tma-narrow).  programs: at most that many
    programs, each taking tiles in turn (kernels/tma.forward_tma_persistent; 0: one program per tile).
    reversed_copy: p is a stride-1 grad_input as forward whose weight comes copied K-innermost (GYXCK in grad_input's
    terms, a [G*taps*K, C] matrix in p's), read with the taps reversed in K-major [BLOCK_N, BLOCK_K] tiles, as
    one-pass TF32 wgmma reads them (the kernel's FLIPPED 2)."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    rows = p.batch * math.prod(p.output)
    lower, upper = im2col_box(p)
    tf32 = p.dtype == "f32"  # one-pass TF32 (policy.tma_forward_reason): both operands rounded by their copies
    maps = (
        TmaMap(0, (p.batch, *p.input, g * c), (tiles.block_m, tiles.block_k), im2col=True, lower=lower, upper=upper,
               element_strides=(1, *p.stride, 1), round_tf32=tf32),
        TmaMap(1, (g * c, math.prod(p.filter) * k), (tiles.block_k, tiles.block_n)) if flipped else
        TmaMap(1, (g * math.prod(p.filter) * k, c), (tiles.block_n, tiles.block_k), round_tf32=tf32) if reversed_copy
        else TmaMap(1, (g * k, math.prod(p.filter) * c), (tiles.block_n, tiles.block_k), round_tf32=tf32),
        TmaMap(2, (rows, g * k), (tiles.block_m, tiles.block_n)),
    )
    consts = dict(O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, DIMS=p.dims, STAGES=tiles.stages,
                  FLIPPED=2 if reversed_copy else int(flipped),
                  PROMOTE=promote, SPECIALISED=specialised, SWAPPED=swapped)
    grid = check_grid(base, (-(-rows // tiles.block_m), -(-k // tiles.block_n), g))
    if flipped and reversed_copy:
        raise ValueError(f"{base}: the weight is read flipped either from itself or from its copy, not both")
    if programs and (specialised or swapped):
        raise ValueError(f"{base}: the persistent TMA forward kernel has no copy warp and no transposed product")
    kernel = "forward_tma"
    if programs:
        kernel = "forward_tma_persistent"
        consts = {name: v for name, v in consts.items() if name not in ("SPECIALISED", "SWAPPED")}
        consts.update(G=g, ROWS=rows)
        grid = (min(math.prod(grid), programs), 1, 1)
    elem = ELEMENT[p.dtype]
    x_elem, w_elem = (FP8_ELEMENT[p.compute[0]], FP8_ELEMENT[p.compute[1]]) if p.fp8_compute else (elem, elem)
    return Launch(kernel, f"{base}_{kernel}", (x_elem, w_elem, elem), tuple(consts.items()), grid,
                  tiles.warps, tiles.stages), maps


def forward_halo_launch(p: ConvProblem, tiles: TileConfig, base: str, split: int, flipped: bool = False,
                        spread: bool = True) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Stride-1 forward (NDHWGC, GKZYXC) on kernels/halo.forward_halo: X read by address into windows of
    halo_grid(p, block_m) rows, W through a map as [G*K, taps*C] in [BLOCK_N, C] tiles (flipped: p is a stride-1
    grad_input as forward reading grad_input's own weight [G*C, taps*K] in [C, BLOCK_N] tiles), Y stored by
    address.  One program per (group, column tile, image, row tile of a plane, range of `split` output planes).
    spread: the next plane's window copied a part with each tap, not all at once."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    grid_ = halo_grid(p, tiles.block_m)
    taps = math.prod(p.filter)
    maps = (TmaMap(1, (g * c, taps * k), (c, tiles.block_n)) if flipped else
            TmaMap(1, (g * k, taps * c), (tiles.block_n, c)),)
    consts = dict(I=pad3(p.input, 1), O=pad3(p.output, 1), F=pad3(p.filter, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, G=g, N=p.batch, WP=grid_.width, R=grid_.rows,
                  RS=grid_.slot_rows, RP=grid_.ring_rows, QT=grid_.row_tiles, SPLIT=split, BLOCK_M=tiles.block_m,
                  BSTAGES=tiles.stages, FLIPPED=int(flipped), SPREAD=int(spread))
    programs = g * -(-k // tiles.block_n) * p.batch * grid_.row_tiles * split
    elem = ELEMENT[p.dtype]
    return Launch("forward_halo", f"{base}_forward_halo", (elem, elem, elem), tuple(consts.items()),
                  check_grid(base, (programs, 1, 1)), tiles.warps, tiles.stages), maps


def grad_input_phases_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, programs: int
                                 ) -> tuple[Launch, tuple[TmaMap, ...]]:
    """Strided grad_input (NHWGC, GKYXC) on kernels/tma.grad_input_phases_tma: every stride phase a forward of dY
    with its taps of the weight, all of them in one persistent launch of `programs` programs.  dY through one
    im2col map over (N, *O, G*K) whose pixel box holds QM positions per dimension from -LOM (phases_window); a
    phase whose window starts higher reads it through larger im2col offsets (its shift LOM - LO_p).  W as its
    own [G*K, taps*C] matrix in [BLOCK_K, BLOCK_N] tiles; dX stored by address (a phase's rows are every s-th
    position, no box of dX), rows past the phase's own Q positions dropped.  Per-phase tables (residue r, Q,
    taps J, first tap y0, shift) in phases_heaviest_first order, per dimension padded to 3 like the rest."""
    phases = phases_heaviest_first(p)
    most, lom = phases_window(p)
    c, k, g = p.in_channels, p.out_channels, p.groups
    rows = p.batch * math.prod(most)
    lower = tuple(-v for v in lom)
    upper = tuple(q - o - v for q, o, v in zip(most, p.output, lom))  # QM positions from -LOM: QM - 1 + 1 - O - LOM
    maps = (
        TmaMap(0, (p.batch, *p.output, g * k), (tiles.block_m, tiles.block_k), im2col=True, lower=lower, upper=upper,
               element_strides=(1,) * (p.dims + 2)),
        TmaMap(1, (g * k, math.prod(p.filter) * c), (tiles.block_k, tiles.block_n)),
    )

    consts = dict(
        PHASES=len(phases),
        PR=tuple(pad3(ph.residue, 0) for ph in phases),
        PQ=tuple(pad3(ph.sizes, 1) for ph in phases),
        PJ=tuple(pad3(ph.taps, 1) for ph in phases),
        PY=tuple(pad3(tuple(d.y0 for d in ph.dims), 0) for ph in phases),
        # a phase's window starts LO_p = (J - 1) * o_step - off below its q: LOM - LO_p above the box's start
        PSH=tuple(pad3(tuple(v - ((d.J - 1) * d.o_step - d.off) for v, d in zip(lom, ph.dims)), 0) for ph in phases),
        QM=pad3(most, 1), LOM=pad3(lom, 0), TS=pad3(tuple(d.tap_step for d in phases[0].dims), 1),
        OS=pad3(tuple(d.o_step for d in phases[0].dims), 1), FF=pad3(p.filter, 1), I=pad3(p.input, 1),
        S=pad3(p.stride, 1), C=k, K=c, G=g, ROWS=rows, DIMS=p.dims, STAGES=tiles.stages)
    grid = (min(grad_input_phases_tiles(p, tiles), programs), 1, 1)
    elem = ELEMENT[p.dtype]
    return Launch("grad_input_phases_tma", f"{base}_grad_input_phases_tma", (elem, elem, elem), tuple(consts.items()),
                  grid, tiles.warps, tiles.stages), maps


# the TMA grad_weight's f32 partials: columns per store box
PARTIALS_BOX_MOST = 128


def grad_weight_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int],
                           specialised: bool = False, promote: int = 0
                           ) -> tuple[Launch, tuple[TmaMap, ...], tuple[int, ...]]:
    """grad_weight (NHWGC) on kernels/tma.grad_weight_tma: X through the im2col map of its forward (the same
    pixel box), dY as [N*O, G*K], f32 partials as [S*G*K, taps*C]; one program per (K tile, tap and C tile,
    group, chunk); a tile wider than C spans taps.  split: the split-K chunks (S, CHUNK positions)
    (policy.tma_grad_weight_split).  specialised: a warp of its own issues the copies
    (policy.tma_grad_weight_specialised).  promote: wgmma sums this many steps at a time, each run then added in
    f32 by the SM (0: wgmma's accumulator throughout).  Returns the launch, its maps and the partials' shape
    [S, G, K, F0, F1, F2, C]."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    parts, chunk = split
    rows = p.batch * math.prod(p.output)
    taps = math.prod(p.filter)
    lower, upper = im2col_box(p)
    # a tile wider than C spans taps: one im2col box per tap; the f32 partials leave in boxes of at most 128
    # columns, through one 64 KB buffer that reuses the ring's shared memory (a 256-wide tile in two halves)
    maps = (
        TmaMap(0, (p.batch, *p.input, g * c), (tiles.block_k, min(tiles.block_n, c)), im2col=True, lower=lower,
               upper=upper, element_strides=(1, *p.stride, 1)),
        TmaMap(1, (rows, g * k), (tiles.block_k, tiles.block_m)),
        TmaMap(2, (parts * g * k, taps * c), (tiles.block_m, min(tiles.block_n, PARTIALS_BOX_MOST))),
    )
    consts = dict(O=pad3(p.output, 1), F=pad3(p.filter, 1), S=pad3(p.stride, 1), D=pad3(p.dilation, 1),
                  LO=pad3(p.pad_lo, 0), C=c, K=k, G=g, L=rows, CHUNK=chunk, BLOCK_N=tiles.block_n, DIMS=p.dims,
                  STAGES=tiles.stages, SPECIALISED=specialised, PROMOTE=promote)
    grid = check_grid(base, ((k // tiles.block_m) * -(-(taps * c) // tiles.block_n), g, parts))
    elem = operand_element(p)  # fp8 compute: X and dY rounded to fp8 values in f16 copies first
    launch = Launch("grad_weight_tma", f"{base}_grad_weight_tma", (elem, elem, "fp32"), tuple(consts.items()), grid,
                    tiles.warps, tiles.stages)
    return launch, maps, (parts, g, k, *pad3(p.filter, 1), c)


def grad_weight_flat_tma_launch(p: ConvProblem, tiles: TileConfig, base: str, split: tuple[int, int],
                                promote: int = 0) -> tuple[Launch, tuple[TmaMap, ...], tuple[int, ...], FlatPlanes]:
    """grad_weight (stride 1; f32 in one-pass TF32, or fp8 compute) on kernels/tma.grad_weight_flat_tma over the
    flat plane copies of X and dY (operands 0 and 1 of its launch: pad_planes_launch's), f32 partials as
    [S*G*K, taps*C]; one program per (K tile, tap and C tile, group, chunk), the split-K chunks `split` = (S,
    CHUNK steps of images x position blocks) (policy.tma_flat_grad_weight_split).  Returns the launch, its maps, the
    partials' shape [S, G, K, F0, F1, F2, C] and the planes.  promote (fp8): positions whose products wgmma sums in
    its own accumulator before adding them to the f32 one (0: all of them)."""
    c, k, g = p.in_channels, p.out_channels, p.groups
    planes = flat_planes(p, tiles.block_k)
    steps = p.batch * planes.blocks
    parts, chunk = split
    a = planes.order[0]
    p1, p2 = planes.plane
    flat = [0, 0, 0]  # each spatial dimension's stride in the flat positions
    flat[planes.order[0]], flat[planes.order[1]], flat[planes.order[2]] = p1 * p2, p2, 1
    outer_lo = [0, 0, 0]
    outer_lo[a] = pad3(p.pad_lo, 0)[a]
    taps = math.prod(p.filter)
    x_copies, dy_copies = (planes.residues, 1) if planes.shifted == "x" else (1, planes.residues)
    maps = (
        TmaMap(0, (x_copies * p.batch * g * c, planes.x_length), (tiles.block_n, tiles.block_k)),
        TmaMap(1, (dy_copies * p.batch * g * k, planes.dy_length), (tiles.block_m, tiles.block_k)),
        TmaMap(2, (parts * g * k, taps * c), (tiles.block_m, tiles.block_n)),
    )
    consts = dict(F=pad3(p.filter, 1), D=pad3(p.dilation, 1), XS=tuple(flat), LOX=tuple(outer_lo), C=c, K=k, G=g,
                  N=p.batch, QB=planes.blocks, STEPS=steps, CHUNK=chunk, SHIFT_X=planes.shifted == "x",
                  ALIGN=planes.align, PROMOTE=promote, STAGES=tiles.stages)
    grid = check_grid(base, ((k // tiles.block_m) * taps * (c // tiles.block_n), g, parts))
    launch = Launch("grad_weight_flat_tma", f"{base}_grad_weight_flat_tma", (*flat_elements(p), "fp32"),
                    tuple(consts.items()), grid, tiles.warps, tiles.stages)
    return launch, maps, (parts, g, k, *pad3(p.filter, 1), c), planes
