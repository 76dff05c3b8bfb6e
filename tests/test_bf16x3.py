"""compute = "bf16x3": f32 convolutions as three bf16 products per product (convdsl/passes/bf16x3.py).

Checked on llvm-cpu, which runs the same split kernel as the GPUs: against the float64 reference of the
plain f32 convolution, against what a plain bf16 conversion of the inputs would give, in the emitted IR,
and in the frontend's and the API's error messages.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import convdsl
from convdsl.api import infer_problem
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.compiler import cache_key
from convdsl.frontend import ConvSyntaxError, parse
from convdsl.passes import lower_to_mlir
from convdsl.passes.explain import describe_plan
from convdsl.passes.plan import plan_kernel
from convdsl.passes.plan import plan_kernel
from convdsl.problem import BF16X3_COMPUTE, ConvProblem, Epilogue, ProblemError, problem_from_spec, problem_to_spec
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from test_lowering_cpu import CPU, check, check_every_batch, function_text, problems

# Relative L2 error allowed against the float64 reference.  Measured on llvm-cpu: 3.0e-6 .. 4.2e-6 over the
# kernels below (bf16 hi/lo split: ~2^-16 per product; the plain f32 kernel: ~4e-7).  Mispaired blocks give
# 1.0, a lost lo part ~2e-3 (a plain bf16 conversion of the inputs: 1.7e-3 .. 2.6e-3), truncating instead of
# rounding to bf16 ~2.3e-5.
BOUND = 2e-5
# bf16x3 must beat a plain bf16 conversion of the inputs by at least this factor (measured: 430x .. 640x)
GAIN = 50


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)


def run_module(ps: list[ConvProblem], seed: int = 0) -> list[tuple[ConvProblem, float, float]]:
    """Compile `ps` as one module, run each kernel on random unit-scale inputs (never zero).

    Returns (problem, bf16x3 error, error of a plain bf16 conversion of the inputs) per kernel."""
    module = LoadedModule(compile_mlir(lower_to_mlir(ps, CPU), CPU), CPU)
    out = []
    for i, p in enumerate(ps):
        inputs = random_inputs(p, seed=seed + i)
        got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
        assert got.shape == p.result_shape
        want = reference(p, *inputs)
        err = relative_error(np.asarray(got, dtype=np.float64), want)
        # the same convolution on operands rounded to bf16 (what dtype = bf16 would compute at best)
        plain = reference(p, bf16(inputs[0]), bf16(inputs[1]), *inputs[2:])
        out.append((p, err, relative_error(plain, want)))
    return out


def assert_accurate(results: list[tuple[ConvProblem, float, float]], bound: float = BOUND) -> None:
    for p, err, err_bf16 in results:
        assert err < bound, f"{p.name}: {p.describe()}: relative error {err:.2e} >= {bound:.0e}"
        assert err * GAIN < err_bf16, f"{p.name}: bf16x3 error {err:.2e} vs plain bf16 {err_bf16:.2e}"


# Every activation layout with G = 1 and G = 2, both weight layouts, every rank with G = 1 and G = 2.
COMBOS = [
    ("NHWGC", "GKYXC", 1, 1), ("NHWGC", "GKCYX", 2, 2), ("GNHWC", "GKYXC", 3, 1),
    ("GNHWC", "GKCYX", 1, 2), ("NGCHW", "GKYXC", 2, 1), ("NGCHW", "GKCYX", 3, 2),
]


def kernels(layout: str, weight_layout: str, dims: int, groups: int) -> list[ConvProblem]:
    # C*K = 30 per group: the implicit-GEMM form (few channels per group would take the gather form)
    base = ConvProblem(
        op="forward", dims=dims, groups=groups, batch=2, in_channels=6, out_channels=5,
        input={1: (13,), 2: (9, 8), 3: (6, 5, 4)}[dims], filter={1: (3,), 2: (3, 2), 3: (3, 2, 2)}[dims],
        stride=(1,) * dims, dilation=(1,) * dims, pad_lo=(1,) * dims, pad_hi=(1,) * dims,
        layout=layout, weight_layout=weight_layout, compute="bf16x3", name="k",
    )
    strided = dict(stride=(2,) * dims, dilation=(1,) + (2,) * (dims - 1), pad_lo=(1,) * dims, pad_hi=(0,) * dims)
    return [
        base.with_(name="fwd", **strided),
        base.with_(op="grad_input", name="dgrad"),
        base.with_(op="grad_input", name="dgrad_s2", **strided),
        base.with_(op="transposed", name="up", **strided),
        base.with_(op="grad_weight", name="wgrad", batch=4, split_k=2, **strided),
    ]


@pytest.mark.parametrize("layout, weight_layout, dims, groups", COMBOS)
def test_exact_against_f64_on_every_layout(layout, weight_layout, dims, groups):
    ps = kernels(layout, weight_layout, dims, groups)
    for p in ps:
        plan = plan_kernel(p, CPU)
        assert plan.bf16x3 is not None and plan.bf16x3.problem.dtype == "bf16", p.name
    assert_accurate(run_module(ps))


def test_grad_weight_split_k_forms():
    # uneven chunks of the tripled batch, equal chunks (one dispatch), no split, and one chunk per block
    base = kernels("NHWGC", "GKYXC", 2, 2)[-1]
    ps = [base.with_(name=f"wgrad_s{s}_n{n}", batch=n, split_k=s) for s, n in ((3, 5), (2, 2), (1, 3), (3, 1))]
    assert_accurate(run_module(ps, seed=7))


def test_dynamic_batch_module_serves_every_batch():
    # `batch = ?` is supported, grad_weight included: the tripled batch is a collapse of (3, ?) into ?
    ps = [p.with_(dynamic_batch=True, split_k=None) for p in kernels("GNHWC", "GKYXC", 2, 2) if p.name != "dgrad"]
    mlir = lower_to_mlir(ps, CPU)
    assert "tensor<3x?x" in mlir or "x3x?x" in mlir  # the batch split of grad_weight
    check_every_batch(mlir, ps, lambda _: BOUND)


def test_gpu_forms_channels_last_detour_and_1x1_grad_weight(policy_rules):
    # On GPUs an NGCHW kernel runs channels-last between layout copies and a 1x1 grad_weight has dY first;
    # the split must compose with both: check them on the CPU, where they can be compared.
    policy_rules(CHANNELS_LAST_BACKENDS=("cpu",))
    ngchw = [p for p in kernels("NGCHW", "GKCYX", 2, 2) if p.name in ("fwd", "dgrad_s2", "wgrad")]
    one = kernels("NHWGC", "GKYXC", 2, 1)[-1].with_(
        name="wgrad_1x1", filter=(1, 1), stride=(1, 1), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0))
    assert all(plan_kernel(p, CPU).bf16x3.channels_last is not None for p in ngchw)
    assert plan_kernel(one, CPU).bf16x3.dy_first
    assert_accurate(run_module([*ngchw, one], seed=11))


def test_epilogues_and_out_dtype():
    # D (bilinear) is not split; the epilogue and the output cast run on the f32 accumulator
    fwd, dgrad, _, up, wgrad = kernels("NHWGC", "GKCYX", 2, 2)
    ps = [
        fwd.with_(name="fwd_bilinear", epilogue=Epilogue("bilinear", 0.5, -1.5)),
        wgrad.with_(name="wgrad_scale", epilogue=Epilogue("scale", 2.0)),
        up.with_(name="up_bilinear", epilogue=Epilogue("bilinear", 1.25, 0.75)),
    ]
    assert_accurate(run_module(ps, seed=3))
    to_f16 = dgrad.with_(name="dgrad_f16", out_dtype="f16")
    assert tolerance(to_f16) == 1e-2
    check(to_f16)


def test_much_more_accurate_than_bf16_on_a_long_reduction():
    # C*taps = 64*9 = 576 products per output (forward), N*pixels = 4*64 per weight (grad_weight)
    p = ConvProblem(op="forward", dims=2, groups=1, batch=4, in_channels=64, out_channels=16, input=(8, 8),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1),
                    compute="bf16x3", name="fwd")
    results = run_module([p, p.with_(op="grad_weight", name="wgrad"), p.with_(op="grad_input", name="dgrad")])
    for q, err, err_bf16 in results:
        assert err_bf16 > 1e-3, (q.name, err_bf16)  # the bf16 conversion alone is visible at this length
        assert err < err_bf16 / GAIN and err < BOUND, (q.name, err, err_bf16)


def test_memory_bound_forms_stay_f32():
    # depthwise and the few-channel gather forms gain nothing from matrix units: no split, plain f32
    depthwise = ConvProblem(op="forward", dims=2, groups=4, batch=2, in_channels=1, out_channels=1, input=(7, 6),
                            filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1),
                            compute="bf16x3", name="dw")
    gather = depthwise.with_(op="grad_input", in_channels=2, out_channels=3, stride=(2, 2), name="gi")
    for p, form in ((depthwise, "depthwise"), (gather, "gather")):
        plan = plan_kernel(p, CPU)
        assert (plan.form, plan.bf16x3, plan.problem) == (form, None, p)
        assert "bf16x3 not applied" in describe_plan(plan)
    mlir = lower_to_mlir([depthwise, gather], CPU)
    assert "bf16" not in mlir
    for p, err, _ in run_module([depthwise, gather]):
        assert err <= 1e-5, (p.name, err)


# --- the emitted IR ------------------------------------------------------------------------------------
_GENERIC = re.compile(r"linalg\.generic \{[^\n]*iterator_types = \[([^\]]*)\]\} ins\(([^)]*)\) outs\(([^)]*)\)")


def _generics(mlir: str) -> list[tuple[list[str], list[str], str]]:
    """(iterator kinds, input element types, output element type) of every linalg.generic."""
    out = []
    for iters, ins, outs in _GENERIC.findall(mlir):
        in_types = re.findall(r"x([a-z]+\d+)>", ins.split(":", 1)[1]) if ":" in ins else []
        out_type = re.findall(r"x([a-z]+\d+)>", outs.split(":", 1)[1])[0]
        out.append((re.findall(r'"(\w+)"', iters), in_types, out_type))
    return out


@pytest.mark.parametrize("which", ["fwd", "dgrad", "dgrad_s2", "up", "wgrad"])
def test_ir_splits_each_operand_once_and_contracts_bf16_into_f32(which):
    p = next(q for q in kernels("NHWGC", "GKYXC", 2, 2) if q.name == which)
    p = p.with_(epilogue=Epilogue("bilinear", 0.5, 2.0))  # D must pass through unsplit
    mlir = function_text(lower_to_mlir([p], CPU), p.name)
    generics = _generics(mlir)
    splits = [g for g in generics if g[1] == ["f32"] and g[2] == "bf16"]
    assert len(splits) == 2, generics  # one split generic per operand, none for D
    assert all(iters.count("parallel") == len(iters) for iters, _, _ in splits)
    assert mlir.count("tensor.collapse_shape") == 2
    contractions = [g for g in generics if "reduction" in g[0] and len(g[1]) == 2]
    assert contractions and all(ins == ["bf16", "bf16"] and out == "f32" for _, ins, out in contractions), generics
    # no f32 x f32 product left: every multiply widens bf16 operands
    assert not any("reduction" in it and ins == ["f32", "f32"] for it, ins, _ in generics)
    # the split's blocks: operand A is [hi, hi, lo] (lo at block 2), B is [hi, lo, hi] (lo at block 1)
    bodies = re.findall(r"linalg\.index (\d+) : index\n\s*%\w+ = arith\.cmpi eq, %\w+, %(c\d+)", mlir)
    assert sorted(c for _, c in bodies) == ["c1", "c2"], bodies


def test_plan_describes_the_split():
    p = kernels("NHWGC", "GKYXC", 2, 1)[2]  # grad_input, stride 2
    text = describe_plan(plan_kernel(p, CPU))
    assert "compute: bf16x3" in text and "along K" in text and "[A_hi|A_hi|A_lo] x [B_hi|B_lo|B_hi]" in text
    assert f"{p.out_channels * 3}]" in text.split("compute: bf16x3", 1)[1]  # the inner kernel's tripled K
    assert "stride phases" in text


# --- problem, frontend and API -------------------------------------------------------------------------
def test_problem_canonical_form_round_trips():
    p = kernels("NHWGC", "GKYXC", 2, 2)[0]
    assert p.compute == BF16X3_COMPUTE and p.bf16x3 and not p.fp8_compute
    assert p == p.with_(compute=["bf16x3", "bf16x3"]) == p.with_(compute=("bf16x3", "bf16x3"))
    assert problem_from_spec(problem_to_spec(p)) == p
    assert "compute=bf16x3" in p.describe()
    assert cache_key([p], CPU) != cache_key([p.with_(compute=None)], CPU)
    fp8 = p.with_(dtype="f16", compute=("bf8", "fp8"))
    assert fp8.fp8_compute and not fp8.bf16x3


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dtype="f16"), r'compute: bf16x3 splits f32 operands into bf16 pairs: expected dtype f32, got dtype f16'),
        (dict(dtype="bf16"), r"expected dtype f32, got dtype bf16"),
        (dict(compute=("bf16x3", "fp8")), r'compute: expected "bf16x3" for both operands \(it treats A and B '
                                          r"alike\), not mixed with fp8, bf8, tf32, got \['bf16x3', 'fp8'\]"),
        (dict(compute="bf16x2"), r'compute: expected \[A, B\] from fp8, bf8, "bf16x3" or "tf32", got \'bf16x2\''),
    ],
)
def test_problem_errors(changes, message):
    with pytest.raises(ProblemError, match=message):
        kernels("NHWGC", "GKYXC", 2, 1)[0].with_(**changes)


CONV = "conv c {{\n  dims = 2; batch = 2; in_channels = 3; out_channels = 5\n  input = [9, 7]; filter = [3, 3]\n  {extra}\n}}\n"


@pytest.mark.parametrize("spelling", ['"bf16x3"', "bf16x3", "[bf16x3, bf16x3]"])
def test_frontend_accepts_bf16x3(spelling):
    conv_level = parse(CONV.format(extra=f"compute = {spelling}") + "kernel k = grad_input(c)\n", "x.conv")[0]
    kernel_level = parse(CONV.format(extra="") + f"kernel k = grad_input(c) {{ compute = {spelling} }}\n", "x.conv")[0]
    assert conv_level.compute == kernel_level.compute == BF16X3_COMPUTE
    assert conv_level == kernel_level


def _error(text: str) -> ConvSyntaxError:
    with pytest.raises(ConvSyntaxError) as info:
        parse(text, "x.conv")
    return info.value


@pytest.mark.parametrize(
    "extra, kernel, where, message",
    [
        # bf16x3 on an f16 conv: at the compute value, with a note at the dtype
        ('dtype = f16; compute = "bf16x3"', "", "4:26",
         "expected dtype f32 for compute = bf16x3 (it splits f32 operands into bf16 pairs), got dtype f16"),
        ("dtype = bf16", '{ compute = "bf16x3" }', "6:35", "expected dtype f32 for compute = bf16x3"),
        ("compute = [bf16x3, fp8]", "", "4:13", "expected bf16x3 for both operands or for neither (it treats A and "
                                                 "B alike), got [bf16x3, fp8]"),
        ("compute = [fp8, bf16x3]", "", "4:13", "got [fp8, bf16x3]"),
        ('compute = "bf16x4"', "", "4:13", 'expected bf16x3, tf32 or a list of 2 compute types [A, B] for compute, '
                                           "got \"bf16x4\"; did you mean 'bf16x3'?"),
        ("compute = bf16", "", "4:13", "expected bf16x3, tf32 or a list of 2 compute types [A, B] for compute, "
                                       "got 'bf16'"),
        ('dtype = "f32"', "", "4:11", 'expected a dtype (f32, f16 or bf16) for dtype, got "f32"'),
    ],
)
def test_frontend_errors(extra, kernel, where, message):
    err = _error(CONV.format(extra=extra) + f"kernel k = forward(c) {kernel}\n")
    first = str(err).splitlines()[0]
    assert first.startswith(f"x.conv:{where}: error: "), str(err)
    assert message in first, str(err)
    if extra.startswith("dtype = f16"):
        assert "x.conv:4:11: note: dtype set here" in str(err)


def test_syntax_errors_do_not_advertise_strings():
    err = _error(CONV.format(extra="stride = = 2") + "kernel k = forward(c)\n")
    assert "expected a name, a number, '?' or '[', got '='" in str(err)


def test_api_compute_bf16x3():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2, 9, 8, 1, 8)).astype(np.float32)  # NHWGC, C = 8
    w = rng.uniform(-1, 1, (1, 6, 3, 3, 8)).astype(np.float32)  # GKYXC, K = 6
    got = convdsl.conv(x, w, padding=1, compute="bf16x3")
    plain = convdsl.conv(x, w, padding=1)
    p = infer_problem("forward", x, w, padding=1, compute="bf16x3")
    assert p.compute == BF16X3_COMPUTE
    err = relative_error(got.astype(np.float64), reference(p, x, w))
    assert err < BOUND and relative_error(got, plain) < BOUND, err
    with pytest.raises(ProblemError, match=r"conv: compute: bf16x3 splits f32 operands .* got dtype f16"):
        convdsl.conv(x.astype(np.float16), w.astype(np.float16), padding=1, compute="bf16x3")
    # the API's compute errors are the language's (convdsl.options), without the position
    with pytest.raises(ProblemError, match=r"conv: compute: expected bf16x3 for both operands or for neither "
                                           r"\(it treats A and B alike\), got \[bf16x3, fp8\]"):
        convdsl.conv(x, w, padding=1, compute=("bf16x3", "fp8"))
    with pytest.raises(ProblemError, match=r"conv: compute: expected bf16x3, tf32 or a list of 2 compute types "
                                           r"\[A, B\], got 'bf16x2'; did you mean 'bf16x3'\?"):
        convdsl.conv(x, w, padding=1, compute="bf16x2")


# --- random problems -------------------------------------------------------------------------------------
@given(st.sampled_from(["forward", "grad_input", "grad_weight", "transposed"]).flatmap(problems), st.booleans())
@settings(max_examples=8)
def test_random_problems(p, one_group):
    # the lowering tests' problems, in f32 with bf16x3; half of them with G = 1, which is always a GEMM
    p = p.with_(dtype="f32", out_dtype=None, compute="bf16x3", groups=1 if one_group else p.groups)
    assert plan_kernel(p, CPU).bf16x3 is not None or p.depthwise or p.groups > 1
    check(p)
