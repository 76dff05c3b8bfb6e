"""The CPU's measured matmul peak: what `convdsl run --bench --target cpu` reports each kernel's share of.

    gflops = peak.cached(target)            # None until measured on this machine, IREE and flags
    gflops = peak.measure(target)           # compile, time, store; about a second at 1024^3
    vmfb = peak.compile_matmul(target)      # compile only (another machine may run it: time_matmul)

The yardstick is a plain f32 `linalg.matmul` (C = A B, MATMUL_SIZE cubed unless `size` says otherwise), built
with the MLIR Python bindings, compiled by IREE for the same target with the same flags as the CPU kernels
(Target.compile_flags: data tiling and the matmul microkernels) and called through iree.runtime on the same
local-task device (backends/iree.py: LoadedModule), on random inputs: WARMUP calls, then the median of REPEAT.

The GFLOP/s are stored in convdsl's cache (cache.py: checksummed, written atomically) under a key of everything
that changes them: the matmul's IR, the target and its flags, IREE's compiler and runtime versions, the CPU
model and its feature flags, and the threads this process may run on.  Any of them changing is a miss and a new
measurement; `convdsl` says on the terminal when it measures.

Timing a compiled matmul (time_matmul) needs only NumPy and iree.runtime: the compiler is imported where the
matmul is built or compiled, so a machine that runs modules compiled elsewhere can measure its peak.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Optional, Sequence

import numpy as np

from . import cache
from .backends import iree as _iree
from .targets import Target, TargetError

__all__ = ["MATMUL_SIZE", "cached", "compile_matmul", "key_material", "matmul_mlir", "measure", "peak_key",
           "time_matmul"]

# Bump when the key's JSON or the stored record changes, so old entries are never misread.
PEAK_SCHEMA = 1
SUFFIX = ".peak"  # the cache entry's suffix, beside the modules' .vmfb
FUNCTION = "matmul"

MATMUL_SIZE = 1024  # M = N = K; read at call time, so tests may measure a smaller one
WARMUP = 3
REPEAT = 15


def matmul_mlir(size: int) -> str:
    """`func.func @matmul(A: size x size, B: size x size) -> A B`, f32, as IREE's input text."""
    from iree.compiler import ir
    from iree.compiler.dialects import func, linalg

    from .passes.ir import element_type, tensor_type, zeros

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        f32 = element_type("f32")
        square = tensor_type([size, size], f32)
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp(FUNCTION, ([square, square], [square]))
            with ir.InsertionPoint(fn.add_entry_block()):
                a, b = fn.arguments
                func.ReturnOp([linalg.matmul(a, b, outs=[zeros([size, size], f32)])])
        return str(module)


def cpu_model() -> dict:
    """The CPU's model name and a digest of its feature flags (/proc/cpuinfo where there is one): `host`
    compiles for exactly these, so two machines sold under one name but with other vector units differ."""
    name, features = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not features:
                    features = value.strip()
                if name and features:
                    break
    except OSError:
        pass
    return {
        "name": name or platform.processor() or "unknown",
        "machine": platform.machine(),
        "features": hashlib.sha256(" ".join(sorted(features.split())).encode()).hexdigest()[:16] if features else "",
    }


def threads() -> int:
    """The CPUs this process may run on: the local-task device sizes its workers from them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def key_material(target: Target, extra_flags: Sequence[str] = (), size: Optional[int] = None) -> dict:
    """Everything that changes the measured GFLOP/s."""
    from . import compiler

    size = size or MATMUL_SIZE
    return {
        "schema": PEAK_SCHEMA,
        "kind": "matmul-peak",
        "size": [size, size, size],
        "ir": hashlib.sha256(matmul_mlir(size).encode()).hexdigest(),
        "backend": target.backend,
        "arch": target.arch,
        "flags": [*target.compile_flags(), *extra_flags],
        "iree_version": compiler.iree_version(),  # through the module: a patched version is seen
        "iree_runtime_version": _iree.iree_version("iree-base-runtime"),
        "cpu": cpu_model(),
        "threads": threads(),
    }


def peak_key(target: Target, extra_flags: Sequence[str] = (), size: Optional[int] = None) -> str:
    return cache.cache_key(key_material(target, extra_flags, size))


def _check_cpu(target: Target) -> None:
    if target.backend != "cpu":
        raise TargetError(f"matmul peak: measured for the CPU target only, got {target}")


def cached(target: Target, extra_flags: Sequence[str] = (), size: Optional[int] = None) -> Optional[float]:
    """The stored GFLOP/s for this machine, IREE and flags, or None where none is (or the entry is damaged)."""
    _check_cpu(target)
    data = cache.load(peak_key(target, extra_flags, size), suffix=SUFFIX)
    if data is None:
        return None
    try:
        gflops = float(json.loads(data)["gflops"])
    except (ValueError, KeyError, TypeError):
        return None
    return gflops if gflops > 0 and np.isfinite(gflops) else None


def compile_matmul(target: Target, extra_flags: Sequence[str] = (), size: Optional[int] = None) -> bytes:
    """The matmul's .vmfb for `target` (an LLVM CPU name compiles it for another machine's CPU)."""
    _check_cpu(target)
    # through the module: a patched compile_mlir is seen
    vmfb = _iree.compile_mlir(matmul_mlir(size or MATMUL_SIZE), target, extra_flags)
    cache.stats.compiles += 1
    return vmfb


def time_matmul(vmfb: bytes, target: Target, size: Optional[int] = None, repeat: Optional[int] = None,
                seed: int = 0) -> tuple[float, float]:
    """(GFLOP/s, median seconds per call) of a compiled matmul (compile_matmul, same `size`) on this machine."""
    _check_cpu(target)
    size = size or MATMUL_SIZE
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    seconds = _iree.LoadedModule(vmfb, target).time(FUNCTION, [a, b], repeat=repeat or REPEAT, warmup=WARMUP)
    return 2.0 * size ** 3 / seconds / 1e9, seconds


def measure(target: Target, extra_flags: Sequence[str] = (), size: Optional[int] = None,
            repeat: Optional[int] = None, seed: int = 0) -> float:
    """Compile and time the matmul, store its GFLOP/s in the cache and return them."""
    size = size or MATMUL_SIZE
    repeat = repeat or REPEAT
    material = key_material(target, extra_flags, size)
    vmfb = compile_matmul(target, extra_flags, size)
    gflops, seconds = time_matmul(vmfb, target, size, repeat, seed)
    record = {"gflops": gflops, "seconds": seconds, "repeat": repeat, "warmup": WARMUP, "key": material}
    cache.store(cache.cache_key(material), json.dumps(record, sort_keys=True).encode(), suffix=SUFFIX)
    return gflops
