"""The compile driver: Triton (cp.async kernels, elementwise steps) and Triton's Gluon (TMA kernels) turn a
`Launch` into a `Binary` for an arch, without a GPU; and what the installed Triton offers.
"""
from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import Optional

from ..targets import Target
from .launch import POINTER_ALIGNMENT, TRITON_TRAILING_PARAMS, Binary, Launch, TmaMap

# the kernels of kernels/elementwise.py and kernels/halo.py; the others are in kernels/igemm.py and kernels/tma.py
ELEMENTWISE_KERNELS = ("sum_partials", "round_fp8", "transpose_planes", "pad_planes", "space_to_depth",
                       "split_bf16")
HALO_KERNELS = ("forward_halo",)
# the fused BatchNorm + activation (kernels/batchnorm.py)
BATCHNORM_KERNELS = ("batch_stats", "apply_act", "apply_running", "grad_stats", "grad_apply")

# Triton releases that miscompile convdsl's kernels: Triton 3.8 built a cp.async grad_weight that reads out of
# bounds (docs/decisions.md#grad-weight-fit); 3.6 (PyTorch 2.11's) and 3.9 (convdsl[cuda]'s) do not
MISCOMPILING_TRITON = ("3.8.",)


class TritonVersionError(RuntimeError):
    """The installed Triton is one convdsl refuses to compile with (MISCOMPILING_TRITON)."""


def check_triton_version() -> None:
    """Refuse to compile with a Triton that miscompiles the kernels: a clear error rather than a wrong number."""
    version = triton_version()
    if version is not None and version.startswith(MISCOMPILING_TRITON):
        raise TritonVersionError(
            f"Triton {version} miscompiles convdsl's kernels (docs/decisions.md#grad-weight-fit): install Triton 3.9 "
            f"(pip install 'convdsl[cuda]'), or PyTorch 2.11's Triton 3.6, or run kernels compiled ahead into a "
            f"bundle (CONVDSL_STREAM_BUNDLES)")


@functools.lru_cache(maxsize=None)
def gluon_tma_im2col() -> bool:
    """Whether the installed Triton compiles Gluon kernels with TMA im2col copies (Triton 3.9 does; PyTorch's
    own Triton may not).  Kernels compiled elsewhere run without it (the runner needs only the CUDA driver)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return False
    return hasattr(tma, "async_load_im2col")


@functools.lru_cache(maxsize=None)
def compile_tma_launch(launch: Launch, maps: tuple[TmaMap, ...], arch: str
                       ) -> tuple[Binary, tuple[TmaMap, ...], tuple[str, ...]]:
    """Compile a TMA launch with Triton's Gluon for `arch` (sm_90): its binary, the maps with the binary's boxes
    and swizzles, and the kinds of its parameters in order ("map": a 128-byte CUtensorMap by value, "ptr<i>": the
    device address of operand i (one no map reads), "u32", "u64")."""
    check_triton_version()
    import triton  # optional dependencies: planned only where they are installed (policy.tma_forward_reason)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from . import halo, tma

    fn = getattr(halo if launch.kernel in HALO_KERNELS else tma, launch.kernel)
    dtypes = {"fp16": gl.float16, "bf16": gl.bfloat16, "fp32": gl.float32, "fp8e4nv": gl.float8e4nv,
              "fp8e5": gl.float8e5}
    signature = {}
    for name, m in zip(fn.arg_names, maps):
        layout = gl.NVMMASharedLayout.get_default_for(list(m.block), dtypes[launch.pointer_types[m.operand]])
        kind = "tensordesc_im2col" if m.im2col else "tensordesc"
        signature[name] = f"{kind}<{launch.pointer_types[m.operand]}[{m.block[0]},{m.block[1]}],{layout!r}>"
    constexprs = dict(launch.constants, num_warps=launch.warps)
    # the operands no map reads come as pointers, after the maps, in operand order (16-byte aligned)
    pointers = [i for i in range(len(launch.pointer_types)) if i not in {m.operand for m in maps}]
    pointer_names = [name for name in fn.arg_names[len(maps):] if name not in constexprs][:len(pointers)]
    for name, operand in zip(pointer_names, pointers):
        signature[name] = "*" + launch.pointer_types[operand]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", POINTER_ALIGNMENT]] for name in pointer_names}
    signature.update({name: "constexpr" for name in constexprs})
    options = {"num_warps": launch.warps}
    target = Target("cuda", arch)
    warp = target.gpu.subgroup_size
    if constexprs.get("SPECIALISED"):
        # a warp-specialised kernel runs a warp group (4 warps) more than num_warps: registers for all of them
        per_sm, most = target.registers
        options["maxnreg"] = min(most, per_sm // (warp * (launch.warps + 4))) // 8 * 8
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", target.arch_number, warp), options=options)
    meta = kernel.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"launch {launch.name}: Triton asked for scratch memory, which the runner does not pass")
    head = kernel.asm["ptx"].split(")", 1)[0]
    kinds = tuple("map" if "[128]" in decl else "u32" if ".u32" in decl else "u64"
                  for decl in re.findall(r"\.param ([^\n,]*)", head))
    if pointers:  # the pointers are the last parameters before Triton's trailing ones: "ptr<operand>"
        at = len(kinds) - TRITON_TRAILING_PARAMS - len(pointers)
        if kinds[at:at + len(pointers)] != ("u64",) * len(pointers):
            raise RuntimeError(f"launch {launch.name}: expected {len(pointers)} pointer parameters before Triton's "
                               f"trailing ones, got the parameter kinds {kinds}")
        kinds = kinds[:at] + tuple(f"ptr{i}" for i in pointers) + kinds[at + len(pointers):]
    compiled = tuple(replace(m, box=tuple(d["block_size"]), swizzle=d["swizzle"])
                     for m, d in zip(maps, meta.tensordesc_meta))
    # meta.num_warps: the launch's warps plus a warp-specialised kernel's worker warps (in whole warp groups)
    binary = Binary(meta.name, kernel.asm["cubin"], "cubin", threads=32 * meta.num_warps, shared_bytes=int(meta.shared),
                    params=len(kinds))
    return binary, compiled, kinds


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.lru_cache(maxsize=None)
def compile_launch(launch: Launch, arch: str) -> Binary:
    """Compile one launch with Triton for `arch` (no GPU needed: Triton's LLVM and its bundled ptxas)."""
    check_triton_version()
    import triton  # an optional dependency: planned only where it is installed (policy.unsupported_reason)
    from triton.backends.compiler import GPUTarget

    from . import batchnorm, elementwise, igemm  # import triton: only where a launch is compiled

    module = (elementwise if launch.kernel in ELEMENTWISE_KERNELS
              else batchnorm if launch.kernel in BATCHNORM_KERNELS else igemm)
    fn = getattr(module, launch.kernel)
    arg_names = fn.arg_names
    pointers = arg_names[: len(launch.pointer_types)]
    signature = {name: "*" + t for name, t in zip(pointers, launch.pointer_types)}
    signature.update({name: "constexpr" for name in arg_names[len(pointers):]})
    constexprs = dict(launch.constants)
    missing = set(arg_names[len(pointers):]) - set(constexprs)
    if missing:
        raise ValueError(f"launch {launch.name}: no value for {sorted(missing)}")
    target = Target("cuda", arch)
    # every binding starts 16-byte aligned (IREE aligns buffers and their suballocations to at least 64
    # bytes): without this fact Triton loads one element at a time and cannot pipeline through cp.async
    attrs = {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i in range(len(pointers))}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    # fp fusion (fma) on, Triton's historical default: the products and sums of the GEMM are fused anyway
    options = {"num_warps": launch.warps, "num_stages": launch.stages, "enable_fp_fusion": True}
    if target.ptx_version is not None:  # PTX for the driver to JIT, in an ISA the driver accepts
        options["ptx_version"] = target.ptx_version
    kernel = triton.compile(source, target=GPUTarget("cuda", target.arch_number, target.gpu.subgroup_size),
                            options=options)
    meta = kernel.metadata
    if meta.global_scratch_size or meta.profile_scratch_size:
        raise RuntimeError(f"launch {launch.name}: Triton asked for scratch memory, which IREE cannot pass")
    ptx = kernel.asm["ptx"]
    params = len(re.findall(r"\.param\s+\.", ptx.split(")", 1)[0]))
    expected = len(launch.pointer_types) + TRITON_TRAILING_PARAMS
    if params != expected:
        raise RuntimeError(f"launch {launch.name}: kernel has {params} parameters, expected {expected}")
    entry = meta.name
    if target.ptx_version is None:
        data, kind = kernel.asm["cubin"], "cubin"
    else:
        data, kind = ptx.encode(), "ptx"
    return Binary(entry, data, kind, threads=32 * launch.warps, shared_bytes=int(meta.shared), params=params)
