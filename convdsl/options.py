"""The one normaliser of convolution options, shared by the .conv parser, the functional API and the suite.

Each function takes an option's value as its caller has it (plain Python: numbers, strings, lists; the
parser turns source values into these) and returns the canonical form `ConvProblem` stores, or raises
`OptionError`, which names the option (`key`), what was expected, what came and where inside the value
(`at`, the index path to the offending item).  `str(err)` is the plain message, `key: expected ..., got
...`; the parser renders the same fields at the item's position (`OptionError.located`).

Range checks that `ConvProblem` also makes (stride >= 1, ...) are optional here (`minimum=`): the parser
asks for them to point at the offending item; other callers leave them to `ConvProblem`.
"""
from __future__ import annotations

import difflib
import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from .problem import (
    COMPUTE_TYPES, DTYPES, F32_COMPUTES, LAYOUTS, MAX_SIZE, PROLOGUE_OPS, STEP_OPS, WEIGHT_LAYOUTS, Epilogue,
    ProblemError, Prologue, step_text,
)

__all__ = [
    "ArityError", "Call", "ChoiceError", "DimsError", "OptionError", "compute", "did_you_mean", "dims",
    "dtype", "epilogue", "epilogue_range", "expand", "integer", "layout", "padding", "parse_epilogue",
    "parse_prologue", "prologue", "split_k", "weight_layout",
]


# --- errors --------------------------------------------------------------------------------------------
class OptionError(ProblemError):
    """An option's value that does not fit.

    key: the option; expected: what it takes, as a phrase ("a positive integer"); got: the offending value
    (the item at `at`); at: the index path from the option's value to that item, () for the whole value;
    came: what came, shown instead of the item where that is not the item itself (a count: "3"); within:
    what the expectation is about when not the option itself (an epilogue's signature; "" where `expected`
    already says it); hint: a suggestion ("; did you mean ...?").
    """

    def __init__(self, key: str, expected: str, got: Any, *, at: Sequence[int] = (), came: Optional[str] = None,
                 within: Optional[str] = None, hint: str = "") -> None:
        self.key = key
        self.expected = expected
        self.got = got
        self.at = tuple(at)
        self.came = came
        self.within = key if within is None else within
        self.hint = hint
        super().__init__(self._plain())

    def __reduce__(self):  # the default would call __init__ with only the message
        return _restore, (type(self), self.args, self.__dict__)

    def _plain(self) -> str:
        about = f" {'in' if self.at else 'for'} {self.within}" if self.within not in (self.key, "") else ""
        return f"{self.key}: expected {self.expected}{about}, got {self.came if self.came is not None else repr(self.got)}{self.hint}"

    def located(self, got_text: str) -> str:
        """The message for a diagnostic that points at the item: `expected X for key, got Y` (`in key` for an
        item inside the value); `got_text` describes the item in the caller's own syntax."""
        got = self.came if self.came is not None else got_text
        about = f" {'in' if self.at else 'for'} {self.within}" if self.within else ""
        return f"expected {self.expected}{about}, got {got}{self.hint}"


def _restore(cls: type, args: tuple, state: dict) -> OptionError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class ChoiceError(OptionError):
    """A name outside a fixed set: located as `a layout (NHWGC, GNHWC or NGCHW)`, plain as `one of ...`."""

    def __init__(self, key: str, noun: str, choices: Sequence[str], got: Any, *, hint: str = "") -> None:
        self.choices = tuple(choices)
        super().__init__(key, f"{noun} ({one_of(self.choices)})", got, hint=hint)

    def _plain(self) -> str:
        return f"{self.key}: expected one of {', '.join(self.choices)}, got {self.got!r}{self.hint}"


class DimsError(OptionError):
    """A per-dim list whose length is not the number of spatial dims."""

    def __init__(self, key: str, dims: int, got: Sequence[Any], forms: str) -> None:
        self.dims = dims
        self.forms = forms  # the spellings the option takes, for the plain message
        super().__init__(key, plural(dims, "value"), got, came=str(len(got)), within=f"dims = {dims}")

    def _plain(self) -> str:
        return (f"{self.key}: expected {self.forms} for {plural(self.dims, 'spatial dim')}, "
                f"got {self.came}: {self.got!r}")


class ArityError(OptionError):
    """A call spelling (`scale(alpha)`) with the wrong number of arguments."""

    def __init__(self, key: str, name: str, params: Sequence[str], got: Any, count: int) -> None:
        self.name = name
        self.signature = f"{name}({', '.join(params)})"
        super().__init__(key, plural(len(params), "argument"), got, came=str(count), within=self.signature)

    def _plain(self) -> str:
        return f"{self.key}: {self.name} takes {self.expected} ({self.signature}), got {self.came}: {self.got!r}"


# --- wording -------------------------------------------------------------------------------------------
def one_of(words: Sequence[str]) -> str:
    """"a", "a or b", "a, b or c"."""
    words = list(words)
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def did_you_mean(word: Any, choices: Sequence[str]) -> str:
    """"; did you mean 'X'?" for the closest of `choices` (case-insensitive), or "" (also for a non-string)."""
    if not isinstance(word, str):
        return ""
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{lowered[match[0]]}'?" if match else ""


def _integer_noun(minimum: Optional[int]) -> str:
    return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}")


# --- plain values --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """`name(args...)` as the .conv language writes an epilogue; `args` are plain values."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Chain:
    """`a, b, c` as the .conv language writes a key's several values (an epilogue's steps); `items` are plain
    values."""

    items: tuple[Any, ...]


def _as_int(value: Any) -> Optional[int]:
    """A Python int for Python and NumPy integers (not bools, not floats: 1.5 and 2.0 are not sizes)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_list(value: Any) -> Optional[list]:
    """The items of a list, tuple or array (not of a string), else None."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not hasattr(value, "__len__"):
        return None
    try:
        return list(value)
    except TypeError:  # a 0-d array
        return None


def integer(value: Any, key: str, *, minimum: Optional[int] = None, at: Sequence[int] = ()) -> int:
    """An integer option (groups, batch, channels); `minimum` also checks the range."""
    n = _as_int(value)
    if n is None or (minimum is not None and n < minimum):
        raise OptionError(key, _integer_noun(minimum), value, at=at)
    return n


def dims(value: Any, key: str = "dims") -> int:
    n = _as_int(value)
    if n not in (1, 2, 3):
        raise OptionError(key, "1, 2 or 3", value)
    return n  # type: ignore[return-value]


def expand(value: Any, dims: int, key: str, *, scalar: bool = True, minimum: Optional[int] = None) -> tuple[int, ...]:
    """Per-dim sizes (input, filter, stride, dilation): one integer (if `scalar`) or one per spatial dim."""
    items = _as_list(value)
    if items is None:
        if scalar and isinstance(value, numbers.Number):  # integer() refuses 1.5 as "an integer"
            return (integer(value, key, minimum=minimum),) * dims
        shown = f"one number or a list of {dims} numbers" if scalar else f"a list of {dims} numbers"
        raise OptionError(key, shown, value)
    if len(items) != dims:
        raise DimsError(key, dims, items, f"one number or {dims} numbers" if scalar else f"{dims} numbers")
    return tuple(integer(item, key, minimum=minimum, at=(i,)) for i, item in enumerate(items))


PaddingForm = Literal["pairs", "sides"]


def padding(value: Any, dims: int, key: str = "padding", *, form: PaddingForm = "pairs",
            filter: Optional[Sequence[int]] = None, dilation: Optional[Sequence[int]] = None,
            stride: Optional[Sequence[int]] = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lo per dim, hi per dim) from one number, one per dim, or (form "pairs", the language's and the API's)
    a [lo, hi] pair per dim, the forms mixed per dim; or (form "sides", the suite's) [[lo per dim], [hi per
    dim]].  "valid" is no padding; "same" pads the dilated filter's reach, the odd cell on the high side (as
    PyTorch does), and needs `filter`, `dilation` and a stride of 1."""
    if isinstance(value, str) and value.lower() in ("same", "valid"):
        return _named_padding(value, dims, key, filter, dilation, stride)
    items = _as_list(value)
    if items is None:
        n = integer(value, key, minimum=0)
        return (n,) * dims, (n,) * dims
    if form == "sides" and len(items) == 2 and all(_as_list(side) is not None for side in items):
        lo, hi = (_sides(side, dims, key, at=(i,)) for i, side in enumerate(items))
        return lo, hi
    if len(items) != dims:
        forms = (f"one number, {dims} numbers or {dims} (lo, hi) pairs" if form == "pairs"
                 else f"one number, {dims} numbers or [[lo per dim], [hi per dim]]")
        raise DimsError(key, dims, items, forms)
    pairs = [_pair(item, key, at=(i,), pairs=form == "pairs") for i, item in enumerate(items)]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _pair(item: Any, key: str, at: tuple[int, ...], pairs: bool) -> tuple[int, int]:
    parts = _as_list(item)
    if parts is None:
        if not isinstance(item, numbers.Number):
            raise OptionError(key, "a number or [lo, hi]" if pairs else "a number", item, at=at)
        n = integer(item, key, minimum=0, at=at)
        return n, n
    if not pairs:
        raise OptionError(key, "a number", item, at=at)
    if len(parts) != 2:
        raise OptionError(key, "[lo, hi] (2 values)", item, at=at, came=str(len(parts)))
    lo, hi = (integer(p, key, minimum=0, at=(*at, j)) for j, p in enumerate(parts))
    return lo, hi


def _sides(side: Any, dims: int, key: str, at: tuple[int, ...]) -> tuple[int, ...]:
    items = _as_list(side) or []
    if len(items) != dims:
        raise OptionError(key, f"{plural(dims, 'number')} per side", side, at=at, came=str(len(items)))
    return tuple(integer(v, key, minimum=0, at=(*at, j)) for j, v in enumerate(items))


def _named_padding(value: str, dims: int, key: str, filter: Optional[Sequence[int]],
                   dilation: Optional[Sequence[int]], stride: Optional[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if value.lower() == "valid":
        return (0,) * dims, (0,) * dims
    if filter is None or dilation is None:
        raise OptionError(key, "numbers here (same needs the filter size, which is not known yet)", value)
    if stride is not None and any(s != 1 for s in stride):
        # with stride > 1 no padding keeps the size: PyTorch refuses it too
        raise OptionError(key, "a stride of 1 with same (only then is the output the input's size)", value,
                          came=f"stride {list(stride)}")
    reach = [d * (r - 1) for r, d in zip(filter, dilation)]
    return tuple(t // 2 for t in reach), tuple(t - t // 2 for t in reach)


# --- names ---------------------------------------------------------------------------------------------
_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
_TAPS = {1: "X", 2: "YX", 3: "ZYX"}
_ACT_TEMPLATES = {"NHWGC": "N{sp}G{c}", "GNHWC": "GN{sp}{c}", "NGCHW": "NG{c}{sp}"}
_W_TEMPLATES = {"GKYXC": "GK{taps}C", "GKCYX": "GKC{taps}"}
assert set(_ACT_TEMPLATES) == set(LAYOUTS) and set(_W_TEMPLATES) == set(WEIGHT_LAYOUTS)


def activation_letters(layout: str, dims: int, channel: str = "C") -> str:
    """The axis letters of an activation in `layout` at this rank, e.g. NDHWGC; `channel` C or K."""
    return _ACT_TEMPLATES[layout].format(sp=_SPATIAL[dims], c=channel)


def weight_letters(weight_layout: str, dims: int) -> str:
    """The axis letters of the weight in `weight_layout` at this rank, e.g. GKZYXC."""
    return _W_TEMPLATES[weight_layout].format(taps=_TAPS[dims])


def _spellings(weight: bool) -> dict[str, tuple[str, Optional[int]]]:
    """Spelling -> (canonical name, the rank it fixes or None).  The 2D names stand for every rank, as in
    the .conv language; the 1D and 3D names (NWGC, GKZYXC, ...) also fix the rank."""
    canon = WEIGHT_LAYOUTS if weight else LAYOUTS
    table: dict[str, tuple[str, Optional[int]]] = {name: (name, None) for name in canon}
    for rank in (1, 3):
        for name in canon:
            spelled = weight_letters(name, rank) if weight else activation_letters(name, rank)
            table[spelled] = (name, rank)
    return table


_LAYOUT_SPELLINGS = _spellings(weight=False)
_WEIGHT_LAYOUT_SPELLINGS = _spellings(weight=True)


def _layout(value: Any, key: str, dims: Optional[int], weight: bool) -> tuple[str, Optional[int]]:
    table = _WEIGHT_LAYOUT_SPELLINGS if weight else _LAYOUT_SPELLINGS
    noun, canon = ("a weight layout", WEIGHT_LAYOUTS) if weight else ("a layout", LAYOUTS)
    found = table.get(value.upper()) if isinstance(value, str) else None
    if found is None:
        near = [s for s, (_, rank) in table.items() if dims is None or rank in (None, dims)]
        raise ChoiceError(key, noun, canon, value, hint=did_you_mean(value, near))
    name, rank = found
    if dims is not None and rank not in (None, dims):
        raise ChoiceError(key, noun, canon, value,
                          hint=f"; {value} is the {rank}D spelling of {name}, but dims = {dims}")
    return name, rank


def layout(value: Any, key: str = "layout", *, dims: Optional[int] = None) -> tuple[str, Optional[int]]:
    """An activation layout, any case: (canonical name, the rank its spelling fixes or None).  With `dims`,
    a spelling for another rank is refused."""
    return _layout(value, key, dims, weight=False)


def weight_layout(value: Any, key: str = "weight_layout", *, dims: Optional[int] = None) -> tuple[str, Optional[int]]:
    """A weight layout, as `layout` does it: GKYXC, GKCYX and their 1D/3D spellings (GKX, GKZYXC, ...)."""
    return _layout(value, key, dims, weight=True)


# NumPy and PyTorch names; NumPy's "float" and "double" are 64-bit and so not here
_DTYPE_SPELLINGS = {"f32": "f32", "float32": "f32", "f16": "f16", "float16": "f16", "half": "f16",
                    "bf16": "bf16", "bfloat16": "bf16"}


def dtype(value: Any, key: str = "dtype") -> str:
    """f32, f16 or bf16 from those names, NumPy's (float32, np.float16, np.dtype, ml_dtypes.bfloat16) or
    PyTorch's (torch.float32, torch.bfloat16)."""
    # np.dtype has .name, NumPy scalar types and ml_dtypes have __name__, a torch.dtype prints as "torch.x"
    for spelled in (value, getattr(value, "name", None), getattr(value, "__name__", None), str(value)):
        if isinstance(spelled, str) and spelled.removeprefix("torch.") in _DTYPE_SPELLINGS:
            return _DTYPE_SPELLINGS[spelled.removeprefix("torch.")]
    raise ChoiceError(key, "a dtype", DTYPES, value, hint=did_you_mean(value, DTYPES))


_COMPUTE_USAGE = f"{', '.join(F32_COMPUTES)} or a list of 2 compute types [A, B]"


def compute(value: Any, key: str = "compute") -> Optional[tuple[str, str]]:
    """None; an f32 mode (bf16x3, tf32), stored as the pair (mode, mode); or [A, B] of fp8 / bf8 (a mode
    given for both operands is the mode).  Whether the dtype allows an f32 mode is ConvProblem's check."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in F32_COMPUTES:
            return value, value
        hint = (f"; did you mean [{value}, {value}]?" if value in COMPUTE_TYPES
                else did_you_mean(value, list(F32_COMPUTES)))
        raise OptionError(key, _COMPUTE_USAGE, value, hint=hint)
    items = _as_list(value)
    if items is None:
        raise OptionError(key, _COMPUTE_USAGE, value)
    if len(items) != 2:
        raise OptionError(key, "a list of 2 compute types [A, B]", value, came=f"a list of {len(items)}")
    for i, item in enumerate(items):
        if item not in (*COMPUTE_TYPES, *F32_COMPUTES):
            raise OptionError(key, one_of(COMPUTE_TYPES), item, at=(i,), hint=did_you_mean(item, COMPUTE_TYPES))
    mode = next((c for c in items if c in F32_COMPUTES), None)
    if mode is not None and items[0] != items[1]:
        raise OptionError(key, f"{mode} for both operands or for neither (it treats A and B alike)", value,
                          came=f"[{', '.join(items)}]", within="")
    return items[0], items[1]


def split_k(value: Any, key: str = "split_k") -> Optional[int]:
    """None or "auto" (the planner decides), or a positive integer."""
    if value is None or value == "auto":
        return None
    n = _as_int(value)
    if n is None or n < 1:
        raise OptionError(key, "auto or a positive integer", value)
    if n > MAX_SIZE:  # as every other size: the planner would clamp it silently
        raise OptionError(key, f"at most {MAX_SIZE} (2^31 - 1)", value)
    return n


# --- epilogue and prologue ----------------------------------------------------------------------------
_EPILOGUE_PARAMS = {"none": (), "scale": ("alpha",), "bilinear": ("alpha", "beta")}
# the fused steps as written; gelu also takes torch's approximate= (gelu(tanh); gelu and gelu(none): exact erf)
_STEP_WORDS = ("bias", "affine", "residual", "relu", "silu", "gelu", "hardswish")
_GELU_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}
EPILOGUE_USAGE = "none, scale(alpha) or bilinear(alpha, beta)"
_STEPS_USAGE = "bias, affine, residual, relu, silu, gelu, gelu(tanh) or hardswish"
_CALL_TEXT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.S)


def _call_parts(value: Any) -> Optional[tuple[str, Optional[tuple[Any, ...]]]]:
    """(name, arguments) of a Call or of its text ("scale(0.5)"); arguments None for a bare name ("scale")."""
    if isinstance(value, Call):
        return value.name, value.args
    m = _CALL_TEXT.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    name, inner = m.groups()
    if inner is None:
        return name, None
    texts = [t.strip() for t in inner.split(",")] if inner.strip() else []
    return name, tuple(_number_or_text(t) for t in texts)


def _number_or_text(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def _chain_items(value: Any) -> Optional[tuple[Any, ...]]:
    """The steps of a chain: the language's `a, b`, a list or tuple, or text with commas outside parentheses
    ("scale(0.5), bias, relu"); None for a single step."""
    if isinstance(value, Chain):
        return value.items
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, str):
        parts, depth, start = [], 0, 0
        for i, ch in enumerate(value):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(value[start:i])
                start = i + 1
        if parts:
            return tuple(part.strip() for part in (*parts, value[start:]))
    return None


def _head(value: Any, name: str, args: Optional[tuple[Any, ...]], key: str, usage: str,
          at: tuple[int, ...]) -> Epilogue:
    """scale(alpha) / bilinear(alpha, beta) / none: the epilogue's head, its arguments finite numbers."""
    params = _EPILOGUE_PARAMS[name]
    if args is None and params:
        # `scale` without its arguments is most likely `scale(...)` half written
        raise OptionError(key, usage, value, at=at, hint=f"; did you mean {name}({', '.join(params)})?")
    args = args or ()
    if len(args) != len(params):
        err = ArityError(key, name, params, value, len(args))
        err.at = at
        raise err
    signature = f"{name}({', '.join(params)})"
    values: list[float] = []
    for i, (param, arg) in enumerate(zip(params, args)):
        is_number = isinstance(arg, numbers.Real) and not isinstance(arg, bool)
        if not is_number or not math.isfinite(arg):
            what = "a finite number" if is_number else "a number"
            raise OptionError(key, f"{what} for {param}", arg, at=(*at, i), within=signature)
        values.append(float(arg))
    return Epilogue(name, *values)


def _step(value: Any, name: str, args: Optional[tuple[Any, ...]], key: str, at: tuple[int, ...]) -> str:
    """A fused step's canonical name (gelu(tanh) -> gelu_tanh)."""
    if name == "gelu" and args is not None:
        if len(args) != 1:
            err = ArityError(key, "gelu", ("approximate",), value, len(args))
            err.at = at
            raise err
        if args[0] not in _GELU_APPROXIMATE:
            raise OptionError(key, f"{one_of(list(_GELU_APPROXIMATE))} for approximate (as torch.nn.GELU's)",
                              args[0], at=(*at, 0), within="gelu(approximate)",
                              hint=did_you_mean(args[0], list(_GELU_APPROXIMATE)))
        return _GELU_APPROXIMATE[args[0]]
    if args is not None:
        raise OptionError(key, f"{name} without arguments", value, at=at, within="")
    return name


def epilogue(value: Any, key: str = "epilogue", *, usage: str = EPILOGUE_USAGE, op: Optional[str] = None) -> Epilogue:
    """An epilogue as the language spells it: a name ("none"), a Call, or a chain of steps (`scale(0.5), bias,
    relu`, a list or tuple of them); or as text ("scale(0.5)", "bias, gelu(tanh)").  The scale/bilinear head
    comes first, its arguments finite numbers; the fused steps follow, each once.  `usage` is what the caller
    accepts, for the message; with `op`, steps that op's result cannot take are refused at the step."""
    items = _chain_items(value)
    chained = items is not None
    head, steps = Epilogue(), []
    for index, item in enumerate(items if chained else (value,)):
        at = (index,) if chained else ()
        parts = _call_parts(item)
        if parts is None:
            raise OptionError(key, f"{usage}, or {_STEPS_USAGE}", item, at=at)
        name, args = parts
        if chained and name == "none":
            raise OptionError(key, "a step (none stands alone: no epilogue)", item, at=at, within="")
        if name in _EPILOGUE_PARAMS:
            if index > 0:
                raise OptionError(key, f"{name}(...) as the first step (it acts on the convolution's sum)", item,
                                  at=at, within="", came=f"it after {', '.join(map(step_text, steps))}"
                                  if steps else f"it after {head}")
            head = _head(item, name, args, key, usage, at)
            continue
        if name not in _STEP_WORDS:
            words = [*_EPILOGUE_PARAMS, *_STEP_WORDS]
            raise OptionError(key, f"{usage}, or {_STEPS_USAGE}", item, at=at, hint=did_you_mean(name, words))
        step = _step(item, name, args, key, at)
        if op is not None and op not in STEP_OPS:
            raise OptionError(key, f"scale(alpha) or bilinear(alpha, beta) in a {op} kernel's epilogue ({_STEPS_USAGE} "
                                   f"apply to {' and '.join(STEP_OPS)} results)", item, at=at, within="",
                              came=step_text(step))
        if step in steps:
            raise OptionError(key, "each step once", item, at=at, within="", came=f"a second {step_text(step)}")
        steps.append(step)
    return Epilogue(head.kind, head.alpha, head.beta, tuple(steps))


_PROLOGUE_WORDS = ("relu_backward", "silu_backward", "gelu_backward", "hardswish_backward")
PROLOGUE_USAGE = "none, relu_backward, silu_backward, gelu_backward, gelu_backward(tanh) or hardswish_backward"


def prologue(value: Any, key: str = "prologue", *, usage: str = PROLOGUE_USAGE, op: Optional[str] = None) -> Prologue:
    """An activation's backward applied to dY (`relu_backward`, `gelu_backward(tanh)`, ...) or none, as a name, a
    Call or text; with `op`, an op whose kernel reads no dY is refused."""
    parts = _call_parts(value) if _chain_items(value) is None else None
    if parts is None:
        raise OptionError(key, usage, value)
    name, args = parts
    if name != "none" and name not in _PROLOGUE_WORDS:
        words = ["none", *_PROLOGUE_WORDS]
        hint = did_you_mean(name, words) or (f"; did you mean '{name}_backward'?" if name in _STEP_WORDS else "")
        raise OptionError(key, usage, value, hint=hint)
    kind = name
    if name == "gelu_backward" and args is not None:
        kind = _step(value, "gelu", args, key, ()) + "_backward"
    elif args is not None:
        raise OptionError(key, f"{name} without arguments", value, within="")
    if op is not None and kind != "none" and op not in PROLOGUE_OPS:
        raise OptionError(key, f"a prologue only on {' and '.join(PROLOGUE_OPS)} kernels (it acts on the dY they "
                               f"read)", value, within="", came=f"it on a {op} kernel")
    return Prologue(kind)


# The largest finite value of each dtype: alpha * acc is computed in f32, then cast to the result's dtype
FINITE_MAX = {"f32": 3.4028234663852886e38, "f16": 65504.0, "bf16": 3.3895313892515355e38}
_F32_TINIEST = 1.401298464324817e-45  # the smallest f32 subnormal: a smaller alpha becomes 0


def epilogue_range(value: Epilogue, result_dtype: str, key: str = "epilogue", *, at: Sequence[int] = ()) -> Epilogue:
    """The epilogue, once its arguments fit: each must be representable in the result's dtype (and as the f32
    constant it is compiled to), else every nonzero result would silently be inf, or 0.  `at`: the head's index
    path in the caller's value (a chain's first step: (0,))."""
    params = _EPILOGUE_PARAMS[value.kind]
    signature = f"{value.kind}({', '.join(params)})"
    largest = FINITE_MAX[result_dtype]
    for i, param in enumerate(params):
        x = value.beta if param == "beta" else value.alpha
        if abs(x) > largest:
            raise OptionError(key, f"{param} representable in the output dtype {result_dtype} (|{param}| <= "
                                   f"{largest:.6g})", x, at=(*at, i), within=signature, came=f"{x:g}")
        if 0 < abs(x) < _F32_TINIEST:
            raise OptionError(key, f"{param} representable as the f32 constant it is applied as (0 or |{param}| "
                                   f">= {_F32_TINIEST:.3g})", x, at=(*at, i), within=signature, came=f"{x:g}")
    return value


def parse_epilogue(value: Any, key: str = "epilogue") -> Epilogue:
    """None (no epilogue), an Epilogue, or its spelling as `epilogue` takes it ("scale(0.5)")."""
    if value is None:
        return Epilogue()
    if isinstance(value, Epilogue):
        return value
    return epilogue(value, key, usage=f"an Epilogue or {EPILOGUE_USAGE}")


def parse_prologue(value: Any, key: str = "prologue") -> Prologue:
    """None (no prologue), a Prologue, or its spelling as `prologue` takes it ("relu_backward")."""
    if value is None:
        return Prologue()
    if isinstance(value, Prologue):
        return value
    return prologue(value, key, usage=f"a Prologue or {PROLOGUE_USAGE}")
