"""Compiled kernels on llvm-cpu against the float64 reference, over random configurations."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from convdsl.algebra import output_size
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.passes.explain import describe_plan
from convdsl.passes.plan import plan_kernel
from convdsl.problem import DYNAMIC_BATCH_NOMINAL, LAYOUTS, WEIGHT_LAYOUTS, ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target
from convdsl.tuning import Knobs

CPU = Target("cpu", "host")


def run_on_cpu(p: ConvProblem, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    inputs = random_inputs(p, seed=seed)
    return module.call(p.name, *inputs, out_dtype=p.result_dtype), inputs


def check_every_batch(mlir: str, problems: list[ConvProblem], bound, batches=(1, 3)) -> None:
    """One `batch = ?` module, called at several batch sizes; each result within bound(problem)."""
    module = LoadedModule(compile_mlir(mlir, CPU), CPU)
    for n in batches:
        for p in problems:
            concrete = p.with_(batch=n)
            inputs = random_inputs(concrete, seed=n)
            got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
            assert got.shape == concrete.result_shape
            err = relative_error(np.asarray(got, dtype=np.float64), reference(concrete, *inputs))
            assert err <= bound(concrete), (n, p.name, err)


def function_text(mlir: str, name: str) -> str:
    """The text of `func.func @name` alone (every module also holds its `$into` twin: convdsl/abi.py)."""
    start = mlir.index(f"func.func @{name}(")
    end = mlir.find("func.func @", start + 1)
    return mlir[start:] if end < 0 else mlir[start:end]


def draw_window(data: st.DataObject, most_taps: int) -> dict:
    """A random 1D/2D window for ConvProblem: filter (1..most_taps per dim), stride 1-3, dilation 1-2, borders on
    either side up to the filter's reach, and an input just large enough for one output or up to 9."""
    dims = data.draw(st.integers(1, 2))
    f = [data.draw(st.integers(1, most_taps)) for _ in range(dims)]
    s = [data.draw(st.integers(1, 3)) for _ in range(dims)]
    d = [data.draw(st.integers(1, 2)) for _ in range(dims)]
    lo = [data.draw(st.integers(0, (fi - 1) * di)) for fi, di in zip(f, d)]
    hi = [data.draw(st.integers(0, (fi - 1) * di)) for fi, di in zip(f, d)]
    size = [data.draw(st.integers(max(1, (fi - 1) * di + 1 - a - b), 9)) for fi, di, a, b in zip(f, d, lo, hi)]
    return dict(dims=dims, input=tuple(size), filter=tuple(f), stride=tuple(s), dilation=tuple(d), pad_lo=tuple(lo),
                pad_hi=tuple(hi))


def check(p: ConvProblem) -> None:
    got, inputs = run_on_cpu(p)
    assert got.shape == p.result_shape
    want = reference(p, *inputs)
    err = relative_error(np.asarray(got, dtype=np.float64), want)
    assert err <= tolerance(p), f"{p.describe()}: relative error {err:.3e} > {tolerance(p):.0e}"


@st.composite
def problems(draw, op: str) -> ConvProblem:
    dims = draw(st.integers(1, 3))
    max_size = {1: 9, 2: 7, 3: 5}[dims]
    depthwise = draw(st.booleans()) if op != "transposed" else False
    groups = draw(st.integers(2, 4)) if depthwise else draw(st.integers(1, 3))
    c = 1 if depthwise else draw(st.sampled_from([1, 2, 3, 5, 7]))
    k = 1 if depthwise else draw(st.sampled_from([1, 2, 3, 5, 6]))
    filt = tuple(draw(st.integers(1, 4 if dims < 3 else 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dil = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    lo = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    hi = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    size = tuple(draw(st.integers(1, max_size)) for _ in range(dims))
    assume(all(output_size(*a) >= 1 for a in zip(size, filt, stride, dil, lo, hi)))
    dtype = draw(st.sampled_from(["f32", "f16", "bf16"]))
    out_dtype = draw(st.sampled_from([None, "f32"])) if dtype != "f32" else None
    kind = draw(st.sampled_from(["none", "scale", "bilinear"]))
    epilogue = Epilogue(kind, draw(st.sampled_from([0.5, -1.25, 2.0])), draw(st.sampled_from([0.5, -0.75]))) \
        if kind != "none" else Epilogue()
    compute = draw(st.sampled_from([None, None, None, ("bf8", "fp8"), ("fp8", "fp8")])) if dtype != "f32" else None
    return ConvProblem(
        op=op, dims=dims, groups=groups, batch=draw(st.integers(1, 3)), in_channels=c, out_channels=k,
        input=size, filter=filt, stride=stride, dilation=dil, pad_lo=lo, pad_hi=hi,
        layout=draw(st.sampled_from(LAYOUTS)), weight_layout=draw(st.sampled_from(WEIGHT_LAYOUTS)),
        dtype=dtype, out_dtype=out_dtype, compute=compute,
        split_k=draw(st.sampled_from([None, 1, 2, 3])) if op == "grad_weight" else None,
        epilogue=epilogue, name=f"k_{op}",
    )


@given(problems("grad_input"))
def test_grad_input(p):
    check(p)


@given(problems("grad_weight"))
def test_grad_weight(p):
    check(p)


@given(problems("forward"))
def test_forward(p):
    check(p)


@given(problems("transposed"))
@settings(max_examples=10)
def test_transposed(p):
    check(p)


BASE = ConvProblem(
    op="grad_input", dims=2, groups=2, batch=2, in_channels=3, out_channels=5, input=(9, 8), filter=(3, 3),
    stride=(2, 3), dilation=(1, 2), pad_lo=(1, 0), pad_hi=(2, 1), name="k",
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_layout", WEIGHT_LAYOUTS)
@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight", "transposed"])
def test_every_layout_pair(op, layout, weight_layout):
    check(BASE.with_(op=op, layout=layout, weight_layout=weight_layout))


def test_split_k_is_bitwise_deterministic_and_close_to_unsplit():
    p = BASE.with_(op="grad_weight", batch=6, split_k=3, dtype="f16", out_dtype="f32")
    first, inputs = run_on_cpu(p, seed=3)
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    for _ in range(3):
        again = module.call(p.name, *inputs, out_dtype="f32")
        assert np.array_equal(first.view(np.uint32), again.view(np.uint32))
    unsplit, _ = run_on_cpu(p.with_(split_k=1), seed=3)
    assert relative_error(first.astype(np.float64), unsplit.astype(np.float64)) < 1e-6


def test_split_k_uneven_chunks_and_clamped_to_the_batch():
    from convdsl.algebra import plan_split_k

    uneven = BASE.with_(op="grad_weight", batch=5, split_k=3)  # chunks of 1, 2, 2 samples
    assert [b - a for a, b in plan_split_k(uneven).chunks] == [1, 2, 2]
    check(uneven)
    clamped = BASE.with_(op="grad_weight", batch=2, split_k=4)
    assert plan_split_k(clamped).parts == 2
    check(clamped)


def test_phase_that_no_tap_reaches_is_zero():
    # stride 2, dilation 2: odd positions of dX are reached by no tap (gcd(2, 2) = 2): they must be 0
    p = BASE.with_(stride=(2, 2), dilation=(2, 2), pad_lo=(0, 0), pad_hi=(0, 0), input=(9, 9))
    got, inputs = run_on_cpu(p)
    assert np.all(got[:, 1::2] == 0) and np.all(got[:, :, 1::2] == 0)
    check(p)
    check(p.with_(epilogue=Epilogue("bilinear", 1.5, -0.5)))  # there the result is beta * D


def test_no_zero_inserted_tensor_in_strided_grad_input():
    # Zero insertion would build a dY of spatial size about (O-1)*s + 1 + 2*(R-1): here 19..23.
    # The phases only ever hold dY windows (at most O + R) and slices of dX (the full I, or ceil(I/s)).
    import re

    p = BASE.with_(stride=(3, 3), dilation=(1, 1), input=(20, 20), pad_lo=(1, 1), pad_hi=(1, 1))
    ir_text = lower_to_mlir([p], CPU)
    o, r, i = p.output[0], p.filter[0], p.input[0]
    for shape in re.findall(r"tensor<((?:\d+x){5})", ir_text):
        n, h, w_, *_ = (int(v) for v in shape.rstrip("x").split("x"))
        for size in (h, w_):
            assert size == i or size <= o + r, f"tensor of spatial size {size} in {shape}"
    # and the GEMMs read each filter tap once: the phase weights together hold prod(R) taps
    from convdsl.algebra import grad_input_phases

    assert sum(np.prod(ph.taps) for ph in grad_input_phases(p) if not ph.empty) == 9


def test_depthwise_has_no_channel_loops():
    # depthwise (C = K = 1 per group) is a stencil: its contraction reduces over the taps alone
    p = BASE.with_(groups=8, in_channels=1, out_channels=1, op="forward")
    ir_text = lower_to_mlir([p], CPU)
    reductions = [ln for ln in ir_text.splitlines() if "linalg.generic" in ln and "reduction" in ln]
    assert reductions and all(ln.count('"reduction"') == p.dims for ln in reductions)
    check(p)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dynamic_batch_module_serves_every_batch(layout):
    # `batch = ?`: one module, called at several batch sizes, each checked against the reference
    problems = [
        BASE.with_(op=op, name=op, layout=layout, dynamic_batch=True, dtype="f16",
                   split_k=2 if op == "grad_weight" else None,
                   epilogue=Epilogue("bilinear", 0.5, 2.0) if op == "grad_input" else Epilogue())
        for op in ("forward", "grad_input", "grad_weight", "transposed")
    ]
    mlir = lower_to_mlir(problems, CPU)
    assert "tensor<?x" in mlir or "x?x" in mlir
    check_every_batch(mlir, problems, tolerance)


@pytest.mark.parametrize("op", ["forward", "grad_input", "grad_weight", "transposed"])
def test_ngchw_channels_last_detour_is_exact(op, policy_rules):
    # On GPUs, NGCHW kernels run channels-last between two layout copies (IREE miscompiles the
    # channel-first form there); check that detour on the CPU, where it can be compared.
    policy_rules(CHANNELS_LAST_BACKENDS=("cpu",))
    p = BASE.with_(op=op, layout="NGCHW", weight_layout="GKCYX", dtype="bf16", dynamic_batch=True,
                   epilogue=Epilogue("bilinear", 0.5, 1.5) if op != "grad_weight" else Epilogue("scale", 2.0))
    assert "layout: NGCHW activations copied to NHWGC" in describe_plan(plan_kernel(p, CPU))
    check(p)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_gpu_1x1_grad_weight_form_is_exact(layout, split_k, policy_rules):
    # On GPUs a 1x1 grad_weight has dY as the contraction's first operand (IREE's CUDA matmul path got
    # the X-first form wrong); check that form on the CPU, where it can be compared.
    policy_rules(CHANNELS_LAST_BACKENDS=("cpu",))
    p = BASE.with_(op="grad_weight", filter=(1, 1), stride=(1, 1), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0),
                   batch=6, in_channels=6, out_channels=5, layout=layout, dtype="f16", out_dtype="f32",
                   split_k=split_k)
    assert plan_kernel(p, CPU).dy_first or layout == "NGCHW"
    check(p)
    check(p.with_(batch=5, split_k=None, dynamic_batch=(split_k == 1)))


@settings(max_examples=12, deadline=None)
@given(p=problems("grad_input"))
def test_grad_input_with_phase_weights_k_innermost(p):
    # the order CUDA uses for strided kernels ([G, C, taps, K], plan.weight_k_inner), forced on the CPU
    planned = plan_kernel(p, CPU, Knobs(k_inner=True))
    assert planned.weight_k_inner == (planned.form == "implicit-gemm")
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU, knobs={p.name: Knobs(k_inner=True)}), CPU), CPU)
    inputs = random_inputs(p, seed=0)
    got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
    err = relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))
    assert err <= tolerance(p), f"{p.describe()}: relative error {err:.3e}"


def test_phase_weights_are_k_innermost_on_gpus_only():
    p = BASE.with_(op="grad_input", stride=(2, 2), groups=1, in_channels=64, out_channels=64)
    linalg = Knobs(extern=False)  # the order is a choice of the linalg form (not of the Triton kernels)
    assert not plan_kernel(p.with_(stride=(1, 1)), Target("cuda", "sm_80"), linalg).weight_k_inner
    assert plan_kernel(p, Target("cuda", "sm_80"), linalg).form == "implicit-gemm"
    assert plan_kernel(p, Target("cuda", "sm_80"), linalg).weight_k_inner
    assert not plan_kernel(p, CPU).weight_k_inner


def test_a_dynamic_batch_module_refuses_mismatched_batches():
    # a deployed `batch = ?` module is called without convdsl's argument checks: it checks the batches itself
    p = BASE.with_(op="grad_weight", batch=DYNAMIC_BATCH_NOMINAL, dynamic_batch=True, name="wg")
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    x = random_inputs(p.with_(batch=3, dynamic_batch=False), seed=0)[0]
    dy_same, dy_other = (random_inputs(p.with_(batch=b, dynamic_batch=False), seed=0)[1] for b in (3, 2))
    assert module.call("wg", x, dy_same, out_dtype=p.result_dtype).shape == p.w_shape
    with pytest.raises(RuntimeError, match="argument 'dy' must have the batch size of 'x'"):
        module.call("wg", x, dy_other, out_dtype=p.result_dtype)
