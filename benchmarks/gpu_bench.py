#!/usr/bin/env python3
"""Time the suite on a CUDA GPU: cuDNN (through PyTorch) vs convdsl vs "IREE as a user gets it today".

Runs on the GPU machine with only torch, numpy and iree.runtime (no convdsl, no iree.compiler, no
ml_dtypes): it reads benchmarks/build/cases.json and the .vmfb files that benchmarks/compile_suite.py wrote.

Per case:
  1. inputs: uniform [-1, 1) in the case dtype, drawn on the GPU, exact zeros replaced by 0.5; in the kernel
     argument order (forward(x, w), grad_input(dy, w), grad_weight(x, dy)) and the case's layouts.
     When both inputs together fit in 50 MB (the L2), 3 input sets are drawn and timing rotates among them.
  2. reference: torch on the GPU in float64 (float32 with TF32 off above REF_F64_MAX_FLOPS, where f64
     would take seconds), inputs first rounded to fp8/bf8 for fp8-compute cases.
  3. cuDNN: torch.ops.aten.convolution_backward (forward: aten.convolution) on the tensors permuted to
     PyTorch's N(G*C)(D)HW order, channels_last(_3d) memory format where the layout keeps channels last
     (NHWGC, GNHWC in 2D/3D), contiguous otherwise; groups = G; cudnn.benchmark = True.  f32 cases are
     timed with TF32 allowed (the default for convolutions) and with TF32 off.  fp8-compute cases run
     the f16 convolution on the unrounded f16 inputs (cuDNN has no such mode): noted, error not gated.
  4. convdsl and iree-today: the .vmfb is loaded with iree.runtime (driver cuda), inputs uploaded once as
     device arrays (bf16 as raw 16-bit words with the BFLOAT_16 element type), the result verified
     against the reference (relative L2 error), then timed.  convdsl is timed through its destination-
     passing function `<name>$into` (convdsl/abi.py: result buffer and workspace allocated once, as cuDNN
     gets dX/dW and its workspace from PyTorch's caching allocator), verified again through that call, as
     convdsl's runtime calls it (backends/into_call.py: its fenced twin `$into$async`, whose fence the
     call polls before it returns, as a CUDA stream synchronisation spins); the blocking synchronous
     `$into` and the allocating function are timed too (variant columns "convdsl (blocking $into)",
     "convdsl (allocating call)"; the JSON also has the allocating function invoked on packed arguments,
     "allocating_raw", and the allocator's bytes per call).  iree-today modules have only the allocating
     function.
  Timing: warm-up up to 5 calls, then the median of 20 calls (fewer, at least 3, when 20 would exceed the
  per-implementation time budget); every call is timed on the host clock and followed by
  torch.cuda.synchronize() for torch.  IREE's synchronous calling convention returns only after the
  device finished; `sync_check` in the JSON measures that for every case (see benchmarks/README.md).

Outputs RESULTS/<device>-<date>.json and .md; the Markdown table is printed last.

    python3 benchmarks/gpu_bench.py --out RESULTS [--cases a,b] [--budget 1.0] [--deadline 330]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "benchmarks" / "build"

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FP8_TORCH = {"fp8": torch.float8_e4m3fn, "bf8": torch.float8_e5m2}
TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "bf16": 1e-2}  # relative L2 error against the reference
TF32_TOLERANCE = 5e-3  # compute = "tf32": as convdsl.reference.TF32_TOLERANCE
FP8_TOLERANCE = 1e-2  # the reference rounds the inputs the same way, so only f16 output rounding remains
L2_BYTES = 50e6
ROTATE_SETS = 3
REF_F64_MAX_FLOPS = 1.2e12
IMPLS = ("convdsl", "iree-today")


def log(*a):
    print(*a, flush=True)


# --- layouts -------------------------------------------------------------------------------------
def act_perm(layout: str, d: int) -> tuple[int, ...]:
    """Axes of an activation in `layout` that give (N, G, C, spatial...)."""
    if layout == "NHWGC":
        return (0, d + 1, d + 2, *range(1, d + 1))
    if layout == "GNHWC":
        return (1, 0, d + 2, *range(2, d + 2))
    if layout == "NGCHW":
        return tuple(range(d + 3))
    raise ValueError(layout)


def w_perm(weight_layout: str, d: int) -> tuple[int, ...]:
    """Axes of a weight in `weight_layout` that give (G, K, C, taps...)."""
    if weight_layout == "GKYXC":
        return (0, 1, d + 2, *range(2, d + 2))
    if weight_layout == "GKCYX":
        return tuple(range(d + 3))
    raise ValueError(weight_layout)


def inverse(perm) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(perm))


def memory_format(spec: dict):
    d = spec["dims"]
    if spec["layout"] in ("NHWGC", "GNHWC") and d == 2:
        return torch.channels_last
    if spec["layout"] in ("NHWGC", "GNHWC") and d == 3:
        return torch.channels_last_3d
    return torch.contiguous_format


def act_to_torch(t: torch.Tensor, spec: dict, fmt) -> torch.Tensor:
    c = t.permute(act_perm(spec["layout"], spec["dims"]))
    return c.reshape(c.shape[0], c.shape[1] * c.shape[2], *c.shape[3:]).contiguous(memory_format=fmt)


def act_from_torch(t: torch.Tensor, spec: dict, channels: int) -> torch.Tensor:
    c = t.reshape(t.shape[0], spec["groups"], channels, *t.shape[2:])
    return c.permute(inverse(act_perm(spec["layout"], spec["dims"])))


def w_to_torch(t: torch.Tensor, spec: dict, fmt) -> torch.Tensor:
    c = t.permute(w_perm(spec["weight_layout"], spec["dims"]))
    return c.reshape(c.shape[0] * c.shape[1], *c.shape[2:]).contiguous(memory_format=fmt)


def w_from_torch(t: torch.Tensor, spec: dict) -> torch.Tensor:
    g = spec["groups"]
    c = t.reshape(g, t.shape[0] // g, *t.shape[1:])
    return c.permute(inverse(w_perm(spec["weight_layout"], spec["dims"])))


class TorchConv:
    """One case's convolution through PyTorch (cuDNN) on tensors in the case's layouts."""

    def __init__(self, case: dict):
        spec = self.spec = case["spec"]
        if spec["pad_lo"] != spec["pad_hi"]:
            raise NotImplementedError("asymmetric padding: PyTorch's convolution takes one padding per dim")
        self.op = case["op"]
        self.fmt = memory_format(spec)
        self.d = spec["dims"]

    def to_torch(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        s, f = self.spec, self.fmt
        if self.op in ("forward", "grad_input"):
            return [act_to_torch(args[0], s, f), w_to_torch(args[1], s, f)]
        return [act_to_torch(args[0], s, f), act_to_torch(args[1], s, f)]

    def like(self, dtype) -> torch.Tensor:
        """The tensor convolution_backward reads only the shape (and memory format) of."""
        s = self.spec
        if self.op == "grad_input":
            shape = (s["batch"], s["groups"] * s["in_channels"], *s["input"])
        else:
            shape = (s["groups"] * s["out_channels"], s["in_channels"], *s["filter"])
        return torch.empty(shape, dtype=dtype, device="cuda", memory_format=self.fmt)

    def fn(self, like: torch.Tensor):
        s = self.spec
        stride, pad, dil, groups = list(s["stride"]), list(s["pad_lo"]), list(s["dilation"]), s["groups"]
        opad = [0] * self.d
        conv_bwd = torch.ops.aten.convolution_backward
        if self.op == "forward":
            return lambda a, b: torch.ops.aten.convolution(a, b, None, stride, pad, dil, False, opad, groups)
        if self.op == "grad_input":
            return lambda dy, w: conv_bwd(dy, like, w, None, stride, pad, dil, False, opad, groups,
                                          [True, False, False])[0]
        return lambda x, dy: conv_bwd(dy, x, like, None, stride, pad, dil, False, opad, groups,
                                      [False, True, False])[1]

    def from_torch(self, r: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if self.op == "grad_weight":
            return w_from_torch(r, s)
        return act_from_torch(r, s, s["out_channels"] if self.op == "forward" else s["in_channels"])


# --- inputs, reference, errors ---------------------------------------------------------------------
def random_args(case: dict, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    out = []
    for a in case["args"]:
        t = torch.empty(a["shape"], dtype=TORCH_DTYPES[a["dtype"]], device="cuda")
        t.uniform_(-1.0, 1.0, generator=g)
        t.masked_fill_(t == 0, 0.5)  # never an exact zero: it would hide unwritten or skipped elements
        out.append(t)
    return out


def reference(case: dict, conv: TorchConv, args: list[torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The result in the case's result layout, in float64 (or float32 with TF32 off for large cases)."""
    ref_dtype = torch.float64 if case["flops"] <= REF_F64_MAX_FLOPS else torch.float32
    compute = _fp8_compute(case)  # bf16x3 approximates f32: its reference is the plain f32 one
    targs = conv.to_torch(args)
    ups = []
    for i, t in enumerate(targs):
        if compute:  # operand A (first) and B (second) rounded to their 8-bit compute types
            t = t.to(FP8_TORCH[compute[i]])
        ups.append(t.to(ref_dtype))
    del targs
    bench, tf32 = torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = False, False
    try:
        r = conv.fn(conv.like(ref_dtype))(*ups)
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = bench, tf32
    return conv.from_torch(r), str(ref_dtype).replace("torch.", "")


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"result shape {tuple(got.shape)} != expected {tuple(ref.shape)}")
    g = got.to(device="cuda", dtype=torch.float64)
    w = ref.to(torch.float64)
    if not bool(torch.isfinite(g).all()):
        return math.inf
    return float(torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w).clamp_min(1e-300))


def diagnose(case: dict, got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Where a wrong result is wrong: exact zeros, and the error per residue (mod stride) of each spatial dim."""
    spec = case["spec"]
    g = got.to(device="cuda", dtype=torch.float64)
    w = ref.to(torch.float64)
    out = {"zero_fraction": float((g == 0).double().mean()), "ref_zero_fraction": float((w == 0).double().mean()),
           "max_abs_err": float((g - w).abs().max())}
    axes = case["result"]["layout"]
    letters = {1: "W", 2: "HW", 3: "DHW"}[spec["dims"]]
    if case["op"] == "grad_input":
        for i, letter in enumerate(letters):
            s = spec["stride"][i]
            pos = axes.index(letter)
            per = []
            for r in range(s):
                gi, wi = g.narrow(pos, r, g.shape[pos] - r)[(slice(None),) * pos + (slice(None, None, s),)], \
                    w.narrow(pos, r, w.shape[pos] - r)[(slice(None),) * pos + (slice(None, None, s),)]
                per.append(float(torch.linalg.vector_norm(gi - wi) / torch.linalg.vector_norm(wi).clamp_min(1e-300)))
            out[f"err_by_residue_{letter}"] = per
    return out


def _fp8_compute(case: dict):
    """The case's fp8 compute types [A, B], or None (none set, or compute = bf16x3)."""
    compute = case["spec"].get("compute")
    return compute if compute and compute[0] in FP8_TORCH else None


def tolerance(case: dict) -> float:
    if _fp8_compute(case):
        return FP8_TOLERANCE
    base = max(TOLERANCE[case["args"][0]["dtype"]], TOLERANCE[case["result"]["dtype"]])
    if (case["spec"].get("compute") or [None])[0] == "tf32":  # one-pass TF32 products (convdsl.reference)
        return max(base, TF32_TOLERANCE)
    return base


# --- timing ------------------------------------------------------------------------------------------
def bench(calls, budget_s: float, sync=None, warmup: int = 5, reps: int = 20, min_reps: int = 3) -> dict:
    """Median host time of calls[i % len(calls)](); `sync` (if any) runs before the clock stops.

    Warm-up: up to `warmup` calls, fewer once they use half the budget.  Then `reps` timed calls, fewer
    (at least `min_reps`) where `reps` would not fit the budget.
    """
    def one(i):
        if sync:
            sync()
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        if sync:
            sync()
        return time.perf_counter() - t0

    warm = []
    for i in range(warmup):
        warm.append(one(i))
        if sum(warm) > budget_s / 2:
            break
    est = statistics.median(warm[1:] if len(warm) > 1 else warm)
    n = reps if est * reps <= budget_s else max(min_reps, int(budget_s / max(est, 1e-9)))
    times = [one(i) for i in range(n)]
    return {"ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "reps": n,
            "warmup": len(warm), "spread": (max(times) - min(times)) / statistics.median(times)}


def bench_events(calls, reps: int) -> float:
    """Median CUDA-event time of torch calls (device time, no launch gap): for reference in the JSON."""
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        calls[i % len(calls)]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# --- IREE ----------------------------------------------------------------------------------------------
class Iree:
    def __init__(self, driver: str = "cuda", allocators: tuple[str, ...] = ()):
        import iree.runtime as rt

        self.rt = rt
        if allocators:  # allocator specs layered over the device's own, e.g. "caching"
            self.config = rt.Config(device=rt.get_driver(driver).create_default_device(allocators=list(allocators)))
        else:
            self.config = rt.Config(driver)
        self.device = self.config.device
        self.elem = {"f32": rt.HalElementType.FLOAT_32, "f16": rt.HalElementType.FLOAT_16,
                     "bf16": rt.HalElementType.BFLOAT_16}

    def load(self, path: Path, function: str):
        rt = self.rt
        ctx = rt.SystemContext(config=self.config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(self.config.vm_instance, path.read_bytes()))
        return ctx, ctx.modules.module[function]

    def into_calls(self, ctx, case: dict, dsets, wait: str = "poll") -> tuple | None:
        """convdsl's destination-passing twin of the function (convdsl/abi.py), when the module has one:
        (IntoCall, one zero-argument call per input set).  Result buffer and workspace are allocated here,
        once, as a framework would keep them; None for modules without it (iree-today).  wait: IntoCall's
        ("poll": the runtime's default; "block": the synchronous `$into`)."""
        from convdsl.backends.into_call import IntoCall, allocate_result

        vm_module = ctx.modules.module.vm_module
        if vm_module.lookup_function(case["function"] + "$into") is None:
            return None
        rdtype = case["result"]["dtype"]
        views = [[a._buffer_view for a in s] for s in dsets]
        out = allocate_result(self.device, case["result"]["shape"], self.elem[rdtype], 4 if rdtype == "f32" else 2)
        call = IntoCall(ctx, vm_module, case["function"], views[0], out, wait=wait)
        packed = [call.pack(v) for v in views]
        return call, [lambda a=a: call.call(a) for a in packed]

    def download_view(self, view, dtype: str) -> torch.Tensor:
        return self.download(self.rt.DeviceArray(self.device, view, implicit_host_transfer=False), dtype)

    def upload(self, t: torch.Tensor, dtype: str):
        """A device array from a torch tensor: bf16 goes up as raw 16-bit words typed BFLOAT_16."""
        rt = self.rt
        host = t.detach().contiguous().cpu()
        arr = host.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else host.numpy()
        bv = self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
            device=self.device, buffer=np.ascontiguousarray(arr), element_type=self.elem[dtype])
        return rt.DeviceArray(self.device, bv, implicit_host_transfer=False)

    def raw_calls(self, f, dsets) -> list:
        """The same synchronous calls without the Python argument packing and result wrapping: the
        argument lists are packed once, each call is one VM invoke (which still waits for the GPU)."""
        from iree.runtime.function import InvokeContext

        packed = [f._arg_packer.pack(InvokeContext(self.device), tuple(s), {}) for s in dsets]

        def call(args):
            f._vm_context.invoke(f._vm_function, args, self.rt.VmVariantList(1))

        return [lambda a=a: call(a) for a in packed]

    def download(self, arr, dtype: str) -> torch.Tensor:
        rt = self.rt
        bv = arr._buffer_view
        if dtype == "bf16":
            raw = rt.HalBufferView(bv.get_buffer(), list(bv.shape), rt.HalElementType.UINT_16)
            host = np.array(rt.DeviceArray(self.device, raw).to_host(), copy=True)
            return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.array(arr.to_host(), copy=True))


def sync_check(fn, dev_args, download, t_est: float) -> dict:
    """Does a call return only after the GPU finished?  Host time of single calls, of 10 back-to-back
    calls, of a call followed by torch.cuda.synchronize(), and of a call followed by downloading its
    result minus the download of a finished result."""
    def timed(f):
        t0 = time.perf_counter()
        out = f()
        return time.perf_counter() - t0, out

    single = statistics.median([timed(lambda: fn(*dev_args))[0] for _ in range(3)])
    t0 = time.perf_counter()
    for _ in range(10):
        fn(*dev_args)
    b2b = (time.perf_counter() - t0) / 10

    def call_sync():
        fn(*dev_args)
        torch.cuda.synchronize()

    with_sync = statistics.median([timed(call_sync)[0] for _ in range(3)])

    def sync_after(sleep_s):
        fn(*dev_args)
        time.sleep(sleep_s)
        return timed(torch.cuda.synchronize)[0]

    sync_now = statistics.median([sync_after(0.0) for _ in range(3)])
    sync_later = statistics.median([sync_after(max(0.05, 2 * t_est / 1e3)) for _ in range(3)])
    r = fn(*dev_args)
    dl_only = statistics.median([timed(lambda: download(r))[0] for _ in range(3)])
    call_dl = statistics.median([timed(lambda: download(fn(*dev_args)))[0] for _ in range(3)])
    return {"single_ms": single * 1e3, "back_to_back_10_per_call_ms": b2b * 1e3,
            "call_then_torch_sync_ms": with_sync * 1e3,
            "torch_sync_right_after_call_ms": sync_now * 1e3, "torch_sync_after_sleep_ms": sync_later * 1e3, "call_then_download_ms": call_dl * 1e3,
            "download_finished_result_ms": dl_only * 1e3,
            "call_then_download_minus_download_ms": (call_dl - dl_only) * 1e3}


# --- ceilings ------------------------------------------------------------------------------------------
def ceilings() -> dict:
    out = {}
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = bench_events([lambda: dst.copy_(src)], 10)
    out["copy_GBps"] = 2 * n / (t * 1e-3) / 1e9
    del src, dst
    for name, dtype, size in (("bf16", torch.bfloat16, 8192), ("f16", torch.float16, 8192),
                              ("f32_tf32", torch.float32, 8192), ("f32", torch.float32, 8192)):
        torch.backends.cuda.matmul.allow_tf32 = name == "f32_tf32"
        a = torch.empty(size, size, dtype=dtype, device="cuda").uniform_(-1, 1)
        b = torch.empty(size, size, dtype=dtype, device="cuda").uniform_(-1, 1)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t = bench_events([lambda: a @ b], 10 if dtype != torch.float32 else 5)
        out[f"matmul_{name}_TFLOPs"] = 2 * size ** 3 / (t * 1e-3) / 1e12
        del a, b
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.empty_cache()
    return out


def peak_for(case: dict, ceil: dict) -> float:
    dt = case["args"][0]["dtype"]
    if dt == "f32":
        return ceil["matmul_f32_TFLOPs"]  # convdsl computes f32 on the FMA units, not TF32
    return ceil["matmul_bf16_TFLOPs"] if dt == "bf16" else ceil["matmul_f16_TFLOPs"]


# --- one case ------------------------------------------------------------------------------------------
def run_case(case: dict, iree: Iree | None, build: Path, ceil: dict, budget: float,
             only: frozenset[str] = frozenset(), time_allocating: bool = True) -> dict:
    """Verify and time every implementation of one case (those named in `only`, when given)."""
    spec, op = case["spec"], case["op"]
    dtype, rdtype = case["args"][0]["dtype"], case["result"]["dtype"]
    res = {"name": case["name"], "op": op, "dtype": dtype, "compute": spec.get("compute"),
           "layout": spec["layout"], "weight_layout": spec["weight_layout"], "problem": case["problem"],
           "flops": case["flops"], "bytes": case["bytes"], "impls": {}, "notes": []}
    peak = peak_for(case, ceil)
    t_math, t_mem = case["flops"] / (peak * 1e12), case["bytes"] / (ceil["copy_GBps"] * 1e9)
    res["floor_ms"] = max(t_math, t_mem) * 1e3
    res["floor_bound"] = "compute" if t_math >= t_mem else "memory"
    res["peak_TFLOPs_used"] = peak
    in_bytes = sum(math.prod(a["shape"]) * (4 if a["dtype"] == "f32" else 2) for a in case["args"])
    nsets = ROTATE_SETS if in_bytes <= L2_BYTES else 1
    res["input_sets"] = nsets
    tol = tolerance(case)
    res["tolerance"] = tol

    phases = res["phase_s"] = {}
    t0 = time.perf_counter()
    sets = [random_args(case, seed=1000 + i) for i in range(nsets)]
    conv = TorchConv(case)
    torch.cuda.synchronize()
    phases["inputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref, res["reference_dtype"] = reference(case, conv, sets[0])
    res["reference_s"] = phases["reference"] = time.perf_counter() - t0

    # cuDNN through PyTorch
    tsets = [conv.to_torch(s) for s in sets]
    fn = conv.fn(conv.like(TORCH_DTYPES[dtype]))
    variants = [("cudnn", True)] + ([("cudnn_notf32", False)] if dtype == "f32" else [])
    variants = [v for v in variants if not only or "cudnn" in only]
    if _fp8_compute(case):
        res["notes"].append("cuDNN runs the f16 convolution (no fp8 compute); its error is not gated")
    for name, tf32 in variants:
        entry = res["impls"][name] = {}
        try:
            torch.backends.cudnn.allow_tf32 = tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            t0 = time.perf_counter()
            out = fn(*tsets[0])  # with cudnn.benchmark: the autotuning call
            torch.cuda.synchronize()
            entry["first_call_s"] = time.perf_counter() - t0
            entry["err"] = rel_error(conv.from_torch(out), ref)
            # TF32 rounds the f32 operands to 10 mantissa bits: allow 1e-2 there; fp8 cases: not gated
            entry["ok"] = None if _fp8_compute(case) else bool(
                entry["err"] <= (1e-2 if tf32 and dtype == "f32" else tol))
            del out
            calls = [lambda s=s: fn(*s) for s in tsets]
            entry.update(bench(calls, budget, sync=torch.cuda.synchronize))
            entry["events_ms"] = bench_events(calls, min(entry["reps"], 20))
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            log(f"    {name} failed: {entry['error']}")
        finally:
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cuda.matmul.allow_tf32 = False
    del tsets, fn
    torch.cuda.empty_cache()

    # convdsl and iree-today (and any other compiled variant) through iree.runtime
    for impl in [*IMPLS, *(k for k in case["vmfbs"] if k not in IMPLS)]:
        if only and impl not in only:
            continue
        entry = res["impls"][impl] = {}
        vmfb = case["vmfbs"].get(impl)
        if not vmfb:
            entry["error"] = case.get("errors", {}).get(impl, f"{impl}: no vmfb")
            continue
        if iree is None:
            entry["error"] = "iree.runtime not available"
            continue
        try:
            t0 = time.perf_counter()
            ctx, f = iree.load(build / vmfb, case["function"])
            entry["load_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            dsets = [[iree.upload(t, a["dtype"]) for t, a in zip(s, case["args"])] for s in sets]
            entry["upload_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = f(*dsets[0])
            entry["first_call_s"] = time.perf_counter() - t0
            got = iree.download(r, rdtype)
            del r
            entry["err"] = rel_error(got, ref)
            entry["ok"] = bool(entry["err"] <= tol)
            if not entry["ok"]:
                try:
                    entry["wrong"] = diagnose(case, got, ref)
                except Exception as err:  # noqa: BLE001 - a diagnosis must not stop the timing
                    entry["wrong"] = f"diagnose failed: {type(err).__name__}: {err}"
                log(f"    {impl}: WRONG result, relative error {entry['err']:.3g} > {tol:g}: {entry['wrong']}")
            calls = [lambda s=s: f(*s) for s in dsets]
            if entry["first_call_s"] > 3 * max(budget, 1.0):  # very slow: one more call is the measurement
                t0 = time.perf_counter()
                f(*dsets[0])
                dt = time.perf_counter() - t0
                entry.update({"ms": dt * 1e3, "min_ms": dt * 1e3, "reps": 1, "warmup": 1, "spread": 0.0})
                entry["note"] = "slow: timed once after the first call"
            else:
                into = iree.into_calls(ctx, case, dsets)
                if into is None:
                    entry["abi"] = "allocating"
                    entry.update(bench(calls, budget))
                    entry["raw"] = bench(iree.raw_calls(f, dsets), budget)
                else:
                    # the destination-passing call is the measurement; it is verified like the first call
                    into_call, into_fns = into
                    entry["abi"] = "into"
                    entry["workspace_bytes"] = into_call.workspace_bytes
                    if time_allocating:
                        # the allocator's counters around the timed calls: what was not served from a cache
                        before = iree.device.allocator.statistics
                        entry["allocating"] = bench(calls, budget)
                        after, made = iree.device.allocator.statistics, sum(entry["allocating"][k] for k in
                                                                            ("warmup", "reps"))
                        entry["allocating"]["device_bytes_allocated_per_call"] = (
                            after["device_bytes_allocated"] - before["device_bytes_allocated"]) / made
                        # the same function invoked on packed arguments (no iree.runtime Python wrapping), as
                        # iree-run-module or a C caller calls it: beside the blocking $into, which is invoked so
                        entry["allocating_raw"] = bench(iree.raw_calls(f, dsets), budget)
                        # verified again after the repeated calls (a module may keep its workspace between them)
                        entry["allocating"]["err_after"] = rel_error(iree.download(f(*dsets[0]), rdtype), ref)
                        if entry["allocating"]["err_after"] > tol:
                            entry["ok"] = False
                            log(f"    {impl}: WRONG result from a repeated allocating call, relative error "
                                f"{entry['allocating']['err_after']:.3g}")
                    into_fns[0]()
                    entry["into_err"] = rel_error(iree.download_view(into_call.out, rdtype), ref)
                    if entry["into_err"] > tol:
                        entry["ok"] = False
                        log(f"    {impl}: WRONG result through the into ABI, relative error {entry['into_err']:.3g}")
                    entry.update(bench(into_fns, budget))
                    entry["wait"] = "poll" if into_call.async_function is not None else "block"
                    if into_call.async_function is not None:  # the blocking synchronous call, for reference
                        blocking_call, blocking_fns = iree.into_calls(ctx, case, dsets, wait="block")
                        blocking_fns[0]()
                        entry["blocking_err"] = rel_error(iree.download_view(blocking_call.out, rdtype), ref)
                        entry["blocking"] = bench(blocking_fns, budget)
                        del blocking_call, blocking_fns
                    del into_call, into_fns, into
            # the result of the last timed calls still equals the verified one (same inputs, set 0)
            again = iree.download(f(*dsets[0]), rdtype)
            entry["repeat_max_abs_diff"] = float((again.double() - got.double()).abs().max())
            if entry["ms"] * 16 < 1000 * budget:
                entry["sync_check"] = sync_check(f, dsets[0], lambda a: iree.download(a, rdtype), entry["ms"])
            del dsets, ctx, f, got, again
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            log(f"    {impl} failed: {entry['error']}")
    del sets, ref
    torch.cuda.empty_cache()
    return res


# --- report ------------------------------------------------------------------------------------------------
def _ms(e: dict | None) -> str:
    if not e:
        return "–"
    if "error" in e and "ms" not in e:
        return "compile failed" if "compile failed" in e["error"] else "failed"
    s = f"{e['ms']:.3f}"
    if e.get("ok") is False:
        s += " (WRONG)"
    return s


def _geo(values) -> float | None:
    v = [x for x in values if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def summarize(results: list[dict]) -> tuple[str, dict]:
    rows = []
    ratios, speedups, roofs, roofs_cudnn = [], [], [], []
    head = ("| case | op | dtype | cuDNN ms | cuDNN no-TF32 ms | convdsl ms | iree-today ms | cuDNN TFLOP/s | "
            "convdsl TFLOP/s | cuDNN/convdsl | convdsl vs iree-today | convdsl % roofline | floor ms | "
            "err convdsl | err iree-today |")
    rows.append(head)
    rows.append("|" + "---|" * (head.count("|") - 1))
    for r in results:
        if "impls" not in r:
            rows.append(f"| {r['name']} | {r.get('op', '?')} | {r.get('dtype', '?')} | failed: {r.get('error', '')[:80]} |"
                        + " |" * 11)
            continue
        im = r["impls"]
        cd, cdn, cv, it = im.get("cudnn"), im.get("cudnn_notf32"), im.get("convdsl"), im.get("iree-today")
        good = lambda e: e is not None and "ms" in e  # noqa: E731
        tf = lambda e: f"{r['flops'] / (e['ms'] * 1e-3) / 1e12:.1f}" if good(e) else "–"  # noqa: E731
        ratio = cd["ms"] / cv["ms"] if good(cd) and good(cv) else None
        speed = it["ms"] / cv["ms"] if good(it) and good(cv) else None
        roof = r["floor_ms"] / cv["ms"] * 100 if good(cv) else None
        if ratio and cv.get("ok"):
            ratios.append(ratio)
        if speed and cv.get("ok") and it.get("ok"):
            speedups.append(speed)
        if roof and cv.get("ok"):
            roofs.append(roof)
        if good(cd):
            roofs_cudnn.append(r["floor_ms"] / cd["ms"] * 100)
        err = lambda e: f"{e['err']:.1e}" if e and e.get("err") is not None else "–"  # noqa: E731
        dtype = r["dtype"] + (f" ({'/'.join(r['compute'])})" if r.get("compute") else "")
        rows.append(
            f"| {r['name']} | {r['op']} | {dtype} | {_ms(cd)} | {_ms(cdn) if cdn else '–'} | {_ms(cv)} | {_ms(it)} | "
            f"{tf(cd)} | {tf(cv)} | {f'{ratio:.2f}' if ratio else '–'} | {f'{speed:.2f}x' if speed else '–'} | "
            f"{f'{roof:.0f}%' if roof else '–'} | {r['floor_ms']:.3f} | {err(cv)} | {err(it)} |"
        )
    geo = {"cudnn_over_convdsl": _geo(ratios), "iree_today_over_convdsl": _geo(speedups),
           "convdsl_pct_roofline": _geo(roofs), "cudnn_pct_roofline": _geo(roofs_cudnn),
           "n_ratio": len(ratios), "n_speedup": len(speedups)}
    fmt = lambda v, suf="": f"{v:.3g}{suf}" if v else "–"  # noqa: E731
    rows.append("")
    rows.append(f"Geometric means: cuDNN time / convdsl time = {fmt(geo['cudnn_over_convdsl'])} "
                f"over {len(ratios)} cases (>1: convdsl faster); convdsl speedup over iree-today = "
                f"{fmt(geo['iree_today_over_convdsl'], 'x')} over {len(speedups)} cases; convdsl at "
                f"{fmt(geo['convdsl_pct_roofline'], '%')} of the roofline floor, cuDNN at "
                f"{fmt(geo['cudnn_pct_roofline'], '%')} (correct results only).")
    rows += variants_table(results)
    return "\n".join(rows), geo


def variants_table(results: list[dict]) -> list[str]:
    """Extra compiled variants (cases.json vmfbs beyond convdsl and iree-today) against convdsl, and convdsl
    called through its allocating function and through the blocking `$into` (the convdsl column is the
    runtime's call: the fenced `$into$async`, polled)."""
    for r in results:
        cv = r.get("impls", {}).get("convdsl") or {}
        if "allocating" in cv:
            r["impls"]["convdsl (allocating call)"] = {**cv["allocating"], "ok": cv.get("ok"), "err": cv.get("err")}
        if "blocking" in cv:
            ok = cv.get("ok") and cv["blocking_err"] <= r.get("tolerance", 0)
            r["impls"]["convdsl (blocking $into)"] = {**cv["blocking"], "ok": ok, "err": cv["blocking_err"]}
    extra = sorted({k for r in results for k in r.get("impls", {}) if k not in (*IMPLS, "cudnn", "cudnn_notf32")})
    if not extra:
        return []
    rows = ["", "| case | convdsl ms | " + " | ".join(f"{v} ms | convdsl/{v} | {v} err" for v in extra) + " |",
            "|---|---|" + "---|---|---|" * len(extra)]
    logs = {v: [] for v in extra}
    for r in results:
        im = r.get("impls", {})
        base = im.get("convdsl") or {}
        cells = [r["name"], f"{base['ms']:.3f}" if "ms" in base else "–"]
        for v in extra:
            e = im.get(v) or {}
            if "ms" not in e:
                cells += [e.get("error", "–")[:40], "–", "–"]
                continue
            speed = base["ms"] / e["ms"] if "ms" in base else None
            if speed and e.get("ok") and base.get("ok"):
                logs[v].append(math.log(speed))
            cells += [f"{e['ms']:.3f}", f"{speed:.2f}x" if speed else "–",
                      f"{e['err']:.1e}{'' if e.get('ok') else ' WRONG'}"]
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    rows.append("Geometric mean speedup over convdsl: " + ", ".join(
        f"{v} {math.exp(sum(x) / len(x)):.3f}x over {len(x)} cases" if x else f"{v} –" for v, x in logs.items()))
    return rows


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version(), "numpy": np.__version__}
    try:
        v["iree_runtime"] = version("iree-base-runtime")
    except PackageNotFoundError:
        v["iree_runtime"] = None
    return v


def allocator_modes() -> tuple[tuple[str, str, str], ...]:
    """(mode, IREE runtime flags, allocator specs) for --compare-allocators: what a plain iree.runtime user or
    iree-run-module gets, and the documented caching allocator (README, Deployment), the one convdsl's own devices
    have (IREE's default free list of 64 buffers fills up over the suite's 27 modules).  On CUDA the allocating
    functions take results and transients from the stream-ordered pool unless async allocations are off (with them
    on, the pool serves them whatever allocator is layered: measured as the defaults)."""
    from convdsl.backends.iree import DEVICE_ALLOCATORS  # as into_calls: convdsl on PYTHONPATH

    return (("default", "", ""), ("caching", "--cuda_async_allocations=false", ",".join(DEVICE_ALLOCATORS)))


def compare_allocators(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script once per allocator_modes() entry (convdsl only) and put the allocating and kept-buffer
    times side by side."""
    import subprocess

    modes_run = allocator_modes()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    for mode, flags, allocators in modes_run:
        tag = (f"{args.tag}-" if args.tag else "") + f"alloc-{mode}"
        rest = [a for i, a in enumerate(argv)  # the user's arguments less --tag (each run gets its own)
                if not a.startswith("--tag") and not (i > 0 and argv[i - 1] == "--tag")]
        command = [sys.executable, str(Path(__file__).resolve()), *rest,
                   "--impls", args.impls or "convdsl", "--tag", tag, f"--iree-flags={flags}",
                   f"--iree-allocators={allocators}"]
        log(f"allocators {mode}: {' '.join(command)}")
        t0 = time.time()
        subprocess.run(command, check=True)
        written = sorted((p for p in out.glob(f"*-{tag}.json") if p.stat().st_mtime >= t0),
                         key=lambda p: p.stat().st_mtime)
        runs[mode] = json.loads(written[-1].read_text())
    rows = []
    modes = [m for m, _, _ in modes_run]
    for case in runs["default"]["results"]:
        row = {"name": case["name"]}
        for mode in modes:
            c = next((c for c in runs[mode]["results"] if c["name"] == case["name"]), {})
            cv = c.get("impls", {}).get("convdsl") or {}  # its "allocating" entry: the allocating function's
            allocating = cv.get("allocating") or {}
            row[f"kept_ms_{mode}"] = cv.get("ms")
            row[f"allocating_ms_{mode}"] = allocating.get("ms")
            row[f"allocated_bytes_per_call_{mode}"] = allocating.get("device_bytes_allocated_per_call")
            row[f"allocating_raw_ms_{mode}"] = (cv.get("allocating_raw") or {}).get("ms")
            row[f"blocking_into_ms_{mode}"] = (cv.get("blocking") or {}).get("ms")
        kept = row["kept_ms_default"]
        for mode in modes:
            a, raw, blocking = (row[f"{k}_{mode}"] for k in ("allocating_ms", "allocating_raw_ms", "blocking_into_ms"))
            row[f"allocating_over_kept_{mode}"] = a / kept if a and kept else None
            row[f"raw_allocating_over_blocking_into_{mode}"] = raw / blocking if raw and blocking else None
        rows.append(row)
    base = runs["default"]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", base["device"]).strip("-") + "-" + base["date"][:10] + (
        f"-{args.tag}" if args.tag else "") + "-allocators"
    (out / f"{stem}.json").write_text(json.dumps(
        {"device": base["device"], "date": base["date"], "versions": base.get("versions"),
         "command": " ".join(["python3 benchmarks/gpu_bench.py", *argv, "--compare-allocators"]),
         "modes": [{"mode": m, "iree_flags": f, "allocators": a} for m, f, a in modes_run],
         "results": rows}, indent=1, default=str) + "\n")

    def ms(v):
        return f"{v:.3f}" if v else "-"

    log("| case | kept ms | " + " | ".join(f"allocating ms ({m}) | x kept ({m}) | raw x blocking $into ({m})"
                                          for m in modes) + " |\n|---|---|" + "---|---|---|" * len(modes))
    for r in rows:
        log(f"| {r['name']} | {ms(r['kept_ms_default'])} | " + " | ".join(
            f"{ms(r[f'allocating_ms_{m}'])} | {ms(r[f'allocating_over_kept_{m}'])} | "
            f"{ms(r[f'raw_allocating_over_blocking_into_{m}'])}" for m in modes) + " |")
    log(f"wrote {out / (stem + '.json')}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--build", default=str(BUILD))
    ap.add_argument("--cases", help="comma-separated case names (default: all in cases.json)")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per implementation")
    ap.add_argument("--tag", default="", help="appended to the output file names")
    ap.add_argument("--iree-flags", default="",
                    help="IREE runtime flags, space-separated, parsed before the CUDA device is created (default: "
                         "IREE's own; --cuda_async_allocations=false with --iree-allocators caching: run 9 in "
                         "benchmarks/README.md)")
    ap.add_argument("--impls", default="",
                    help="comma-separated implementations to time (cudnn, convdsl, iree-today, or a variant in "
                         "cases.json such as convdsl:sm_90; default: all)")
    ap.add_argument("--iree-allocators", default="",
                    help="IREE allocator specs layered over the CUDA device's allocator, comma-separated (e.g. "
                         "caching; default: none)")
    ap.add_argument("--skip-allocating", action="store_true",
                    help="do not also time convdsl's allocating function (tuning runs)")
    ap.add_argument("--deadline", type=float, default=330.0,
                    help="seconds for all cases: the per-implementation budget shrinks to fit")
    ap.add_argument("--compare-allocators", action="store_true",
                    help="time convdsl's allocating function with IREE's defaults and with a caching allocator "
                         "(--cuda_async_allocations=false, allocator caching), each in a process of its own (the "
                         "flag is process-wide), beside the kept-buffer call; writes <device>-<date>-allocators.json")
    args = ap.parse_args(argv)
    if args.compare_allocators:
        return compare_allocators(args, [a for a in (argv if argv is not None else sys.argv[1:])
                                         if a != "--compare-allocators"])

    t_start = time.perf_counter()
    build, out = Path(args.build), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((build / "cases.json").read_text())
    cases = manifest["cases"]
    if args.cases:
        want = args.cases.split(",")
        cases = [c for c in cases if c["name"] in want]

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    device = torch.cuda.get_device_name(0)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") + "-" + date + (f"-{args.tag}" if args.tag else "")
    info = {"device": device, "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "memory_bytes": props.total_memory,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
            "compiled_for": {"arch": manifest.get("arch"), "iree_compiler": manifest.get("iree_compiler_version"),
                             "iree_today_flags": manifest.get("iree_today_flags")}}
    log(f"device {device}, {info['versions']}")

    t0 = time.perf_counter()
    ceil = ceilings()
    info["ceilings"] = ceil
    log(f"ceilings ({time.perf_counter() - t0:.1f} s): " + ", ".join(f"{k} {v:.0f}" for k, v in ceil.items()))

    iree = None
    info["iree_runtime_flags"] = args.iree_flags.split()
    allocators = tuple(a for a in args.iree_allocators.split(",") if a)
    only = frozenset(i for i in args.impls.split(",") if i)
    info["impls"] = sorted(only) or "all"
    info["iree_allocators"] = list(allocators)
    try:
        if args.iree_flags.split():
            import iree.runtime as rt

            rt.flags.parse_flags(*args.iree_flags.split())
        iree = Iree("cuda", allocators)
        log(f"iree.runtime cuda device: {iree.device}")
    except Exception as err:  # noqa: BLE001
        info["iree_error"] = f"{type(err).__name__}: {err}"
        log(f"iree.runtime unavailable: {info['iree_error']}")

    results = []
    json_path = out / f"{stem}.json"
    t_cases = time.perf_counter()
    for i, case in enumerate(cases):
        left = len(cases) - i
        remaining = args.deadline - (time.perf_counter() - t_cases)
        budget = min(args.budget, max(0.15, remaining / left / 6))
        t0 = time.perf_counter()
        log(f"[{i + 1}/{len(cases)}] {case['name']} ({case['problem']}) budget {budget:.2f} s")
        try:
            r = run_case(case, iree, build, ceil, budget, only, time_allocating=not args.skip_allocating)
        except Exception as err:  # noqa: BLE001 - record it and go on with the next case
            r = {"name": case["name"], "op": case.get("op"), "dtype": case["args"][0]["dtype"],
                 "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
                 "traceback": traceback.format_exc()[-2000:]}
            log(f"    case failed: {r['error']}")
            torch.cuda.empty_cache()
        r["case_s"] = time.perf_counter() - t0
        results.append(r)
        if "impls" in r:
            log("    " + "; ".join(
                f"{k} {v['ms']:.3f} ms" + (" WRONG" if v.get("ok") is False else "") + (
                    f" err {v['err']:.1e}" if v.get("err") is not None else "")
                if "ms" in v else f"{k} {v.get('error', '?')[:120]}"
                for k, v in r["impls"].items()) + f"  [{r['case_s']:.1f} s]")
        json_path.write_text(json.dumps({**info, "results": results}, indent=1, default=str) + "\n")

    table, geo = summarize(results)
    info["geomeans"] = geo
    info["total_s"] = time.perf_counter() - t_start
    json_path.write_text(json.dumps({**info, "results": results}, indent=1, default=str) + "\n")
    md = (f"# convdsl suite on {device} ({date})\n\n"
          f"torch {info['versions']['torch']}, cuDNN {info['versions']['cudnn']}, iree-base-runtime "
          f"{info['versions']['iree_runtime']}; kernels compiled for {manifest.get('arch')} with iree-base-compiler "
          f"{manifest.get('iree_compiler_version')}.\n"
          f"Ceilings measured here: copy {ceil['copy_GBps']:.0f} GB/s (read+write), matmul bf16 "
          f"{ceil['matmul_bf16_TFLOPs']:.0f}, f16 {ceil['matmul_f16_TFLOPs']:.0f}, f32 (no TF32) "
          f"{ceil['matmul_f32_TFLOPs']:.0f}, TF32 {ceil['matmul_f32_tf32_TFLOPs']:.0f} TFLOP/s. Floor = "
          f"max(flops / matmul peak of the dtype (f32: no-TF32 peak), minimal bytes / copy bandwidth).\n"
          f"Times: median host time per call, each returning after the GPU work (torch: synchronised each call; "
          f"convdsl: its runtime's call, the fenced `$into$async` polled to completion; iree-today: synchronous "
          f"calls; IREE runtime "
          f"flags {' '.join(info['iree_runtime_flags']) or '(defaults)'}, allocators "
          f"{','.join(info['iree_allocators']) or '(device default)'}). "
          f"cuDNN column: TF32 allowed (PyTorch's default for convolutions); fp8-compute case: cuDNN runs f16.\n\n"
          + table + "\n")
    (out / f"{stem}.md").write_text(md)
    log(f"\nwrote {json_path} and {out / (stem + '.md')} in {info['total_s']:.0f} s\n")
    log(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
