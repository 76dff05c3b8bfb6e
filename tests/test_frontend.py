"""Tests for the convdsl frontend: the language, its defaults, and its error messages."""
from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convdsl.frontend import ConvSyntaxError, parse, parse_file
from convdsl.problem import Epilogue

EXAMPLE = """\
# ResNeXt stage 2, one grouped 3x3 layer
conv rx2 {
  dims         = 2          # 1, 2 or 3 spatial dimensions
  groups       = 32
  batch        = 64
  in_channels  = 4          # per group (C)
  out_channels = 4          # per group (K)
  input        = [56, 56]   # spatial sizes, outermost first (D, H, W)
  filter       = [3, 3]
  stride       = 1          # one number, or one per spatial dim
  dilation     = 1
  padding      = 1          # one number, one per dim, or [[lo, hi], [lo, hi]] per dim
  layout       = NHWGC      # NHWGC | GNHWC | NGCHW (named in 2D form, meaning every rank)
  weight_layout = GKYXC     # GKYXC | GKCYX; output gradient follows the input layout (NHWGK ...)
  dtype        = f16        # f32 | f16 | bf16
}
kernel dgrad = grad_input(rx2)
kernel wgrad = grad_weight(rx2) { split_k = auto; out_dtype = f32; epilogue = scale(0.5) }
kernel y     = forward(rx2)
kernel up    = transposed(rx2)   # the transposed convolution: same arithmetic as grad_input
"""

# A minimal valid 2D conv, for tests that only care about one key or one kernel option.
SMALL = "conv c {{ dims = 2; batch = 2; in_channels = 3; out_channels = 5; input = [9, 7]; filter = [3, 3]{extra} }}\n"


def small(extra: str = "", kernels: str = "kernel k = forward(c)\n") -> str:
    return SMALL.format(extra=extra) + kernels


# ------------------------------------------------------------------------------------------------
# The language
# ------------------------------------------------------------------------------------------------
def test_example_parses_to_four_problems() -> None:
    problems = parse(EXAMPLE, "examples/rx2.conv")
    assert [p.name for p in problems] == ["dgrad", "wgrad", "y", "up"]
    assert [p.op for p in problems] == ["grad_input", "grad_weight", "forward", "transposed"]
    for p in problems:
        assert p.dims == 2
        assert p.groups == 32
        assert p.batch == 64
        assert (p.in_channels, p.out_channels) == (4, 4)
        assert p.input == (56, 56)
        assert p.filter == (3, 3)
        assert p.stride == (1, 1)
        assert p.dilation == (1, 1)
        assert (p.pad_lo, p.pad_hi) == ((1, 1), (1, 1))
        assert p.output == (56, 56)
        assert (p.layout, p.weight_layout, p.dtype) == ("NHWGC", "GKYXC", "f16")
        assert p.compute is None
        assert p.split_k is None
    dgrad, wgrad, y, up = problems
    assert wgrad.out_dtype == "f32" and wgrad.result_dtype == "f32"
    assert wgrad.epilogue == Epilogue("scale", 0.5)
    for p in (dgrad, y, up):
        assert p.out_dtype is None and p.result_dtype == "f16"
        assert p.epilogue == Epilogue()


def test_defaults() -> None:
    (p,) = parse(small())
    assert p.groups == 1
    assert p.stride == (1, 1) and p.dilation == (1, 1)
    assert p.pad_lo == (0, 0) and p.pad_hi == (0, 0)
    assert (p.layout, p.weight_layout, p.dtype) == ("NHWGC", "GKYXC", "f32")
    assert p.out_dtype is None and p.compute is None and p.split_k is None
    assert p.epilogue == Epilogue()
    assert p.output == (7, 5)


def test_split_k_forced_and_auto() -> None:
    a, b = parse(small(kernels="kernel a = grad_weight(c) { split_k = 4 }\nkernel b = grad_weight(c) { split_k = auto }"))
    assert a.split_k == 4
    assert b.split_k is None


def test_per_dim_lists() -> None:
    (p,) = parse(small("; stride = [2, 1]; dilation = [1, 2]; padding = [1, 0]"))
    assert p.stride == (2, 1)
    assert p.dilation == (1, 2)
    assert (p.pad_lo, p.pad_hi) == ((1, 0), (1, 0))
    assert p.output == ((9 + 2 - 3) // 2 + 1, (7 - 2 * 2 - 1) // 1 + 1)


def test_lo_hi_padding_and_mixed_padding() -> None:
    (p,) = parse(small("; padding = [[0, 1], [2, 3]]"))
    assert (p.pad_lo, p.pad_hi) == ((0, 2), (1, 3))
    (q,) = parse(small("; padding = [1, [0, 2]]"))
    assert (q.pad_lo, q.pad_hi) == ((1, 0), (1, 2))


def test_1d_and_3d() -> None:
    text = """
    conv line { dims = 1; batch = 8; in_channels = 16; out_channels = 32; input = [100]; filter = [5]
                stride = 2; padding = [[2, 1]]; layout = NWGC; weight_layout = GKCX }
    conv vol {
      dims = 3; groups = 2; batch = 1; in_channels = 4; out_channels = 8
      input = [8, 16, 16]; filter = [3, 3, 3]; stride = [1, 2, 2]; dilation = [2, 1, 1]
      padding = [2, 1, 1]; layout = GNDHWC; weight_layout = GKZYXC; dtype = bf16
    }
    kernel l = forward(line)
    kernel v = grad_input(vol)
    """
    line, vol = parse(text)
    assert (line.dims, line.input, line.filter, line.stride) == (1, (100,), (5,), (2,))
    assert (line.pad_lo, line.pad_hi) == ((2,), (1,))
    # Rank-specific layout names are accepted and stored in their 2D (canonical) form.
    assert (line.layout, line.weight_layout) == ("NHWGC", "GKCYX")
    assert line.layout_name("x") == "NWGC"
    assert (vol.dims, vol.groups, vol.input, vol.filter) == (3, 2, (8, 16, 16), (3, 3, 3))
    assert (vol.stride, vol.dilation, vol.pad_lo, vol.pad_hi) == ((1, 2, 2), (2, 1, 1), (2, 1, 1), (2, 1, 1))
    assert (vol.layout, vol.weight_layout, vol.dtype) == ("GNHWC", "GKYXC", "bf16")
    assert vol.output == (8, 8, 8)


def test_compute_and_out_dtype_defaults_are_inherited_and_overridable() -> None:
    text = """
    conv c { dims = 1; batch = 1; in_channels = 2; out_channels = 2; input = [8]; filter = [3]
             dtype = f16; compute = [bf8, fp8]; out_dtype = f32 }
    kernel inherit = forward(c)
    kernel over = grad_input(c) { compute = [fp8, fp8]; out_dtype = bf16 }
    kernel same = grad_weight(c) { out_dtype = f16 }
    """
    inherit, over, same = parse(text)
    assert (inherit.compute, inherit.out_dtype) == (("bf8", "fp8"), "f32")
    assert (over.compute, over.out_dtype) == (("fp8", "fp8"), "bf16")
    # out_dtype equal to dtype means "same as dtype": stored as None so equal sources hash equal.
    assert same.out_dtype is None and same.result_dtype == "f16"


def test_bilinear_with_negative_and_exponent() -> None:
    (p,) = parse(small(kernels="kernel b = forward(c) { epilogue = bilinear(-1.5e-1, +2) }"))
    assert p.epilogue == Epilogue("bilinear", -0.15, 2.0)
    assert p.arg_names == ("x", "w", "d")
    (q,) = parse(small(kernels="kernel n = forward(c) { epilogue = none }"))
    assert q.epilogue == Epilogue()


def test_batch_override(tmp_path: Path) -> None:
    problems = parse(EXAMPLE, batch=2)
    assert [p.batch for p in problems] == [2, 2, 2, 2]
    path = tmp_path / "rx2.conv"
    path.write_text(EXAMPLE)
    assert [p.batch for p in parse_file(path, batch=3)] == [3, 3, 3, 3]
    assert parse_file(str(path)) == parse(EXAMPLE)
    with pytest.raises(ValueError, match="batch override"):
        parse(EXAMPLE, batch=0)


def test_layout_free_forms() -> None:
    # Forward references, several convs, `;` between kernels, wrapped lists, blank lines, no final newline.
    text = (
        "kernel early = forward(b); kernel late = grad_weight(a) { split_k = 2\n epilogue = scale(\n 2) }\n\n"
        "conv a {\n\n  dims = 2 ; ; batch = 1\n  in_channels = 1; out_channels = 1\n"
        "  input = [4,\n           4]   # wrapped\n  filter = [1, 1];\n}\n"
        "conv b\n{ dims = 1; batch = 1; in_channels = 1; out_channels = 1; input = [3]; filter = [3] }"
    )
    early, late = parse(text)
    assert (early.name, early.dims, early.output) == ("early", 1, (1,))
    assert (late.name, late.input, late.split_k, late.epilogue) == ("late", (4, 4), 2, Epilogue("scale", 2.0))


def test_empty_and_comment_only_files() -> None:
    assert parse("") == []
    assert parse("# nothing here\n\n;\n") == []
    assert parse(SMALL.format(extra="")) == []  # a conv without kernels is checked but yields nothing


# ------------------------------------------------------------------------------------------------
# Errors: one per class; each checks position, message, source line and caret line
# ------------------------------------------------------------------------------------------------
def error_of(text: str, filename: str = "x.conv") -> ConvSyntaxError:
    with pytest.raises(ConvSyntaxError) as info:
        parse(text, filename)
    return info.value


def assert_error(text: str, where: str, fragments: tuple[str, ...], source: str, caret: str) -> ConvSyntaxError:
    err = error_of(text)
    lines = str(err).split("\n")
    assert lines[0].startswith(f"x.conv:{where}: error: "), str(err)
    for fragment in fragments:
        assert fragment in lines[0] or fragment in str(err), (fragment, str(err))
    assert lines[1] == source, str(err)
    assert lines[2] == caret, str(err)
    assert isinstance(err, ValueError)
    line, column = map(int, where.split(":"))
    assert (err.filename, err.line, err.column) == ("x.conv", line, column)
    return err


BAD_KEYS = "conv c {\n  dims = 2; batch = 2; in_channels = 3; out_channels = 5\n  input = [9, 7]; filter = [3, 3]\n  %s\n}\nkernel k = forward(c)\n"


@pytest.mark.parametrize(
    "entry, column, fragments, caret",
    [
        # Lark syntax errors, with terminal names turned into words
        ("stride 2", 10, ("expected '=', got '2'",), "         ^"),
        ("stride = = 2", 12, ("expected a name, a number, '?' or '[', got '='",), "           ^"),
        ("stride = 1 @", 14, ("expected ',', ';', '}' or a newline, got '@'",), "             ^"),
        # key checks
        ("strid = 2", 3, ("expected a conv key, got 'strid'; did you mean 'stride'?", "valid conv keys: dims, groups"), "  ^~~~~"),
        ("split_k = 2", 3, ("expected a conv key, got 'split_k'", "is a kernel option"), "  ^~~~~~~"),
        ("filter = [1, 1]", 3, ("expected each key once, got a second 'filter'", "x.conv:3:19: note: 'filter' first set here"), "  ^~~~~~"),
        # value kinds and lengths
        ("groups = [1, 2]", 12, ("expected a positive integer for groups, got a list [1, 2]",), "           ^~~~~~"),
        ("groups = 2.5", 12, ("expected a positive integer for groups, got 2.5",), "           ^~~"),
        ("groups = 0", 12, ("expected a positive integer for groups, got 0",), "           ^"),
        ("stride = [1, 2, 3]", 12, ("expected 2 values for dims = 2, got 3", "x.conv:2:10: note: dims = 2 set here"), "           ^~~~~~~~~"),
        ("stride = two", 12, ("expected one number or a list of 2 numbers for stride, got 'two'",), "           ^~~"),
        ("dilation = [1, 0]", 18, ("expected a positive integer in dilation, got 0",), "                 ^"),
        ("padding = [[1, 2], [1]]", 22, ("expected [lo, hi] (2 values) in padding, got 1",), "                     ^~~"),
        ("padding = -1", 13, ("expected a non-negative integer for padding, got -1",), "            ^~"),
        # names
        ("layout = NHWC", 12, ("expected a layout (NHWGC, GNHWC or NGCHW) for layout, got 'NHWC'; did you mean 'NHWGC'?",), "           ^~~~"),
        ("weight_layout = KCYX", 19, ("expected a weight layout (GKYXC or GKCYX) for weight_layout, got 'KCYX'",), "                  ^~~~"),
        ("dtype = f64", 11, ("expected a dtype (f32, f16 or bf16) for dtype, got 'f64'",), "          ^~~"),
        ("compute = [fp8, fp16]", 19, ("expected fp8 or bf8 in compute, got 'fp16'",), "                  ^~~~"),
        ("compute = [fp8]", 13, ("expected a list of 2 compute types [A, B] for compute, got a list of 1",), "            ^~~~~"),
    ],
)
def test_conv_entry_errors(entry: str, column: int, fragments: tuple[str, ...], caret: str) -> None:
    assert_error(BAD_KEYS % entry, f"4:{column}", fragments, "  " + entry, caret)


def test_bad_dims() -> None:
    text = "conv c { dims = 4; batch = 1; in_channels = 1; out_channels = 1; input = [1]; filter = [1] }"
    assert_error(text, "1:17", ("expected 1, 2 or 3 for dims, got 4",), text, " " * 16 + "^")


def test_missing_required_keys_point_at_conv_name() -> None:
    text = "# header\nconv rx2 {\n  dims = 2; batch = 1; input = [4, 4]\n}\n"
    assert_error(
        text, "2:6",
        ("expected values for required keys in_channels, out_channels, filter in conv rx2, got none",),
        "conv rx2 {", "     ^~~",
    )


def test_unexpected_end_of_input() -> None:
    text = "conv c {\n  dims = 2"
    assert_error(text, "2:11", ("expected a name, ';', '}' or a newline, got end of input",), "  dims = 2", "          ^")


def test_unexpected_keyword_suggests_keyword() -> None:
    text = "conf c { }"
    assert_error(text, "1:1", ("expected 'conv', 'kernel', ';', a newline or end of input, got 'conf'; did you mean 'conv'?",), text, "^~~~")


def test_empty_output_is_pinned_to_conv() -> None:
    text = "conv tiny { dims = 2; batch = 1; in_channels = 1; out_channels = 1; input = [2, 8]; filter = [3, 3] }\n"
    assert_error(text, "1:6", ("invalid conv tiny: output size", "is empty in spatial dim 0"), text.rstrip("\n"), "     ^~~~")


@pytest.mark.parametrize(
    "kernel, column, fragments, caret",
    [
        ("kernel j = fwd(c)", 12, ("expected an op (forward, grad_input, grad_weight or transposed), got 'fwd'; did you mean 'forward'?",), "           ^~~"),
        ("kernel j = forward(cc)", 20, ("expected the name of a conv declared in this file, got 'cc'; did you mean 'c'?", "note: convs in this file: c"), "                   ^~"),
        ("kernel k = forward(c)", 8, ("expected a unique kernel name, got a second 'k'", "x.conv:2:8: note: kernel k first defined here"), "       ^"),
        ("kernel j = grad_input(c) { split_k = 2 }", 28, ("expected split_k only on grad_weight kernels, got it on a grad_input kernel",), " " * 27 + "^~~~~~~"),
        ("kernel j = grad_weight(c) { split_k = 0 }", 39, ("expected auto or a positive integer for split_k, got 0",), " " * 38 + "^"),
        ("kernel j = forward(c) { stride = 2 }", 25, ("expected a kernel option, got 'stride'", "is a conv key"), " " * 24 + "^~~~~~"),
        ("kernel j = forward(c) { epilog = none }", 25, ("expected a kernel option, got 'epilog'; did you mean 'epilogue'?", "valid kernel options: split_k, out_dtype, epilogue, prologue, compute"), " " * 24 + "^~~~~~"),
        ("kernel j = forward(c) { epilogue = scale(1, 2) }", 36, ("expected 1 argument for scale(alpha), got 2",), " " * 35 + "^~~~~~~~~~~"),
        ("kernel j = forward(c) { epilogue = relu(1) }", 36, ("expected relu without arguments, got relu(1)",), " " * 35 + "^~~~~~~"),
        ("kernel j = forward(c) { epilogue = relu6(1) }", 36, ("expected none, scale(alpha) or bilinear(alpha, beta), or bias, affine, residual, relu, silu, gelu, gelu(tanh) or hardswish for epilogue, got relu6(1); did you mean 'relu'?",), " " * 35 + "^~~~~~~~"),
        ("kernel j = forward(c) { epilogue = bilinear(1, x) }", 48, ("expected a number for beta in bilinear(alpha, beta), got 'x'",), " " * 47 + "^"),
        ("kernel j = forward(c) { out_dtype = f8 }", 37, ("expected a dtype (f32, f16 or bf16) for out_dtype, got 'f8'",), " " * 36 + "^~"),
        ("kernel def = forward(c)", 8, ("expected a kernel name that is not a Python keyword, got 'def'",), "       ^~~"),
        ("kernel j = forward(c) kernel", 23, ("expected ';', '{' or a newline, got 'kernel'",), " " * 22 + "^~~~~~"),
        ("kernel j = forward(c) { epilogue = scale(3 }", 44, ("expected ')' or ',', got '}'",), " " * 43 + "^"),
    ],
)
def test_kernel_errors(kernel: str, column: int, fragments: tuple[str, ...], caret: str) -> None:
    text = small(kernels="kernel k = forward(c)\n" + kernel + "\n")
    assert_error(text, f"3:{column}", fragments, kernel, caret)


def test_duplicate_conv_name() -> None:
    text = small(kernels="") + "conv c { dims = 1; batch = 1; in_channels = 1; out_channels = 1; input = [1]; filter = [1] }\n"
    assert_error(text, "2:6", ("expected a unique conv name, got a second 'c'", "x.conv:1:6: note: conv c first declared here"), text.split("\n")[1], "     ^")


def test_tabs_are_kept_in_caret_line() -> None:
    text = small("\n\t\tgroups = x1\n")
    err = error_of(text)
    assert str(err).split("\n")[1:3] == ["\t\tgroups = x1", "\t\t         ^~"]


def test_parse_file_names_the_file_and_reports_bad_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bad.conv"
    path.write_bytes(b"conv c {\n  dims = 2 # \xff\n}\n")
    with pytest.raises(ConvSyntaxError) as info:
        parse_file(path)
    assert str(info.value).startswith(f"{path}:2:14: error: expected UTF-8 text, got the byte 0xff")
    path.write_text("conv c {\n  dims = 2; dims = 2\n}\n")
    with pytest.raises(ConvSyntaxError, match=rf"^{path}:2:13: error: expected each key once"):
        parse_file(path)


def test_error_pickles_and_has_no_lark_context() -> None:
    err = error_of("conv c { dims = [ }")
    assert err.__cause__ is None and err.__suppress_context__
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.line == err.line


# ------------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------------
_WS = st.sampled_from(["", " ", "  ", "\t"])
_COMMENT = st.sampled_from(["", " # note", "  # [1, 2] = ; { } conv kernel", "#"])


@st.composite
def conv_sources(draw: st.DrawFn) -> tuple[str, dict]:
    """A random valid conv block plus one kernel, and the values the parser must return."""
    dims = draw(st.integers(1, 3))
    per_dim = st.lists(st.integers(1, 3), min_size=dims, max_size=dims)
    filt, dil, stride = draw(per_dim), draw(per_dim), draw(per_dim)
    lo = draw(st.lists(st.integers(0, 3), min_size=dims, max_size=dims))
    hi = draw(st.lists(st.integers(0, 3), min_size=dims, max_size=dims))
    # Keep the output non-empty: input + padding must cover the dilated filter.
    inp = [draw(st.integers(max(1, d * (r - 1) + 1 - a - b), 12)) for r, d, a, b in zip(filt, dil, lo, hi)]
    want = {
        "dims": dims, "groups": draw(st.integers(1, 64)), "batch": draw(st.integers(1, 256)),
        "in_channels": draw(st.integers(1, 64)), "out_channels": draw(st.integers(1, 64)),
        "input": tuple(inp), "filter": tuple(filt), "stride": tuple(stride), "dilation": tuple(dil),
        "pad_lo": tuple(lo), "pad_hi": tuple(hi),
        "layout": draw(st.sampled_from(["NHWGC", "GNHWC", "NGCHW"])),
        "weight_layout": draw(st.sampled_from(["GKYXC", "GKCYX"])),
        "dtype": draw(st.sampled_from(["f32", "f16", "bf16"])),
    }

    def lst(values: list, inner: st.SearchStrategy = _WS) -> str:
        return "[" + ",".join(draw(inner) + str(v) + draw(inner) for v in values) + "]"

    def per_dim_text(values: tuple[int, ...]) -> str:
        if len(set(values)) == 1 and draw(st.booleans()):
            return str(values[0])
        return lst(list(values), st.sampled_from(["", " ", "\n  "]))  # newlines inside [...] are fine

    if lo == hi:
        pad = str(lo[0]) if len(set(lo)) == 1 and draw(st.booleans()) else lst(lo)
    else:
        pad = "[" + ", ".join(f"[{a}, {b}]" for a, b in zip(lo, hi)) + "]"
    entries = {
        "dims": str(dims), "groups": str(want["groups"]), "batch": str(want["batch"]),
        "in_channels": str(want["in_channels"]), "out_channels": str(want["out_channels"]),
        "input": lst(inp), "filter": lst(filt), "stride": per_dim_text(want["stride"]),
        "dilation": per_dim_text(want["dilation"]), "padding": pad,
        "layout": want["layout"], "weight_layout": want["weight_layout"], "dtype": want["dtype"],
    }
    # Optional keys whose value equals the default may be left out.
    is_default = {
        "groups": want["groups"] == 1, "stride": set(stride) == {1}, "dilation": set(dil) == {1},
        "padding": set(lo + hi) == {0}, "layout": want["layout"] == "NHWGC",
        "weight_layout": want["weight_layout"] == "GKYXC", "dtype": want["dtype"] == "f32",
    }
    for key, default in is_default.items():
        if default and draw(st.booleans()):
            del entries[key]
    keys = draw(st.permutations(list(entries)))
    body = ""
    for key in keys:
        body += draw(_WS) + key + draw(_WS) + "=" + draw(_WS) + entries[key] + draw(_WS)
        if draw(st.booleans()):
            body += ";"
        else:
            body += draw(_COMMENT) + "\n" + draw(st.sampled_from(["", "\n", "  # blank\n"]))
    head = draw(st.sampled_from(["", "# file header\n", "\n\n"]))
    text = f"{head}conv c{draw(_WS)}{{{draw(st.sampled_from(['', chr(10)]))}{body}}}{draw(_COMMENT)}\n"

    op = draw(st.sampled_from(["forward", "grad_input", "grad_weight", "transposed"]))
    split_k = draw(st.one_of(st.none(), st.integers(1, 16))) if op == "grad_weight" else None
    # f32 values: the epilogue is applied as f32 constants (a smaller nonzero one is refused)
    alpha, beta = (draw(st.floats(-4, 4, allow_nan=False, width=32)) for _ in range(2))
    epilogue = draw(st.sampled_from([Epilogue(), Epilogue("scale", alpha), Epilogue("bilinear", alpha, beta)]))
    options = []
    if op == "grad_weight" and (split_k is not None or draw(st.booleans())):
        options.append(f"split_k = {split_k if split_k is not None else 'auto'}")
    if epilogue.kind == "scale":
        options.append(f"epilogue = scale({epilogue.alpha!r})")
    elif epilogue.kind == "bilinear":
        options.append(f"epilogue = bilinear({epilogue.alpha!r}, {epilogue.beta!r})")
    draw(st.randoms()).shuffle(options)
    block = (" { " + draw(st.sampled_from(["; ", "\n"])).join(options) + " }") if options else ""
    kernel = f"kernel kk{draw(_WS)}={draw(_WS)}{op}(c){block}{draw(_COMMENT)}"
    if draw(st.booleans()):  # kernels may come before the conv they use
        text = kernel + "\n" + text
    else:
        text = text + kernel
    want.update(op=op, split_k=split_k, epilogue=epilogue, name="kk")
    return text, want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_sources())
def test_round_trip_of_random_conv_blocks(case: tuple[str, dict]) -> None:
    text, want = case
    (problem,) = parse(text)
    for key, value in want.items():
        assert getattr(problem, key) == value, (key, text)


_TOKENS = st.sampled_from(
    ["conv", "kernel", "c", "k", "dims", "=", "2", "-1", "1.5", "[", "]", "(", ")", "{", "}", ",", ";", "\n",
     " ", "#x", "forward", "grad_weight", "split_k", "auto", "scale", "input", "@", "\t", "NHWGC"]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_TOKENS, max_size=40))
def test_arbitrary_input_raises_only_conv_syntax_errors(tokens: list[str]) -> None:
    text = "".join(tokens)
    try:
        parse(text, "f.conv")
    except ConvSyntaxError as err:
        lines = str(err).split("\n")
        assert lines[0].startswith(f"f.conv:{err.line}:{err.column}: error: ")
        assert lines[2].lstrip(" \t").startswith("^")


def test_dynamic_batch():
    (p,) = parse("conv c { dims = 1; batch = ?; in_channels = 2; out_channels = 3; input = [8]; filter = [3] }\n"
                 "kernel k = grad_weight(c)\n")
    assert p.dynamic_batch and p.batch >= 1
    (q,) = parse("conv c { dims = 1; batch = ?; in_channels = 2; out_channels = 3; input = [8]; filter = [3] }\n"
                 "kernel k = grad_weight(c)\n", batch=5)
    assert not q.dynamic_batch and q.batch == 5  # the override fixes every batch, `?` included
    with pytest.raises(ConvSyntaxError, match="got '\\?'"):
        parse("conv c { dims = 1; batch = 2; in_channels = ?; out_channels = 3; input = [8]; filter = [3] }\n")


# ------------------------------------------------------------------------------------------------
# Limits and encodings
# ------------------------------------------------------------------------------------------------

def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.conv"
    path.write_bytes("\ufeff".encode() + small().encode())
    assert [p.name for p in parse_file(path)] == ["k"]


def test_fullwidth_digits_are_not_numbers() -> None:
    with pytest.raises(ConvSyntaxError, match=r"1:\d+: error: expected .*got '３'"):
        parse(small().replace("batch = 2", "batch = ３"))


@pytest.mark.parametrize("key, value, fragment", [
    ("batch", "9223372036854775807", "batch: expected at most 2147483647"),
    ("input", "[2147483648, 7]", "input: expected at most 2147483647"),
    ("stride", "[1, 4294967296]", "stride: expected at most 2147483647"),
])
def test_sizes_past_32_bits_are_refused_where_they_stand(key: str, value: str, fragment: str) -> None:
    source = small().replace(f"{key} = " + {"batch": "2", "input": "[9, 7]", "stride": ""}[key], f"{key} = {value}") \
        if key != "stride" else small(f"; stride = {value}")
    with pytest.raises(ConvSyntaxError, match=r"<string>:1:6: error: invalid conv c: " + fragment):
        parse(source)


def test_tensors_past_2_48_elements_are_refused() -> None:
    source = small().replace("batch = 2", "batch = 2147483647").replace("input = [9, 7]", "input = [65536, 7]")
    with pytest.raises(ConvSyntaxError, match=r"input tensor would have \d+ elements; expected at most"):
        parse(source)


def test_huge_strides_check_and_plan_at_once() -> None:
    """Residues that hold no position cost nothing: a stride of 10^9 plans as fast as a stride of 2."""
    import time

    from convdsl.algebra import grad_input_phases

    (p,) = parse(small("; stride = 1000000000", kernels="kernel d = grad_input(c)\n"))
    start = time.perf_counter()
    phases = grad_input_phases(p)
    assert time.perf_counter() - start < 1.0
    assert {ph.residue for ph in phases} == {(a, b) for a in range(9) for b in range(7)}


# ------------------------------------------------------------------------------------------------
# Fuzzing: any text gives problems or a located error, never another exception
# ------------------------------------------------------------------------------------------------
# CONVDSL_FUZZ_EXAMPLES=10000 runs a longer search than the default one
FUZZ_EXAMPLES = int(os.environ.get("CONVDSL_FUZZ_EXAMPLES", "300"))
FUZZ_SECONDS_EACH = 2.0
_ALPHABET = st.sampled_from(list("{}[]()=;,?#.-+eE0123456789 \n\t") +
                            ["conv", "kernel", "grad_input", "grad_weight", "forward", "stride", "padding", "batch",
                             "dims", "split_k", "auto", "NHWGC", "bf16", "９", "\ufeff", "\x00", "é"])


@st.composite
def _mutated_sources(draw) -> str:
    text = EXAMPLE
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 12))
        insert = "".join(draw(st.lists(_ALPHABET, max_size=4)))
        text = text[:at] + insert + text[at + cut:]
    return text


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.one_of(_mutated_sources(), st.text(max_size=200)))
def test_fuzzed_sources_parse_or_give_a_located_error(source: str) -> None:
    # what `convdsl check` does (parse, then describe each kernel), within a time bound
    start = time.perf_counter()
    try:
        problems = parse(source)
    except ConvSyntaxError as err:
        assert str(err).startswith("<string>:") and ": error: " in str(err)
    else:
        assert all(p.name and p.describe() for p in problems)
    assert time.perf_counter() - start < FUZZ_SECONDS_EACH


# ------------------------------------------------------------------------------------------------
# Values the compiled module or the dtypes cannot hold: refused where they stand
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, column, fragments, caret", [
    # alpha * acc is cast to the output dtype: 1e30 is inf in f16 (and 1e39 in every dtype)
    ("kernel j = forward(c) { epilogue = scale(1e30) }", 42,
     ("expected alpha representable in the output dtype f16 (|alpha| <= 65504) in scale(alpha), got 1e+30",),
     " " * 41 + "^~~~"),
    ("kernel j = forward(c) { epilogue = bilinear(1, -7e4) }", 48,
     ("expected beta representable in the output dtype f16 (|beta| <= 65504) in bilinear(alpha, beta), got -70000",),
     " " * 47 + "^~~~"),
    # a nonzero scale that the f32 constant rounds to 0
    ("kernel j = forward(c) { epilogue = scale(1e-50) }", 42, ("expected alpha representable as the f32 constant",),
     " " * 41 + "^~~~~"),
    # IREE's VM reserves __init and __deinit: such a module compiled but did not load
    ("kernel __init = forward(c)", 8,
     ("expected a kernel name that does not start with '__' (the compiled module reserves such names",),
     "       ^~~~~~"),
    ("kernel j = grad_weight(c) { split_k = 9223372036854775808 }", 39,
     ("expected at most 2147483647 (2^31 - 1) for split_k, got 9223372036854775808",), " " * 38 + "^" + "~" * 18),
])
def test_unrepresentable_kernel_values(kernel: str, column: int, fragments: tuple[str, ...], caret: str) -> None:
    text = small("; dtype = f16", kernels="kernel k = forward(c)\n" + kernel + "\n")
    assert_error(text, f"3:{column}", fragments, kernel, caret)


def test_epilogue_in_range_of_a_wider_output_dtype_is_kept() -> None:
    # 1e30 fits an f32 result: the check is against the result's dtype, not the operands'
    (p,) = parse(small("; dtype = f16", kernels="kernel j = forward(c) { out_dtype = f32; epilogue = scale(1e30) }\n"))
    assert p.epilogue == Epilogue("scale", 1e30) and p.result_dtype == "f32"
    (p,) = parse(small(kernels="kernel j = grad_weight(c) { split_k = 2147483647 }\n"))
    assert p.split_k == 2**31 - 1


def test_integers_of_thousands_of_digits_are_located() -> None:
    digits = "1" + "0" * 5000
    err = error_of(small().replace("batch = 2", f"batch = {digits}"))
    assert str(err).startswith("x.conv:1:28: error: expected a number of at most 20 digits, got one of 5001 digits")
    assert (err.line, err.column) == (1, 28)
