"""Compiled kernels on framework tensors, without copies: DLPack import plus the destination-passing twin.

    mod = convdsl.compile("examples/resnext.conv", target="cuda")
    dx = convdsl.interop.torch_call(mod, "dgrad", dy, w)       # torch CUDA tensors in, a torch tensor out
    dgrad = DLPackKernel(mod, "dgrad"); dgrad(dy, w, out=dx)   # any __dlpack__ tensors, into your buffer

Arguments and result are imported into IREE through DLPack (`HalDevice.from_dlpack_capsule`: IREE reads and
writes the framework's memory), and the kernel's `$into` twin (convdsl/abi.py) writes the result into `out`
with a workspace that is allocated once per argument shapes (bit-identical to the usual call).

Host memory: IREE's CPU device imports only memory that starts on a 64-byte boundary (HOST_ALIGNMENT), which
NumPy does not promise.  A misaligned CPU argument is copied into aligned memory first, and a misaligned `out` is
computed into aligned memory and copied back (a copy each call): allocate with `empty` (64-byte aligned) to
avoid both.  `out` may not share memory with an argument (the kernel would read what it already wrote).

Ordering: IREE runs on its own CUDA stream.  Before a call the framework's current stream is synchronised
(so IREE reads finished inputs); the call returns after IREE's work is done (IntoCall waits for the fence of the
`$into$async` twin, or the synchronous `$into` blocks), so the framework may use `out` at once.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from .backends.into_call import HOST_DRIVERS, IntoCall, default_wait
from .backends.iree import HOST_ALIGNMENT  # IREE's CPU device imports host memory only at this alignment
from .module import concrete_problem

# DLPack device types (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_ROCM = 1, 2, 3, 10
DRIVER_DEVICE_TYPES = {"local-task": (KDL_CPU, KDL_CUDA_HOST), "local-sync": (KDL_CPU, KDL_CUDA_HOST),
                       "cuda": (KDL_CUDA,), "hip": (KDL_ROCM,)}
DTYPE_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# PyTorch's intra-op threads (OpenMP; libgomp waits by spinning) spin for milliseconds after each parallel op, on
# the cores IREE's local-task workers then run a kernel on, and the kernel waits for the worker that shares a core
# with them: the first CPU kernel call on torch tensors caps PyTorch's threads at this many (0 leaves them; a
# later torch.set_num_threads is the caller's choice): docs/decisions.md#cpu-torch-threads
TORCH_CPU_THREADS_ENV = "CONVDSL_TORCH_CPU_THREADS"
DEFAULT_TORCH_CPU_THREADS = 1
# the default cap applies on machines of at most this many cores (where it was measured to pay); on more, one
# thread would slow PyTorch's own ops by more than the kernels gain, unmeasured: the default leaves them
CAPPED_MOST_CORES = 4

log = logging.getLogger("convdsl.interop")


def empty(shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised NumPy array whose data starts on a HOST_ALIGNMENT boundary: DLPackKernel imports it
    on the CPU without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % HOST_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


class InteropError(TypeError):
    """A tensor handed to a kernel has the wrong shape, dtype, device or memory order (names the argument)."""


def _dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, name)


def _contiguous(t: Any) -> bool:
    if hasattr(t, "is_contiguous"):
        return bool(t.is_contiguous())
    flags = getattr(t, "flags", None)
    return bool(flags["C_CONTIGUOUS"]) if flags is not None else True


def _host_array(t: Any) -> Optional[np.ndarray]:
    """A NumPy view of a host tensor's memory (NumPy arrays themselves; others through DLPack), or None."""
    if isinstance(t, np.ndarray):
        return t
    try:
        return np.from_dlpack(t)
    except (TypeError, ValueError, RuntimeError, BufferError):
        return None


def _span(t: Any) -> Optional[tuple[int, int, int]]:
    """(DLPack device type, first byte, end byte) of a contiguous tensor's memory, or None where it cannot be
    told (then overlap is not checked)."""
    device_type = t.__dlpack_device__()[0]
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch, on any device
        start, size = int(t.data_ptr()), int(t.numel()) * int(t.element_size())
    elif hasattr(t, "__array_interface__"):
        interface = t.__array_interface__
        start, size = int(interface["data"][0]), int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
    else:
        return None
    return device_type, start, start + size


def _synchronize_producers(tensors) -> None:
    """Let the framework finish the work that produces (or last reads) these tensors: torch's current stream."""
    for t in tensors:
        if getattr(t, "is_cuda", False):
            import torch

            torch.cuda.current_stream(t.device).synchronize()
            return


# the call signatures a kernel keeps (a program that calls with ever new shapes only refills them)
SIGNATURES_KEPT = 256


def _signature(tensors) -> Optional[tuple]:
    """What a call's checks depend on, per tensor: its type, shape, strides, dtype and device (torch: and whether
    it requires grad, which its DLPack export refuses); None where a tensor is neither a torch tensor nor a NumPy
    array (such calls are checked every time)."""
    torch = sys.modules.get("torch")
    tensor_type = torch.Tensor if torch is not None else None
    key = []
    for t in tensors:
        kind = type(t)
        if kind is tensor_type:
            key.append((kind, t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        elif kind is np.ndarray:
            key.append((kind, t.shape, t.strides, t.dtype))
        else:
            return None
    return tuple(key)


def _pointer(t: Any) -> int:
    """The first byte of a torch tensor's or NumPy array's memory."""
    return t.data_ptr() if hasattr(t, "data_ptr") else t.__array_interface__["data"][0]


def _nbytes(t: Any) -> Optional[int]:
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
        return int(t.numel()) * int(t.element_size())
    return int(t.nbytes) if isinstance(t, np.ndarray) else None


def _device_of(t: Any) -> int:
    return int(t.__dlpack_device__()[0])


def _exporter(t: Any):
    """A faster way to t's DLPack capsule than `t.__dlpack__()`, or None: a plain CPU torch tensor's is
    torch._C._to_dlpack itself (what __dlpack__ calls after its checks, which the tensor's signature already
    passed; about 1.5 us a tensor less)."""
    torch = sys.modules.get("torch")
    if torch is not None and type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad:
        return getattr(torch._C, "_to_dlpack", None)
    return None


class _Plan:
    """A checked call signature: its concrete problem, each tensor's capsule exporter, size and DLPack device
    type, and its destination-passing call once made."""

    __slots__ = ("concrete", "host", "exports", "nbytes", "devices", "names", "result_name", "call")

    def __init__(self, concrete, host: bool, exports: list, nbytes: list, devices: list) -> None:
        self.concrete, self.host, self.exports, self.nbytes, self.devices = concrete, host, exports, nbytes, devices
        self.names, self.result_name = tuple(concrete.arg_names), concrete.result_name
        self.call: Optional[IntoCall] = None

    def check_no_overlap(self, pointers: Sequence[int]) -> None:
        """DLPackKernel._check_no_overlap on the pointers of a call of this signature."""
        start, end = pointers[-1], pointers[-1] + self.nbytes[-1]
        for name, ptr, size, device in zip(self.names, pointers, self.nbytes, self.devices):
            if device == self.devices[-1] and ptr < end and start < ptr + size:
                raise InteropError(f"{self.concrete.name}: out ({self.result_name!r}) shares memory with argument "
                                   f"{name!r}; expected a separate output tensor")


class DLPackKernel:
    """One kernel of a compiled module, called on tensors that support DLPack (`__dlpack__`)."""

    def __init__(self, module, name: str) -> None:
        self.module = module
        self.kernel = module[name]
        self.problem = self.kernel.problem
        self._calls: dict[tuple, Any] = {}
        # per call signature (every tensor's type, shape, strides, dtype, device): its checks passed once, and what
        # its calls reuse (docs/decisions.md#cpu-torch-threads: the per-call checks and imports took 1.6-2.2 ms a
        # training step); signature_hits counts the calls that took a known signature
        self._plans: dict[tuple, _Plan] = {}
        self.signature_hits = 0

    def result_shape(self, *args: Any) -> tuple[int, ...]:
        return self._concrete(args).result_shape

    def _concrete(self, args):
        p = self.problem
        if len(args) != len(p.arg_names):
            raise InteropError(f"{p.name}({', '.join(p.arg_names)}): expected {len(p.arg_names)} tensors, got {len(args)}")
        return concrete_problem(p, args)

    def _check(self, args, out) -> Any:
        concrete = self._concrete(args)
        named = [*zip(concrete.arg_names, concrete.arg_shapes, concrete.arg_dtypes, args),
                 (concrete.result_name, concrete.result_shape, concrete.result_dtype, out)]
        accepted = DRIVER_DEVICE_TYPES.get(self.module.target.driver, ())
        for name, shape, dtype, t in named:
            if not hasattr(t, "__dlpack__"):
                raise InteropError(f"{concrete.name}: argument {name!r} must support DLPack (__dlpack__), "
                                   f"got {type(t).__name__}")
            if tuple(t.shape) != tuple(shape):
                raise InteropError(f"{concrete.name}: argument {name!r} expected shape {list(shape)}, "
                                   f"got {list(t.shape)}")
            if _dtype_name(t) != dtype:
                raise InteropError(f"{concrete.name}: argument {name!r} expected dtype {dtype}, got {t.dtype}")
            if not _contiguous(t):
                raise InteropError(f"{concrete.name}: argument {name!r} must be contiguous (row-major in the "
                                   f"kernel's layout); call .contiguous() first")
            device_type = t.__dlpack_device__()[0]
            if accepted and device_type not in accepted:
                raise InteropError(f"{concrete.name}: argument {name!r} lives on DLPack device type {device_type}, "
                                   f"but the module runs on {self.module.target} (device types {list(accepted)})")
        self._check_no_overlap(concrete, args, out)
        return concrete

    @staticmethod
    def _check_no_overlap(concrete, args, out) -> None:
        """The kernel writes `out` while it reads the arguments: shared memory would give a wrong result."""
        out_span = _span(out)
        if out_span is None:
            return
        for name, t in zip(concrete.arg_names, args):
            span = _span(t)
            if span is not None and span[0] == out_span[0] and span[1] < out_span[2] and out_span[1] < span[2]:
                raise InteropError(f"{concrete.name}: out ({concrete.result_name!r}) shares memory with argument "
                                   f"{name!r}; expected a separate output tensor")

    def _import(self, name: str, t: Any, export: Optional[Any] = None):
        device = self.module.loaded.device
        try:
            return device.from_dlpack_capsule(export(t) if export is not None else t.__dlpack__())
        except Exception as err:  # noqa: BLE001 - IREE maps its status codes to several exception types
            raise InteropError(f"{self.problem.name}: IREE could not import argument {name!r}: "
                               f"{str(err).splitlines()[0]}") from None

    def __call__(self, *args: Any, out: Any) -> Any:
        """Compute into `out` (a tensor of the result's shape and dtype) and return it."""
        key = _signature((*args, out))
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            plan = self._plan(args, out, key)
        else:
            # a signature checked before: only what can change between calls of it (memory) is looked at
            self.signature_hits += 1
            pointers = [_pointer(t) for t in (*args, out)]
            plan.check_no_overlap(pointers)
            if plan.host and plan.call is not None and not any(ptr % HOST_ALIGNMENT for ptr in pointers):
                views = [self._import(n, t, e) for n, t, e in zip(plan.names, args, plan.exports)]
                plan.call.call(plan.call.pack(views, out=self._import(plan.result_name, out, plan.exports[-1])))
                return out
        return self._run(plan, args, out)

    def _plan(self, args, out, key) -> "_Plan":
        """The checks of a new signature, and what its later calls reuse (kept where the signature is known)."""
        concrete = self._check(args, out)
        tensors = (*args, out)
        host = self.module.target.driver in HOST_DRIVERS
        plan = _Plan(concrete, host, [_exporter(t) for t in tensors], [_nbytes(t) for t in tensors],
                     [_device_of(t) for t in tensors])
        if key is not None:
            if len(self._plans) >= SIGNATURES_KEPT:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _run(self, plan: "_Plan", args, out) -> Any:
        """A call through the general path: producers synchronised, misaligned host memory through aligned copies."""
        concrete = plan.concrete
        _synchronize_producers([*args, out])
        # misaligned host memory goes through aligned copies (see the module's docstring)
        given = args
        args = [self._aligned(n, t, False) if plan.host else t for n, t in zip(concrete.arg_names, args)]
        target = self._aligned(concrete.result_name, out, True) if plan.host else out
        views = [self._import(n, t, e if t is g else None)
                 for n, t, g, e in zip(concrete.arg_names, args, given, plan.exports)]
        out_view = self._import(concrete.result_name, target, plan.exports[-1] if target is out else None)
        if plan.call is None:
            plan.call = self._into_call(views, out_view)
        plan.call.call(plan.call.pack(views, out=out_view))
        if target is not out:
            _host_array(out)[...] = target
        return out

    def _into_call(self, views, out_view) -> IntoCall:
        key = tuple(tuple(v.shape) for v in views)
        call = self._calls.get(key)
        if call is None:
            loaded = self.module.loaded
            call = self._calls[key] = IntoCall(loaded.context, loaded.vm_module, self.problem.name, views, out_view,
                                               wait=default_wait(self.module.target.driver))
        return call

    def _aligned(self, name: str, t: Any, is_out: bool) -> Any:
        """`t` itself where its host memory is aligned for IREE's import, else an aligned copy (of `out`: an
        aligned array to compute into, copied back by the caller)."""
        array = _host_array(t)
        if array is None or array.__array_interface__["data"][0] % HOST_ALIGNMENT == 0:
            return t
        if is_out and not array.flags.writeable:
            raise InteropError(f"{self.problem.name}: argument {name!r} is not aligned to {HOST_ALIGNMENT} bytes "
                               "and cannot be written through NumPy; allocate it with convdsl.interop.empty")
        copy = empty(array.shape, array.dtype)
        if not is_out:
            copy[...] = array
        return copy


def torch_cpu_threads() -> int:
    """The most intra-op threads PyTorch keeps once a CPU kernel ran on torch tensors (TORCH_CPU_THREADS_ENV;
    by default DEFAULT_TORCH_CPU_THREADS on machines of at most CAPPED_MOST_CORES cores, else no cap; 0: no cap)."""
    value = os.environ.get(TORCH_CPU_THREADS_ENV, "").strip()
    if value:
        return int(value)
    return DEFAULT_TORCH_CPU_THREADS if (os.cpu_count() or 1) <= CAPPED_MOST_CORES else 0


_torch_threads_capped = False


def cap_torch_threads() -> None:
    """Once per process: PyTorch's intra-op threads capped at torch_cpu_threads() (see TORCH_CPU_THREADS_ENV)."""
    global _torch_threads_capped
    if _torch_threads_capped:
        return
    _torch_threads_capped = True
    import torch

    limit, threads = torch_cpu_threads(), torch.get_num_threads()
    if 0 < limit < threads:
        torch.set_num_threads(limit)
        log.info("PyTorch's intra-op threads %d -> %d while IREE's CPU workers run convdsl's kernels (%s=0 leaves "
                 "them)", threads, limit, TORCH_CPU_THREADS_ENV)


def dlpack_kernel(module, name: str) -> DLPackKernel:
    """The module's DLPackKernel of `name`, one per module and kernel (it keeps its checked call signatures)."""
    kernels = module.__dict__.setdefault("_dlpack_kernels", {})
    return kernels.get(name) or kernels.setdefault(name, DLPackKernel(module, name))


def torch_call(module, name: str, *tensors: Any, out: Optional[Any] = None) -> Any:
    """`name`'s kernel on torch tensors (on the module's device), into `out` or a new tensor.  The first call on
    the CPU caps PyTorch's intra-op threads (cap_torch_threads)."""
    import torch

    if not _torch_threads_capped and module.target.driver in HOST_DRIVERS:
        cap_torch_threads()  # their spinning took the IREE workers' cores (docs/decisions.md#cpu-torch-threads)
    kernel = dlpack_kernel(module, name)
    if out is None:
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kernel.problem.result_dtype]
        out = torch.empty(kernel.result_shape(*tensors), dtype=dtype, device=tensors[0].device)
    return kernel(*tensors, out=out)


__all__ = ["DLPackKernel", "InteropError", "cap_torch_threads", "dlpack_kernel", "empty", "torch_call",
           "torch_cpu_threads"]
