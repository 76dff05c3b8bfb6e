"""Launches of the steps around the GEMM cores (kernels/elementwise.py), for runtimes that launch the kernels
themselves (the stream runner): the split-K sum, fp8 rounding, bf16 splits, layout transposes, space-to-depth
and the flat-plane copies of the one-pass TMA grad_weight.
"""
from __future__ import annotations

import math
from typing import Optional

from ..problem import FP8_FORMATS, ConvProblem
from ..targets import CUDA_MAX_GRID
from .launch import (ELEMENT, ELEMENT_BYTES, FP8_ELEMENT, FP8_MAX, WIDE_ELEMENTS, FlatPlanes, Launch,
                     activation_strides, check_grid, flat_elements, needs_wide, pad3, weight_strides)
from .tiles import matrix_block


# a copy tile: the channels of 128 source bytes (one coalesced line per position in NHWGC) x 128 positions
PAD_PLANES_ROW_BYTES, PAD_PLANES_POSITIONS = 128, 128


def pad_planes_launch(p: ConvProblem, planes: FlatPlanes, operand: str, base: str) -> tuple[Launch, tuple[int, int]]:
    """The copy of `operand` ("x" or "dy") to its flat plane rows, rounded to its compute type (TF32, or fp8
    stored as fp8), once per residue if it is the shifted operand: the launch and the copy's shape
    [R * N*G*channels, length]."""
    x = operand == "x"
    channels = p.in_channels if x else p.out_channels
    sizes = pad3(p.input, 1) if x else pad3(p.output, 1)
    strides = activation_strides(p, p.input if x else p.output, channels)
    lo = pad3(p.pad_lo, 0) if x else (0, 0, 0)
    a, b, c = planes.order
    rows, length = p.batch * p.groups * channels, planes.x_length if x else planes.dy_length
    copies = planes.residues if planes.shifted == operand else 1
    kind = p.compute[0 if x else 1] if p.fp8_compute else None
    block_rows = PAD_PLANES_ROW_BYTES // ELEMENT_BYTES[ELEMENT[p.dtype]]
    mbits, emin = FP8_FORMATS[kind] if kind else (0, 0)
    consts = dict(CH=channels, G=p.groups, SN=strides[0], SG=strides[1], SC=strides[2],
                  S0=strides[3 + a], S1=strides[3 + b], S2=strides[3 + c], I0=sizes[a], I1=sizes[b], I2=sizes[c],
                  P1=planes.plane[0], P2=planes.plane[1], LO1=lo[b], LO2=lo[c], L=length, ROWS=rows,
                  SIGN=1 if x else -1, COPIES=copies, FP8=kind is not None, MBITS=mbits, EMIN=emin,
                  FP8_MAX=FP8_MAX[kind] if kind else 0.0, BLOCK_R=block_rows, BLOCK_F=PAD_PLANES_POSITIONS,
                  WIDE=needs_wide(p, copies * rows * length))
    grid = check_grid(f"{base}_{operand}", (-(-rows // block_rows), -(-length // PAD_PLANES_POSITIONS), 1))
    elements = flat_elements(p)[0 if x else 1]
    return Launch("pad_planes", f"{base}_{operand}_planes", (ELEMENT[p.dtype], elements), tuple(consts.items()),
                  grid, 4, 1), (copies * rows, length)


ELEMENTWISE_BLOCK = 1024


def sum_partials_launch(p: ConvProblem, partials_shape: tuple[int, ...], base: str, programs: int) -> Launch:
    """dW from grad_weight's f32 partials [S, G, K, F0, F1, F2, C] (depthwise: [S, G, 1, F0, F1, F2, 1]): the
    sum in chunk order, the scale epilogue and the cast to the result type, in the weight's layout.  programs: how
    many programs the sum aims for (policy.sum_programs, a fact of the target)."""
    parts, elements = partials_shape[0], math.prod(partials_shape[1:])
    alpha = float(p.epilogue.alpha) if p.epilogue.kind == "scale" else 1.0
    # columns per program: as many as keep `programs` programs busy (a small weight with many chunks, as
    # depthwise kernels have, still spreads over the GPU), 16 to 256; rows per step fill a 4096-element tile
    block_e = min(256, max(16, 1 << max(0, (elements // programs).bit_length() - 1)))
    block_s = min(matrix_block(parts), 4096 // block_e)
    consts = dict(E=elements, S=parts, T=math.prod(p.filter), C=p.in_channels,
                  C_FIRST=p.weight_layout == "GKCYX", ALPHA=alpha, BLOCK_S=block_s, BLOCK_E=block_e,
                  WIDE=needs_wide(p, parts * elements))
    return Launch("sum_partials", f"{base}_sum", ("fp32", ELEMENT[p.result_dtype]), tuple(consts.items()),
                  (-(-elements // block_e), 1, 1), 4, 1)


def round_fp8_launch(elements: int, dtype: str, kind: str, base: str, as_fp8: bool = False) -> Launch:
    """`elements` values of `dtype` rounded to the fp8 type `kind` (fp8 = e4m3, bf8 = e5m2), stored in f16, or
    with as_fp8 in that type (saturated)."""
    mbits, emin = FP8_FORMATS[kind]
    consts = dict(N=elements, MBITS=mbits, EMIN=emin, FP8_MAX=FP8_MAX[kind] if as_fp8 else 0.0,
                  BLOCK=ELEMENTWISE_BLOCK, WIDE=elements >= WIDE_ELEMENTS)
    return Launch("round_fp8", f"{base}_round_{kind}", (ELEMENT[dtype], FP8_ELEMENT[kind] if as_fp8 else "fp16"),
                  tuple(consts.items()), (-(-elements // ELEMENTWISE_BLOCK), 1, 1), 4, 1)





# f32 operands of the 16-bit kernels as stacked bf16 parts (kernels/elementwise.split_bf16): per product kept, the
# parts of operand A and of operand B.  bf16x3: hi x hi, hi x lo, lo x hi (passes/bf16x3.py; the rules' split);
# bf16x6 adds the three products of about 2^-16 (hi x lo2, lo2 x hi, lo x lo), leaving out what is about 2^-24 of a
# product: measured for exact f32, not taken (its six-fold sums lost accuracy; docs/decisions.md#bf16x3-grad-weight-tma)
SPLIT_PRODUCTS = {"bf16x3": ((0, 0), (0, 1), (1, 0)),
                  "bf16x6": ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1))}


def split_bf16_launch(elements: int, split: str, operand: int, base: str) -> Launch:
    """`elements` f32 values split into bf16 parts, stored once per product of `split` (SPLIT_PRODUCTS) in the
    order of the products: operand 0 (A) or 1 (B)'s part of each."""
    order = tuple(pair[operand] for pair in SPLIT_PRODUCTS[split])
    consts = dict(N=elements, PARTS=max(order) + 1, ORDER=order, BLOCK=ELEMENTWISE_BLOCK,
                  WIDE=len(order) * elements >= WIDE_ELEMENTS)
    return Launch("split_bf16", f"{base}_split_{split}_{operand}", ("fp32", "bf16"), tuple(consts.items()),
                  (-(-elements // ELEMENTWISE_BLOCK), 1, 1), 4, 1)


TRANSPOSE_BLOCK = 64


def transpose_launch(images: int, rows: int, cols: int, dtype: str, base: str) -> Optional[Launch]:
    """y[b, c, r] = x[b, r, c] for `images` planes of rows x cols `dtype` elements (an NGCHW activation's
    [G*C, positions] per image to NHWGC, or back), or None where the grid would pass CUDA's limits."""
    grid = (-(-cols // TRANSPOSE_BLOCK), -(-rows // TRANSPOSE_BLOCK), images)
    if grid[1] > CUDA_MAX_GRID[1] or grid[2] > CUDA_MAX_GRID[2]:
        return None
    consts = dict(ROWS=rows, COLS=cols, BLOCK=TRANSPOSE_BLOCK, WIDE=images * rows * cols >= WIDE_ELEMENTS)
    return Launch("transpose_planes", f"{base}_transpose", (ELEMENT[dtype], ELEMENT[dtype]), tuple(consts.items()),
                  grid, 4, 1)


SPACE_TO_DEPTH_POSITIONS = 64


def space_to_depth_launch(p: ConvProblem, q: ConvProblem, operand: str, base: str
                          ) -> tuple[Launch, tuple[int, ...]]:
    """The copy of p's `operand` ("x" or "w") regrouped space-to-depth into q's (policy.space_to_depth_forward):
    the launch and the copy's shape (q's X or GKYXC weight)."""
    x = operand == "x"
    if x:
        sb, _, sc, *spatial_strides = activation_strides(p, p.input, p.in_channels)
        sizes, lo, blocks, shape = pad3(p.input, 1), pad3(p.pad_lo, 0), p.batch, q.x_shape
        regrouped = pad3(q.input, 1)
    else:
        _, sb, sc, *spatial_strides = weight_strides(p)
        sizes, lo, blocks, shape = pad3(p.filter, 1), (0, 0, 0), p.out_channels, q.w_shape
        regrouped = pad3(q.filter, 1)
    r = pad3(p.stride, 1)
    consts = dict(CH=p.in_channels, SB=sb, SC=sc, S0=spatial_strides[0], S1=spatial_strides[1],
                  S2=spatial_strides[2], I0=sizes[0], I1=sizes[1], I2=sizes[2], R0=r[0], R1=r[1], R2=r[2],
                  LO0=lo[0], LO1=lo[1], LO2=lo[2], J0=regrouped[0], J1=regrouped[1], J2=regrouped[2],
                  BLOCK_J=SPACE_TO_DEPTH_POSITIONS, BLOCK_C=matrix_block(q.in_channels),
                  WIDE=needs_wide(p, math.prod(shape)))
    grid = check_grid(f"{base}_{operand}", (-(-math.prod(regrouped) // SPACE_TO_DEPTH_POSITIONS), blocks, 1))
    return Launch("space_to_depth", f"{base}_{operand}_space_to_depth", (ELEMENT[p.dtype], ELEMENT[p.dtype]),
                  tuple(consts.items()), grid, 4, 1), shape
