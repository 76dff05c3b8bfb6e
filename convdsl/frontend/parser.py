"""Parse convdsl source text into `ConvProblem`s, one per `kernel` line.

A file holds any number of `conv` blocks and `kernel` lines, in any order: a kernel may refer to a
conv declared before or after it (convs are collected and checked first, then kernels in file
order), so a file can list its kernels at the top.  The returned list follows the kernel order.

    conv rx2 {                      # entries separated by newlines or `;`
      dims = 2; groups = 32; batch = 64
      in_channels = 4; out_channels = 4      # per group
      input = [56, 56]; filter = [3, 3]
      stride = 1; dilation = 1; padding = 1  # padding: n, [n, ...], [[lo, hi], ...], same or valid
      layout = NHWGC; weight_layout = GKYXC; dtype = f16
    }
    kernel wgrad = grad_weight(rx2) { split_k = auto; out_dtype = f32; epilogue = scale(0.5) }

Conv keys: dims, batch, in_channels, out_channels, input, filter (required); groups (1), stride (1),
dilation (1), padding (0), layout (NHWGC), weight_layout (GKYXC), dtype (f32), and the kernel
defaults out_dtype and compute.  Kernel options: split_k (grad_weight only), out_dtype, epilogue,
compute; a kernel's value wins over its conv's default.  compute is [A, B] of fp8 / bf8, or one of the
f32 modes (f32 only; also written quoted, the one quoted value of the language): bf16x3, f32 as three bf16
products; tf32, one-pass TF32 products allowed (cuDNN's and PyTorch's default for convolutions).

`input` and `filter` always take a list, one size per spatial dim, even for dims = 1: a bare number
there is more likely a slip than a square image.  Layouts are named in their 2D form (NHWGC means
NWGC in 1D and NDHWGC in 3D); the name for the conv's own rank is accepted too and normalised, in any
case.  A dtype may also be written by its NumPy name (float32, float16, bfloat16).  A padding list may mix the two forms per dim: `[1, [0, 1]]`; `padding = same` keeps the size (stride 1),
`valid` is no padding.  An `out_dtype` equal to `dtype` is stored as None ("same as dtype") so that
equivalent sources give equal, equally-hashed problems.

Values are normalised by convdsl.options, the functions the Python API uses too; the parser hands each
value over as plain Python (numbers, names as strings, lists) and turns an `OptionError`, which names
the offending item by its index path in the value, into a diagnostic at that item's source position.

Every error in the source raises `ConvSyntaxError` (a ValueError), rendered like a compiler
diagnostic: `file:line:col: error: expected ..., got ...`, the source line and a `^~~~` underline.
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lark import PostLex
from lark.lexer import PatternStr

from convdsl import options
from convdsl.options import Call, Chain, DimsError, OptionError, did_you_mean, one_of
from convdsl.problem import (
    DYNAMIC_BATCH_NOMINAL, F32_COMPUTES, OPS, PROLOGUE_OPS, ConvProblem, Epilogue, ProblemError, Prologue,
)

__all__ = ["ConvSyntaxError", "parse", "parse_file", "CONV_KEYS", "KERNEL_KEYS", "REQUIRED_CONV_KEYS"]

# Listing order is the order a reader meets them in a conv block; messages list keys in this order.
CONV_KEYS = (
    "dims", "groups", "batch", "in_channels", "out_channels", "input", "filter", "stride",
    "dilation", "padding", "layout", "weight_layout", "dtype", "out_dtype", "compute",
)
REQUIRED_CONV_KEYS = ("dims", "batch", "in_channels", "out_channels", "input", "filter")
KERNEL_KEYS = ("split_k", "out_dtype", "epilogue", "prologue", "compute")
# the keys that take several comma-separated values (a chain of steps)
_CHAIN_KEYS = ("epilogue",)

# Nothing in the language nests deeper than padding's [[lo, hi], ...]; the limit only keeps a
# pathological `[[[[...` from turning into a RecursionError in the tree walk.
_MAX_NESTING = 16
# far beyond any real source (a few KiB); the cap keeps a wrong path from being read until memory runs out
MAX_SOURCE_BYTES = 16 * 2**20
# Sizes stop at 2^31 - 1 (10 digits): a longer integer is refused where it stands, before int() parses it
_MAX_DIGITS = 20
# IREE's VM reserves these function names in every module (its initialiser and finaliser): a kernel named so
# compiles, but the module does not load
_RESERVED_PREFIX = "__"


# ------------------------------------------------------------------------------------------------
# Diagnostics
# ------------------------------------------------------------------------------------------------
class ConvSyntaxError(ValueError):
    """An error in convdsl source, pinned to a file position.

    str() gives the full diagnostic: `file:line:col: error: message`, the source line, a caret line
    underlining `width` characters from `column`, then any `note:` lines.
    """

    def __init__(
        self,
        message: str,
        filename: str = "<string>",
        line: int = 1,
        column: int = 1,
        source_line: str = "",
        width: int = 1,
        notes: Sequence[str] = (),
    ) -> None:
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        self.source_line = source_line
        self.width = max(1, width)
        self.notes = tuple(notes)
        super().__init__(self._render())

    def _render(self) -> str:
        # Keep the source line's tabs in the caret line's indent so the caret lines up in a terminal.
        indent = "".join(c if c == "\t" else " " for c in self.source_line[: self.column - 1])
        parts = [
            f"{self.filename}:{self.line}:{self.column}: error: {self.message}",
            self.source_line,
            indent + "^" + "~" * (self.width - 1),
        ]
        parts.extend(self.notes)
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):  # the default would call __init__ with only the rendered text
        return (
            type(self),
            (self.message, self.filename, self.line, self.column, self.source_line, self.width, self.notes),
        )


@dataclass(frozen=True)
class _Span:
    line: int
    column: int
    end_line: int
    end_column: int
    start_pos: int
    end_pos: int


def _span(node: Union[Tree, Token]) -> _Span:
    if isinstance(node, Token):
        return _Span(node.line, node.column, node.end_line, node.end_column, node.start_pos, node.end_pos)
    m = node.meta
    return _Span(m.line, m.column, m.end_line, m.end_column, m.start_pos, m.end_pos)


class _Source:
    """The text being parsed, able to turn a span and a message into a ConvSyntaxError."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename
        # Lark counts lines by "\n" only; str.splitlines would also split on \f, \x1c, ... and skew.
        self.lines = [line.rstrip("\r") for line in text.split("\n")]

    def line_text(self, line: int) -> str:
        return self.lines[line - 1] if 1 <= line <= len(self.lines) else ""

    def where(self, span: _Span) -> str:
        return f"{self.filename}:{span.line}:{span.column}"

    def snippet(self, span: _Span, limit: int = 40) -> str:
        text = " ".join(self.text[span.start_pos : span.end_pos].split())
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def error(self, span: _Span, message: str, notes: Sequence[str] = ()) -> ConvSyntaxError:
        source_line = self.line_text(span.line)
        if span.end_line == span.line:
            width = span.end_column - span.column
        else:  # a value wrapped over lines: underline to the end of its first line
            width = len(source_line) - span.column + 1
        return ConvSyntaxError(message, self.filename, span.line, span.column, source_line, width, notes)

    def note(self, span: _Span, message: str) -> str:
        return f"{self.where(span)}: note: {message}"


# ------------------------------------------------------------------------------------------------
# Lark: grammar, newline handling, syntax-error translation
# ------------------------------------------------------------------------------------------------
class _BracketNewlines(PostLex):
    """Drop newlines inside [...] and (...), and after a comma, so lists, epilogue arguments and chains of steps may
    wrap lines."""

    # The contextual lexer only lexes terminals the parser state accepts; _NL must always be
    # lexed so that this filter, not the lexer, decides where a newline is meaningful.
    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth, last = 0, None
        for tok in stream:
            if tok.type == "_NL":
                # and after a comma outside brackets: a chain of epilogue steps may wrap after any of its commas
                if depth or (last is not None and last.value == ","):
                    continue
            elif tok.value in ("[", "("):
                depth += 1
            elif tok.value in ("]", ")"):
                depth = max(0, depth - 1)
            last = tok
            yield tok


@lru_cache(maxsize=None)
def _lark() -> Lark:
    return Lark.open(
        "grammar.lark",
        rel_to=__file__,
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        postlex=_BracketNewlines(),
    )


_TERMINAL_WORDS = {"NAME": "a name", "NUMBER": "a number", "_NL": "a newline", "$END": "end of input"}


def _terminal_word(name: str) -> tuple[int, str]:
    """(sort rank, human words) for a terminal name from a Lark error."""
    # Order: open-ended tokens, then keywords, then punctuation, then line and file ends.
    if name in _TERMINAL_WORDS:
        rank = {"NAME": 0, "NUMBER": 1, "_NL": 4, "$END": 5}[name]
        return rank, _TERMINAL_WORDS[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return 3, name.lower()
    if isinstance(pattern, PatternStr):
        return (2 if pattern.value.isidentifier() else 3), f"'{pattern.value}'"
    return 3, name.lower()


def _token_words(tok: Token) -> str:
    if tok.type == "$END":
        return "end of input"
    if tok.type == "_NL":
        return "end of line"
    return f"'{tok.value}'"


def _char_words(char: str) -> str:
    return f"'{char}'" if char.isprintable() and char != "'" else repr(char)


def _expected_words(names: Sequence[str]) -> str:
    # STRING: only compute takes a quoted word (`compute = "tf32"`); listing it everywhere would mislead
    ranked = sorted({_terminal_word(n) for n in names if n not in ("WS", "COMMENT", "STRING")})
    return one_of([words for _, words in ranked])


def _translate_lark_error(src: _Source, err: UnexpectedInput) -> ConvSyntaxError:
    # The interactive parser knows exactly which terminals would let parsing go on; the sets on
    # the exception itself may come from the lexer state and include terminals the parser rejects.
    expected: Sequence[str] = ()
    if err.interactive_parser is not None:
        try:
            expected = sorted(err.interactive_parser.accepts())
        except Exception:  # accepts() replays the parser; never let that mask the real error
            expected = ()
    if isinstance(err, UnexpectedToken):
        if not expected:
            expected = sorted(err.expected)
        tok = err.token
        got = _token_words(tok)
        span = _Span(tok.line, tok.column, tok.line, tok.column + max(1, len(tok.value)), 0, 0)
        if tok.type in ("_NL", "$END") or tok.end_line != tok.line:
            span = _Span(tok.line, tok.column, tok.line, tok.column + 1, 0, 0)
        hint = ""
        if tok.type not in ("_NL", "$END") and tok.value.isidentifier():
            words = [_terminal_word(n)[1].strip("'") for n in expected]
            hint = did_you_mean(tok.value, [w for w in words if w.isidentifier()])
        return src.error(span, f"expected {_expected_words(expected)}, got {got}{hint}")
    if isinstance(err, UnexpectedCharacters):
        if not expected:
            expected = sorted(err.allowed or ())
        span = _Span(err.line, err.column, err.line, err.column + 1, 0, 0)
        what = f"expected {_expected_words(expected)}" if expected else "unexpected character"
        return src.error(span, f"{what}, got {_char_words(err.char)}")
    # UnexpectedEOF (Earley only) or a future subclass: still report a position, never a traceback.
    line = getattr(err, "line", None)
    column = getattr(err, "column", None)
    if not isinstance(line, int) or not isinstance(column, int) or line < 1:
        line = len(src.lines)
        column = len(src.line_text(line)) + 1
    expected = expected or sorted(getattr(err, "expected", ()) or ())
    return src.error(_Span(line, column, line, column + 1, 0, 0), f"expected {_expected_words(expected)}, got end of input")


def _parse_tree(src: _Source) -> Tree:
    try:
        # The trailing newline lets the last kernel line end without one in the file.
        return _lark().parse(src.text + "\n")
    except UnexpectedInput as err:
        raise _translate_lark_error(src, err) from None


# ------------------------------------------------------------------------------------------------
# Parse tree -> values with positions
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Value:
    kind: str  # "int" | "float" | "name" | "string" | "list" | "call"
    span: _Span
    text: str  # the source text, shortened, for messages
    number: Union[int, float, None] = None
    name: str = ""  # of a name, of a call, or a string's text without its quotes
    items: tuple["_Value", ...] = ()  # of a list, or a call's arguments


@dataclass(frozen=True)
class _Entry:
    key: str
    key_span: _Span
    value: _Value


def _describe(v: _Value) -> str:
    """The 'got ...' half of a message."""
    if v.kind in ("int", "float"):
        return v.text
    if v.kind == "dynamic":
        return "'?'"
    if v.kind == "name":
        return f"'{v.name}'"
    if v.kind == "list":
        return f"a list {v.text}"
    return v.text


def _to_value(src: _Source, node: Tree, depth: int = 0) -> _Value:
    span = _span(node)
    if depth > _MAX_NESTING:
        raise src.error(span, f"expected at most {_MAX_NESTING} levels of brackets, got more")
    text = src.snippet(span)
    if node.data == "number":
        raw = str(node.children[0])
        if any(c in raw for c in ".eE"):
            return _Value("float", span, text, number=float(raw))
        digits = len(raw.lstrip("+-").lstrip("0"))
        if digits > _MAX_DIGITS:  # far past any size (and past Python's int-from-text limit)
            raise src.error(span, f"expected a number of at most {_MAX_DIGITS} digits, got one of {digits} digits")
        return _Value("int", span, text, number=int(raw))
    if node.data == "name":
        return _Value("name", span, text, name=str(node.children[0]))
    if node.data == "string":
        return _Value("string", span, text, name=str(node.children[0])[1:-1])
    if node.data == "dynamic":
        return _Value("dynamic", span, "?")
    if node.data == "list":
        items = tuple(_to_value(src, c, depth + 1) for c in node.children if c is not None)
        return _Value("list", span, text, items=items)
    # call: NAME "(" args ")"
    head, *args = node.children
    items = tuple(_to_value(src, c, depth + 1) for c in args if c is not None)
    return _Value("call", span, text, name=str(head), items=items)


def _entries(src: _Source, nodes: Sequence[Tree]) -> list[_Entry]:
    out = []
    for node in nodes:
        key_tok, *value_nodes = node.children
        values = [_to_value(src, v) for v in value_nodes]
        value = values[0]
        if len(values) > 1:  # `a, b, c`: one chain value spanning its items
            first, last = values[0].span, values[-1].span
            span = _Span(first.line, first.column, last.end_line, last.end_column, first.start_pos, last.end_pos)
            value = _Value("chain", span, src.snippet(span), items=tuple(values))
        out.append(_Entry(str(key_tok), _span(key_tok), value))
    return out


def _collect(src: _Source, entries: Sequence[_Entry], block: str) -> dict[str, _Entry]:
    """Check keys (known, each once) of a conv block or a kernel option block."""
    valid, foreign = (CONV_KEYS, KERNEL_KEYS) if block == "conv" else (KERNEL_KEYS, CONV_KEYS)
    noun = "a conv key" if block == "conv" else "a kernel option"
    seen: dict[str, _Entry] = {}
    for e in entries:
        if e.key not in valid:
            if e.key in foreign:
                # The key exists, just not here: say where it belongs instead of listing keys.
                if block == "conv":
                    why = "a kernel option; set it in a kernel's { ... } block"
                else:
                    why = "a conv key; kernels cannot override it, declare another conv instead"
                raise src.error(e.key_span, f"expected {noun}, got '{e.key}'", [f"note: '{e.key}' is {why}"])
            raise src.error(
                e.key_span,
                f"expected {noun}, got '{e.key}'{did_you_mean(e.key, valid)}",
                [f"note: valid {'conv keys' if block == 'conv' else 'kernel options'}: {', '.join(valid)}"],
            )
        if e.value.kind == "chain" and e.key not in _CHAIN_KEYS:
            raise src.error(e.value.items[1].span,
                            f"expected one value for {e.key}, got {len(e.value.items)} separated by ','",
                            ["note: only an epilogue chains values (epilogue = bias, relu); a list is written in "
                             "brackets: [1, 2]"])
        if e.key in seen:
            raise src.error(
                e.key_span,
                f"expected each key once, got a second '{e.key}'",
                [src.note(seen[e.key].key_span, f"'{e.key}' first set here")],
            )
        seen[e.key] = e
    return seen


# ------------------------------------------------------------------------------------------------
# Values: through the normaliser (convdsl.options), its errors pointed at the offending item
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Unaccepted:
    """A source value no option takes where it stands (a quoted word anywhere but compute, `?` anywhere but
    batch): handed to the normaliser as is, so that it is refused with the option's own expectation."""

    text: str


# the one option that takes a quoted word (`compute = "tf32"`, the same as the bare name)
_QUOTED_KEYS = ("compute",)


def _python(v: _Value, quoted: bool) -> Any:
    """The plain Python value the normaliser takes: numbers, names as strings, lists, calls as Call."""
    if v.kind in ("int", "float"):
        return v.number
    if v.kind == "name" or (v.kind == "string" and quoted):
        return v.name
    if v.kind == "list":
        return [_python(item, quoted) for item in v.items]
    if v.kind == "call":
        return Call(v.name, tuple(_python(item, quoted) for item in v.items))
    if v.kind == "chain":
        return Chain(tuple(_python(item, quoted) for item in v.items))
    return _Unaccepted(v.text)


def _item(v: _Value, at: Sequence[int]) -> _Value:
    """The source value at index path `at` inside `v` (as far as the path goes)."""
    for i in at:
        if not 0 <= i < len(v.items):
            break
        v = v.items[i]
    return v


def _option(src: _Source, e: _Entry, normalise: Callable[..., Any], *args: Any,
            dims_entry: Optional[_Entry] = None, **kwargs: Any) -> Any:
    """`normalise(value, *args, key=..., **kwargs)` on the entry's value; an OptionError becomes a diagnostic
    at the item it names (with a note at `dims` for a per-dim list of the wrong length)."""
    try:
        return normalise(_python(e.value, e.key in _QUOTED_KEYS), *args, key=e.key, **kwargs)
    except OptionError as err:
        item = _item(e.value, err.at)
        notes = []
        if isinstance(err, DimsError) and dims_entry is not None:
            notes.append(src.note(dims_entry.value.span, f"dims = {err.dims} set here"))
        raise src.error(item.span, err.located(_describe(item)), notes) from None
    except ProblemError as err:  # a check of the built value (Epilogue's own): at the whole value
        raise src.error(e.value.span, str(err)) from None


def _check_f32_compute(src: _Source, e: _Entry, mode: str, dtype: str, notes: Sequence[str]) -> None:
    """compute = bf16x3 or tf32 (`mode`) acts on f32 operands: refuse it, at the compute value, on any other
    dtype."""
    if dtype != "f32":
        raise src.error(e.value.span, f"expected dtype f32 for compute = {mode} (it {F32_COMPUTES[mode]}), "
                                      f"got dtype {dtype}", notes)


# ------------------------------------------------------------------------------------------------
# Declarations
# ------------------------------------------------------------------------------------------------
@dataclass
class _Conv:
    name: str
    span: _Span
    fields: dict  # ConvProblem keyword arguments shared by every kernel of this conv
    out_dtype: Optional[str]
    compute: Optional[tuple[str, str]]


def _check_name(src: _Source, tok: Token, what: str) -> str:
    name = str(tok)
    # Kernel names become function names in the compiled module, conv names appear in messages and
    # generated comments: both must be usable Python identifiers.
    if keyword.iskeyword(name):
        raise src.error(_span(tok), f"expected a {what} name that is not a Python keyword, got '{name}'")
    if what == "kernel" and name.startswith(_RESERVED_PREFIX):
        raise src.error(_span(tok), f"expected a kernel name that does not start with '{_RESERVED_PREFIX}' (the "
                                    f"compiled module reserves such names, e.g. __init), got '{name}'")
    return name


def _conv(src: _Source, node: Tree, batch: Optional[int]) -> _Conv:
    name_tok, *entry_nodes = node.children
    name = _check_name(src, name_tok, "conv")
    name_span = _span(name_tok)
    seen = _collect(src, _entries(src, entry_nodes), "conv")
    missing = [k for k in REQUIRED_CONV_KEYS if k not in seen]
    if missing:
        keys = ", ".join(missing)
        raise src.error(
            name_span,
            f"expected {'a value for required key' if len(missing) == 1 else 'values for required keys'} "
            f"{keys} in conv {name}, got none",
        )
    dims_entry = seen["dims"]
    dims = _option(src, dims_entry, options.dims)
    fields: dict = {
        "dims": dims,
        "groups": 1,
        "stride": (1,) * dims,
        "dilation": (1,) * dims,
        "pad_lo": (0,) * dims,
        "pad_hi": (0,) * dims,
        "layout": "NHWGC",
        "weight_layout": "GKYXC",
        "dtype": "f32",
    }
    out_dtype: Optional[str] = None
    compute: Optional[tuple[str, str]] = None
    # Source order, so that with several bad values the first one in the file is reported; padding last,
    # because `padding = same` needs the filter, dilation and stride.
    for key, e in sorted(seen.items(), key=lambda kv: kv[1].key_span.start_pos):
        if key in ("dims", "padding"):
            continue
        if key == "batch" and e.value.kind == "dynamic":
            # `batch = ?`: one module serves any batch; the nominal size is what `run` draws inputs at
            fields["dynamic_batch"] = True
            fields["batch"] = DYNAMIC_BATCH_NOMINAL
        elif key in ("groups", "batch", "in_channels", "out_channels"):
            fields[key] = _option(src, e, options.integer, minimum=1)
        elif key in ("input", "filter", "stride", "dilation"):
            # input and filter always take a list: a bare number there is more likely a slip
            fields[key] = _option(src, e, options.expand, dims, scalar=key in ("stride", "dilation"), minimum=1,
                                  dims_entry=dims_entry)
        elif key == "layout":
            fields[key] = _option(src, e, options.layout, dims=dims)[0]
        elif key == "weight_layout":
            fields[key] = _option(src, e, options.weight_layout, dims=dims)[0]
        elif key == "dtype":
            fields[key] = _option(src, e, options.dtype)
        elif key == "out_dtype":
            out_dtype = _option(src, e, options.dtype)
        elif key == "compute":
            compute = _option(src, e, options.compute)
        else:  # pragma: no cover - _collect admits only CONV_KEYS
            raise AssertionError(key)
    if "padding" in seen:
        fields["pad_lo"], fields["pad_hi"] = _option(
            src, seen["padding"], options.padding, dims, filter=fields["filter"], dilation=fields["dilation"],
            stride=fields["stride"], dims_entry=dims_entry)
    if compute is not None and compute[0] in F32_COMPUTES:
        dtype_entry = seen.get("dtype")
        notes = [src.note(dtype_entry.value.span, "dtype set here")] if dtype_entry is not None else []
        _check_f32_compute(src, seen["compute"], compute[0], fields["dtype"], notes)
    if batch is not None:
        # the override fixes every batch, `batch = ?` included: the kernel is compiled for that batch
        fields["batch"] = batch
        fields.pop("dynamic_batch", None)
    try:
        # A forward problem checks everything the conv itself decides (sizes, empty output), so
        # a bad conv is reported at its name even when no kernel uses it.
        ConvProblem(op="forward", name=name, **fields)
    except ProblemError as err:
        raise src.error(name_span, f"invalid conv {name}: {err}") from None
    return _Conv(name, name_span, fields, out_dtype, compute)


def _kernel(src: _Source, node: Tree, convs: dict[str, _Conv]) -> tuple[ConvProblem, _Span]:
    name_tok, op_tok, conv_tok, option_block = node.children
    name = _check_name(src, name_tok, "kernel")
    op = str(op_tok)
    if op not in OPS:
        raise src.error(
            _span(op_tok), f"expected an op ({one_of(OPS)}), got '{op}'{did_you_mean(op, OPS)}"
        )
    conv_name = str(conv_tok)
    if conv_name not in convs:
        notes = [f"note: convs in this file: {', '.join(convs)}"] if convs else ["note: this file declares no conv"]
        raise src.error(
            _span(conv_tok),
            f"expected the name of a conv declared in this file, got '{conv_name}'{did_you_mean(conv_name, list(convs))}",
            notes,
        )
    conv = convs[conv_name]
    seen = _collect(src, _entries(src, option_block.children if option_block is not None else ()), "kernel")
    out_dtype, compute = conv.out_dtype, conv.compute
    split_k: Optional[int] = None
    epilogue, prologue = Epilogue(), Prologue()
    for key, e in sorted(seen.items(), key=lambda kv: kv[1].key_span.start_pos):
        if key == "split_k":
            if op != "grad_weight":
                raise src.error(
                    e.key_span,
                    f"expected split_k only on grad_weight kernels, got it on a {op} kernel",
                    ["note: only grad_weight reduces over batch and output pixels, the reduction split_k splits"],
                )
            split_k = _option(src, e, options.split_k)
        elif key == "out_dtype":
            out_dtype = _option(src, e, options.dtype)
        elif key == "compute":
            compute = _option(src, e, options.compute)
        elif key == "epilogue":
            epilogue = _option(src, e, options.epilogue, op=op)
        elif key == "prologue":
            if op not in PROLOGUE_OPS:
                raise src.error(
                    e.key_span,
                    f"expected prologue only on {' and '.join(PROLOGUE_OPS)} kernels, got it on a {op} kernel",
                    ["note: a prologue applies an activation's backward to dY as the kernel reads it; a forward "
                     "activation is an epilogue step (epilogue = bias, relu)"],
                )
            prologue = _option(src, e, options.prologue)
    if "compute" in seen and compute is not None and compute[0] in F32_COMPUTES:
        _check_f32_compute(src, seen["compute"], compute[0], conv.fields["dtype"],
                           [src.note(conv.span, f"conv {conv.name} declared here")])
    if out_dtype == conv.fields["dtype"]:
        out_dtype = None  # "same as dtype", so equal sources give equal problems
    try:
        problem = ConvProblem(
            op=op, name=name, out_dtype=out_dtype, compute=compute, split_k=split_k, epilogue=epilogue,
            prologue=prologue, **conv.fields
        )
    except ProblemError as err:
        raise src.error(_span(name_tok), f"invalid kernel {name}: {err}", [src.note(conv.span, f"conv {conv.name} declared here")]) from None
    if "epilogue" in seen:
        # the arguments against the result's dtype, known only now (out_dtype may come from the conv)
        head = (0,) if seen["epilogue"].value.kind == "chain" else ()
        _option(src, seen["epilogue"],
                lambda _value, key: options.epilogue_range(epilogue, problem.result_dtype, key, at=head))
    return problem, _span(name_tok)


def _problems(src: _Source, tree: Tree, batch: Optional[int]) -> list[ConvProblem]:
    conv_nodes = [n for n in tree.children if isinstance(n, Tree) and n.data == "conv"]
    kernel_nodes = [n for n in tree.children if isinstance(n, Tree) and n.data == "kernel"]
    convs: dict[str, _Conv] = {}
    for node in conv_nodes:
        conv = _conv(src, node, batch)
        if conv.name in convs:
            raise src.error(
                conv.span,
                f"expected a unique conv name, got a second '{conv.name}'",
                [src.note(convs[conv.name].span, f"conv {conv.name} first declared here")],
            )
        convs[conv.name] = conv
    problems: list[ConvProblem] = []
    first: dict[str, _Span] = {}
    for node in kernel_nodes:
        problem, span = _kernel(src, node, convs)
        if problem.name in first:
            raise src.error(
                span,
                f"expected a unique kernel name, got a second '{problem.name}'",
                [src.note(first[problem.name], f"kernel {problem.name} first defined here")],
            )
        first[problem.name] = span
        problems.append(problem)
    return problems


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def parse(text: str, filename: str = "<string>", batch: Optional[int] = None) -> list[ConvProblem]:
    """Parse convdsl source into one ConvProblem per `kernel` line, in file order.

    `batch`, if given, replaces every conv's batch (to run examples at a reduced size), `batch = ?`
    included, which it makes static; the source must still set one.  Errors in the source raise
    ConvSyntaxError; a bad `batch` raises ValueError.
    """
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"batch override: expected a positive integer, got {batch!r}")
    # a UTF-8 byte-order mark, as some editors write, is not part of the source
    src = _Source(text[1:] if text.startswith("\ufeff") else text, filename)
    return _problems(src, _parse_tree(src), batch)


def _read_source(path: Path) -> bytes:
    """The file's bytes: a regular file of at most MAX_SOURCE_BYTES (a device such as /dev/zero, or a pipe, would
    be read until memory runs out, or forever)."""
    if path.exists() and not path.is_dir() and not path.is_file():
        raise ConvSyntaxError("expected a regular .conv file, got a device, pipe or socket", str(path), 1, 1)
    with path.open("rb") as f:
        data = f.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise ConvSyntaxError(f"expected a .conv file of at most {MAX_SOURCE_BYTES} bytes, got a larger one",
                              str(path), 1, 1)
    return data


def parse_file(path: Union[str, Path], batch: Optional[int] = None) -> list[ConvProblem]:
    """Read a .conv file (UTF-8) and parse it; messages name the file as `path` was given."""
    path = Path(path)
    data = _read_source(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        # Report bad bytes like any other error: at a line and column, not as a decode traceback.
        before = data[: err.start]
        line = before.count(b"\n") + 1
        line_start = before.rfind(b"\n") + 1
        shown = data[line_start:].split(b"\n", 1)[0].decode("utf-8", errors="replace")
        column = len(before[line_start:].decode("utf-8", errors="replace")) + 1
        raise ConvSyntaxError(
            f"expected UTF-8 text, got the byte {data[err.start]:#04x}", str(path), line, column, shown, 1
        ) from None
    return parse(text, str(path), batch)
