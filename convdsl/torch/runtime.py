"""Where a PyTorch call runs, and the mapping from PyTorch's tensors to convdsl's problems and layouts.

Activations (N, G*C, *spatial): contiguous -> NGCHW, viewed (N, G, C, *spatial); channels-last -> NHWGC,
viewed (N, *spatial, G, C).  Weights (G*K, C, *filter): contiguous -> GKCYX, viewed (G, K, C, *filter);
channels-last -> GKYXC, viewed (G, K, *filter, C).  None of these views copies.  A second activation in the
other memory format than the first is made like the first (a copy), as cuDNN does.

Paths: on CUDA the stream kernels (convdsl/stream.py) on PyTorch's current stream where they apply, else the
IREE module through DLPack (it synchronises); on the CPU the IREE module.  `logging.getLogger("convdsl.torch")`
says at debug level which path each new problem takes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from .. import stream
from ..abi import KERNEL_NAME
from .. import interop
from ..interop import torch_call
from ..module import native_cuda_arch
from ..problem import ConvProblem
from ..targets import Target
from . import fallback, native
from .stream import ALIGNMENT, StreamRunner

log = logging.getLogger("convdsl.torch")

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def result_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype


# torch.backends.cudnn.allow_tf32's getter itself: the module property costs about 1 us a read, and eager calls
# read it on every call
tf32_allowed = getattr(torch._C, "_get_cudnn_allow_tf32", None) or (lambda: torch.backends.cudnn.allow_tf32)


def _channels_last(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def _format_of(t: torch.Tensor) -> torch.memory_format:
    return {4: torch.channels_last, 5: torch.channels_last_3d}[t.dim()] if _channels_last(t) else \
        torch.contiguous_format


def activation_view(t: torch.Tensor, groups: int, layout: str) -> torch.Tensor:
    """(N, G*C, *sp) as convdsl's `layout` (NGCHW or NHWGC), a view of the same memory."""
    n, gc, *sp = t.shape
    if layout == "NHWGC":
        return t.permute(0, *range(2, t.dim()), 1).view(n, *sp, groups, gc // groups)
    return t.view(n, groups, gc // groups, *sp)


def weight_view(w: torch.Tensor, groups: int, layout: str) -> torch.Tensor:
    gk, c, *f = w.shape
    if layout == "GKYXC":
        return w.permute(0, *range(2, w.dim()), 1).view(groups, gk // groups, *f, c)
    return w.view(groups, gk // groups, c, *f)


def problem_for(op: str, a: torch.Tensor, b: torch.Tensor, *, spatial: Sequence[int], filt: Sequence[int],
                stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
                groups: int, out_dtype: Optional[torch.dtype] = None) -> ConvProblem:
    """The problem of a call: op's arguments (a, b) as PyTorch tensors, sizes the tensors cannot say passed.
    out_dtype: the result's dtype where it is not the arguments' (grad_weight into an f32 parameter's gradient
    from 16-bit operands: the f32 partials are summed straight into it)."""
    dims = a.dim() - 2
    layout = "NHWGC" if _channels_last(a) else "NGCHW"  # the first argument is an activation for every op
    # the weight's layout follows its memory format; grad_weight's result follows the activations' (a model
    # in channels-last has channels-last weights)
    weight_channels_last = _channels_last(b) if op in ("forward", "grad_input") else layout == "NHWGC"
    weight_layout = "GKYXC" if weight_channels_last else "GKCYX"
    dtype = DTYPES[a.dtype]
    if op == "forward":
        c, k = a.shape[1] // groups, b.shape[0] // groups
    elif op == "grad_input":
        c, k = b.shape[1], b.shape[0] // groups  # dy = a has G*K channels
    else:  # grad_weight(x, dy)
        c, k = a.shape[1] // groups, b.shape[1] // groups
    cuda = a.is_cuda or (_recording is not None and _recording_for_cuda)
    compute = "tf32" if dtype == "f32" and cuda and tf32_allowed() else None
    return ConvProblem(
        op=op, dims=dims, groups=groups, batch=a.shape[0], in_channels=c, out_channels=k, input=tuple(spatial),
        filter=tuple(filt), stride=tuple(stride), dilation=tuple(dilation), pad_lo=tuple(pad_lo),
        pad_hi=tuple(pad_hi), layout=layout, weight_layout=weight_layout, dtype=dtype, compute=compute,
        out_dtype=None if out_dtype is None or DTYPES[out_dtype] == dtype else DTYPES[out_dtype], name=KERNEL_NAME)


_runners: dict[tuple, StreamRunner] = {}
_targets: dict[int, Target] = {}
_recording: Optional[list[ConvProblem]] = None
_recording_for_cuda = False
_recording_calls: Optional[dict[ConvProblem, int]] = None  # counted calls per problem (recording(calls=...))
_bundles_registered = False

# Stream-kernel bundles compiled elsewhere (convdsl.stream.save_bundle), loaded before anything is compiled:
# a GPU machine without Triton or IREE's compiler runs what a build machine compiled.
BUNDLES_ENV = "CONVDSL_STREAM_BUNDLES"


def register_bundles() -> None:
    """Register the bundles named in CONVDSL_STREAM_BUNDLES (once a process), as the first CUDA call does."""
    global _bundles_registered
    if _bundles_registered:
        return
    _bundles_registered = True
    for path in filter(None, os.environ.get(BUNDLES_ENV, "").split(os.pathsep)):
        stream.register_bundle(stream.load_bundle(path))
        log.debug("stream kernels from %s", path)


@contextlib.contextmanager
def recording(as_cuda: bool = True, calls: Optional[dict[ConvProblem, int]] = None) -> Iterator[list[ConvProblem]]:
    """The problems the calls inside make (each once, in first-call order), shapes only: run a model on fake
    tensors (FakeTensorMode, on the CPU too) inside it to learn which kernels to compile ahead, e.g. into a bundle
    for a machine without a compiler.  as_cuda: record the problems as CUDA calls make them (f32 follows
    cudnn.allow_tf32).  calls: a dict that counts the calls of each problem."""
    global _recording, _recording_for_cuda, _recording_calls
    previous, _recording = (_recording, _recording_for_cuda, _recording_calls), []
    _recording_for_cuda, _recording_calls = as_cuda, calls
    try:
        yield _recording
    finally:
        _recording, _recording_for_cuda, _recording_calls = previous


def recording_active() -> bool:
    return _recording is not None


def note(op: str, a: torch.Tensor, b: torch.Tensor, counted: bool = True, **conv) -> None:
    """Record the problem of a call traced on fake tensors (the ops' fake implementations call this).
    counted: whether the call counts in recording(calls=...) (False: a kernel another path of the same step
    runs instead, recorded so that a bundle holds it)."""
    if _recording is not None:
        if a.dtype not in DTYPES or b.dtype not in DTYPES or a.numel() == 0 or b.numel() == 0:
            return  # computed by PyTorch's convolution (fallback.py): no kernel to record
        a, b = _as_laid_out(op, a, b)
        p = problem_for(op, a, b, **conv)
        if p not in _recording:
            _recording.append(p)
        if _recording_calls is not None and counted:
            _recording_calls[p] = _recording_calls.get(p, 0) + 1


def cuda_target(device: torch.device) -> Target:
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = _targets.get(index)
    if target is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = native_cuda_arch(index) or "sm_80"
        target = _targets.setdefault(index, Target("cuda", arch))
        log.debug("device %d (compute capability %d.%d): target %s", index, major, minor, target)
    return target


def _stream_runner(p: ConvProblem, device: torch.device) -> Optional[StreamRunner]:
    key = (p, device.index)
    if key in _runners:
        return _runners[key]
    register_bundles()
    target = cuda_target(device)
    reason = stream.unsupported_reason(p, target)
    runner = None
    if reason is None:
        runner = StreamRunner(stream.stream_kernel(p, target), device)
        log.debug("%s: %s", p.describe(), runner.kernel.describe())
    else:
        log.debug("%s: IREE module through DLPack (synchronised): %s", p.describe(), reason)
    _runners[key] = runner
    return runner


def _iree_kernel(p: ConvProblem, device: torch.device):
    # IREE's compiler is needed only here: a machine that runs stream kernels compiled elsewhere imports
    # convdsl.torch without it
    from ..api import get_kernel

    return get_kernel(p, cuda_target(device) if device.type == "cuda" else Target("cpu", "host"))


def _as_laid_out(op: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two arguments in one of the mapped memory formats, the second like the first."""
    if _format_of(b) != _format_of(a) and op == "grad_weight":
        b = b.contiguous(memory_format=_format_of(a))  # dy like x
    elif op != "grad_weight" and _channels_last(a) != _channels_last(b):
        # torch.nn's rule: a channels-last input or weight makes the convolution (and its result) channels-last
        if _channels_last(b):
            a = a.contiguous(memory_format=_format_of(b))
        else:
            b = b.contiguous(memory_format=_format_of(a))
    if not (a.is_contiguous() or _channels_last(a)):
        a = a.contiguous()
    if not (b.is_contiguous() or _channels_last(b)):
        b = b.contiguous()
    return a, b


@dataclass(frozen=True)
class _Call:
    """What a call with these shapes, strides and options does, worked out once: its problem, and its stream
    runner or else its IREE kernel."""

    problem: ConvProblem
    runner: Optional[StreamRunner]
    iree: object = None  # api.Kernel where there is no runner
    # the fast path: the runner reads the arguments and writes a result made as PyTorch's tensor in place
    # (no view, no copy); the result's PyTorch shape, memory format and dtype
    direct: bool = False
    result_shape: tuple[int, ...] = ()
    result_format: torch.memory_format = torch.contiguous_format
    result_dtype: torch.dtype = torch.float32
    # no kernel could be had (fallback.py says why): PyTorch's own convolution computes the call
    fallback: bool = False
    # a stream call whose arguments, as they come, are in the memory formats the problem maps (no copy into
    # another format first): `launch` runs it, direct or through the kernel's own layout copies
    planned: bool = False
    # an IREE call whose arguments, as they come, are in the mapped memory formats: the (shape, strides) of the
    # layout views of a, b and the result (made with as_strided: one call a tensor, not a permute and a view), and
    # its interop.DLPackKernel, so that a repeated call skips the layout checks (`run_iree`)
    iree_views: Optional[tuple] = None
    dlpack: object = None

    def run_iree(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """An IREE call with iree_views on its arguments as they lie: the result, computed."""
        if not interop._torch_threads_capped and a.device.type == "cpu":
            interop.cap_torch_threads()
        out = torch.empty(self.result_shape, dtype=self.result_dtype, device=a.device, memory_format=self.result_format)
        (sa, ta), (sb, tb), (so, to) = self.iree_views
        self.dlpack(a.detach().as_strided(sa, ta), b.detach().as_strided(sb, tb), out=out.as_strided(so, to))
        return out

    def launch(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A planned call on its arguments as they lie (the caller checked `aligned`): the result, queued.  Direct
        kernels read and write PyTorch's memory as it lies; the others through their layout views."""
        out = torch.empty(self.result_shape, dtype=self.result_dtype, device=a.device,
                          memory_format=self.result_format)
        if self.direct:
            return self.runner.run_into(a, b, out)
        av, bv, ov = _layout_views(self.problem, a, b, out)
        self.runner(av, bv, out=ov)
        return out

    def native_program(self, native, a: torch.Tensor, b: torch.Tensor):
        """This planned call as a Program of the native extension (convdsl/torch/native.py) for arguments laid
        out as a and b, the same launches as `launch`; None where it has no such program."""
        out = torch.empty(self.result_shape, dtype=self.result_dtype, device="meta", memory_format=self.result_format)
        if self.direct:
            return self.runner.native_program(native, True, (a, b), out, self.result_format, out)
        av, bv, ov = _layout_views(self.problem, a, b, out)
        return self.runner.native_program(native, False, (av, bv), out, self.result_format, ov)


def _layout_views(p: ConvProblem, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple:
    """The arguments and the result as views in p's layouts (no copies)."""
    av = activation_view(a, p.groups, p.layout)
    if p.op == "grad_weight":
        return av, activation_view(b, p.groups, p.layout), weight_view(out, p.groups, p.weight_layout)
    return av, weight_view(b, p.groups, p.weight_layout), activation_view(out, p.groups, p.layout)


def on_stream_device(t: torch.Tensor) -> bool:
    """Whether calls on t can take the stream kernels (t is on a CUDA device)."""
    return t.is_cuda


def aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() % ALIGNMENT == 0 and b.data_ptr() % ALIGNMENT == 0


def _result_spec(p: ConvProblem) -> tuple[tuple[int, ...], torch.memory_format, torch.dtype]:
    """The result of p as PyTorch holds it: its shape, memory format and dtype (the kernels write into it)."""
    if p.op == "grad_weight":
        shape = (p.groups * p.out_channels, p.in_channels, *p.filter)
        channels_last = p.weight_layout == "GKYXC"
    else:
        channels = p.in_channels if p.op in ("grad_input", "transposed") else p.out_channels
        spatial = p.input if p.op in ("grad_input", "transposed") else p.output
        shape = (p.batch, p.groups * channels, *spatial)
        channels_last = p.layout == "NHWGC"
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape), torch.contiguous_format) \
        if channels_last and p.dims > 1 else torch.contiguous_format
    return shape, fmt, TORCH_DTYPES[p.result_dtype]


def _new_call(p: ConvProblem, device: torch.device, a: torch.Tensor, b: torch.Tensor) -> _Call:
    """The call's runner or IREE kernel; where neither can be had, a fallback call (fallback.unavailable
    decides: a one-line warning and PyTorch's convolution, or the error in strict mode)."""
    try:
        runner = _stream_runner(p, device) if on_stream_device(a) else None
        if runner is None:
            # a result in another dtype is a stream-path option (planned_call's out_dtype): its callers fall back
            # to the arguments' dtype, so no IREE module is compiled for it
            return _Call(p, None, None if p.out_dtype else _iree_kernel(p, device), False, *_result_spec(p))
    except Exception as err:  # noqa: BLE001 - any failure to compile or load a kernel (IREE, Triton, driver)
        fallback.unavailable(p.describe(), err)
        return _Call(p, None, None, False, *_result_spec(p), fallback=True)
    return _new_call_with(p, runner, a, b)


def _new_call_with(p: ConvProblem, runner, a: torch.Tensor, b: torch.Tensor) -> _Call:
    # direct when the views the kernels expect are the tensors' memory as it lies (contiguous views)
    av = activation_view(a, p.groups, p.layout)
    bv = weight_view(b, p.groups, p.weight_layout) if p.op != "grad_weight" else activation_view(b, p.groups, p.layout)
    direct = runner.direct and av.is_contiguous() and bv.is_contiguous()
    return _Call(p, runner, None, direct, *_result_spec(p))


# per (op, shapes, strides, dtype, device, options, TF32 flag): the call's problem and runner, so that a repeated
# call (every training step) builds no problem and asks no policy
_calls: dict[tuple, _Call] = {}


def _key(op: str, a: torch.Tensor, b: torch.Tensor, spatial: Sequence[int], filt: Sequence[int],
         stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
         groups: int, out_dtype: Optional[torch.dtype] = None) -> tuple:
    # keyed on the arguments as they come: whether they need a copy into a mapped memory format follows from
    # their shapes and strides, so a repeated call on tensors the kernels read in place skips all of that
    return (op, a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device, tuple(spatial), tuple(filt),
            tuple(stride), tuple(pad_lo), tuple(pad_hi), tuple(dilation), groups,
            a.is_cuda and tf32_allowed(), out_dtype)


def _call_of(key: tuple, op: str, a: torch.Tensor, b: torch.Tensor,
             laid: Optional[tuple[torch.Tensor, torch.Tensor]], spatial: Sequence[int], filt: Sequence[int],
             stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
             groups: int, out_dtype: Optional[torch.dtype] = None) -> _Call:
    call = _calls.get(key)
    if call is None:
        _check_groups(op, a, b, groups)
        if a.dtype not in DTYPES or b.dtype not in DTYPES or a.numel() == 0 or b.numel() == 0:
            if a.numel() and b.numel():  # an empty batch needs no kernel: nothing to announce
                fallback.unavailable(f"{op} on {a.dtype} tensors", "convdsl computes float32, float16 and "
                                     "bfloat16")
            return _calls.setdefault(key, _Call(None, None, fallback=True))
        laid_a, laid_b = laid if laid is not None else _as_laid_out(op, a, b)
        p = problem_for(op, laid_a, laid_b, spatial=spatial, filt=filt, stride=stride, pad_lo=pad_lo,
                        pad_hi=pad_hi, dilation=dilation, groups=groups, out_dtype=out_dtype)
        call = _new_call(p, laid_a.device, laid_a, laid_b)
        # direct or planned only where the arguments as they come are already laid out (no copy was needed)
        as_given = laid_a is a and laid_b is b
        call = dataclasses.replace(call, direct=call.direct and as_given,
                                   planned=call.runner is not None and as_given)
        if call.iree is not None and as_given:
            call = dataclasses.replace(call, iree_views=_iree_views(call, laid_a, laid_b),
                                       dlpack=interop.dlpack_kernel(call.iree.module, p.name))
        call = _calls.setdefault(key, call)
    return call


def _iree_views(call: _Call, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """The (shape, strides) of _layout_views of a, b and the call's result (made as run makes it)."""
    out = torch.empty(call.result_shape, dtype=call.result_dtype, device="meta", memory_format=call.result_format)
    return tuple((tuple(v.shape), tuple(v.stride())) for v in _layout_views(call.problem, a, b, out))


# per call key (run's): the planned call's program in the native launcher, or None where it has none; the
# operators' calls (torch.compile's, the general eager path's) then launch from C++ as the eager plans do
_programs: dict[tuple, Optional[object]] = {}
OPERATOR_CODES = {"forward": 0, "grad_input": 1, "grad_weight": 2}  # native.cpp's OperatorKind


_native_made = False  # whether a planned call has a program of the native extension


def native_programs() -> bool:
    """Whether a planned call has a program of the native extension (then the operators can take its kernels)."""
    return _native_made


def _native_program(call: _Call, a: torch.Tensor, b: torch.Tensor) -> Optional[object]:
    ext = native.extension() if a.is_cuda else None
    return None if ext is None or call.runner is None else call.native_program(ext, a, b)


def _check_groups(op: str, a: torch.Tensor, b: torch.Tensor, groups: int) -> None:
    """torch.nn's errors for groups that do not fit the tensors (the problem's arithmetic divides by them)."""
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    weight_rows = b.shape[1] if op == "grad_weight" else b.shape[0]  # grad_weight's b is dY: G*K channels
    if weight_rows % groups:
        what = "grad_output" if op == "grad_weight" else "weight"
        raise RuntimeError(f"Given groups={groups}, expected {what} to be divisible by {groups} at dimension "
                           f"{1 if op == 'grad_weight' else 0}, but got {what} of size {list(b.shape)} instead")
    if op == "forward" and a.shape[1] != b.shape[1] * groups:
        raise RuntimeError(f"Given groups={groups}, weight of size {list(b.shape)}, expected input{list(a.shape)} "
                           f"to have {b.shape[1] * groups} channels, but got {a.shape[1]} channels instead")
    if op == "grad_weight" and a.shape[1] % groups:
        raise RuntimeError(f"Given groups={groups}, expected input to be divisible by {groups} at dimension 1, "
                           f"but got input of size {list(a.shape)} instead")


def planned_call(op: str, a: torch.Tensor, b: torch.Tensor, *, spatial: Sequence[int], filt: Sequence[int],
                 stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
                 groups: int, out_dtype: Optional[torch.dtype] = None) -> Optional[_Call]:
    """The call of op on tensors shaped and strided like a and b where its stream kernels take them as they lie
    (`_Call.launch`), else None: callers that see the same tensors every step keep it (ops.py's eager plans).
    out_dtype: the result's dtype, where not a's (problem_for)."""
    key = _key(op, a, b, spatial, filt, stride, pad_lo, pad_hi, dilation, groups, out_dtype)
    call = _call_of(key, op, a, b, None, spatial, filt, stride, pad_lo, pad_hi, dilation, groups, out_dtype)
    return call if call.planned else None


def run(op: str, a: torch.Tensor, b: torch.Tensor, *, spatial: Sequence[int], filt: Sequence[int],
        stride: Sequence[int], pad_lo: Sequence[int], pad_hi: Sequence[int], dilation: Sequence[int],
        groups: int) -> torch.Tensor:
    """op's result as a PyTorch tensor in a's memory format."""
    key = _key(op, a, b, spatial, filt, stride, pad_lo, pad_hi, dilation, groups)
    program = _programs.get(key)
    if program is not None:  # the native launcher's program of a planned call (it copies offset views itself)
        return program.run(a, b)
    call = _calls.get(key)
    if call is not None and call.planned:
        if key not in _programs:  # its second call: planned, so worked out once
            program = _programs[key] = _native_program(call, a, b)
            if program is not None:
                global _native_made
                _native_made = True
                # the operators' native kernels (ops.py) run this signature's calls from now on without Python
                native.extension().remember(OPERATOR_CODES[op], a, b, list(spatial), list(filt), list(stride),
                                            list(pad_lo), list(pad_hi), list(dilation), groups, program)
                return program.run(a, b)
        if aligned(a, b):  # the kernels read the values through data pointers; autograd is the ops' own
            return call.launch(a, b)
    if call is None:
        call = _call_of(key, op, a, b, None, spatial, filt, stride, pad_lo, pad_hi, dilation, groups)
    if call.iree_views is not None:  # the tensors as they come are laid out: no copies to consider
        return call.run_iree(a, b)
    if call.fallback:
        return fallback.compute(op, a.detach(), b.detach(), spatial=spatial, filt=filt, stride=stride,
                                pad_lo=pad_lo, pad_hi=pad_hi, dilation=dilation, groups=groups)
    laid_a, laid_b = _as_laid_out(op, a, b)
    a, b = laid_a.detach(), laid_b.detach()
    p = call.problem
    # the result is allocated as PyTorch's tensor (never a view of another, so in-place ops on it work as on
    # torch.nn's) and the kernels write into its view in the problem's layout
    out = torch.empty(call.result_shape, dtype=call.result_dtype, device=a.device, memory_format=call.result_format)
    av, bv, ov = _layout_views(p, a, b, out)
    if call.runner is not None:
        call.runner(av, bv, out=ov)
    else:
        torch_call(call.iree.module, p.name, av, bv, out=ov)
    return out
