"""IREE backend: compile linalg IR to a .vmfb with `iree.compiler`, run it with `iree.runtime`.

Running needs only NumPy and iree.runtime (iree.compiler is imported by the compile functions, ml_dtypes only to
hand a bf16 result back as an ml_dtypes array), so a machine that runs modules compiled elsewhere needs neither."""
from __future__ import annotations

import functools
import hashlib
import logging
from importlib.metadata import PackageNotFoundError, version
import os
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..abi import ASYNC_SUFFIX, INTO_SUFFIX, TRANSIENTS_SIZE_CONSTANT
from ..targets import Target, TargetError
from .into_call import HOST_DRIVERS, IntoCall, allocate_result, default_wait
from .iree_cpu_config import DistributionRule, with_distribution


log = logging.getLogger("convdsl.iree")


class CompileError(RuntimeError):
    """iree-compile rejected the IR; the message names the saved MLIR and a command that reproduces it."""


@functools.lru_cache(maxsize=None)  # the installed packages cannot change under a running process
def iree_version(package: str = "iree-base-compiler") -> str:
    """The installed IREE compiler's version (or another IREE package's, e.g. "iree-base-runtime"), or
    "not installed" (a machine that only runs modules has no compiler)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def failure_dir() -> Path:
    return Path(os.environ.get("CONVDSL_FAILURE_DIR", Path(tempfile.gettempdir()) / "convdsl-failures"))


# convdsl emits tensor.pad only where it wants the zero border fused into the consuming contraction
# (plan pad_form "fuse"); IREE fuses it only with this flag, and otherwise copies it with a slow kernel.  Its CPU
# codegen fails on some fused borders (a depthwise convolution over 9-23 channels of a 2-3 pixel wide image in
# IREE 3.13: benchmarks/iree-upstream.md); such a module is compiled again without the flag (the border then a
# copy of its own), and the fallback is logged as a warning
FUSE_PAD_FLAG = "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops"

# LLVM's AMDGPU pass that lowers buffer fat pointers crashes on some dispatches (3D f32 grad_input with 8 channels
# on gfx942 in IREE 3.13: benchmarks/iree-upstream.md); a ROCm module it crashes on is compiled again with IREE's
# buffer instructions off, the one change that avoided it, and the fallback is logged as a warning
NO_BUFFER_INSTRUCTIONS_FLAG = "--iree-rocdl-enable-buffer-instructions=false"
BUFFER_FAT_POINTER_CRASH = "Lower buffer fat pointer operations"

# iree_config's edited executable configurations, compiled in place of IREE's own
SUBSTITUTE_CONFIGURATIONS_FLAG = "--iree-hal-substitute-executable-configurations-from"


def retries_unfused(flags: Sequence[str]) -> bool:
    """Whether a failed compile with `flags` is compiled again without FUSE_PAD_FLAG: not where it substitutes
    edited executable configurations, which were made for the fused module's executables (the unfused module has
    others, so the substitution would not apply, and IREE would warn as if it had)."""
    return FUSE_PAD_FLAG in flags and not any(f.startswith(SUBSTITUTE_CONFIGURATIONS_FLAG) for f in flags)


def with_device_targets(mlir: str, target: Target) -> str:
    """The module with `hal.device.targets` set when the target is described in IR (Target.device_targets_attr)."""
    attr = target.device_targets_attr()
    if attr is None:
        return mlir
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(mlir)
        module.operation.attributes["hal.device.targets"] = ir.ArrayAttr.get([ir.Attribute.parse(attr)])
        return str(module)


def transient_sizes(mlir: str, target: Target, extra_flags: Sequence[str] = ()) -> dict[str, int]:
    """Per kernel function of the module: the bytes of transient storage iree-compile plans for one call (with
    the module's `extra_flags`, as compile_mlir compiles it), read from its destination-passing twin's reflection
    (`iree.abi.transients.size.constant`, convdsl/abi.py) after IREE's stream phase; absent where the size is not
    static (`batch = ?`).  Where compile_mlir may compile the module twice (zero borders fused, then not) the
    larger of the two plans'."""
    import iree.compiler as ireec
    from iree.compiler import ir

    mlir = with_device_targets(mlir, target)
    flags = [*target.compile_flags(), *extra_flags, "--compile-to=stream"]
    variants = [[*flags, FUSE_PAD_FLAG], flags] if "tensor.pad" in mlir else [flags]
    sizes: dict[str, int] = {}
    for variant in variants:
        with ir.Context():
            module = ir.Module.parse(ireec.compile_str(mlir, extra_args=variant).decode())
            for op in module.body.operations:
                name = ir.StringAttr(op.attributes["sym_name"]).value if "sym_name" in op.attributes else ""
                if not name.endswith(INTO_SUFFIX) or name.endswith(ASYNC_SUFFIX) or \
                        "iree.reflection" not in op.attributes:
                    continue
                reflection = ir.DictAttr(op.attributes["iree.reflection"])
                if TRANSIENTS_SIZE_CONSTANT in reflection:
                    kernel = name[:-len(INTO_SUFFIX)]
                    size = ir.IntegerAttr(reflection[TRANSIENTS_SIZE_CONSTANT]).value
                    sizes[kernel] = max(sizes.get(kernel, 0), size)
    return sizes


def _compile_distributed(mlir: str, flags: list[str], rule: DistributionRule) -> Optional[bytes]:
    """The CPU module compiled in two phases with its packed matmuls' workgroup tiles set by `rule` in between
    (backends/iree_cpu_config.py); None where a phase fails, for the one-phase compile to report or retry."""
    import iree.compiler as ireec
    from iree.compiler.tools import CompilerToolError

    try:
        configured = ireec.compile_str(mlir, extra_args=[*flags, "--compile-to=executable-configurations"]).decode()
    except CompilerToolError:
        return None
    edited, changes = with_distribution(configured, rule)
    for matmul, distribution in changes:
        log.debug("packed matmul %s: distribution %s -> %s", matmul, list(matmul.distribution), list(distribution))
    try:
        return ireec.compile_str(edited, extra_args=[*flags, "--compile-from=executable-configurations"])
    except CompilerToolError as err:
        if not changes:
            return None
        log.warning("iree-compile rejected the packed matmuls' workgroup tiles (%s); compiled with IREE's own",
                    (getattr(err, "stderr_text", None) or str(err)).strip().splitlines()[-1][:200])
        return None


def compile_mlir(mlir: str, target: Target, extra_flags: Sequence[str] = (), data_tiling: bool = True,
                 fuse_pad: bool = True, packed_matmul_tiles: Optional[DistributionRule] = None) -> bytes:
    """MLIR text -> .vmfb bytes (`data_tiling`: Target.compile_flags'; `fuse_pad`: FUSE_PAD_FLAG where the module
    holds a tensor.pad; `packed_matmul_tiles`: on the CPU with data tiling, the rule that sets each packed matmul's
    workgroup tiles, policy.cpu_packed_matmul_distribution).  On failure the input is saved and the error says how
    to reproduce it."""
    import iree.compiler as ireec
    from iree.compiler.tools import CompilerToolError

    mlir = with_device_targets(mlir, target)
    flags = [*target.compile_flags(data_tiling), *extra_flags]
    if fuse_pad and "tensor.pad" in mlir:
        flags.append(FUSE_PAD_FLAG)
    if packed_matmul_tiles is not None and target.backend == "cpu" and data_tiling:
        vmfb = _compile_distributed(mlir, flags, packed_matmul_tiles)
        if vmfb is not None:
            return vmfb
    try:
        return ireec.compile_str(mlir, extra_args=flags)
    except CompilerToolError as err:
        stderr = getattr(err, "stderr_text", None) or str(err)
        if (target.backend == "rocm" and BUFFER_FAT_POINTER_CRASH in str(stderr)
                and NO_BUFFER_INSTRUCTIONS_FLAG not in flags):
            log.warning("%s: iree-compile crashed in LLVM's AMDGPU buffer fat pointer lowering; compiled again with "
                        "%s (plain global loads and stores)", target, NO_BUFFER_INSTRUCTIONS_FLAG)
            return compile_mlir(mlir, target, [*extra_flags, NO_BUFFER_INSTRUCTIONS_FLAG], data_tiling, fuse_pad,
                                packed_matmul_tiles)
        if retries_unfused(flags):
            log.warning("%s: iree-compile failed with the zero borders fused (%s); compiled again with them as "
                        "copies of their own", target, FUSE_PAD_FLAG)
            return compile_mlir(mlir, target, extra_flags, data_tiling, fuse_pad=False,
                                packed_matmul_tiles=packed_matmul_tiles)
        folder = failure_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{hashlib.sha256(mlir.encode()).hexdigest()[:16]}.mlir"
        path.write_text(mlir)
        command = shlex.join(["iree-compile", str(path), *flags, "-o", "/tmp/out.vmfb"])
        lines = [ln[:300] for ln in str(stderr).splitlines() if "error" in ln][:8] or str(stderr).splitlines()[-8:]
        raise CompileError(
            f"iree-compile failed for target {target}:\n  " + "\n  ".join(lines)
            + f"\nThe input was saved to {path}; reproduce with:\n  {command}"
        ) from None


# IREE's CPU device imports host memory only at this alignment ("imported heap buffer data must be aligned to 64")
HOST_ALIGNMENT = 64

# convdsl's dtype names -> (iree.runtime's element type name, bytes per element)
ELEMENT_TYPES = {"f32": ("FLOAT_32", 4), "f16": ("FLOAT_16", 2), "bf16": ("BFLOAT_16", 2)}


def _element_type(dtype: str):
    import iree.runtime as rt

    return getattr(rt.HalElementType, ELEMENT_TYPES[dtype][0])


# Free buffers IREE's caching allocator keeps per heap.  Its default, 64, fills up once a process has called
# kernels of a few dozen buffer sizes (every layer of a model has its own): each later release is then freed,
# each allocation asks the device again (docs/decisions.md#runtime-config).
CACHED_FREE_BUFFERS = 1024
# Allocator specs layered over each device's own allocator (iree-run-module's --device_allocator=): a caching
# allocator over the device-local heap ("<heap>=<largest size>;<bytes held>;<free buffers>", `*` = no limit),
# so that the allocating functions stop asking the device for result and workspace memory on every call.
DEVICE_ALLOCATORS: tuple[str, ...] = (f"caching:device_local=*;*;{CACHED_FREE_BUFFERS}",)


@functools.lru_cache(maxsize=None)
def runtime_config(driver: str):
    """One iree.runtime Config (one device) per driver and process, its device created with the
    DEVICE_ALLOCATORS (a caching allocator) over the driver's own.

    On CUDA and HIP, results and transients of the allocating functions come from stream-ordered pools unless
    `--cuda_async_allocations=false` (`--hip_async_allocations=false`) is set, a process-wide flag this
    library leaves to its user; the `$into` twin avoids per-call allocation on every driver.
    """
    import iree.runtime as rt

    try:
        device = rt.get_driver(driver).create_default_device(allocators=list(DEVICE_ALLOCATORS))
        return rt.Config(device=device)
    except RuntimeError as err:  # no such device here (no GPU, no driver): said in one line, not a traceback
        cause = str(err.__cause__ or err).strip().splitlines()
        raise TargetError(f"IREE's {driver} driver found no device to run on ({cause[-1] if cause else 'no detail'}): "
                          "run on a machine with one, or choose --target cpu") from err


def _owns_memory(array: np.ndarray) -> bool:
    """Whether the array's memory is NumPy's own (its base chain ends in an array that owns its data)."""
    while not array.flags.owndata:
        if not isinstance(array.base, np.ndarray):
            return False
        array = array.base
    return True


class _HostBuffer:
    """The owner of a host array of IREE memory: NumPy arrays made from it (np.asarray) have it as their base,
    and it holds what keeps the memory valid (the mapped array, the device array with its mapping)."""

    __slots__ = ("__array_interface__", "_keep")

    def __init__(self, host: np.ndarray, *keep: object) -> None:
        self.__array_interface__ = host.__array_interface__
        self._keep = (host, *keep)


@dataclass
class LoadedModule:
    """A compiled module bound to a device: call functions with NumPy arrays, get NumPy arrays back."""

    vmfb: bytes
    target: Target
    driver: Optional[str] = None

    def __post_init__(self) -> None:
        import iree.runtime as rt

        self._rt = rt
        self.config = runtime_config(self.driver or self.target.driver)
        self.context = rt.SystemContext(config=self.config)
        self.vm_module = rt.VmModule.copy_buffer(self.config.vm_instance, self.vmfb)
        self.context.add_vm_module(self.vm_module)
        self.module = self.context.modules.module
        self._functions: dict = {}  # name -> its iree.runtime FunctionInvoker (call_device)
        self._vm_functions: dict = {}  # name -> its VmFunction (call_views)
        # the NumPy dtypes import_view imports or copies itself (native byte order; bf16 goes through upload)
        self._element_types = {np.dtype(np.float32): rt.HalElementType.FLOAT_32,
                               np.dtype(np.float16): rt.HalElementType.FLOAT_16}
        # whether the device runs on the host's cores and memory (import_view imports host arrays there)
        self.host = (self.driver or self.target.driver) in HOST_DRIVERS

    @property
    def device(self):
        return self.config.device

    def upload(self, array: np.ndarray, bf16_words: bool = False):
        """Host array -> device array; bf16 goes up as raw 16-bit words with the bf16 element type: an
        ml_dtypes.bfloat16 array, or (`bf16_words`) the words themselves as 16-bit integers (no ml_dtypes)."""
        rt = self._rt
        array = np.ascontiguousarray(array)
        if array.dtype.name != "bfloat16" and not bf16_words:
            return rt.asdevicearray(self.device, array, implicit_host_transfer=True)
        buffer_view = self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT,
            device=self.device,
            buffer=array.view(np.uint16),
            element_type=rt.HalElementType.BFLOAT_16,
        )
        return rt.DeviceArray(self.device, buffer_view, implicit_host_transfer=True)

    def import_view(self, array: np.ndarray):
        """Host array -> buffer view for one call: on the CPU, an array IREE can import as it lies (C-contiguous,
        f32 or f16, writeable, its data on a HOST_ALIGNMENT boundary) is imported without a copy (the view reads
        the host memory: it must not change before the call returns); anything else is uploaded (a copy)."""
        element_type = self._element_types.get(array.dtype) if type(array) is np.ndarray else None
        if element_type is None or not array.flags.c_contiguous:
            return self.upload(array)._buffer_view
        if self.host and array.flags.writeable and array.__array_interface__["data"][0] % HOST_ALIGNMENT == 0:
            # no copy: a 3.6 MB input's took about 100 us beside the 360 us of MobileNetV2's depthwise grad_input
            return self.device.from_dlpack_capsule(array.__dlpack__())
        # the copy itself, without asdevicearray's wrapping (a device array made and dropped)
        rt = self._rt
        return self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=self.device,
            buffer=array, element_type=element_type)

    def call_views(self, name: str, views: Sequence):
        """The allocating function `name` on buffer views (import_view), invoked directly: its result's buffer
        view.  iree.runtime's FunctionInvoker packs and unpacks through reflection, about 10 us a call."""
        function = self._vm_functions.get(name)
        if function is None:
            function = self._vm_functions[name] = self.vm_module.lookup_function(name)
        rt = self._rt
        arguments = rt.VmVariantList(len(views))
        for view in views:
            arguments.push_ref(view)
        results = rt.VmVariantList(1)
        self.context.vm_context.invoke(function, arguments, results)
        return results.get_as_object(0, rt.HalBufferView)

    def host_result(self, view, out_dtype: Optional[str] = None) -> np.ndarray:
        """A result buffer view -> host array: on the CPU its memory mapped (no copy; download's _HostBuffer owns
        the mapping), else download_view."""
        if not self.host or out_dtype == "bf16":
            return self.download_view(view, out_dtype)
        mapped = view.map()
        host = mapped.asarray(view.shape, self._rt.HalElementType.map_to_dtype(view.element_type))
        return np.asarray(_HostBuffer(host, mapped, view))

    def call(self, name: str, *args, out_dtype: Optional[str] = None) -> np.ndarray:
        result = self.call_device(name, *args)
        return self.download(result, out_dtype)

    def call_device(self, name: str, *args):
        fn = self._functions.get(name)
        if fn is None:  # iree.runtime makes a new invoker (reflection parsed again) on every lookup: one per name
            fn = self._functions[name] = self.module[name]
        return fn(*[a if isinstance(a, self._rt.DeviceArray) else self.upload(a) for a in args])

    def download(self, result, out_dtype: Optional[str] = None) -> np.ndarray:
        """A device result -> host array, without a copy where the buffer is host-visible (the CPU).

        iree.runtime's host array of a mapped buffer keeps the mapping alive only while that very array
        lives (a weak reference to it), and NumPy hands its views that array's own base: a view outlives
        the mapping (freed memory).  The array returned here has an owner, _HostBuffer, as its base, which
        holds the mapping and the device array, so every view keeps the buffer alive."""
        if out_dtype != "bf16":
            host = result.to_host()
            return host if _owns_memory(host) else np.asarray(_HostBuffer(host, result))
        import ml_dtypes

        return self.download_bf16_words(result).view(ml_dtypes.bfloat16)

    def download_bf16_words(self, result) -> np.ndarray:
        """A bf16 device array's raw 16-bit words, as uint16.  NumPy has no bf16: view the same buffer as
        16-bit words and copy those to the host (mapping the buffer instead works on the CPU but not for CUDA's
        device-local memory)."""
        rt = self._rt
        view = result._buffer_view
        raw = rt.HalBufferView(view.get_buffer(), list(view.shape), rt.HalElementType.UINT_16)
        return np.array(rt.DeviceArray(self.device, raw, implicit_host_transfer=True).to_host(), copy=True)

    def allocate_result(self, shape: Sequence[int], dtype: str):
        """A result buffer view of this shape and dtype on the module's device, for a destination-passing call."""
        return allocate_result(self.device, shape, _element_type(dtype), ELEMENT_TYPES[dtype][1])

    def into_call(self, name: str, device_args: Sequence, out_shape: Sequence[int], out_dtype: str,
                  wait: Optional[str] = None):
        """A reusable destination-passing call of kernel `name` (convdsl/abi.py): `call.call(call.pack(views))`
        writes the result into `call.out`, a buffer allocated once, with a workspace allocated once.  wait: how
        a call waits (IntoCall); by default it blocks on the CPU and polls on a GPU (into_call.default_wait)."""
        out = self.allocate_result(out_shape, out_dtype)
        return IntoCall(self.context, self.vm_module, name, [a._buffer_view for a in device_args], out,
                        wait=wait or default_wait(self.driver or self.target.driver))

    def download_view(self, view, out_dtype: Optional[str] = None) -> np.ndarray:
        """A result buffer view (e.g. IntoCall.out) -> host array."""
        return self.download(self._rt.DeviceArray(self.device, view, implicit_host_transfer=True), out_dtype)

    def time(self, name: str, args: Sequence, repeat: int = 20, warmup: int = 3,
             out_shape: Optional[Sequence[int]] = None, out_dtype: Optional[str] = None) -> float:
        """Median seconds per call; each call returns after the device finished (IntoCall's polled fence, or
        the allocating function's synchronous ABI).

        Given the result's shape and dtype, the destination-passing twin is timed (result buffer and
        workspace allocated once, as a framework keeps them: convdsl/abi.py), else the allocating function.
        """
        if (out_shape is None) != (out_dtype is None):
            raise ValueError("time: give the result's out_shape and out_dtype together, or neither")
        dev_args = [self.upload(a) for a in args]
        if out_shape is not None and self.vm_module.lookup_function(name + INTO_SUFFIX) is not None:
            into = self.into_call(name, dev_args, out_shape, out_dtype)
            packed = into.pack([a._buffer_view for a in dev_args])
            one = lambda: into.call(packed)  # noqa: E731
        else:
            fn = self.module[name]
            one = lambda: fn(*dev_args)  # noqa: E731
        for _ in range(warmup):
            one()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))
