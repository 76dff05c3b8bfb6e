"""The gather forms (passes/gather.py): when they are chosen, their row-block rule, and exactness on llvm-cpu."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convdsl import policy
from convdsl.passes import lower_to_mlir
from convdsl.passes.plan import plan_kernel
from convdsl.problem import LAYOUTS, WEIGHT_LAYOUTS, ConvProblem, Epilogue
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs

from test_lowering_cpu import CPU, check, draw_window, function_text

CUDA = Target.parse("cuda", "sm_80")
# these tests are about the linalg forms; on CUDA the depthwise kernels get Triton kernels by default
# (tests/test_extern.py), so they ask for the linalg form
LINALG = Knobs(extern=False)
DW = ConvProblem(
    op="grad_input", dims=2, groups=6, batch=2, in_channels=1, out_channels=1, input=(9, 8), filter=(3, 3),
    stride=(2, 1), dilation=(1, 2), pad_lo=(1, 2), pad_hi=(2, 1), name="k",
)


@pytest.mark.parametrize("op", ["grad_input", "transposed", "grad_weight"])
def test_small_groups_take_the_gather_form(op):
    for c, k in ((1, 1), (4, 4), (8, 2)):
        assert plan_kernel(DW.with_(op=op, in_channels=c, out_channels=k), CUDA, LINALG).form == "gather"


@pytest.mark.parametrize("change", [
    dict(groups=1, in_channels=1, out_channels=1),  # not grouped: a GEMM
    dict(in_channels=4, out_channels=5),  # C*K = 20: the GEMM forms
    dict(in_channels=2, out_channels=8),  # 9 taps x K = 72 weight slices: above MAX_WEIGHT_SLICES
    dict(dynamic_batch=True),  # shapes must be static
    dict(dtype="f16", compute=("fp8", "fp8")),  # fp8 compute keeps the GEMM forms' rounding
    dict(op="forward"),  # gradients only on GPUs (the CPU gathers forward too: see below)
    dict(op="grad_weight", dims=3, input=(5, 4, 4), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
         pad_lo=(1, 1, 1), pad_hi=(1, 1, 1)),  # IREE fails to distribute 3D partial sums
])
def test_other_problems_keep_their_forms(change):
    assert plan_kernel(DW.with_(**change), CUDA, LINALG).form != "gather"


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 128), o0=st.integers(1, 200), g=st.integers(2, 256), taps=st.integers(1, 7))
def test_row_blocks_is_the_fewest_that_fill_the_gpu(batch, o0, g, taps):
    p = ConvProblem(op="grad_weight", dims=1, groups=g, batch=batch, in_channels=1, out_channels=1,
                    input=(o0 + taps - 1,), filter=(taps,), stride=(1,), dilation=(1,), pad_lo=(0,), pad_hi=(0,))
    assert p.output == (o0,)
    b = policy.gather_row_blocks(p)
    weights = math.prod(p.w_shape)
    assert o0 % b == 0
    enough = lambda blocks: batch * blocks * weights >= policy.MIN_PARTIALS  # noqa: E731
    assert enough(b) or b == o0
    assert not any(o0 % smaller == 0 and enough(smaller) for smaller in range(1, b))


def test_gather_grad_input_has_no_padded_copy_and_no_reduction():
    text = function_text(lower_to_mlir([DW], CUDA, knobs={DW.name: LINALG}), DW.name)
    assert "tensor.extract " in text and "tensor.pad" not in text and "insert_slice" not in text
    generics = [ln for ln in text.splitlines() if "linalg.generic" in ln]
    # the weight's [taps.., K, G, C] copy, then the gather; no reduction anywhere
    assert len(generics) == 2 and not any('"reduction"' in g for g in generics)


@pytest.mark.parametrize("op", ["grad_input", "forward"])
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
def test_gather_weight_slices_are_cut_from_a_copy(op, weight_layout):
    # slices of W itself are strided where the other channel axis is not innermost (every GKCYX slice) and ran
    # several times slower on the CPU: every slice is cut from the contiguous copy, none from the argument
    p = FEW.with_(op=op, weight_layout=weight_layout)
    text = function_text(lower_to_mlir([p], CPU), p.name)
    slices = [ln for ln in text.splitlines() if "tensor.extract_slice" in ln]
    assert len(slices) == math.prod(p.filter) * (p.out_channels if op == "grad_input" else p.in_channels)
    assert not any("extract_slice %arg" in ln for ln in slices)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
@pytest.mark.parametrize("op", ["grad_input", "transposed", "grad_weight"])
def test_gather_forms_are_exact(layout, weight_layout, op, policy_rules):
    # the gather forms are chosen on GPUs: check them on the CPU, where they can be compared (the CPU's own
    # depthwise-named form put aside)
    policy_rules(cpu_depthwise_named=lambda *_: False)
    p = DW.with_(op=op, layout=layout, weight_layout=weight_layout, dtype="bf16", in_channels=2, out_channels=3,
                 epilogue=Epilogue("bilinear", 0.5, -0.75) if op != "grad_weight" else Epilogue("scale", 2.0))
    assert plan_kernel(p, CPU).form == "gather"
    check(p)
    check(p.with_(dims=1, input=(11,), filter=(4,), stride=(3,), dilation=(2,), pad_lo=(3,), pad_hi=(0,),
                  in_channels=1, out_channels=1))


# --- forward with few channels per group: the gather form on the CPU (policy.cpu_gather_forward) -------------

FEW = DW.with_(op="forward", in_channels=4, out_channels=4)


def test_cpu_forward_with_few_channels_takes_the_gather_form():
    assert plan_kernel(FEW, CPU).form == "gather"
    assert plan_kernel(FEW.with_(in_channels=2, out_channels=8), CPU).form == "gather"
    # elsewhere forward keeps its forms: GPUs, depthwise, more channels, one group, batch = ?, fp8 compute, and a
    # window whose taps x C weight slices pass MAX_WEIGHT_SLICES
    assert plan_kernel(FEW, CUDA, LINALG).form != "gather"
    for change in (dict(in_channels=1, out_channels=1), dict(in_channels=4, out_channels=5),
                   dict(groups=1), dict(dynamic_batch=True), dict(dtype="f16", compute=("fp8", "fp8")),
                   dict(in_channels=8, out_channels=2)):
        assert plan_kernel(FEW.with_(**change), CPU).form != "gather", change


def test_gather_forward_is_one_parallel_generic_reading_x_by_extract():
    text = function_text(lower_to_mlir([FEW], CPU), FEW.name)
    assert "tensor.extract " in text and "tensor.pad" not in text and "insert_slice" not in text
    generics = [ln for ln in text.splitlines() if "linalg.generic" in ln]
    # the weight's [taps.., C, G, K] copy, then the gather; no reduction anywhere
    assert len(generics) == 2 and not any('"reduction"' in g for g in generics)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
def test_gather_forward_is_exact(layout, weight_layout):
    p = FEW.with_(layout=layout, weight_layout=weight_layout, dtype="bf16", in_channels=2, out_channels=3,
                  epilogue=Epilogue("bilinear", 0.5, -0.75))
    assert plan_kernel(p, CPU).form == "gather"
    check(p)
    check(p.with_(dims=1, input=(11,), filter=(4,), stride=(3,), dilation=(2,), pad_lo=(3,), pad_hi=(0,),
                  epilogue=Epilogue("scale", 2.0)))


@pytest.mark.parametrize("changes", [
    {}, dict(dtype="f16"), dict(dtype="f32", stride=(1, 1), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0)),
    dict(batch=3, groups=32, in_channels=4, out_channels=4, input=(12, 12), stride=(2, 2), dilation=(1, 1),
         pad_lo=(1, 1), pad_hi=(1, 1)),
    dict(dims=3, input=(5, 6, 7), filter=(3, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
         pad_hi=(1, 0, 1), in_channels=2, out_channels=2),
])
def test_gather_forward_shapes_and_dtypes(changes):
    p = FEW.with_(**changes)
    assert plan_kernel(p, CPU).form == "gather"
    check(p)


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_gather_forward_index_algebra(data):
    # random 1D/2D windows (stride, dilation, borders on either side, cropped tails) against the float64 reference:
    # the X position o*s + t*d - lo and its [0, I) mask
    p = FEW.with_(batch=data.draw(st.integers(1, 2)), groups=data.draw(st.integers(2, 5)),
                  in_channels=data.draw(st.integers(1, 2)), out_channels=data.draw(st.integers(2, 4)),
                  **draw_window(data, most_taps=3))
    assert plan_kernel(p, CPU).form == "gather"
    check(p)
