"""Stream kernels (convdsl/stream.py) run on PyTorch's current CUDA stream.

A call queues its work and returns: no host synchronisation, results and workspace (split-K partials, fp8
roundings, NHWGC copies) from PyTorch's caching allocator, every step ordered on the caller's stream and
capturable in a CUDA graph.  The kernels are launched through the CUDA driver (backends/cuda_driver.py), so
the Triton that PyTorch brings is not used and need not match the one that compiled them.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Optional, Sequence

import torch

from ..backends.cuda_driver import TENSOR_MAP_BYTES, LoadedFunction, TensorMaps, bind_raw, load_function
from ..kernels.launch import TmaMap
from ..problem import activation_axes, weight_axes
from ..stream import StreamKernel, StreamLaunch

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# the launches' Triton element types of the staged copies (kernels/launch.flat_elements)
TORCH_ELEMENTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                  "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
# every binding of the kernels starts 16-byte aligned (kernels/launch.POINTER_ALIGNMENT)
ALIGNMENT = 16
# the TMA descriptors a launch keeps per map, by tensor address (TmaDriverLaunch)
ENCODED_PER_MAP = 16

try:  # the current stream's raw handle without building a Stream object (a few microseconds a call)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - other PyTorch builds
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _permutation(src: Sequence[str], dst: Sequence[str]) -> list[int]:
    return [list(src).index(a) for a in dst]


def _bindable(a: torch.Tensor) -> torch.Tensor:
    """`a` itself where a kernel can bind it (contiguous, ALIGNMENT-aligned), else a contiguous aligned copy."""
    if a.is_contiguous() and a.data_ptr() % ALIGNMENT == 0:
        return a
    return a.contiguous() if not a.is_contiguous() else a.clone()


# A launch as the runner calls it: (stream handle, tensors in binding order) -> None
Launcher = Callable[..., None]

# a native Program's parameter kinds (convdsl/torch/csrc/native.cpp): a buffer's address, a TMA descriptor, zero
_NATIVE_POINTER, _NATIVE_MAP, _NATIVE_ZERO = 0, 1, 2
# the memory formats' codes in a native Program
NATIVE_FORMATS = {torch.contiguous_format: 0, torch.channels_last: 1, torch.channels_last_3d: 2}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DriverLaunch:
    """A stream launch loaded through the CUDA driver: its tensors passed as device pointers."""

    def __init__(self, sl: StreamLaunch, device: int) -> None:
        b = sl.binary
        self.grid = sl.launch.grid
        self.function: LoadedFunction = load_function(b.data, b.kind, b.name, b.threads, b.shared_bytes, b.params,
                                                      device)
        self._launch = self.function.bind(self.grid)

    def __call__(self, stream: int, *tensors: torch.Tensor) -> None:
        self._launch(stream, [t.data_ptr() for t in tensors])

    def add_to(self, native, program, buffers: Sequence[int]) -> None:
        """This launch on the program's `buffers` (as __call__'s tensors), the kernel's other parameters 0;
        native: the extension module (convdsl/torch/native.py)."""
        f = self.function
        params = [(_NATIVE_POINTER, b) for b in buffers] + [(_NATIVE_ZERO, 0)] * (f.params - len(buffers))
        program.launch(f.handle.value, self.grid, f.threads, f.shared_bytes, f.name, params, [])


class TmaDriverLaunch:
    """A TMA launch (kernels/tma.py) loaded through the CUDA driver.  Its descriptors are made over the tensors
    of each call (operands, then the result) in a parameter block kept by the launch, each re-made only when its
    tensor's address changed (a training loop's tensors mostly come back at the same addresses; each map's
    shape, strides and box are converted to C once); the driver copies the block at every launch, so a CUDA
    graph keeps the descriptors of its capture."""

    _ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp8e4nv": 1, "fp8e5": 1}

    def __init__(self, sl: StreamLaunch, maps: Sequence[TmaMap], kinds: Sequence[str], device: int) -> None:
        b = sl.binary
        self.grid = sl.launch.grid
        self.function: LoadedFunction = load_function(b.data, b.kind, b.name, b.threads, b.shared_bytes, b.params,
                                                      device)
        self.maps = tuple(maps)
        self.tensor_maps = TensorMaps(len(self.maps))
        for i, m in enumerate(self.maps):
            element = "tf32" if m.round_tf32 else sl.launch.pointer_types[m.operand]
            size = self._ELEMENT_BYTES[element]
            if m.im2col:
                self.tensor_maps.prepare_im2col(i, element, m.shape, size, m.lower, m.upper, m.element_strides,
                                                m.box[0], m.box[1], m.swizzle)
            else:
                self.tensor_maps.prepare_tiled(i, element, m.shape, size, m.box, m.swizzle)
        self._operands = [m.operand for m in self.maps]
        self._addresses: list[Optional[int]] = [None] * len(self.maps)
        # per map, the descriptors already encoded, by tensor address: a training loop's tensors come back at a few
        # addresses (PyTorch's caching allocator), and copying a descriptor's 128 bytes costs far less host time
        # than encoding it again
        self._encoded: list[dict[int, bytes]] = [{} for _ in self.maps]
        # the maps' bytes in place; an operand no map reads ("ptr<i>") as its device address, set per call; every
        # other parameter (a map's shape and strides, which the kernel does not read, and Triton's scratch
        # pointers, size 0) passed as zero
        self._zeros = [ctypes.c_uint64(0) for _ in kinds]
        self._pointers = [(int(kind[3:]), value) for kind, value in zip(kinds, self._zeros) if kind.startswith("ptr")]
        slots, it = [], iter(self.tensor_maps.addresses)
        for kind, zero in zip(kinds, self._zeros):
            slots.append(next(it) if kind == "map" else ctypes.addressof(zero))
        self._params = (ctypes.c_void_p * len(slots))(*slots)
        self._launch = bind_raw(self.function, self.grid, self._params)
        self._kinds = tuple(kinds)

    def add_to(self, native, program, buffers: Sequence[int]) -> None:
        """This launch on the program's `buffers` (as __call__'s tensors): its descriptors encoded over them per
        call by the program; native: the extension module (convdsl/torch/native.py)."""
        maps = [native.TensorMapSpec(buffers[operand], m.im2col, m.data_type, m.dims, m.strides, m.box,
                                     m.element_strides, m.lower, m.upper, m.channels, m.pixels, m.swizzle)
                for operand, m in zip(self._operands, self.tensor_maps.arguments)]
        params, next_map = [], 0
        for kind in self._kinds:
            if kind == "map":
                params.append((_NATIVE_MAP, next_map))
                next_map += 1
            elif kind.startswith("ptr"):
                params.append((_NATIVE_POINTER, buffers[int(kind[3:])]))
            else:
                params.append((_NATIVE_ZERO, 0))
        f = self.function
        program.launch(f.handle.value, self.grid, f.threads, f.shared_bytes, f.name, params, maps)

    def __call__(self, stream: int, *tensors: torch.Tensor) -> None:
        addresses = self._addresses
        for i, operand in enumerate(self._operands):
            address = tensors[operand].data_ptr()
            if address != addresses[i]:
                encoded = self._encoded[i]
                known = encoded.get(address)
                if known is not None:
                    ctypes.memmove(self.tensor_maps.addresses[i], known, TENSOR_MAP_BYTES)
                else:
                    self.tensor_maps.encode(i, address)
                    if len(encoded) >= ENCODED_PER_MAP:  # bounded: forget the oldest address
                        del encoded[next(iter(encoded))]
                    encoded[address] = ctypes.string_at(self.tensor_maps.addresses[i], TENSOR_MAP_BYTES)
                addresses[i] = address
        for operand, value in self._pointers:
            value.value = tensors[operand].data_ptr()
        self._launch(stream)


class StreamRunner:
    """A stream kernel loaded on one CUDA device, called with tensors in its problem's layouts (contiguous)."""

    def __init__(self, kernel: StreamKernel, device: torch.device,
                 launcher: Optional[Callable[[StreamLaunch], Launcher]] = None) -> None:
        """launcher: how a launch is made callable; by default through the CUDA driver on `device` (tests pass
        one that runs the kernels in Triton's interpreter)."""
        self.kernel = kernel
        self.device = device
        if launcher is None:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.init()
            with torch.cuda.device(self.index):
                if kernel.tma_maps:
                    (self.core,) = [TmaDriverLaunch(sl, kernel.tma_maps, kernel.tma_params, self.index)
                                    for sl in kernel.launches]
                else:
                    (self.core,) = [DriverLaunch(sl, self.index) for sl in kernel.launches]
                self.sum = DriverLaunch(kernel.sum, self.index) if kernel.sum else None
                self.rounds = [DriverLaunch(sl, self.index) for sl in kernel.rounds]
                self.staging = [DriverLaunch(sl, self.index) for sl in kernel.staging]
                copy_in = [DriverLaunch(sl, self.index) for sl in kernel.copy_in]
                self.copy_out = DriverLaunch(kernel.copy_out, self.index) if kernel.copy_out else None
            self._stream = lambda: _raw_stream(self.index)
        else:
            if kernel.tma_maps:
                raise ValueError(f"kernel {kernel.problem.name}: a TMA kernel runs on the GPU only, not through "
                                 "another launcher")
            self.staging = [launcher(sl) for sl in kernel.staging]
            (self.core,) = [launcher(sl) for sl in kernel.launches]
            self.sum = launcher(kernel.sum) if kernel.sum else None
            self.rounds = [launcher(sl) for sl in kernel.rounds]
            copy_in = [launcher(sl) for sl in kernel.copy_in]
            self.copy_out = launcher(kernel.copy_out) if kernel.copy_out else None
            self._stream = lambda: 0
        p = kernel.problem
        channels_last = p.with_(layout="NHWGC")
        # the channel axis is named alike for X and dY: a permutation only moves axes
        to_nhwgc = _permutation(activation_axes(p, "ch"), activation_axes(channels_last, "ch"))
        self._copied = {p.arg_names.index(name): to_nhwgc for name in kernel.copied}
        # the transposes that make those copies (by argument index), where the kernel has them
        self._copy_in = {p.arg_names.index(name): launch for name, launch in zip(kernel.copied, copy_in)}
        self._back = _permutation(activation_axes(channels_last, "ch"), activation_axes(p, "ch"))
        # the launches read a copy of the weight in another axis order (policy.weight_copy_axes)
        self._weight_order = _permutation(weight_axes(p), kernel.weight_axes) if kernel.weight_axes else None
        self._result_shape = kernel.planned.result_shape
        self._result_dtype = TORCH_DTYPES[p.result_dtype]

    @property
    def direct(self) -> bool:
        """Whether run_into applies: no layout copies and no fp8 rounding around the GEMM core."""
        return not self.kernel.copied and not self.rounds and not self.kernel.weight_axes

    def run_into(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The fast path (`direct` kernels): a, b and out are any tensors whose memory is already laid out as the
        problem's arguments and result (PyTorch's channels-last tensors for NHWGC, say), 16-byte aligned; no
        view is made, the kernels read and write through their data pointers."""
        stream = self._stream()
        a, b = self._staged(stream, (a, b))
        if self.sum is None:
            self.core(stream, a, b, out)
            return out
        partials = torch.empty(self.kernel.partials_shape, dtype=torch.float32, device=self.device)
        self.core(stream, a, b, partials)
        self.sum(stream, partials, out)
        return out

    def native_program(self, native, direct: bool, views: Sequence[torch.Tensor], result: torch.Tensor,
                       result_format: torch.memory_format, out_view: torch.Tensor):
        """run_into (direct) or __call__ on layout views as a native Program (convdsl/torch/csrc/native.cpp): the
        same launches on the same buffers, or None where __call__ would take a path a Program has no step for.
        views: the two arguments as the runner takes them (direct: the tensors themselves); result: the result
        as PyTorch holds it, in `result_format`, and out_view its view as the runner takes it (meta tensors will
        do).  The program's buffers 0 and 1 are the arguments, 2 the result."""
        k = self.kernel
        program = native.Program(list(result.shape), NATIVE_FORMATS[result_format], dtype_name(result.dtype))
        operands, shapes = [0, 1], [list(v.shape) for v in views]
        dtypes = [v.dtype for v in views]
        for i, view in enumerate(views):
            if direct:
                continue
            if i in self._copy_in:
                shapes[i] = [view.shape[d] for d in self._copied[i]]
                operands[i] = program.alloc(shapes[i], dtype_name(view.dtype))
                self._copy_in[i].add_to(native, program, [i, operands[i]])
            elif i in self._copied or (i == 1 and self._weight_order is not None):
                moved = view.permute(self._copied[i] if i in self._copied else self._weight_order)
                operands[i] = program.copy(i, list(moved.shape), list(moved.stride()))
                shapes[i] = list(moved.shape)
            elif not view.is_contiguous():
                return None
        for i, launch in enumerate(self.rounds):
            rounded = program.alloc(shapes[i], "float16")
            launch.add_to(native, program, [operands[i], rounded])
            operands[i], dtypes[i] = rounded, torch.float16
        for i, (launch, sl, shape) in enumerate(zip(self.staging, k.staging, k.staged_shapes)):
            staged = program.alloc(list(shape), dtype_name(TORCH_ELEMENTS[sl.launch.pointer_types[1]]))
            launch.add_to(native, program, [operands[i], staged])
            operands[i] = staged
        if not direct and not out_view.is_contiguous():
            return None
        if self.sum is not None:
            partials = program.alloc(list(k.partials_shape), "float32")
            self.core.add_to(native, program, [operands[0], operands[1], partials])
            self.sum.add_to(native, program, [partials, 2])
        elif not k.result_copied or direct:
            self.core.add_to(native, program, [operands[0], operands[1], 2])
        elif self.copy_out is not None:
            moved = program.alloc(list(self._result_shape), dtype_name(self._result_dtype))
            self.core.add_to(native, program, [operands[0], operands[1], moved])
            self.copy_out.add_to(native, program, [moved, 2])
        else:
            return None
        return program

    def _staged(self, stream: int, operands: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The operands the core reads: their staging copies where the kernel has them, else themselves."""
        if not self.staging:
            return list(operands)
        staged = []
        for launch, sl, shape, a in zip(self.staging, self.kernel.staging, self.kernel.staged_shapes, operands):
            copy = torch.empty(shape, dtype=TORCH_ELEMENTS[sl.launch.pointer_types[1]], device=self.device)
            launch(stream, a, copy)
            staged.append(copy)
        return staged

    def __call__(self, *args: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        k = self.kernel
        stream = self._stream()
        operands = list(args[:2])
        for i, a in enumerate(operands):
            if i in self._copy_in:  # NGCHW -> NHWGC by the transpose kernel
                moved = torch.empty([a.shape[d] for d in self._copied[i]], dtype=a.dtype, device=self.device)
                self._copy_in[i](stream, _bindable(a), moved)
                operands[i] = moved
            elif i in self._copied:
                operands[i] = a.permute(self._copied[i]).contiguous()
            elif i == 1 and self._weight_order is not None:
                operands[i] = a.permute(self._weight_order).contiguous()
            else:
                operands[i] = _bindable(a)
        for i, launch in enumerate(self.rounds):  # fp8 compute: each operand rounded once, stored in f16
            rounded = torch.empty(operands[i].shape, dtype=torch.float16, device=self.device)
            launch(stream, operands[i], rounded)
            operands[i] = rounded
        operands = self._staged(stream, operands)
        if self.sum is not None:  # grad_weight: f32 partials, then their sum in chunk order
            partials = torch.empty(k.partials_shape, dtype=torch.float32, device=self.device)
            self.core(stream, operands[0], operands[1], partials)
            direct = out is not None and out.is_contiguous() and out.data_ptr() % ALIGNMENT == 0
            result = out if direct else torch.empty(k.problem.result_shape, dtype=self._result_dtype,
                                                     device=self.device)
            self.sum(stream, partials, result)
        else:
            direct = (out is not None and not k.result_copied and out.is_contiguous()
                      and out.data_ptr() % ALIGNMENT == 0)
            result = out if direct else torch.empty(self._result_shape, dtype=self._result_dtype, device=self.device)
            self.core(stream, operands[0], operands[1], result)
            if k.result_copied and self.copy_out is not None:  # NHWGC -> NGCHW by the transpose kernel
                into_out = out is not None and out.is_contiguous() and out.data_ptr() % ALIGNMENT == 0
                back = out if into_out else torch.empty(k.problem.result_shape, dtype=self._result_dtype,
                                                        device=self.device)
                self.copy_out(stream, result, back)
                result = back
            elif k.result_copied:
                result = result.permute(self._back)
                if out is None:
                    return result.contiguous()
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result
