"""Probe: a TMA forward an IREE module could run (its tensor maps made on the device, each tap a constant shift of
plain row boxes, border rows zeroed in registers; `forward_shift_tma` below) against cuDNN, on the suite's stride-1
dense forwards, per tile candidate.  Its answer (docs/decisions.md#tma-forward): 0.33-0.58x cuDNN, slower than the
modules' cp.async kernels; convdsl does not use it.

    python3 benchmarks/probes/shift_tma.py OUT.json      # on an H100/H200 with PyTorch and its Triton

Each candidate is compiled by the installed Triton (just in time), checked against a float64 convolution of the
same inputs and timed against cuDNN (`cudnn.benchmark`, channels-last) in the same process: median of rounds of
back-to-back launches, the two interleaved.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import sys
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the stride-1 dense forwards of the suite (benchmarks/suite.toml, forward_of each case): name, dtype, N, G, C, K,
# input pixels, filter, dilation, padding
CASES = [
    ("ck15_dgrad_3d_f16_fwd", "f16", 64, 1, 64, 128, (28, 28, 28), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("ck11_wgrad_3d_g8_f16_fwd", "f16", 64, 8, 128, 128, (28, 28, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("deeplab_atrous_dgrad_fwd", "f16", 16, 1, 256, 256, (65, 65), (3, 3), (2, 2), (2, 2)),
    ("r50_3x3_s1_dgrad_fwd", "f16", 64, 1, 64, 64, (56, 56), (3, 3), (1, 1), (1, 1)),
    ("r50_1x1_dgrad_fwd", "f16", 64, 1, 1024, 256, (14, 14), (1, 1), (1, 1), (0, 0)),
    ("unet3d_dgrad_fwd", "bf16", 2, 1, 64, 64, (64, 64, 64), (3, 3, 3), (1, 1, 1), (1, 1, 1)),
    ("ck11_wgrad_2d_g32_fwd", "f16", 256, 32, 192, 192, (28, 28), (3, 3), (1, 1), (1, 1)),
]


# The stream path's TMA forward (kernels/tma.py) copies X through im2col tensor maps made on the host per call and
# passed by value; an IREE dispatch gets only buffer addresses, and a tensor map made on the device can only be a
# tile-mode one (PTX `tensormap.replace` sets no im2col field).  This kernel needs no more: its maps are made on the
# device (`tl.make_tensor_descriptor`, into the global scratch memory Triton asks for, which a module would bind),
# and every copy is a plain [BLOCK_M, BLOCK_K] box of X seen as a matrix of pixels x channels.
#
# Index algebra (stride 1 in every spatial dimension; NHWGC / NDHWGC X, GKYXC W, canonical 3 spatial dimensions):
#     Y[n, o, g, k] = sum over taps t, channels c of X[n, o - lo + t * d, g, c] * W[g, k, t, c]
# The GEMM's rows are X's own pixels m = (n, i0, i1, i2), not Y's: with stride 1 the pixel a tap reads for row m is
# row m + shift(t) of X's matrix, shift(t) = ((t0 d0 - lo0) I1 + t1 d1 - lo1) I2 + t2 d2 - lo2, the same for every
# row, so tap t's copy is the box at row m0 + shift(t).  Rows whose tap position i + t d - lo falls outside X in some
# dimension read a neighbouring row or image there, and are zeroed in registers before the product (TMA zero-fills
# only rows past the matrix's ends).  Row m stores Y[n, i] where i < O in every dimension (O <= I: "same" and
# "valid" padding), so where O == I (the usual 'same' convolution) every computed row is an output.
# Reduction steps (t, cb) take BLOCK_K channels of one tap (C a multiple of BLOCK_K); with several groups K is a
# multiple of BLOCK_N, so that no box reaches into another group.  Tiles: column tiles innermost, then row tiles;
# groups on program_id(1).
@triton.jit
def forward_shift_tma(x_ptr, w_ptr, y_ptr,
                      # X's pixels, Y's pixels, filter, dilation, low padding per spatial dimension (3 each)
                      I: tl.constexpr, O: tl.constexpr, F: tl.constexpr, D: tl.constexpr, LO: tl.constexpr,
                      N: tl.constexpr, C: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      MASKED: tl.constexpr):
    ROWS: tl.constexpr = N * I[0] * I[1] * I[2]
    TAPS: tl.constexpr = F[0] * F[1] * F[2]
    CB: tl.constexpr = C // BLOCK_K
    COL_TILES: tl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    # the maps, made by this program into its share of the global scratch memory
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[ROWS, G * C], strides=[G * C, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * K, TAPS * C], strides=[TAPS * C, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    pid = tl.program_id(0)
    g = tl.program_id(1)
    off_n = (pid % COL_TILES) * BLOCK_N
    off_m = (pid // COL_TILES) * BLOCK_M
    m = off_m + tl.arange(0, BLOCK_M)
    i2 = m % I[2]
    i1 = (m // I[2]) % I[1]
    i0 = (m // (I[2] * I[1])) % I[0]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.range(TAPS * CB, num_stages=STAGES):
        t = step // CB
        cb = step % CB
        s2 = (t % F[2]) * D[2] - LO[2]
        s1 = ((t // F[2]) % F[1]) * D[1] - LO[1]
        s0 = (t // (F[2] * F[1])) * D[0] - LO[0]
        a = x_desc.load([off_m + (s0 * I[1] + s1) * I[2] + s2, g * C + cb * BLOCK_K])
        if MASKED:  # rows whose tap position is outside X in some dimension read zero
            j0 = i0 + s0
            j1 = i1 + s1
            j2 = i2 + s2
            inside = (j0 >= 0) & (j0 < I[0]) & (j1 >= 0) & (j1 < I[1]) & (j2 >= 0) & (j2 < I[2])
            a = tl.where(inside[:, None], a, 0.0)
        b = w_desc.load([g * K + off_n, t * C + cb * BLOCK_K])
        acc = tl.dot(a, b.T, acc)

    # row m is Y's pixel (n, i) where i < O in every dimension
    n = (m // (I[2] * I[1] * I[0])).to(tl.int64)
    y_row = ((n * O[0] + i0) * O[1] + i1) * O[2] + i2
    stored = (m < ROWS) & (i0 < O[0]) & (i1 < O[1]) & (i2 < O[2])
    cols = off_n + tl.arange(0, BLOCK_N)
    y = y_ptr + y_row[:, None] * (G * K) + g * K + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=stored[:, None] & (cols[None, :] < K))


TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)]


def _canonical(v, fill):
    return (fill,) * (3 - len(v)) + tuple(v)


def time_launches(fn, rounds: int = 30, per: int = 10) -> float:
    """The median over `rounds` of the time per call of `per` back-to-back calls of fn, by CUDA events (ms)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(per):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per)
    return statistics.median(times)


def run(out: Path) -> None:
    import torch
    import torch.nn.functional as F
    torch.backends.cudnn.benchmark = True
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    for name, dt, n, g, c, k, size, filt, dil, pad in CASES:
        dims = len(size)
        dtype = dtypes[dt]
        out_size = tuple(i + 2 * p - (f - 1) * d for i, p, f, d in zip(size, pad, filt, dil))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn((n, *size, g * c), device="cuda", generator=gen).to(dtype)  # NHWGC
        w = (torch.randn((g * k, *filt, c), device="cuda", generator=gen) / math.sqrt(c * math.prod(filt))).to(dtype)
        conv = [F.conv1d, F.conv2d, F.conv3d][dims - 1]
        perm_x = (0, dims + 1, *range(1, dims + 1))  # channels-last storage seen as NCHW
        xt, wt = x.permute(perm_x), w.permute(perm_x)
        ref = conv(xt.double(), wt.double(), None, 1, pad, dil, g).permute(0, *range(2, dims + 2), 1)
        scale = ref.abs().max().item()
        cudnn = lambda: conv(xt, wt, None, 1, pad, dil, g)  # noqa: E731
        y_cudnn = cudnn()
        cudnn_err = (y_cudnn.permute(0, *range(2, dims + 2), 1).double() - ref).abs().max().item() / scale
        y = torch.empty((n, *out_size, g * k), device="cuda", dtype=dtype)
        row = {"case": name, "dtype": dt, "cudnn_err": cudnn_err, "tiles": {}}
        for bm, bn, bk, warps, stages in TILES:
            if c % bk or (g > 1 and k % bn) or bn > 2 * k:
                continue
            grid = (math.ceil(n * math.prod(size) / bm) * math.ceil(k / bn), g)
            masked = any(f > 1 for f in filt) or any(pad)
            consts = dict(I=_canonical(size, 1), O=_canonical(out_size, 1), F=_canonical(filt, 1),
                          D=_canonical(dil, 1), LO=_canonical(pad, 0), N=n, C=c, K=k, G=g, BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=bk, STAGES=stages, MASKED=masked)
            launch = lambda: forward_shift_tma[grid](x, w, y, **consts, num_warps=warps, num_stages=stages)  # noqa
            label = f"t{bm}x{bn}x{bk}w{warps}s{stages}"
            try:
                y.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
            except Exception as err:  # a candidate that does not compile or fit: recorded, not timed
                row["tiles"][label] = {"error": str(err)[:300]}
                continue
            err = (y.double() - ref).abs().max().item() / scale
            ms_cudnn, ms = [], []
            for _ in range(3):  # interleaved
                ms_cudnn.append(time_launches(cudnn))
                ms.append(time_launches(launch))
            row["tiles"][label] = {"err": err, "ok": err < 4 * max(cudnn_err, 1e-3), "ms": statistics.median(ms),
                                   "cudnn_ms": statistics.median(ms_cudnn)}
            row["tiles"][label]["cudnn_over_this"] = row["tiles"][label]["cudnn_ms"] / row["tiles"][label]["ms"]
            print(name, label, row["tiles"][label], flush=True)
        rows.append(row)
    record = {"device": torch.cuda.get_device_name(), "date": __import__("datetime").date.today().isoformat(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "cudnn": torch.backends.cudnn.version(), "python": platform.python_version()},
              "command": "python3 benchmarks/probes/shift_tma.py OUT.json", "results": rows}
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    run(Path(sys.argv[1]))
