"""The CUDA driver API through ctypes: load a compiled kernel and launch it on a stream that the caller owns.

Only `libcuda` is needed (no CUDA runtime, no Triton, no framework), so kernels compiled ahead of time run
on any machine with an NVIDIA driver.  The caller passes the raw `CUstream` handle of its own stream
(PyTorch: `torch.cuda.current_stream().cuda_stream`), so launches are ordered with its other work, return
at once, and are captured by CUDA graphs like any other launch on that stream.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# cuFuncSetAttribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED = 8
# a block may take 48 KiB of dynamic shared memory without asking for more
_DEFAULT_SHARED_LIMIT = 48 * 1024


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as err:
                raise CudaDriverError(f"the CUDA driver (libcuda.so.1) could not be loaded: {err}") from err
            lib.cuLaunchKernel.argtypes = [
                ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cuLaunchKernel.restype = ctypes.c_int
            _check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


# CUDA_ERROR_INVALID_CONTEXT: a thread with no current context; autograd's device threads have none until the
# runtime API makes one current, which a backward whose first launch is ours has not done yet
_INVALID_CONTEXT = 201


def _check(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise CudaDriverError(f"{call} failed: {name.value.decode() if name.value else status}")


def _ensure_context(device: int) -> None:
    """Make the device's primary context current on this thread (the one PyTorch and the runtime API use)."""
    lib = _driver()
    current = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value:
        return
    handle, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib, lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "cuDevicePrimaryCtxRetain")
    _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@dataclass
class LoadedFunction:
    """One kernel entry point, loaded in the current context: launch it with `launch`."""

    name: str
    handle: ctypes.c_void_p
    threads: int
    shared_bytes: int
    params: int
    device: int = 0

    def __post_init__(self) -> None:
        # one 8-byte slot per parameter, reused by every launch: the driver copies the values at launch time
        self._slots = [ctypes.c_uint64(0) for _ in range(self.params)]
        self._pointers = (ctypes.c_void_p * self.params)(
            *[ctypes.cast(ctypes.byref(s), ctypes.c_void_p) for s in self._slots])
        self._launch = _driver().cuLaunchKernel

    def launch(self, grid: tuple[int, int, int], stream: int, pointers: Sequence[int]) -> None:
        """Queue the kernel on `stream` (a CUstream handle) with these device pointers; the parameters after
        them (Triton's scratch pointers, never read: scratch size 0) are passed as 0."""
        self.bind(grid)(stream, pointers)

    def bind(self, grid: tuple[int, int, int]) -> Callable[[int, Sequence[int]], None]:
        """launch with `grid` fixed: its arguments converted to C once, not at every call."""
        fixed = (self.handle, *(ctypes.c_uint(v) for v in (*grid, self.threads, 1, 1, self.shared_bytes)))
        slots, parameters, driver_launch, name, device = (self._slots, self._pointers, self._launch, self.name,
                                                          self.device)

        def launch(stream: int, pointers: Sequence[int]) -> None:
            for slot, pointer in zip(slots, pointers):
                slot.value = pointer
            status = driver_launch(*fixed, stream, parameters, None)
            if status == _INVALID_CONTEXT:
                _ensure_context(device)
                status = driver_launch(*fixed, stream, parameters, None)
            if status != 0:
                _check(_driver(), status, f"cuLaunchKernel({name})")

        return launch


# --- TMA descriptors (CUtensorMap), made on the host and passed to a kernel by value --------------------------

# CUtensorMapDataType by element type; CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
# CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (reads past a tensor's bounds give zeros)
# CUtensorMapDataType: "tf32" is TFLOAT32, f32 in memory rounded to TF32 by the copy; fp8 copies as UINT8
TENSOR_MAP_TYPES = {"fp16": 6, "bf16": 9, "fp32": 7, "tf32": 11, "fp8e4nv": 0, "fp8e5": 0}
_INTERLEAVE, _L2_PROMOTION, _OOB_FILL = 0, 2, 0
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), 64-byte aligned


@dataclass(frozen=True)
class TensorMapArguments:
    """One map's arguments to cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col but the address, as the driver
    takes them (innermost dimension first): what a launcher in another language needs to encode it."""

    im2col: bool
    data_type: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, dims[1:]'s
    box: tuple[int, ...]  # tiled: the box per copy
    element_strides: tuple[int, ...]
    lower: tuple[int, ...] = ()  # im2col: the pixel box's corners
    upper: tuple[int, ...] = ()
    channels: int = 0
    pixels: int = 0
    swizzle: int = 0


class TensorMaps:
    """Room for `count` CUtensorMaps (each 64-byte aligned, as the driver requires), filled in place.  Each map is
    described once (prepare_tiled, prepare_im2col: its arguments converted to C then) and encoded over a new
    tensor address per call (encode): only the address changes between a training step's calls."""

    def __init__(self, count: int) -> None:
        self._raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES * count + 64)
        base = ctypes.addressof(self._raw)
        self.addresses = [base + (-base) % 64 + i * TENSOR_MAP_BYTES for i in range(count)]
        self._pointers = [ctypes.c_void_p(0) for _ in range(count)]
        self._encoders: list[Optional[Callable[[], int]]] = [None] * count
        self._what = [""] * count
        self.arguments: list[Optional[TensorMapArguments]] = [None] * count

    def prepare_tiled(self, index: int, element: str, shape: Sequence[int], element_bytes: int,
                      box: Sequence[int], swizzle: int) -> None:
        """Map `index`: a contiguous tensor viewed as `shape` (outermost first), `box` per copy."""
        strides = _contiguous_byte_strides(shape, element_bytes)
        m = TensorMapArguments(False, TENSOR_MAP_TYPES[element], tuple(shape[::-1]), tuple(strides[:-1][::-1]),
                               tuple(box[::-1]), (1,) * len(shape), swizzle=swizzle)
        args = (ctypes.c_void_p(self.addresses[index]), m.data_type, len(m.dims), self._pointers[index],
                _array(ctypes.c_uint64, m.dims), _array(ctypes.c_uint64, m.strides), _array(ctypes.c_uint32, m.box),
                _array(ctypes.c_uint32, m.element_strides), _INTERLEAVE, m.swizzle, _L2_PROMOTION, _OOB_FILL)
        encode = _driver().cuTensorMapEncodeTiled
        self.arguments[index] = m
        self._encoders[index] = lambda: encode(*args)
        self._what[index] = f"cuTensorMapEncodeTiled(shape {list(shape)}, box {list(box)})"

    def prepare_im2col(self, index: int, element: str, shape: Sequence[int], element_bytes: int,
                       lower: Sequence[int], upper: Sequence[int], element_strides: Sequence[int], pixels: int,
                       channels: int, swizzle: int) -> None:
        """Map `index`: an im2col view of a channels-last tensor of `shape` (N, *spatial, C): copies of `pixels` x
        `channels` within the pixel box [lower, spatial + upper) per spatial dimension."""
        strides = _contiguous_byte_strides(shape, element_bytes)
        m = TensorMapArguments(True, TENSOR_MAP_TYPES[element], tuple(shape[::-1]), tuple(strides[:-1][::-1]), (),
                               tuple(element_strides[::-1]), tuple(lower[::-1]), tuple(upper[::-1]), channels,
                               pixels, swizzle)
        args = (ctypes.c_void_p(self.addresses[index]), m.data_type, len(m.dims), self._pointers[index],
                _array(ctypes.c_uint64, m.dims), _array(ctypes.c_uint64, m.strides), _array(ctypes.c_int, m.lower),
                _array(ctypes.c_int, m.upper), m.channels, m.pixels, _array(ctypes.c_uint32, m.element_strides),
                _INTERLEAVE, m.swizzle, _L2_PROMOTION, _OOB_FILL)
        encode = _driver().cuTensorMapEncodeIm2col
        self.arguments[index] = m
        self._encoders[index] = lambda: encode(*args)
        self._what[index] = f"cuTensorMapEncodeIm2col(shape {list(shape)}, box {list(lower)}..{list(upper)})"

    def encode(self, index: int, pointer: int) -> None:
        """Map `index` as prepared, over the tensor at `pointer`."""
        self._pointers[index].value = pointer
        status = self._encoders[index]()
        if status != 0:
            _check(_driver(), status, self._what[index])


def _contiguous_byte_strides(shape: Sequence[int], element_bytes: int) -> list[int]:
    strides = [element_bytes] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def _array(ctype, values: Sequence[int]):
    return (ctype * len(values))(*values)


def bind_raw(function: "LoadedFunction", grid: tuple[int, int, int], parameters) -> Callable[[int], None]:
    """launch(stream) queueing `function` on `grid` with a prepared parameter array (pointers to each
    parameter's bytes, which the caller fills in place), its arguments converted to C once."""
    fixed = (function.handle, *(ctypes.c_uint(v) for v in (*grid, function.threads, 1, 1, function.shared_bytes)))
    driver_launch, name, device = _driver().cuLaunchKernel, function.name, function.device

    def launch(stream: int) -> None:
        status = driver_launch(*fixed, stream, parameters, None)
        if status == _INVALID_CONTEXT:
            _ensure_context(device)
            status = driver_launch(*fixed, stream, parameters, None)
        if status != 0:
            _check(_driver(), status, f"cuLaunchKernel({name})")

    return launch


def load_function(image: bytes, kind: str, name: str, threads: int, shared_bytes: int, params: int,
                  device: int = 0) -> LoadedFunction:
    """Load a cubin or PTX image (`kind`; the driver JIT-compiles PTX for the device) and get its entry point."""
    lib = _driver()
    _ensure_context(device)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    data = image + b"\0" if kind == "ptx" else image  # PTX is read as a NUL-terminated string
    _check(lib, lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(data)), f"cuModuleLoadData({name})")
    _check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
           f"cuModuleGetFunction({name})")
    if shared_bytes > _DEFAULT_SHARED_LIMIT:
        _check(lib, lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, shared_bytes),
               f"cuFuncSetAttribute({name}, max dynamic shared memory {shared_bytes})")
    return LoadedFunction(name, function, threads, shared_bytes, params, device)
