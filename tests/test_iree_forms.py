"""check_iree_forms: a contraction must read its windowed (image) operand first, as IREE's CUDA backend
needs; the window is found in the operand's indexing map by its structure, not by its printed text."""
from __future__ import annotations

import pytest
from iree.compiler import ir

from convdsl.passes.pipeline import LoweringError, Stage, _reads_window, check_iree_forms
from convdsl.targets import Target

# A 1D convolution as linalg.generic over (n, o, k, y, c): y[n, o, k] += x[n, o + y, c] * w[k, y, c].
IMAGE = "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1 + d3, d4)>"
WEIGHT = "affine_map<(d0, d1, d2, d3, d4) -> (d2, d3, d4)>"
RESULT = "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>"
TYPES = {"x": "tensor<1x6x3xf32>", "w": "tensor<2x3x3xf32>"}


def conv_module(first: str, second: str) -> str:
    """The convolution with operand `first` ("x" or "w") read first."""
    maps = {"x": IMAGE, "w": WEIGHT}
    return f"""
func.func @k(%x: {TYPES["x"]}, %w: {TYPES["w"]}, %init: tensor<1x4x2xf32>) -> tensor<1x4x2xf32> {{
  %r = linalg.generic {{indexing_maps = [{maps[first]}, {maps[second]}, {RESULT}],
                        iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]}}
      ins(%{first}, %{second} : {TYPES[first]}, {TYPES[second]}) outs(%init : tensor<1x4x2xf32>) {{
  ^bb0(%a: f32, %b: f32, %acc: f32):
    %p = arith.mulf %a, %b : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  }} -> tensor<1x4x2xf32>
  return %r : tensor<1x4x2xf32>
}}
"""


def stage_of(text: str) -> Stage:
    with ir.Context():
        module = ir.Module.parse(text)
    return Stage(problems=(), target=Target("cpu", "host"), module=module)


def test_image_first_passes() -> None:
    stage = stage_of(conv_module("x", "w"))
    assert check_iree_forms(stage) is stage


def test_image_second_raises() -> None:
    with pytest.raises(LoweringError, match="reads its windowed \\(image\\) operand second"):
        check_iree_forms(stage_of(conv_module("w", "x")))


@pytest.mark.parametrize(
    "expr, windowed",
    [
        ("d1 + d3", True),
        ("d1 * 2 + d3 * 3", True),  # stride and dilation
        ("(d1 * 2 + d3) floordiv 2", True),  # a stride phase
        ("d1 - d3", True),  # grad_input's o = i - y
        ("d1 + 1", False),  # a constant offset is no window, though its text has a "+"
        ("d1 * 2", False),
        ("d3", False),
    ],
)
def test_window_is_a_sum_over_two_dims(expr: str, windowed: bool) -> None:
    with ir.Context():
        amap = ir.AffineMapAttr(ir.Attribute.parse(f"affine_map<(d0, d1, d2, d3) -> ({expr})>")).value
        assert _reads_window(amap.results[0]) is windowed
