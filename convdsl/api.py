"""The functional JIT API: call a convolution op on NumPy arrays; the kernel is compiled on first use.

    dw = convdsl.grad_weight(x, dy, filter=(3, 3), stride=1, padding=1, groups=32, layout="NHWGC")
    dx = convdsl.grad_input(dy, w, input=(56, 56), stride=2, padding=1, groups=32, layout="NHWGC")
    y  = convdsl.conv(x, w, stride=1, padding=1, groups=32, layout="NHWGC")
    y  = convdsl.conv_transpose(x, w, input=(112, 112), stride=2, padding=1, layout="NHWGC")

Every size the kernel needs (dims, batch, groups, channels per group, spatial sizes, dtype) is read from
the arrays through the layout: activations NHWGC = (N, spatial..., G, C), GNHWC = (G, N, spatial..., C),
NGCHW = (N, G, C, spatial...); weights GKYXC = (G, K, taps..., C) or GKCYX = (G, K, C, taps...).
What the arrays cannot say must be passed: `input=` for grad_input and conv_transpose (with stride > 1
several input sizes give the same output size) and `filter=` for grad_weight.

The options are the fields of `ConvOptions`, declared once for the four ops, and normalised by
convdsl.options, as the .conv parser's values are.  Arrays are checked before anything is compiled; a
problem raises `ArgumentError` (wrong array: type, rank, dtype, shape, groups) or `ProblemError`
(inconsistent options), naming the argument with what was expected and what was got; an option the op
does not take raises TypeError.  Compiled kernels are kept in memory for the process, keyed like the disk
cache (compiler.cache_key), and on disk across processes.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

import convdsl as _package

from . import compiler
from . import options as normalise
from .abi import KERNEL_NAME
from .compiler import cache_key
from .module import ArgumentError, Kernel, resolve_target
from .options import activation_letters, weight_letters
from .problem import DYNAMIC_BATCH_NOMINAL, ConvProblem, Epilogue, ProblemError, Prologue
from .targets import Target
from .tuning import db as tuning_db

__all__ = [
    "conv",
    "grad_input",
    "grad_weight",
    "conv_transpose",
    "ConvOptions",
    "infer_problem",
    "get_kernel",
    "clear_memory_cache",
]


IntOrInts = Union[int, Sequence[int]]
Padding = Union[int, str, Sequence[int], Sequence[Sequence[int]]]


# --- the options, declared once -------------------------------------------------------------------
@dataclass(frozen=True)
class ConvOptions:
    """The keyword options of conv, grad_input, grad_weight and conv_transpose (and infer_problem).

    Every op takes the shared ones; `input`, `filter` and `split_k` only the ops of _OP_OWN_OPTIONS.
    The values are normalised (and refused with a message naming the option) by convdsl.options.
    """

    # grad_input, conv_transpose (required): the result's spatial size; with stride > 1 several sizes
    # give the same dy size, so the arrays cannot say it
    input: Optional[IntOrInts] = None
    # grad_weight (required): dw's taps, which x and dy do not imply
    filter: Optional[IntOrInts] = None
    stride: IntOrInts = 1
    dilation: IntOrInts = 1
    # one number, one per dim, a (lo, hi) pair per dim (the forms mixed per dim), "same" or "valid"
    padding: Padding = 0
    # None: the G axis of the arrays
    groups: Optional[int] = None
    # of the activations; 2D names stand for every rank, rank-specific ones (NDHWGC, GKZYXC) fix it
    layout: str = "NHWGC"
    weight_layout: str = "GKYXC"
    # f32, f16, bf16 or a NumPy/PyTorch dtype; None: the arrays' dtype
    out_dtype: Any = None
    # "bf16x3" or "tf32" (f32 only), or (A, B) of "fp8" / "bf8"
    compute: Any = None
    # grad_weight: None or "auto" lets the planner choose
    split_k: Union[None, int, str] = None
    # "scale(alpha)", "bilinear(alpha, beta)" (which adds beta * d, so pass d=), a chain of fused steps (forward and
    # conv_transpose: "bias, relu", "affine, residual, gelu(tanh)"; their tensors by name: bias=, scale=, shift=,
    # residual=) or an Epilogue
    epilogue: Union[None, str, Sequence[str], Epilogue] = None
    # grad_input, grad_weight: an activation's backward applied to dy ("relu_backward", "gelu_backward(tanh)", ...;
    # pass saved=, relu's output or the other activations' input) or a Prologue
    prologue: Union[None, str, Prologue] = None


_OPTION_FIELDS = {f.name: f for f in fields(ConvOptions)}
_OP_OWN_OPTIONS = {"forward": (), "grad_input": ("input", "prologue"), "grad_weight": ("filter", "split_k", "prologue"),
                   "transposed": ("input",)}
_OP_SPECIFIC = {name for own in _OP_OWN_OPTIONS.values() for name in own}

# Per op: (first argument, its kind), (second, its kind), where kind x = activation with C channels,
# y = activation with K channels, w = weight.
_OPERANDS = {
    "forward": (("x", "x"), ("w", "w")),
    "grad_input": (("dy", "y"), ("w", "w")),
    "grad_weight": (("x", "x"), ("dy", "y")),
    "transposed": (("x", "y"), ("w", "w")),
}
_PUBLIC_NAMES = {"forward": "conv", "grad_input": "grad_input", "grad_weight": "grad_weight",
                 "transposed": "conv_transpose"}


def _option_names(op: Optional[str]) -> tuple[str, ...]:
    """The options `op` takes, in ConvOptions' order (op None: all of them)."""
    return tuple(name for name in _OPTION_FIELDS
                 if op is None or name not in _OP_SPECIFIC or name in _OP_OWN_OPTIONS[op])


def _conv_options(op: str, given: Mapping[str, Any]) -> ConvOptions:
    taken = _option_names(op)
    for name in given:
        if name not in taken:
            owners = [_PUBLIC_NAMES[o] for o, own in _OP_OWN_OPTIONS.items() if name in own]
            hint = (f"; {name}= belongs to {' and '.join(owners)}" if owners
                    else normalise.did_you_mean(name, taken))
            raise TypeError(f"{_PUBLIC_NAMES[op]}: got an unexpected keyword argument {name!r}{hint}")
    return ConvOptions(**given)


def _with_options(op: Optional[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorated function takes `op`'s options through **options; its signature (help(),
    inspect.signature) lists them as keyword-only parameters with ConvOptions' defaults, before its own."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        cut = next((i for i, p in enumerate(own) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(own))
        declared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_OPTION_FIELDS[name].default,
                                      annotation=_OPTION_FIELDS[name].type) for name in _option_names(op)]
        fn.__signature__ = signature.replace(parameters=[*own[:cut], *declared, *own[cut:]])  # type: ignore[attr-defined]
        return fn
    return decorate


@contextlib.contextmanager
def _named(fn: str) -> Iterator[None]:
    """Prefix the ProblemErrors raised inside (the options', ConvProblem's) with the public function's name;
    ArgumentErrors name it themselves."""
    try:
        yield
    except ProblemError as err:
        err.args = (f"{fn}: {err.args[0]}", *err.args[1:])
        raise


@functools.lru_cache(maxsize=None)
def _resolve(target: Union[str, Target], arch: Optional[str]) -> Target:
    # "auto" probes the CUDA driver, which costs milliseconds: resolve each spelling once per process.
    return resolve_target(target, arch)


# --- reading sizes from arrays ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Activation:
    batch: int
    groups: int
    channels: int
    spatial: tuple[int, ...]


@dataclass(frozen=True)
class _Weight:
    groups: int
    out_channels: int  # K
    in_channels: int  # C
    taps: tuple[int, ...]


def _activation(shape: tuple[int, ...], layout: str, dims: int) -> _Activation:
    if layout == "NHWGC":
        return _Activation(shape[0], shape[dims + 1], shape[dims + 2], shape[1:dims + 1])
    if layout == "GNHWC":
        return _Activation(shape[1], shape[0], shape[dims + 2], shape[2:dims + 2])
    return _Activation(shape[0], shape[1], shape[2], shape[3:])  # NGCHW


def _weight(shape: tuple[int, ...], weight_layout: str, dims: int) -> _Weight:
    if weight_layout == "GKYXC":
        return _Weight(shape[0], shape[1], shape[dims + 2], shape[2:dims + 2])
    return _Weight(shape[0], shape[1], shape[2], shape[3:])  # GKCYX


def _check_array(a: Any, name: str, fn: str) -> str:
    """The array's dtype name (f32, f16, bf16), once it is a usable array."""
    if not isinstance(a, np.ndarray):
        raise ArgumentError(f"{fn}: argument {name!r} expected a NumPy array, got {type(a).__name__}")
    try:
        dtype = normalise.dtype(a.dtype) if a.dtype.isnative else None
    except ProblemError:
        dtype = None
    if dtype is None:
        raise ArgumentError(f"{fn}: argument {name!r} expected dtype f32, f16 or bf16 (float32, float16, "
                            f"ml_dtypes.bfloat16), got {a.dtype}")
    if 0 in a.shape:
        raise ArgumentError(f"{fn}: argument {name!r} has an empty axis: shape {list(a.shape)}")
    return dtype


def _rank_error(fn: str, name: str, a: np.ndarray, what: str, want: str) -> ArgumentError:
    return ArgumentError(f"{fn}: argument {name!r} expected rank {want} for {what}, got rank {a.ndim} "
                         f"(shape {list(a.shape)})")


def _fit_text(out: Sequence[int], filt: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
              lo: Sequence[int], hi: Sequence[int]) -> str:
    """The input sizes I with (I + lo + hi - d*(R-1) - 1) // s + 1 == O per dim, e.g. "111..112 x 111..112"."""
    parts = []
    for o, r, s, d, pl, ph in zip(out, filt, stride, dilation, lo, hi):
        first = (o - 1) * s + d * (r - 1) + 1 - pl - ph
        last = first + s - 1
        first = max(first, 1)
        parts.append("none" if last < first else str(first) if first == last else f"{first}..{last}")
    return " x ".join(parts)


@dataclass(frozen=True)
class _Operands:
    """The two arrays of one call, read through the layouts: what every later step needs to know."""

    op: str
    fn: str  # the public name, for messages
    arrays: tuple[np.ndarray, np.ndarray]
    names: tuple[str, str]  # 'x', 'w', 'dy'
    kinds: tuple[str, str]  # x: activation with C channels, y: with K channels, w: weight
    dims: int
    layout: str
    weight_layout: str
    dtype: str
    first: _Activation  # the first array is always an activation
    weight: Optional[_Weight]  # the second array, when it is a weight ...
    second: Optional[_Activation]  # ... or when it is dy (grad_weight)

    @property
    def second_groups(self) -> int:
        return self.weight.groups if self.weight is not None else self.second.groups  # type: ignore[union-attr]

    def letters(self, kind: str) -> str:
        if kind == "w":
            return weight_letters(self.weight_layout, self.dims)
        return activation_letters(self.layout, self.dims, "C" if kind == "x" else "K")

    def shape_error(self, which: int, detail: str) -> ArgumentError:
        """`detail` about array `which` (0 or 1), named with its shape and axis letters."""
        array = self.arrays[which]
        return ArgumentError(f"{self.fn}: argument {self.names[which]!r} (shape {list(array.shape)}, "
                             f"{self.letters(self.kinds[which])}) {detail}")


def _read_operands(op: str, a: Any, b: Any, options: ConvOptions) -> _Operands:
    """Check the arrays (type, dtype, rank) and read their sizes through the layouts."""
    fn = _PUBLIC_NAMES[op]
    (a_name, a_kind), (b_name, b_kind) = _OPERANDS[op]
    dtype = _check_array(a, a_name, fn)
    if _check_array(b, b_name, fn) != dtype:
        raise ArgumentError(f"{fn}: argument {b_name!r} expected dtype {a.dtype} to match {a_name!r}, got {b.dtype}")
    layout, layout_dims = normalise.layout(options.layout)
    weight_layout, weight_dims = normalise.weight_layout(options.weight_layout)
    # The first argument is always an activation: its rank gives the number of spatial dims.
    dims = a.ndim - 3
    if layout_dims is not None and dims != layout_dims:
        raise _rank_error(fn, a_name, a, f"layout {options.layout}", str(layout_dims + 3))
    if dims not in (1, 2, 3):
        # the 1D spelling, whose one spatial letter W stands for the spatial axes
        letters = activation_letters(layout, 1, "C" if a_kind == "x" else "K")
        axes = ", ".join("spatial..." if ch == "W" else ch for ch in letters)
        raise _rank_error(fn, a_name, a, f"layout {layout} = ({axes}) with 1, 2 or 3 spatial dims", "4, 5 or 6")
    if b_kind == "w" and weight_dims is not None and weight_dims != dims:
        raise ProblemError(f"weight_layout {options.weight_layout} is for {weight_dims}D, but {a_name!r} has "
                           f"rank {a.ndim}: {dims} spatial dim(s) in layout {layout}")
    weight = _weight(b.shape, weight_layout, dims) if b_kind == "w" else None
    operands = _Operands(
        op, fn, (a, b), (a_name, b_name), (a_kind, b_kind), dims, layout, weight_layout, dtype,
        first=_activation(a.shape, layout, dims), weight=weight,
        second=_activation(b.shape, layout, dims) if weight is None else None,
    )
    if b.ndim != dims + 3:
        raise _rank_error(fn, b_name, b, f"{operands.letters(b_kind)} ({dims} spatial dim(s), as {a_name!r} of "
                                         f"rank {a.ndim})", str(dims + 3))
    return operands


def _check_groups(operands: _Operands, groups: Any) -> int:
    """The G axis of every array must agree, and with `groups=` when it is given."""
    found = (operands.first.groups, operands.second_groups)
    if groups is not None:
        g = normalise.integer(groups, "groups")
        for which, got in enumerate(found):
            if got != g:
                raise operands.shape_error(which, f"has G = {got} on its G axis, but groups = {g}")
    elif found[1] != found[0]:
        raise operands.shape_error(1, f"has G = {found[1]}, expected G = {found[0]} to match "
                                      f"{operands.names[0]!r}")
    return found[0]


def _channels(operands: _Operands) -> tuple[int, int]:
    """(C, K) per group: C of x and K of y, tied through the weight where there is one."""
    first, w = operands.first, operands.weight
    if operands.op == "forward" and w is not None:
        if w.in_channels != first.channels:
            raise operands.shape_error(1, f"has C = {w.in_channels}, expected C = {first.channels} to match 'x'")
        return first.channels, w.out_channels
    if w is not None:  # grad_input, transposed
        if w.out_channels != first.channels:
            raise operands.shape_error(1, f"has K = {w.out_channels}, expected K = {first.channels} to match "
                                          f"{operands.names[0]!r}")
        return w.in_channels, first.channels
    second = operands.second  # grad_weight: x and dy
    assert second is not None
    if second.batch != first.batch:
        raise operands.shape_error(1, f"has N = {second.batch}, expected N = {first.batch} to match 'x'")
    return first.channels, second.channels


def _filter(operands: _Operands, filter: Any) -> tuple[int, ...]:
    """The filter's taps: the weight's, or (grad_weight) `filter=`."""
    dims, w = operands.dims, operands.weight
    if w is None:
        if filter is None:
            raise ArgumentError(f"{operands.fn}: missing filter=: the filter's spatial size, e.g. filter="
                                f"{(3,) * dims}; dw's taps are not implied by x and dy")
        return normalise.expand(filter, dims, "filter")
    if filter is not None and normalise.expand(filter, dims, "filter") != w.taps:
        raise operands.shape_error(1, f"has filter taps {list(w.taps)}, but filter = {filter!r}")
    return w.taps


def _input(operands: _Operands, input: Any, filter: tuple[int, ...], stride: tuple[int, ...],
           dilation: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> tuple[int, ...]:
    """The input's spatial size: the first array's, or (grad_input, transposed) `input=`."""
    if operands.op not in ("grad_input", "transposed"):
        return operands.first.spatial
    if input is None:
        name, spatial = operands.names[0], operands.first.spatial
        what = "dx" if operands.op == "grad_input" else "the output y"
        raise ArgumentError(
            f"{operands.fn}: missing input=: the spatial size of {what}; it cannot be read from {name!r} because "
            f"with stride > 1 several sizes give the same {name} size (here {name} {list(spatial)} fits "
            f"input= {_fit_text(spatial, filter, stride, dilation, lo, hi)})"
        )
    return normalise.expand(input, operands.dims, "input")


def _build_problem(operands: _Operands, options: ConvOptions) -> ConvProblem:
    """The ConvProblem from the sizes the arrays give and the options, each through its normaliser."""
    dims = operands.dims
    groups = _check_groups(operands, options.groups)
    stride = normalise.expand(options.stride, dims, "stride")
    dilation = normalise.expand(options.dilation, dims, "dilation")
    filter = _filter(operands, options.filter)
    lo, hi = normalise.padding(options.padding, dims, filter=filter, dilation=dilation, stride=stride)
    in_channels, out_channels = _channels(operands)
    out_dtype = normalise.dtype(options.out_dtype, "out_dtype") if options.out_dtype is not None else None
    problem = ConvProblem(
        op=operands.op, dims=dims, groups=groups, batch=operands.first.batch, in_channels=in_channels,
        out_channels=out_channels, input=_input(operands, options.input, filter, stride, dilation, lo, hi),
        filter=filter, stride=stride, dilation=dilation, pad_lo=lo, pad_hi=hi, layout=operands.layout,
        weight_layout=operands.weight_layout, dtype=operands.dtype,
        # out_dtype equal to dtype is stored as None, as the parser does, so both spellings share a key.
        out_dtype=None if out_dtype == operands.dtype else out_dtype,
        compute=normalise.compute(options.compute), split_k=normalise.split_k(options.split_k),
        epilogue=normalise.parse_epilogue(options.epilogue), prologue=normalise.parse_prologue(options.prologue),
        name=KERNEL_NAME,
    )
    normalise.epilogue_range(problem.epilogue, problem.result_dtype)
    return problem


def _check_result_side(problem: ConvProblem, operands: _Operands) -> None:
    """The output-side activation must have the spatial size the conv produces from input and filter
    (forward has none: its output size is whatever x and w give)."""
    if problem.op == "forward":
        return
    which, act = (1, operands.second) if operands.second is not None else (0, operands.first)
    if act.spatial == problem.output:
        return
    detail = (f"has spatial size {list(act.spatial)}, expected {list(problem.output)}: the output size for input "
              f"{list(problem.input)}, filter {list(problem.filter)}, stride {list(problem.stride)}, dilation "
              f"{list(problem.dilation)}, padding {list(problem.pad_lo)}/{list(problem.pad_hi)}")
    if problem.op != "grad_weight":
        detail += "; input= sizes that fit it: " + _fit_text(
            act.spatial, problem.filter, problem.stride, problem.dilation, problem.pad_lo, problem.pad_hi)
    raise operands.shape_error(which, detail)


# The tensors after the two operands, by keyword: what reads each (for messages)
_EXTRA_READERS = {"d": "a bilinear epilogue", "bias": "the epilogue's bias step", "scale": "the epilogue's affine step",
                  "shift": "the epilogue's affine step", "residual": "the epilogue's residual step",
                  "saved": "a prologue"}
_PER_CHANNEL = ("bias", "scale", "shift")
Extra = Mapping[str, Optional[np.ndarray]]


def _check_extra_tensors(problem: ConvProblem, fn: str, extra: Extra) -> None:
    """Each tensor the epilogue and prologue read is given, and only those: d and residual in the result's shape and
    dtype, saved in dy's; a per-channel vector (bias, scale, shift) as (G, channels) or (G * channels,), in any of
    the float dtypes (the epilogue applies it in f32)."""
    wanted = dict(zip(problem.arg_names[2:], zip(problem.arg_shapes[2:], problem.arg_dtypes[2:])))
    what = f"epilogue {problem.epilogue}" + (f" and prologue {problem.prologue}" if problem.prologue.kind != "none" else "")
    for name, value in extra.items():
        if value is not None and name not in wanted:
            raise ArgumentError(f"{fn}: {name}= is only used by {_EXTRA_READERS[name]}, but {what} reads no {name}")
    for name, (shape, dtype) in wanted.items():
        value = extra.get(name)
        if value is None:
            reader = "prologue " + str(problem.prologue) if name == "saved" else "epilogue " + str(problem.epilogue)
            raise ArgumentError(f"{fn}: {reader} needs {name}=, of shape {list(shape)}")
        got = _check_array(value, name, fn)
        if name in _PER_CHANNEL:
            if tuple(value.shape) not in (shape, (shape[0] * shape[1],)):
                raise ArgumentError(f"{fn}: argument {name!r} expected shape {list(shape)} (groups, channels per group) "
                                    f"or [{shape[0] * shape[1]}], got {list(value.shape)}")
            continue
        side = "dy's" if name == "saved" else "the result's"
        if tuple(value.shape) != shape:
            raise ArgumentError(f"{fn}: argument {name!r} expected shape {list(shape)} ({side}), got {list(value.shape)}")
        if got != dtype:
            raise ArgumentError(f"{fn}: argument {name!r} expected dtype {dtype} ({side}), got {value.dtype}")


def _extra_spec(problem: ConvProblem) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of the problem's tensors after the two operands (worked out once per problem: its
    shapes are properties computed on every read)."""
    return tuple(zip(problem.arg_names[2:], problem.arg_shapes[2:]))


def _extra_arrays(spec: tuple[tuple[str, tuple[int, ...]], ...], extra: Extra) -> tuple[np.ndarray, ...]:
    """The checked extra tensors in argument order (spec: _extra_spec), per-channel vectors as f32 (G, channels)."""
    out = []
    for name, shape in spec:
        value = extra[name]
        if name in _PER_CHANNEL:
            value = np.ascontiguousarray(value.reshape(shape), dtype=np.float32)
        out.append(value)
    return tuple(out)


@_with_options(None)
def infer_problem(op: str, a: np.ndarray, b: np.ndarray, *, d: Optional[np.ndarray] = None,
                  bias: Optional[np.ndarray] = None, scale: Optional[np.ndarray] = None,
                  shift: Optional[np.ndarray] = None, residual: Optional[np.ndarray] = None,
                  saved: Optional[np.ndarray] = None, **options: Any) -> ConvProblem:
    """The ConvProblem (named KERNEL_NAME) that `op` on arrays `a`, `b` (kernel order) describes.

    `options` are `op`'s ConvOptions; d, bias, scale, shift, residual and saved are the tensors its epilogue and
    prologue read.  Raises ArgumentError for arrays that do not fit (type, rank, dtype, groups, shapes),
    ProblemError for inconsistent options and TypeError for an option `op` does not take; nothing is compiled.
    """
    if op not in _OPERANDS:
        raise ProblemError(f"op: expected one of {', '.join(_OPERANDS)}, got {op!r}")
    fn = _PUBLIC_NAMES[op]
    given = _conv_options(op, options)
    with _named(fn):
        operands = _read_operands(op, a, b, given)
        problem = _build_problem(operands, given)
    _check_result_side(problem, operands)
    _check_extra_tensors(problem, fn, {"d": d, "bias": bias, "scale": scale, "shift": shift, "residual": residual,
                                       "saved": saved})
    return problem


# --- compiled kernels ------------------------------------------------------------------------------
# cache key -> a kernel whose module is loaded on its device.  Keyed like the disk cache so that a
# changed version (or flag) in the same process can never pick up a stale module.
_kernels: dict[str, Kernel] = {}
# (problem, target) -> (the key's other inputs that can change in a process, when it was found; its kernel).  Hashing
# every field of the problem into the key took about 0.1 ms a call, as long as a small kernel runs: a repeated
# call finds its kernel here, and the full key is made again whenever a version or the tuning database changed.
_recent: dict[tuple[ConvProblem, Target], tuple[tuple, Kernel]] = {}


def clear_memory_cache() -> None:
    """Forget the kernels compiled or loaded in this process (the disk cache is untouched)."""
    _kernels.clear()
    _recent.clear()
    _inferred.clear()


def _key_inputs() -> tuple:
    """What compiler.cache_key reads besides the problem and the target that may change while a process runs:
    convdsl's and IREE's versions, the source digest, and the tuning database the knobs come from (its file's
    path, mtime and size: load_db reads it again on a change)."""
    path = tuning_db.DB_PATH
    try:
        stat = path.stat()
        database: tuple = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        database = (str(path),)
    return _package.__version__, compiler.iree_version(), compiler.source_digest(), database


def get_kernel(problem: ConvProblem, target: Union[str, Target] = "cpu", arch: Optional[str] = None) -> Kernel:
    """The loaded kernel for `problem`: from memory, else the disk cache, else compiled (and cached)."""
    tgt = _resolve(target, arch)
    inputs = _key_inputs()
    recent = _recent.get((problem, tgt))
    if recent is not None and recent[0] == inputs:
        return recent[1]
    key = cache_key([problem], tgt)
    kernel = _kernels.get(key)
    if kernel is None:
        module = compiler.compile([problem], tgt, artifact="module")
        module.loaded  # load now: a device error belongs to this call, not to a later one  # noqa: B018
        kernel = module[problem.name]
        _kernels[key] = kernel
    _recent[(problem, tgt)] = (inputs, kernel)
    return kernel


# (op, the arrays' shapes and dtypes, the options with their types) -> the problem infer_problem made of them (and
# its _extra_spec).
# Building and checking a ConvProblem took about 50 us a call, a tenth of a small kernel's time; only the arrays'
# types, shapes and dtypes and the options decide it, so a repeated call takes it from here.  Bounded: a program
# that calls with ever new shapes only refills it.
_inferred: dict[tuple, tuple[ConvProblem, tuple]] = {}
_INFERRED_LIMIT = 4096


def _frozen(value: Any) -> Any:
    """A hashable stand-in for an option's value that tells apart what the normalisers tell apart: the type rides
    along (stride=1.0 is refused where stride=1 is not, though 1.0 == 1), lists become tuples."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_frozen(v) for v in value)
    hash(value)  # TypeError for anything else unhashable: no memo then
    return type(value), value


def _inferred_key(op: str, a: Any, b: Any, extra: Extra, options: Mapping[str, Any]) -> Optional[tuple]:
    given = {name: v for name, v in extra.items() if v is not None}
    arrays = (a, b, *given.values())
    if not all(type(x) is np.ndarray for x in arrays):  # anything else takes the checks (and their errors)
        return None
    try:
        frozen = tuple(sorted((name, _frozen(v)) for name, v in options.items()))
    except TypeError:
        return None
    return (op, *((x.shape, x.dtype) for x in arrays), tuple(given), frozen)


def _run(op: str, a: np.ndarray, b: np.ndarray, options: Mapping[str, Any], extra: Extra,
         target: Union[str, Target], arch: Optional[str], dynamic_batch: bool) -> np.ndarray:
    key = _inferred_key(op, a, b, extra, options)
    known = _inferred.get(key) if key is not None else None
    if known is None:
        problem = infer_problem(op, a, b, **{n: v for n, v in extra.items() if v is not None}, **options)
        known = (problem, _extra_spec(problem))
        if key is not None:
            if len(_inferred) >= _INFERRED_LIMIT:
                _inferred.clear()
            _inferred[key] = known
    problem, spec = known
    if dynamic_batch:
        # one module for every batch size: the key no longer depends on N, the kernel accepts any N
        problem = problem.with_(dynamic_batch=True, batch=DYNAMIC_BATCH_NOMINAL)
    args = (a, b) + _extra_arrays(spec, extra) if spec else (a, b)
    return get_kernel(problem, target, arch)(*args)


# The public ops.  Their options are ConvOptions' fields, keyword-only (with four size-like options a
# positional slip would be silent); each op's signature lists the ones it takes (_with_options).  `input`
# and `filter` shadow builtins on purpose: they are the README's (and .conv files') names.  d= is the
# tensor a bilinear epilogue adds; bias=, scale=, shift= and residual= those of fused epilogue steps (forward
# and conv_transpose); saved= the one a prologue reads (grad_input, grad_weight); target and arch say where the
# kernel runs; dynamic_batch=True compiles one kernel for every batch size.
@_with_options("forward")
def conv(x: np.ndarray, w: np.ndarray, *, d: Optional[np.ndarray] = None, bias: Optional[np.ndarray] = None,
         scale: Optional[np.ndarray] = None, shift: Optional[np.ndarray] = None,
         residual: Optional[np.ndarray] = None, target: Union[str, Target] = "cpu", arch: Optional[str] = None,
         dynamic_batch: bool = False, **options: Any) -> np.ndarray:
    """Forward convolution y = conv(x, w); `groups` defaults to the G axis of x."""
    extra = {"d": d, "bias": bias, "scale": scale, "shift": shift, "residual": residual}
    return _run("forward", x, w, options, extra, target, arch, dynamic_batch)


@_with_options("grad_input")
def grad_input(dy: np.ndarray, w: np.ndarray, *, d: Optional[np.ndarray] = None, saved: Optional[np.ndarray] = None,
               target: Union[str, Target] = "cpu", arch: Optional[str] = None, dynamic_batch: bool = False,
               **options: Any) -> np.ndarray:
    """Backward data dx = grad_input(dy, w); `input=` (required) is the spatial size of dx."""
    return _run("grad_input", dy, w, options, {"d": d, "saved": saved}, target, arch, dynamic_batch)


@_with_options("grad_weight")
def grad_weight(x: np.ndarray, dy: np.ndarray, *, d: Optional[np.ndarray] = None, saved: Optional[np.ndarray] = None,
                target: Union[str, Target] = "cpu", arch: Optional[str] = None, dynamic_batch: bool = False,
                **options: Any) -> np.ndarray:
    """Backward weight dw = grad_weight(x, dy), in `weight_layout`; `filter=` (required) is its taps."""
    return _run("grad_weight", x, dy, options, {"d": d, "saved": saved}, target, arch, dynamic_batch)


@_with_options("transposed")
def conv_transpose(x: np.ndarray, w: np.ndarray, *, d: Optional[np.ndarray] = None, bias: Optional[np.ndarray] = None,
                   scale: Optional[np.ndarray] = None, shift: Optional[np.ndarray] = None,
                   residual: Optional[np.ndarray] = None, target: Union[str, Target] = "cpu",
                   arch: Optional[str] = None, dynamic_batch: bool = False, **options: Any) -> np.ndarray:
    """Transposed convolution: grad_input's arithmetic with x in dy's place.

    x has K channels per group and w is (G, K, taps..., C) in GKYXC; the result has C channels and the
    spatial size `input=` (required), the size of the forward convolution's input that this one inverts.
    """
    extra = {"d": d, "bias": bias, "scale": scale, "shift": shift, "residual": residual}
    return _run("transposed", x, w, options, extra, target, arch, dynamic_batch)
