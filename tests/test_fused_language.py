"""The language's fused forms: `epilogue = <steps>` and `prologue = <activation>_backward` parse, `convdsl check`
refuses bad ones at their file, line and column with what was expected and what came, and `convdsl explain`
shows them.  Nothing here compiles."""
from __future__ import annotations

import pytest

from convdsl.cli import main
from convdsl.frontend.parser import ConvSyntaxError, parse
from convdsl.problem import Epilogue, Prologue

CONV = "conv c { dims = 2; groups = 2; batch = 2; in_channels = 3; out_channels = 4; input = [9, 7]; filter = [3, 3] }\n"


def _kernel(line: str):
    (p,) = parse(CONV + line + "\n", "x.conv")
    return p


@pytest.mark.parametrize("line, epilogue", [
    ("kernel y = forward(c) { epilogue = bias, relu }", Epilogue(steps=("bias", "relu"))),
    ("kernel y = forward(c) { epilogue = affine, residual, relu }", Epilogue(steps=("affine", "residual", "relu"))),
    ("kernel y = forward(c) { epilogue = scale(0.5), bias, gelu(tanh) }",
     Epilogue("scale", 0.5, steps=("bias", "gelu_tanh"))),
    ("kernel y = forward(c) { epilogue = bilinear(1, 2), silu }", Epilogue("bilinear", 1.0, 2.0, steps=("silu",))),
    ("kernel y = transposed(c) { epilogue = gelu }", Epilogue(steps=("gelu",))),
    ("kernel y = transposed(c) { epilogue = gelu(none), hardswish }", Epilogue(steps=("gelu", "hardswish"))),
    ("kernel y = forward(c) { epilogue = [bias, relu] }", Epilogue(steps=("bias", "relu"))),  # the list form too
    # the forms there were keep their meaning
    ("kernel y = forward(c) { epilogue = scale(0.5) }", Epilogue("scale", 0.5)),
    ("kernel y = grad_weight(c) { epilogue = bilinear(1, 0.5) }", Epilogue("bilinear", 1.0, 0.5)),
    ("kernel y = forward(c) { epilogue = none }", Epilogue()),
])
def test_epilogue_forms_parse(line, epilogue):
    assert _kernel(line).epilogue == epilogue


def test_epilogue_arguments_follow_the_steps_in_order():
    p = _kernel("kernel y = forward(c) { epilogue = affine, residual, bias, relu }")
    assert p.arg_names == ("x", "w", "scale", "shift", "residual", "bias")
    assert p.arg_shapes[2:] == ((2, 4), (2, 4), p.y_shape, (2, 4))
    assert p.arg_dtypes[2:] == ("f32", "f32", "f32", "f32")
    t = _kernel("kernel y = transposed(c) { epilogue = bias }")  # channels of the result: C
    assert t.arg_shapes[2] == (2, 3)


@pytest.mark.parametrize("line, prologue, names", [
    ("kernel dx = grad_input(c) { prologue = relu_backward }", "relu_backward", ("dy", "w", "saved")),
    ("kernel dw = grad_weight(c) { prologue = gelu_backward(tanh); out_dtype = f16 }", "gelu_tanh_backward",
     ("x", "dy", "saved")),
    ("kernel dx = grad_input(c) { prologue = gelu_backward; epilogue = bilinear(1, 1) }", "gelu_backward",
     ("dy", "w", "saved", "d")),
    ("kernel dx = grad_input(c) { prologue = silu_backward }", "silu_backward", ("dy", "w", "saved")),
    ("kernel dw = grad_weight(c) { prologue = hardswish_backward }", "hardswish_backward", ("x", "dy", "saved")),
])
def test_prologue_forms_parse(line, prologue, names):
    p = _kernel(line)
    assert p.prologue == Prologue(prologue) and p.arg_names == names
    assert p.arg_shapes[names.index("saved")] == p.y_shape


@pytest.mark.parametrize("line, fragment, at", [
    ("kernel y = forward(c) { epilogue = bias, relu6 }",
     "expected none, scale(alpha) or bilinear(alpha, beta), or bias, affine, residual, relu, silu, gelu, gelu(tanh) "
     "or hardswish in epilogue, got 'relu6'; did you mean 'relu'?", "relu6"),
    ("kernel y = grad_weight(c) { epilogue = bias }",
     "expected scale(alpha) or bilinear(alpha, beta) in a grad_weight kernel's epilogue (bias, affine, residual, "
     "relu, silu, gelu, gelu(tanh) or hardswish apply to forward and transposed results), got bias", "bias"),
    ("kernel y = grad_input(c) { epilogue = scale(2), residual }",
     "in a grad_input kernel's epilogue", "residual"),
    ("kernel y = forward(c) { epilogue = bias, scale(2) }",
     "expected scale(...) as the first step (it acts on the convolution's sum), got it after bias", "scale(2)"),
    ("kernel y = forward(c) { epilogue = relu, bias, relu }", "expected each step once, got a second relu", "relu"),
    ("kernel y = forward(c) { epilogue = gelu(fast) }",
     "expected none or tanh for approximate (as torch.nn.GELU's) in gelu(approximate), got 'fast'", "fast"),
    ("kernel y = forward(c) { epilogue = bias(1) }", "expected bias without arguments, got bias(1)", "bias(1)"),
    ("kernel y = forward(c) { epilogue = bias, none }", "expected a step (none stands alone: no epilogue)", "none"),
    ("kernel y = forward(c) { epilogue = scale(1e9), relu; out_dtype = f16 }",
     "expected alpha representable in the output dtype f16", "1e9"),
    ("kernel y = forward(c) { prologue = relu_backward }",
     "expected prologue only on grad_input and grad_weight kernels, got it on a forward kernel", "prologue"),
    ("kernel y = transposed(c) { prologue = relu_backward }", "got it on a transposed kernel", "prologue"),
    ("kernel y = grad_input(c) { prologue = relu }",
     "expected none, relu_backward, silu_backward, gelu_backward, gelu_backward(tanh) or hardswish_backward for "
     "prologue, got 'relu'; did you mean 'relu_backward'?", "relu"),
    ("kernel y = grad_input(c) { prologue = gelu_backward(erf) }", "got 'erf'", "erf"),
    ("kernel y = grad_input(c) { prologue = relu_backward, silu_backward }",
     "expected one value for prologue, got 2 separated by ','", "silu_backward"),
    ("kernel y = grad_weight(c) { split_k = 2, 4 }", "expected one value for split_k, got 2", "4"),
])
def test_bad_forms_are_located(line, fragment, at):
    with pytest.raises(ConvSyntaxError) as info:
        parse(CONV + line + "\n", "x.conv")
    err = info.value
    column = line.rindex(at) + 1 if at in ("relu", "none") else line.index(at) + 1
    assert (err.filename, err.line, err.column) == ("x.conv", 2, column), str(err)
    assert fragment in err.message, err.message
    assert err.width == len(at)


def test_a_chain_on_a_conv_key_is_refused_with_the_list_form():
    with pytest.raises(ConvSyntaxError) as info:
        parse("conv c { dims = 2; batch = 1; in_channels = 1; out_channels = 1; input = [5, 5]; filter = 3, 3 }\n"
              "kernel y = forward(c)\n", "x.conv")
    assert "expected one value for filter, got 2 separated by ','" in str(info.value)
    assert "a list is written in brackets: [1, 2]" in str(info.value)


def test_check_names_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.conv"
    bad.write_text(CONV + "kernel y = forward(c) {\n  epilogue = affine,\n    residual, swish\n}\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:15: error: expected none, scale(alpha)" in err and "got 'swish'" in err
    assert "    residual, swish\n              ^~~~~" in err
    good = tmp_path / "good.conv"
    good.write_text(CONV + "kernel y = forward(c) { epilogue = affine, residual, relu }\n"
                           "kernel dx = grad_input(c) { prologue = relu_backward }\n")
    assert main(["check", str(good)]) == 0


def test_explain_shows_the_fused_forms(tmp_path, capsys):
    src = tmp_path / "f.conv"
    src.write_text(CONV + "kernel y = forward(c) { epilogue = scale(2), affine, residual, gelu(tanh) }\n"
                          "kernel dw = grad_weight(c) { prologue = relu_backward }\n")
    assert main(["explain", str(src), "--stage", "plan"]) == 0
    out = capsys.readouterr().out
    assert "epilogue=scale(2), affine, residual, gelu(tanh)" in out
    assert "scale: GK [2, 4] f32, shift: GK [2, 4] f32, residual: NHWGK [2, 7, 5, 2, 4] f32 -> y" in out
    assert "in f32, in order: * 2, * scale[g, k] + shift[g, k], + residual, gelu(tanh) (per-channel" in out
    assert "one elementwise generic on the GEMM's result, which IREE fuses into its dispatch" in out
    assert "prologue: relu_backward: dY * relu'(saved), saved being the activation's output" in out
    assert "saved: NHWGK [2, 7, 5, 2, 4] f32 -> dw" in out


def test_explain_on_cuda_says_where_the_steps_run(tmp_path, capsys):
    pytest.importorskip("triton")
    src = tmp_path / "f.conv"
    src.write_text(CONV.replace("groups = 2", "groups = 1").replace("in_channels = 3", "in_channels = 32")
                   .replace("out_channels = 4", "out_channels = 32") + "kernel y = forward(c) { epilogue = bias, relu }\n")
    assert main(["explain", str(src), "--stage", "plan", "--target", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "one elementwise generic after the Triton kernel (which applies the scale and the cast), a dispatch of " \
           "its own" in out
    assert "from PyTorch (convdsl.torch): the IREE module through DLPack (synchronised): the stream kernels take " \
           "no fused epilogue steps or prologue" in out
