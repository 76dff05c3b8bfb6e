"""convdsl.options, the one normaliser of conv options: the forms each option takes, its canonical results,
and errors that name the option, what was expected, what came and where; the parser and the API give
the same expectation for the same value."""
from __future__ import annotations

import inspect
import pickle

import ml_dtypes
import numpy as np
import pytest

import convdsl
from convdsl import api, options
from convdsl.frontend import ConvSyntaxError, parse
from convdsl.options import ArityError, Call, ChoiceError, DimsError, OptionError
from convdsl.problem import Epilogue, ProblemError


@pytest.mark.parametrize(
    "value, form, want",
    [
        (1, "pairs", ((1, 1), (1, 1))),
        (np.int64(2), "pairs", ((2, 2), (2, 2))),
        ([1, 0], "pairs", ((1, 0), (1, 0))),
        ([[0, 1], [2, 3]], "pairs", ((0, 2), (1, 3))),  # [lo, hi] per dim, as the language writes it
        ([1, (0, 2)], "pairs", ((1, 0), (1, 2))),  # the forms mixed per dim
        (np.array([1, 2]), "pairs", ((1, 2), (1, 2))),
        ([[0, 1], [2, 3]], "sides", ((0, 1), (2, 3))),  # [[lo per dim], [hi per dim]], as the suite writes it
        ([1, 2], "sides", ((1, 2), (1, 2))),
        ("valid", "pairs", ((0, 0), (0, 0))),
    ],
)
def test_padding_forms(value, form, want) -> None:
    assert options.padding(value, 2, form=form) == want


def test_same_padding_covers_the_dilated_filter_high_side_first() -> None:
    # reach d*(R-1): 2 (R=3) -> 1/1; 3 (R=4) -> 1/2; 4 (R=3, d=2) -> 2/2
    assert options.padding("same", 3, filter=(3, 4, 3), dilation=(1, 1, 2), stride=(1, 1, 1)) == ((1, 1, 2), (1, 2, 2))
    with pytest.raises(OptionError, match=r"padding: expected a stride of 1 with same .*got stride \[2, 1\]"):
        options.padding("same", 2, filter=(3, 3), dilation=(1, 1), stride=(2, 1))
    with pytest.raises(OptionError, match="same needs the filter size"):
        options.padding("same", 2)


@pytest.mark.parametrize(
    "call, error, key, at, message",
    [
        (lambda: options.padding([1, 1, 1], 2), DimsError, "padding", (),
         r"padding: expected one number, 2 numbers or 2 \(lo, hi\) pairs for 2 spatial dims, got 3: \[1, 1, 1\]"),
        (lambda: options.padding([1, (0, 1, 2)], 2), OptionError, "padding", (1,),
         r"padding: expected \[lo, hi\] \(2 values\), got 3"),
        (lambda: options.padding([[0, -1], 1], 2), OptionError, "padding", (0, 1),
         r"padding: expected a non-negative integer, got -1"),
        (lambda: options.expand(1.5, 2, "stride"), OptionError, "stride", (), r"stride: expected an integer, got 1\.5"),
        (lambda: options.expand([1, 0], 2, "dilation", minimum=1), OptionError, "dilation", (1,),
         r"dilation: expected a positive integer, got 0"),
        (lambda: options.expand(5, 2, "input", scalar=False), OptionError, "input", (),
         r"input: expected a list of 2 numbers, got 5"),
        (lambda: options.layout("NCHW"), ChoiceError, "layout", (),
         r"layout: expected one of NHWGC, GNHWC, NGCHW, got 'NCHW'; did you mean"),
        (lambda: options.layout("NDHWGC", dims=2), ChoiceError, "layout", (),
         r"NDHWGC is the 3D spelling of NHWGC, but dims = 2"),
        (lambda: options.dtype(np.float64, "out_dtype"), ChoiceError, "out_dtype", (),
         r"out_dtype: expected one of f32, f16, bf16"),
        (lambda: options.compute(["fp8", "fp16"]), OptionError, "compute", (1,), r"compute: expected fp8 or bf8, got 'fp16'"),
        (lambda: options.compute("fp8"), OptionError, "compute", (), r"did you mean \[fp8, fp8\]\?"),
        (lambda: options.parse_epilogue("scale(1, 2)"), ArityError, "epilogue", (),
         r"epilogue: scale takes 1 argument \(scale\(alpha\)\), got 2: 'scale\(1, 2\)'"),
        (lambda: options.parse_epilogue("bilinear(1, x)"), OptionError, "epilogue", (1,),
         r"epilogue: expected a number for beta in bilinear\(alpha, beta\), got 'x'"),
        (lambda: options.parse_epilogue("scale"), OptionError, "epilogue", (), r"did you mean scale\(alpha\)\?"),
        (lambda: options.split_k(0), OptionError, "split_k", (), r"split_k: expected auto or a positive integer, got 0"),
    ],
)
def test_errors_name_the_option_what_was_expected_and_what_came(call, error, key, at, message) -> None:
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ProblemError)
    assert (info.value.key, info.value.at) == (key, at)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and str(again) == str(info.value) and again.at == info.value.at


def test_dtype_spellings() -> None:
    torch = pytest.importorskip("torch")
    for value, want in [("f32", "f32"), ("float16", "f16"), (np.float32, "f32"), (np.dtype("float16"), "f16"),
                        (ml_dtypes.bfloat16, "bf16"), (np.dtype(ml_dtypes.bfloat16), "bf16"),
                        (torch.float32, "f32"), (torch.half, "f16"), (torch.bfloat16, "bf16")]:
        assert options.dtype(value) == want, value


def test_layout_spellings_fix_the_rank() -> None:
    assert options.layout("NHWGC") == ("NHWGC", None)
    assert options.layout("ndhwgc") == ("NHWGC", 3)
    assert options.layout("NGCW", dims=1) == ("NGCHW", 1)
    assert options.weight_layout("GKZYXC") == ("GKYXC", 3)
    assert options.weight_layout("GKCX", dims=1) == ("GKCYX", 1)


def test_compute_and_epilogue_canonical_forms() -> None:
    assert options.compute("tf32") == options.compute(["tf32", "tf32"]) == ("tf32", "tf32")
    assert options.compute(("bf8", "fp8")) == ("bf8", "fp8")
    assert options.compute(None) is None
    assert options.parse_epilogue(None) == options.epilogue("none") == Epilogue()
    assert options.parse_epilogue(" bilinear( 1.5 , -0.5 ) ") == Epilogue("bilinear", 1.5, -0.5)
    assert options.epilogue(Call("scale", (2,))) == Epilogue("scale", 2.0)


# --- the same normaliser behind the parser and the API ----------------------------------------------
CONV = "conv c {{ dims = 2; batch = 2; in_channels = 3; out_channels = 4; input = [5, 5]; filter = [3, 3]{extra} }}\n" \
       "kernel k = forward(c)\n"
X = np.zeros((2, 5, 5, 1, 3), np.float32)  # NHWGC
W = np.zeros((1, 4, 3, 3, 3), np.float32)  # GKYXC


@pytest.mark.parametrize(
    "source, keyword, expected",
    [
        ("padding = [[1, 2], [1]]", dict(padding=[[1, 2], [1]]), "expected [lo, hi] (2 values)"),
        ("stride = 2.5", dict(stride=2.5), "expected"),
        ("layout = NCHW", dict(layout="NCHW"), "NCHW"),
        ("compute = [fp8, fp16]", dict(compute=["fp8", "fp16"]), "expected fp8 or bf8"),
        ("compute = bf16x4", dict(compute="bf16x4"), "expected bf16x3, tf32 or a list of 2 compute types [A, B]"),
    ],
)
def test_parser_and_api_refuse_alike(source: str, keyword: dict, expected: str) -> None:
    with pytest.raises(ConvSyntaxError) as located:
        parse(CONV.format(extra="; " + source), "x.conv")
    with pytest.raises(OptionError) as plain:
        api.infer_problem("forward", X, W, **keyword)
    assert expected in str(located.value).splitlines()[0] and expected in str(plain.value)


def test_same_padding_in_the_language_and_the_api() -> None:
    (p,) = parse(CONV.format(extra="; padding = same"))
    assert (p.pad_lo, p.pad_hi, p.output) == ((1, 1), (1, 1), (5, 5))
    assert api.infer_problem("forward", X, W, padding="same") == p.with_(name=api.KERNEL_NAME)
    text = CONV.format(extra="; stride = 2; padding = same")
    with pytest.raises(ConvSyntaxError) as info:
        parse(text, "x.conv")
    first = str(info.value).splitlines()[0]
    column = text.index("same") + 1  # at the padding value
    assert first.startswith(f"x.conv:1:{column}: error: expected a stride of 1 with same")
    assert first.endswith("for padding, got stride [2, 2]")


def test_public_ops_declare_their_options_once() -> None:
    shared = ["stride", "dilation", "padding", "groups", "layout", "weight_layout", "out_dtype", "compute"]
    run = ["target", "arch", "dynamic_batch"]
    forward_tensors = ["d", "bias", "scale", "shift", "residual"]  # the epilogue's tensors, by name
    for fn, own, tensors in [(convdsl.conv, [], forward_tensors), (convdsl.grad_input, ["input"], ["d", "saved"]),
                             (convdsl.grad_weight, ["filter"], ["d", "saved"]),
                             (convdsl.conv_transpose, ["input"], forward_tensors)]:
        names = list(inspect.signature(fn).parameters)[2:]
        split_k = ["split_k"] if fn is convdsl.grad_weight else []
        prologue = ["prologue"] if fn in (convdsl.grad_input, convdsl.grad_weight) else []
        assert names == [*own, *shared, *split_k, "epilogue", *prologue, *tensors, *run], fn.__name__
        assert all(p.kind is p.KEYWORD_ONLY for p in list(inspect.signature(fn).parameters.values())[2:])
    with pytest.raises(TypeError, match=r"conv: got an unexpected keyword argument 'input'; input= belongs to "
                                        r"grad_input and conv_transpose"):
        convdsl.conv(X, W, input=(5, 5))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'strid'; did you mean 'stride'\?"):
        convdsl.conv(X, W, strid=2)


@pytest.mark.parametrize("epilogue, dtype, at, fragment", [
    (Epilogue("scale", 1e30), "f16", (0,), "alpha representable in the output dtype f16 (|alpha| <= 65504)"),
    (Epilogue("scale", -7e4), "f16", (0,), "alpha representable in the output dtype f16"),
    (Epilogue("bilinear", 1.0, 3.4e38), "bf16", (1,), "beta representable in the output dtype bf16"),
    (Epilogue("scale", 1e39), "f32", (0,), "alpha representable in the output dtype f32"),
    (Epilogue("scale", 1e-46), "f32", (0,), "alpha representable as the f32 constant it is applied as"),
])
def test_epilogue_arguments_past_the_output_dtype_are_refused(epilogue, dtype, at, fragment) -> None:
    with pytest.raises(OptionError) as info:
        options.epilogue_range(epilogue, dtype)
    assert info.value.key == "epilogue" and info.value.at == at and fragment in str(info.value)


@pytest.mark.parametrize("epilogue, dtype", [
    (Epilogue("scale", 65504.0), "f16"), (Epilogue("scale", 1e30), "f32"), (Epilogue("scale", 1e30), "bf16"),
    (Epilogue("bilinear", 0.0, -1.5e-45), "f32"), (Epilogue(), "f16"),
])
def test_epilogue_arguments_the_output_dtype_holds_are_kept(epilogue, dtype) -> None:
    assert options.epilogue_range(epilogue, dtype) is epilogue


def test_split_k_stops_at_the_size_limit() -> None:
    assert options.split_k(2**31 - 1) == 2**31 - 1
    with pytest.raises(OptionError, match=r"split_k: expected at most 2147483647 \(2\^31 - 1\), got 9223372036854775808"):
        options.split_k(2**63)
