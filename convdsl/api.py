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

Arrays are checked before anything is compiled; a problem raises `ArgumentError` (wrong array: type,
rank, dtype, shape, groups) or `ProblemError` (inconsistent options), naming the argument with what was
expected and what was got.  Compiled kernels are kept in memory for the process, keyed like the disk
cache (compiler.cache_key), and on disk across processes.
"""
from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from .abi import KERNEL_NAME
from .compiler import cache_key, compile_vmfb
from .module import ArgumentError, CompiledModule, Kernel, resolve_target
from .problem import F32_COMPUTES, DYNAMIC_BATCH_NOMINAL, COMPUTE_TYPES, DTYPES, LAYOUTS, WEIGHT_LAYOUTS, ConvProblem, Epilogue, ProblemError
from .targets import Target

__all__ = [
    "conv",
    "grad_input",
    "grad_weight",
    "conv_transpose",
    "infer_problem",
    "get_kernel",
    "clear_memory_cache",
]


IntOrInts = Union[int, Sequence[int]]
Padding = Union[int, Sequence[int], Sequence[Sequence[int]]]

_NUMPY_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
_TAPS = {1: "X", 2: "YX", 3: "ZYX"}
_ACT_TEMPLATES = {"NHWGC": "N{sp}G{c}", "GNHWC": "GN{sp}{c}", "NGCHW": "NG{c}{sp}"}
_W_TEMPLATES = {"GKYXC": "GK{taps}C", "GKCYX": "GKC{taps}"}


# --- option normalisation ------------------------------------------------------------------------
def _layout_aliases() -> tuple[dict[str, tuple[str, Optional[int]]], dict[str, tuple[str, Optional[int]]]]:
    """Spelling -> (canonical name, dims it implies or None).  The 2D names stand for every rank, as in
    the .conv language; rank-specific names (NDHWGC, GKZYXC, ...) also fix the rank."""
    acts: dict[str, tuple[str, Optional[int]]] = {name: (name, None) for name in LAYOUTS}
    weights: dict[str, tuple[str, Optional[int]]] = {name: (name, None) for name in WEIGHT_LAYOUTS}
    for dims in (1, 3):
        for name, tpl in _ACT_TEMPLATES.items():
            acts[tpl.format(sp=_SPATIAL[dims], c="C")] = (name, dims)
        for name, tpl in _W_TEMPLATES.items():
            weights[tpl.format(taps=_TAPS[dims])] = (name, dims)
    return acts, weights


_ACT_ALIASES, _W_ALIASES = _layout_aliases()


def _layout(value: Any, op: str, weight: bool) -> tuple[str, Optional[int]]:
    table = _W_ALIASES if weight else _ACT_ALIASES
    key = "weight_layout" if weight else "layout"
    if isinstance(value, str) and value.upper() in table:
        return table[value.upper()]
    shown = ", ".join(WEIGHT_LAYOUTS if weight else LAYOUTS)
    raise ProblemError(f"{op}: {key}: expected one of {shown} (or its 1D/3D spelling), got {value!r}")


def _int(value: Any, key: str, op: str) -> int:
    # operator.index accepts Python and NumPy integers but not floats or bools-as-floats: 1.5 is an error.
    if isinstance(value, bool):
        raise ProblemError(f"{op}: {key}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ProblemError(f"{op}: {key}: expected an integer, got {value!r}") from None


def _ints(value: Any, dims: int, key: str, op: str) -> tuple[int, ...]:
    """One integer or one per spatial dim -> `dims` Python ints (ConvProblem rejects NumPy integers)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        values = [_int(v, key, op) for v in value]
        if len(values) != dims:
            raise ProblemError(f"{op}: {key}: expected one number or {dims} numbers for {dims} spatial "
                               f"dim(s), got {len(values)}: {list(values)}")
        return tuple(values)
    return (_int(value, key, op),) * dims


def _padding(value: Any, dims: int, op: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """padding: n, [n, ...] or [(lo, hi), ...] per dim (forms may mix per dim, as in .conv files)."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        n = _int(value, "padding", op)
        return (n,) * dims, (n,) * dims
    items = list(value)
    if len(items) != dims:
        raise ProblemError(f"{op}: padding: expected one number, {dims} numbers or {dims} (lo, hi) pairs for "
                           f"{dims} spatial dim(s), got {len(items)}: {value!r}")
    lo: list[int] = []
    hi: list[int] = []
    for item in items:
        if isinstance(item, (list, tuple, np.ndarray)):
            if len(item) != 2:
                raise ProblemError(f"{op}: padding: expected (lo, hi) pairs, got {list(item)!r}")
            lo.append(_int(item[0], "padding", op))
            hi.append(_int(item[1], "padding", op))
        else:
            n = _int(item, "padding", op)
            lo.append(n)
            hi.append(n)
    return tuple(lo), tuple(hi)


def _dtype_name(value: Any, key: str, op: str) -> str:
    if isinstance(value, str) and value in DTYPES:
        return value
    try:
        name = np.dtype(value).name
    except TypeError:
        name = None
    if name in _NUMPY_NAMES:
        return _NUMPY_NAMES[name]
    raise ProblemError(f"{op}: {key}: expected one of {', '.join(DTYPES)} (or float32, float16, bfloat16), "
                       f"got {value!r}")


def _compute(value: Any, op: str) -> Optional[tuple[str, str]]:
    if value is None:
        return None
    if isinstance(value, str):  # "fp8" for both operands, "bf8,fp8" for (A, B), or "bf16x3" / "tf32" (f32 only)
        parts = [s.strip() for s in value.split(",")]
        value = parts * 2 if len(parts) == 1 else parts
    value = tuple(value)
    mode = next((v for v in value if v in F32_COMPUTES), None)
    if mode is not None:
        if value != (mode, mode):
            raise ProblemError(f"{op}: compute: expected \"{mode}\" for both operands, not mixed with "
                               f"{', '.join(COMPUTE_TYPES)}, got {value!r}")
        return value  # type: ignore[return-value]  # ConvProblem checks the dtype (f32 only)
    if len(value) != 2 or any(v not in COMPUTE_TYPES for v in value):
        raise ProblemError(f"{op}: compute: expected (A, B) from {', '.join(COMPUTE_TYPES)}, one of them for "
                           f"both, or one of {', '.join(repr(m) for m in F32_COMPUTES)}, got {value!r}")
    return value  # type: ignore[return-value]


_EPILOGUE_RE = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$")
_EPILOGUE_ARGS = {"none": 0, "scale": 1, "bilinear": 2}


def parse_epilogue(value: Union[None, str, Epilogue], op: str = "epilogue") -> Epilogue:
    """None, an Epilogue, or the .conv spelling: "none", "scale(0.5)", "bilinear(1.0, 0.5)"."""
    if value is None:
        return Epilogue()
    if isinstance(value, Epilogue):
        return value
    usage = "none, scale(alpha) or bilinear(alpha, beta)"
    m = _EPILOGUE_RE.match(value) if isinstance(value, str) else None
    if m is None or m.group(1) not in _EPILOGUE_ARGS:
        raise ProblemError(f"{op}: epilogue: expected an Epilogue or {usage}, got {value!r}")
    kind, args = m.group(1), m.group(2)
    texts = [a.strip() for a in args.split(",")] if args and args.strip() else []
    if len(texts) != _EPILOGUE_ARGS[kind]:
        raise ProblemError(f"{op}: epilogue: {kind} takes {_EPILOGUE_ARGS[kind]} argument(s) ({usage}), "
                           f"got {value!r}")
    try:
        numbers = [float(t) for t in texts]
    except ValueError:
        raise ProblemError(f"{op}: epilogue: expected numbers in {value!r}") from None
    if not all(math.isfinite(n) for n in numbers):
        raise ProblemError(f"{op}: epilogue: expected finite numbers, got {value!r}")
    return Epilogue(kind, *numbers)


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


def _axis_names(layout: str, dims: int, channel: str) -> str:
    return _ACT_TEMPLATES[layout].format(sp=_SPATIAL[dims], c=channel)


def _weight_axis_names(weight_layout: str, dims: int) -> str:
    return _W_TEMPLATES[weight_layout].format(taps=_TAPS[dims])


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


def _check_array(a: Any, name: str, op: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ArgumentError(f"{op}: argument {name!r} expected a NumPy array, got {type(a).__name__}")
    if a.dtype.name not in _NUMPY_NAMES or not a.dtype.isnative:
        raise ArgumentError(f"{op}: argument {name!r} expected dtype f32, f16 or bf16 (float32, float16, "
                            f"ml_dtypes.bfloat16), got {a.dtype}")
    if 0 in a.shape:
        raise ArgumentError(f"{op}: argument {name!r} has an empty axis: shape {list(a.shape)}")
    return a


def _rank_error(op: str, name: str, a: np.ndarray, what: str, want: str) -> ArgumentError:
    return ArgumentError(f"{op}: argument {name!r} expected rank {want} for {what}, got rank {a.ndim} "
                         f"(shape {list(a.shape)})")


def _layout_word(kind: str, layout: str, weight_layout: str, dims: int) -> str:
    if kind == "w":
        return _weight_axis_names(weight_layout, dims)
    return _axis_names(layout, dims, "C" if kind == "x" else "K")


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


def infer_problem(
    op: str,
    a: np.ndarray,
    b: np.ndarray,
    *,
    input: Optional[IntOrInts] = None,
    filter: Optional[IntOrInts] = None,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    padding: Padding = 0,
    groups: Optional[int] = None,
    layout: str = "NHWGC",
    weight_layout: str = "GKYXC",
    out_dtype: Any = None,
    compute: Any = None,
    split_k: Union[None, int, str] = None,
    epilogue: Union[None, str, Epilogue] = None,
    d: Optional[np.ndarray] = None,
) -> ConvProblem:
    """The ConvProblem (named KERNEL_NAME) that `op` on arrays `a`, `b` (kernel order) describes.

    Raises ArgumentError for arrays that do not fit (type, rank, dtype, groups, shapes) and ProblemError for
    inconsistent options; nothing is compiled.
    """
    if op not in _OPERANDS:
        raise ProblemError(f"op: expected one of {', '.join(_OPERANDS)}, got {op!r}")
    fn = _PUBLIC_NAMES[op]
    (a_name, a_kind), (b_name, b_kind) = _OPERANDS[op]
    a = _check_array(a, a_name, fn)
    b = _check_array(b, b_name, fn)
    if b.dtype != a.dtype:
        raise ArgumentError(f"{fn}: argument {b_name!r} expected dtype {a.dtype} to match {a_name!r}, got {b.dtype}")
    dtype = _NUMPY_NAMES[a.dtype.name]

    act_layout, act_dims = _layout(layout, fn, weight=False)
    w_layout, w_dims = _layout(weight_layout, fn, weight=True)
    # The first argument is always an activation: its rank gives the number of spatial dims.
    dims = a.ndim - 3
    if act_dims is not None and dims != act_dims:
        raise _rank_error(fn, a_name, a, f"layout {layout}", str(act_dims + 3))
    if dims not in (1, 2, 3):
        channel = "C" if a_kind == "x" else "K"
        letters = _ACT_TEMPLATES[act_layout].format(sp="S", c=channel)
        axes = ", ".join("spatial..." if ch == "S" else ch for ch in letters)
        raise _rank_error(fn, a_name, a, f"layout {act_layout} = ({axes}) with 1, 2 or 3 spatial dims", "4, 5 or 6")
    if b_kind == "w" and w_dims is not None and w_dims != dims:
        raise ProblemError(f"{fn}: weight_layout {weight_layout} is for {w_dims}D, but {a_name!r} has rank "
                           f"{a.ndim}: {dims} spatial dim(s) in layout {act_layout}")
    if b.ndim != dims + 3:
        what = _layout_word(b_kind, act_layout, w_layout, dims)
        raise _rank_error(fn, b_name, b, f"{what} ({dims} spatial dim(s), as {a_name!r} of rank {a.ndim})",
                          str(dims + 3))

    def word(kind: str) -> str:
        return _layout_word(kind, act_layout, w_layout, dims)

    def shape_error(name: str, kind: str, arr: np.ndarray, detail: str) -> ArgumentError:
        return ArgumentError(f"{fn}: argument {name!r} (shape {list(arr.shape)}, {word(kind)}) {detail}")

    first = _activation(a.shape, act_layout, dims)
    # Exactly one of these is set: the second operand is a weight, or (grad_weight) dy.
    w: Optional[_Weight] = _weight(b.shape, w_layout, dims) if b_kind == "w" else None
    second: Optional[_Activation] = _activation(b.shape, act_layout, dims) if w is None else None
    second_groups = w.groups if w is not None else second.groups  # type: ignore[union-attr]

    # Groups: the G axis of every array must agree, and with `groups=` when it is given.
    if groups is not None:
        g = _int(groups, "groups", fn)
        for name, kind, arr, got in ((a_name, a_kind, a, first.groups), (b_name, b_kind, b, second_groups)):
            if got != g:
                raise shape_error(name, kind, arr, f"has G = {got} on its G axis, but groups = {g}")
    elif second_groups != first.groups:
        raise shape_error(b_name, b_kind, b, f"has G = {second_groups}, expected G = {first.groups} to match "
                                             f"{a_name!r}")
    groups_ = first.groups

    lo, hi = _padding(padding, dims, fn)
    stride_ = _ints(stride, dims, "stride", fn)
    dilation_ = _ints(dilation, dims, "dilation", fn)

    if op in ("grad_input", "transposed"):
        if input is None:
            what = "dx" if op == "grad_input" else "the output y"
            fits = _fit_text(first.spatial, w.taps if w is not None else first.spatial, stride_, dilation_, lo, hi)
            raise ArgumentError(
                f"{fn}: missing input=: the spatial size of {what}; it cannot be read from {a_name!r} because with "
                f"stride > 1 several sizes give the same {a_name} size (here {a_name} {list(first.spatial)} fits "
                f"input= {fits})"
            )
        input_ = _ints(input, dims, "input", fn)
    else:
        input_ = first.spatial
    if w is None:  # grad_weight
        if filter is None:
            raise ArgumentError(f"{fn}: missing filter=: the filter's spatial size, e.g. filter="
                                f"{(3,) * dims}; dw's taps are not implied by x and dy")
        filter_ = _ints(filter, dims, "filter", fn)
    else:
        filter_ = w.taps
        if filter is not None and _ints(filter, dims, "filter", fn) != filter_:
            raise shape_error(b_name, b_kind, b, f"has filter taps {list(filter_)}, but filter = {filter!r}")

    # Channels per group: C of x and K of y, tied through the weight where there is one.
    if op == "forward" and w is not None:
        if w.in_channels != first.channels:
            raise shape_error("w", "w", b, f"has C = {w.in_channels}, expected C = {first.channels} to match 'x'")
        c, k = first.channels, w.out_channels
    elif w is not None:  # grad_input, transposed
        if w.out_channels != first.channels:
            raise shape_error("w", "w", b, f"has K = {w.out_channels}, expected K = {first.channels} to match "
                                           f"{a_name!r}")
        c, k = w.in_channels, first.channels
    else:  # grad_weight
        assert second is not None
        if second.batch != first.batch:
            raise shape_error("dy", "y", b, f"has N = {second.batch}, expected N = {first.batch} to match 'x'")
        c, k = first.channels, second.channels

    split = None if split_k in (None, "auto") else _int(split_k, "split_k", fn)
    out = _dtype_name(out_dtype, "out_dtype", fn) if out_dtype is not None else None
    compute_ = _compute(compute, fn)
    epilogue_ = parse_epilogue(epilogue, fn)
    try:
        problem = ConvProblem(
            op=op, dims=dims, groups=groups_, batch=first.batch, in_channels=c, out_channels=k,
            input=input_, filter=filter_, stride=stride_, dilation=dilation_, pad_lo=lo, pad_hi=hi,
            layout=act_layout, weight_layout=w_layout, dtype=dtype,
            # out_dtype equal to dtype is stored as None, as the parser does, so both spellings share a key.
            out_dtype=None if out == dtype else out,
            compute=compute_, split_k=split, epilogue=epilogue_, name=KERNEL_NAME,
        )
    except ProblemError as err:
        raise ProblemError(f"{fn}: {err}") from None

    # The output-side activation must have the spatial size the conv produces from input and filter.
    # (forward has none: its output size is whatever x and w give.)
    out_side = (b_name, b_kind, b, second) if second is not None else (a_name, a_kind, a, first)
    if op != "forward":
        name, kind, arr, act = out_side
        if act.spatial != problem.output:
            detail = (f"has spatial size {list(act.spatial)}, expected {list(problem.output)}: the output size "
                      f"for input {list(problem.input)}, filter {list(problem.filter)}, stride "
                      f"{list(problem.stride)}, dilation {list(problem.dilation)}, padding "
                      f"{list(problem.pad_lo)}/{list(problem.pad_hi)}")
            if op != "grad_weight":
                detail += "; input= sizes that fit it: " + _fit_text(
                    act.spatial, problem.filter, problem.stride, problem.dilation, problem.pad_lo, problem.pad_hi)
            raise shape_error(name, kind, arr, detail)

    if problem.epilogue.has_tensor:
        if d is None:
            raise ArgumentError(f"{fn}: epilogue {problem.epilogue} needs d=, the tensor it adds (beta * d), of "
                                f"shape {list(problem.result_shape)}")
        d = _check_array(d, "d", fn)
        if tuple(d.shape) != problem.result_shape:
            raise ArgumentError(f"{fn}: argument 'd' expected shape {list(problem.result_shape)} (the result's), "
                                f"got {list(d.shape)}")
        want = problem.result_dtype
        if _NUMPY_NAMES[d.dtype.name] != want:
            raise ArgumentError(f"{fn}: argument 'd' expected dtype {want} (the result's), got {d.dtype}")
    elif d is not None:
        raise ArgumentError(f"{fn}: d= is only used by a bilinear epilogue, but epilogue is {problem.epilogue}")
    return problem


# --- compiled kernels ------------------------------------------------------------------------------
# cache key -> a kernel whose module is loaded on its device.  Keyed like the disk cache so that a
# changed version (or flag) in the same process can never pick up a stale module.
_kernels: dict[str, Kernel] = {}


def clear_memory_cache() -> None:
    """Forget the kernels compiled or loaded in this process (the disk cache is untouched)."""
    _kernels.clear()


def get_kernel(problem: ConvProblem, target: Union[str, Target] = "cpu", arch: Optional[str] = None) -> Kernel:
    """The loaded kernel for `problem`: from memory, else the disk cache, else compiled (and cached)."""
    tgt = _resolve(target, arch)
    key = cache_key([problem], tgt)
    kernel = _kernels.get(key)
    if kernel is None:
        module = CompiledModule([problem], tgt, compile_vmfb([problem], tgt))
        module.loaded  # load now: a device error belongs to this call, not to a later one  # noqa: B018
        kernel = module[problem.name]
        _kernels[key] = kernel
    return kernel


def _run(op: str, a: np.ndarray, b: np.ndarray, target: Union[str, Target], arch: Optional[str],
         dynamic_batch: bool, **options: Any) -> np.ndarray:
    problem = infer_problem(op, a, b, **options)
    if dynamic_batch:
        # one module for every batch size: the key no longer depends on N, the kernel accepts any N
        problem = problem.with_(dynamic_batch=True, batch=DYNAMIC_BATCH_NOMINAL)
    args = (a, b) + ((options["d"],) if problem.epilogue.has_tensor else ())
    return get_kernel(problem, target, arch)(*args)


# The public ops.  Options are keyword-only: with four size-like options a positional slip would be
# silent.  `input` and `filter` shadow builtins on purpose: they are the README's (and .conv files') names.
def conv(
    x: np.ndarray,
    w: np.ndarray,
    *,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    padding: Padding = 0,
    groups: Optional[int] = None,
    layout: str = "NHWGC",
    weight_layout: str = "GKYXC",
    out_dtype: Any = None,
    compute: Any = None,
    epilogue: Union[None, str, Epilogue] = None,
    d: Optional[np.ndarray] = None,
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    dynamic_batch: bool = False,
) -> np.ndarray:
    """Forward convolution y = conv(x, w); `groups` defaults to the G axis of x."""
    return _run("forward", x, w, target, arch, dynamic_batch, stride=stride, dilation=dilation, padding=padding, groups=groups,
                layout=layout, weight_layout=weight_layout, out_dtype=out_dtype, compute=compute,
                epilogue=epilogue, d=d)


def grad_input(
    dy: np.ndarray,
    w: np.ndarray,
    *,
    input: Optional[IntOrInts] = None,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    padding: Padding = 0,
    groups: Optional[int] = None,
    layout: str = "NHWGC",
    weight_layout: str = "GKYXC",
    out_dtype: Any = None,
    compute: Any = None,
    epilogue: Union[None, str, Epilogue] = None,
    d: Optional[np.ndarray] = None,
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    dynamic_batch: bool = False,
) -> np.ndarray:
    """Backward data dx = grad_input(dy, w); `input=` (required) is the spatial size of dx."""
    return _run("grad_input", dy, w, target, arch, dynamic_batch, input=input, stride=stride, dilation=dilation, padding=padding,
                groups=groups, layout=layout, weight_layout=weight_layout, out_dtype=out_dtype, compute=compute,
                epilogue=epilogue, d=d)


def grad_weight(
    x: np.ndarray,
    dy: np.ndarray,
    *,
    filter: Optional[IntOrInts] = None,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    padding: Padding = 0,
    groups: Optional[int] = None,
    layout: str = "NHWGC",
    weight_layout: str = "GKYXC",
    out_dtype: Any = None,
    compute: Any = None,
    split_k: Union[None, int, str] = None,
    epilogue: Union[None, str, Epilogue] = None,
    d: Optional[np.ndarray] = None,
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    dynamic_batch: bool = False,
) -> np.ndarray:
    """Backward weight dw = grad_weight(x, dy), in `weight_layout`; `filter=` (required) is its taps."""
    return _run("grad_weight", x, dy, target, arch, dynamic_batch, filter=filter, stride=stride, dilation=dilation,
                padding=padding, groups=groups, layout=layout, weight_layout=weight_layout, out_dtype=out_dtype,
                compute=compute, split_k=split_k, epilogue=epilogue, d=d)


def conv_transpose(
    x: np.ndarray,
    w: np.ndarray,
    *,
    input: Optional[IntOrInts] = None,
    stride: IntOrInts = 1,
    dilation: IntOrInts = 1,
    padding: Padding = 0,
    groups: Optional[int] = None,
    layout: str = "NHWGC",
    weight_layout: str = "GKYXC",
    out_dtype: Any = None,
    compute: Any = None,
    epilogue: Union[None, str, Epilogue] = None,
    d: Optional[np.ndarray] = None,
    target: Union[str, Target] = "cpu",
    arch: Optional[str] = None,
    dynamic_batch: bool = False,
) -> np.ndarray:
    """Transposed convolution: grad_input's arithmetic with x in dy's place.

    x has K channels per group and w is (G, K, taps..., C) in GKYXC; the result has C channels and the
    spatial size `input=` (required), the size of the forward convolution's input that this one inverts.
    """
    return _run("transposed", x, w, target, arch, dynamic_batch, input=input, stride=stride, dilation=dilation, padding=padding,
                groups=groups, layout=layout, weight_layout=weight_layout, out_dtype=out_dtype, compute=compute,
                epilogue=epilogue, d=d)
