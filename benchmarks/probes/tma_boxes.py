"""Probe: a TMA forward an IREE module could run (tile-mode maps made on the device; each step's copy of X a box of
output pixels shifted by the tap, zero outside the image by TMA itself, wgmma's A straight from shared memory;
`forward_tma_boxes` below) against cuDNN, on the suite's stride-1 dense forwards, per box and tile candidate.

    python3 benchmarks/probes/tma_boxes.py build P.json          # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_boxes.py run P.json OUT.json   # on an H100/H200 with PyTorch

`build` compiles each candidate for sm_90 (a cubin, its scratch memory per program, its grid); `run` loads them
through the CUDA driver (convdsl/backends/cuda_driver.py), gives each program its share of scratch memory as a
module would bind it, checks the result against a float64 convolution of the same inputs and times it against
cuDNN (`cudnn.benchmark`, channels-last) in the same process: medians of rounds of back-to-back launches, the two
interleaved.  Triton's descriptors take power-of-two boxes: a box past the output's edge computes rows it drops.
"""
from __future__ import annotations

import base64
import json
import math
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,  # noqa: E402
                                                             warpgroup_mma_wait)

from convdsl.kernels.tma import _barriers, _lanes_n, _zero_accumulator  # noqa: E402

# name, dtype, N, G, C, K, input pixels (3D: leading 1 where 2D), filter, dilation, padding; (box, BLOCK_N, warps,
# stages) candidates
CASES = [
    ("ck15_dgrad_3d_f16_fwd", "f16", 64, 1, 64, 128, (28, 28, 28), (3, 3, 3), (1, 1, 1), (1, 1, 1),
     [((1, 4, 32), 128, 8, 4), ((2, 2, 32), 128, 8, 4), ((1, 8, 16), 128, 8, 4), ((1, 4, 32), 128, 4, 4),
      ((2, 4, 32), 128, 8, 3)]),
    ("ck11_wgrad_3d_g8_f16_fwd", "f16", 64, 8, 128, 128, (28, 28, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1),
     [((1, 32, 4), 128, 8, 4), ((4, 8, 4), 128, 8, 4), ((2, 16, 4), 128, 4, 4)]),
    ("deeplab_atrous_dgrad_fwd", "f16", 16, 1, 256, 256, (1, 65, 65), (1, 3, 3), (1, 2, 2), (0, 2, 2),
     [((1, 8, 16), 128, 8, 4), ((1, 4, 32), 128, 8, 4), ((1, 8, 16), 256, 8, 3), ((1, 16, 16), 128, 8, 3)]),
    ("r50_3x3_s1_dgrad_fwd", "f16", 64, 1, 64, 64, (1, 56, 56), (1, 3, 3), (1, 1, 1), (0, 1, 1),
     [((1, 2, 64), 64, 4, 4), ((1, 4, 32), 64, 4, 4), ((1, 2, 64), 128, 8, 4)]),
    ("unet3d_dgrad_fwd", "bf16", 2, 1, 64, 64, (64, 64, 64), (3, 3, 3), (1, 1, 1), (1, 1, 1),
     [((1, 2, 64), 64, 4, 4), ((1, 4, 64), 64, 8, 3)]),
]


@gluon.jit
def _box_issue(x_desc, w_desc, a_buf, b_buf, bar, step, n, b0, b1, b2, g, off_k,
               F: gl.constexpr, D: gl.constexpr, LO: gl.constexpr, C: gl.constexpr, K: gl.constexpr,
               BOX: gl.constexpr, BLOCK_K: gl.constexpr):
    # step (tap t, channel block cb): X's box of the tile's output pixels shifted by t * d - lo, W's tile
    CB: gl.constexpr = C // BLOCK_K
    t = step // CB
    cb = step % CB
    t2 = t % F[2]
    t1 = (t // F[2]) % F[1]
    t0 = t // (F[2] * F[1])
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    box = a_buf.reshape([1, BOX[0], BOX[1], BOX[2], BLOCK_K])
    tma.async_load(x_desc, [n, b0 + t0 * D[0] - LO[0], b1 + t1 * D[1] - LO[1], b2 + t2 * D[2] - LO[2],
                            g * C + cb * BLOCK_K], bar, box)
    tma.async_load(w_desc, [g * K + off_k, t * C + cb * BLOCK_K], bar, b_buf)

@gluon.jit
def forward_tma_boxes(x_ptr, w_ptr, y_ptr,
                      I: gl.constexpr, O: gl.constexpr, F: gl.constexpr, D: gl.constexpr, LO: gl.constexpr,
                      N: gl.constexpr, C: gl.constexpr, K: gl.constexpr, G: gl.constexpr, BOX: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    # Y[n, o, g, k] = sum over taps t, channels c of X[n, o - lo + t * d, g, c] * W[g, k, t, c], stride 1: the
    # tile's rows are a box of output pixels, and tap t's rows of X the same box moved by t * d - lo
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    TAPS: gl.constexpr = F[0] * F[1] * F[2]
    STEPS: gl.constexpr = TAPS * (C // BLOCK_K)
    BLOCK_M: gl.constexpr = BOX[0] * BOX[1] * BOX[2]
    COL_TILES: gl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    T2: gl.constexpr = (O[2] + BOX[2] - 1) // BOX[2]
    T1: gl.constexpr = (O[1] + BOX[1] - 1) // BOX[1]
    T0: gl.constexpr = (O[0] + BOX[0] - 1) // BOX[0]
    x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=5)
    layout2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_desc = tma.make_tensor_descriptor(x_ptr, shape=[N, I[0], I[1], I[2], G * C],
                                        strides=[I[0] * I[1] * I[2] * G * C, I[1] * I[2] * G * C, I[2] * G * C,
                                                 G * C, 1],
                                        block_shape=[1, BOX[0], BOX[1], BOX[2], BLOCK_K], layout=x_layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, shape=[G * K, TAPS * C], strides=[TAPS * C, 1],
                                        block_shape=[BLOCK_N, BLOCK_K], layout=layout2)
    pid = gl.program_id(0)
    g = gl.program_id(1)
    off_k = (pid % COL_TILES) * BLOCK_N
    tile = pid // COL_TILES
    b2 = (tile % T2) * BOX[2]
    b1 = ((tile // T2) % T1) * BOX[1]
    b0 = ((tile // (T2 * T1)) % T0) * BOX[0]
    n = tile // (T2 * T1 * T0)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], layout2)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], layout2)
    bars = _barriers(STAGES)
    acc = _zero_accumulator(BLOCK_M, BLOCK_N, 256 // dtype.primitive_bitwidth, num_warps)
    for i in gl.static_range(STAGES - 1):
        if i < STEPS:
            _box_issue(x_desc, w_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), i, n, b0, b1, b2, g,
                       off_k, F, D, LO, C, K, BOX, BLOCK_K)
    for step in range(STEPS):
        s = step % STAGES
        mbarrier.wait(bars.index(s), (step // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        nxt = step + STAGES - 1
        if nxt < STEPS:
            ns = nxt % STAGES
            _box_issue(x_desc, w_desc, a_bufs.index(ns), b_bufs.index(ns), bars.index(ns), nxt, n, b0, b1, b2,
                       g, off_k, F, D, LO, C, K, BOX, BLOCK_K)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    # the box's pixels inside Y, by address
    LANES_N: gl.constexpr = _lanes_n(BLOCK_N)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_N, LANES_N], [num_warps, 1], [1, 0])
    values = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), layout)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = off_k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    o2 = b2 + r % BOX[2]
    o1 = b1 + (r // BOX[2]) % BOX[1]
    o0 = b0 + r // (BOX[2] * BOX[1])
    pixel = ((n.to(gl.int64) * O[0] + o0) * O[1] + o1) * O[2] + o2
    kept = (o0 < O[0]) & (o1 < O[1]) & (o2 < O[2])
    gl.store(y_ptr + pixel[:, None] * (G * K) + (g * K + cols)[None, :], values,
             mask=kept[:, None] & (cols < K)[None, :])


def _output(size, filt, dil, pad):
    return tuple(i + 2 * p - (f - 1) * d for i, p, f, d in zip(size, pad, filt, dil))


def build(out: Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = forward_tma_boxes
    entries = []
    for name, dt, n, g, c, k, size, filt, dil, pad, candidates in CASES:
        o = _output(size, filt, dil, pad)
        for box, block_n, warps, stages in candidates:
            consts = dict(I=size, O=o, F=filt, D=dil, LO=pad, N=n, C=c, K=k, G=g, BOX=box, BLOCK_N=block_n,
                          BLOCK_K=64, STAGES=stages, num_warps=warps)
            ptr = {"f16": "*fp16", "bf16": "*bf16"}[dt]
            signature = {"x_ptr": ptr, "w_ptr": ptr, "y_ptr": ptr, **{key: "constexpr" for key in consts}}
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
            label = f"box{'x'.join(map(str, box))}n{block_n}w{warps}s{stages}"
            try:
                kernel = triton.compile(GluonASTSource(fn, signature, constexprs=consts, attrs=attrs),
                                        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            except Exception as err:  # a candidate that does not compile: said, left out
                print(f"skip {name} {label}: {str(err)[-600:]}", flush=True)
                continue
            meta = kernel.metadata
            tiles = math.prod(-(-a // b) for a, b in zip(o, box)) * n
            grid = (tiles * -(-k // block_n), g, 1)
            entries.append({"case": name, "label": label, "dtype": dt, "shape": [n, g, c, k, list(size), list(filt),
                                                                              list(dil), list(pad)],
                            "name": meta.name, "cubin": base64.b64encode(kernel.asm["cubin"]).decode(),
                            "threads": 32 * meta.num_warps, "shared": int(meta.shared),
                            "scratch": int(meta.global_scratch_size), "grid": grid,
                            "rows_used": math.prod(o) / (math.prod(-(-a // b) * b for a, b in zip(o, box)))})
            print(name, label, "shared", meta.shared, "scratch", meta.global_scratch_size, flush=True)
    out.write_text(json.dumps({"kernels": entries}))
    print(f"wrote {out}: {len(entries)} kernels")


def run(built: Path, result: Path) -> None:
    import torch
    import torch.nn.functional as F

    from benchmarks.probes.shift_tma import time_launches
    from convdsl.backends.cuda_driver import load_function

    torch.backends.cudnn.benchmark = True
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
    rows, prepared = [], {}
    for e in json.loads(built.read_text())["kernels"]:
        n, g, c, k, size, filt, dil, pad = e["shape"]
        key = e["case"]
        if key not in prepared:
            gen = torch.Generator(device="cuda").manual_seed(0)
            dtype = dtypes[e["dtype"]]
            x = torch.randn((n, *size, g * c), device="cuda", generator=gen).to(dtype)
            w = (torch.randn((g * k, *filt, c), device="cuda", generator=gen) / math.sqrt(c * math.prod(filt))
                 ).to(dtype)
            xs, ws, sz, fl, dl, pd = x, w, size, filt, dil, pad
            if size[0] == 1 and filt[0] == 1:  # 2D, held in 3D with a leading 1
                xs, ws = x[:, 0], w[:, 0]
                sz, fl, dl, pd = size[1:], filt[1:], dil[1:], pad[1:]
            nd = len(sz)
            conv = [F.conv1d, F.conv2d, F.conv3d][nd - 1]
            perm = (0, nd + 1, *range(1, nd + 1))
            xt, wt = xs.permute(perm), ws.permute(perm)
            ref = conv(xt.double(), wt.double(), None, 1, pd, dl, g).permute(0, *range(2, nd + 2), 1)
            cudnn = (lambda xt=xt, wt=wt, conv=conv, pd=pd, dl=dl: conv(xt, wt, None, 1, pd, dl, g))
            y_cudnn = cudnn().permute(0, *range(2, nd + 2), 1)
            scale = ref.abs().max().item()
            prepared[key] = (x, w, ref, scale, cudnn, (y_cudnn.double() - ref).abs().max().item() / scale,
                             _output(size, filt, dil, pad))
        x, w, ref, scale, cudnn, cudnn_err, o = prepared[key]
        y = torch.full((n, *o, g * k), float("nan"), device="cuda", dtype=x.dtype)
        programs = math.prod(e["grid"])
        scratch = torch.empty(max(1, e["scratch"] * programs), device="cuda", dtype=torch.int8)
        fn = load_function(base64.b64decode(e["cubin"]), "cubin", e["name"], e["threads"], e["shared"], 5)
        stream = torch.cuda.current_stream().cuda_stream
        args = [x.data_ptr(), w.data_ptr(), y.data_ptr(), scratch.data_ptr(), 0]
        launch = lambda: fn.launch(tuple(e["grid"]), stream, args)  # noqa: E731
        launch()
        torch.cuda.synchronize()
        err = (y.double().reshape(ref.shape) - ref).abs().max().item() / scale
        ms, ms_cudnn = [], []
        for _ in range(3):
            ms_cudnn.append(time_launches(cudnn))
            ms.append(time_launches(launch))
        row = {"case": key, "kernel": e["label"], "err": err, "cudnn_err": cudnn_err,
               "ok": bool(err <= 4 * max(cudnn_err, 1e-3)), "ms": statistics.median(ms),
               "cudnn_ms": statistics.median(ms_cudnn), "rows_used": e["rows_used"]}
        row["cudnn_over_this"] = row["cudnn_ms"] / row["ms"]
        print(row, flush=True)
        rows.append(row)
    record = {"device": torch.cuda.get_device_name(), "versions": {
        "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
        "triton_compiled_with": "3.9.0"},
        "command": "python3 benchmarks/probes/tma_boxes.py run P.json OUT.json", "results": rows}
    result.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    mode, built = sys.argv[1], Path(sys.argv[2])
    build(built) if mode == "build" else run(built, Path(sys.argv[3]))
