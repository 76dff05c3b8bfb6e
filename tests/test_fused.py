"""Fused epilogue steps and prologues on the CPU: every op that takes them, every rank, both channel orders and
every activation, against the unfused float64 reference (the convolution in float64, then the steps).

The cases cover the product sparsely to keep the compiles few: each op runs at every (rank, layout) pair, its
activation and dtype rotating so that each op meets every activation and every dtype; the per-channel vectors,
the residual, scale/bilinear heads, groups and strides (the stride-phase forms, positions no tap reaches) and the
gather and GEMM forms (few or many channels) are spread over the same cases.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import convdsl
from convdsl import api
from convdsl.backends.iree import compile_mlir
from convdsl.compiler import lower_to_mlir
from convdsl.frontend.parser import parse
from convdsl.problem import problem_from_spec, problem_to_spec
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")
ACTIVATIONS = ("relu", "silu", "gelu", "gelu(tanh)", "hardswish")
RANKS_LAYOUTS = [(d, layout) for d in (1, 2, 3) for layout in ("NHWGC", "NGCHW")]
DTYPES = ("f32", "f16", "bf16")
SPATIAL = {1: "[9]", 2: "[6, 5]", 3: "[4, 3, 5]"}
# the epilogue's other steps, rotating: per-channel vectors, the residual and the scale/bilinear heads
EPILOGUE_FORMS = ("bias, {act}", "affine, residual, {act}", "scale(0.5), bias, residual, {act}", "residual, {act}",
                  "affine, {act}", "bilinear(1, 0.5), bias, {act}")
OPS = ("forward", "transposed", "grad_input", "grad_weight")


def _case(op_index: int, slot: int) -> tuple[str, str]:
    """(test id, .conv source of one kernel) for op OPS[op_index] at RANKS_LAYOUTS[slot]."""
    op = OPS[op_index]
    dims, layout = RANKS_LAYOUTS[slot]
    act = ACTIVATIONS[(slot + op_index) % len(ACTIVATIONS)]
    dtype = DTYPES[(slot + op_index) % len(DTYPES)]
    # few channels per group (the gather form) on odd slots, a GEMM's worth on even ones; stride 2 on every
    # third, with a 1-tap filter on the transposed one so that some positions are reached by no tap
    groups, c, k = (2, 3, 4) if slot % 2 else (1, 8, 8)
    stride = 2 if slot % 3 == 1 else 1
    taps = 1 if (stride == 2 and op == "transposed") else 3
    pad = 0 if taps == 1 else 1
    conv = (f"conv c {{ dims = {dims}; groups = {groups}; batch = 2; in_channels = {c}; out_channels = {k}; "
            f"input = {SPATIAL[dims]}; filter = [{', '.join([str(taps)] * dims)}]; stride = {stride}; "
            f"padding = {pad}; layout = {layout}; dtype = {dtype} }}\n")
    if op in ("forward", "transposed"):
        option = f"epilogue = {EPILOGUE_FORMS[(slot + op_index) % len(EPILOGUE_FORMS)].format(act=act)}"
    else:
        option = f"prologue = {act.replace('(tanh)', '')}_backward" + ("(tanh)" if "tanh" in act else "")
    name = f"{op}_{dims}d_{layout}_{dtype}_{re.sub(r'[^a-z0-9]+', '_', option.split('= ')[1]).strip('_')}"
    return name, conv + f"kernel k = {op}(c) {{ {option} }}\n"


CASES = dict(_case(o, s) for o in range(len(OPS)) for s in range(len(RANKS_LAYOUTS)))


def _unfused(p):
    """The same kernel without its fused forms (the reference of what the fusion changes)."""
    return p.without_fused()


def test_the_cases_cover_every_op_activation_rank_layout_and_dtype():
    problems = [parse(src)[0] for src in CASES.values()]
    for op in OPS:
        mine = [p for p in problems if p.op == op]
        assert {(p.dims, p.layout) for p in mine} == set(RANKS_LAYOUTS)
        assert {p.dtype for p in mine} == set(DTYPES)
        acts = {s for p in mine for s in p.epilogue.steps} | {p.prologue.activation for p in mine}
        assert {"relu", "silu", "gelu", "gelu_tanh", "hardswish"} <= acts, op
    epilogue_tensors = {t for p in problems for t in p.epilogue.tensors}
    assert epilogue_tensors == {"d", "bias", "scale", "shift", "residual"}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_kernel_matches_the_unfused_float64_reference(name):
    (p,) = parse(CASES[name])
    args = random_inputs(p, seed=7)
    # conv sums of uniform [-1, 1) inputs spread over a few units: the activations' curved parts are exercised
    got = api.get_kernel(p, "cpu")(*args)
    want = reference(p, *args)
    err = relative_error(got, want)
    assert err <= tolerance(p), (name, err)
    # the test can tell: the fused forms change the result by far more than the tolerance
    plain = _unfused(p)
    operands = [a for n, a in zip(p.arg_names, args) if n in plain.arg_names]
    assert relative_error(reference(plain, *operands), want) > 10 * tolerance(p), name


def test_positions_no_tap_reaches_get_the_epilogue():
    # transposed, stride 2, one tap: odd outputs are reached by no tap, so they are act(0 + bias), not 0
    (p,) = parse("conv c { dims = 1; batch = 1; in_channels = 2; out_channels = 3; input = [8]; filter = [1]; "
                 "stride = 2 }\nkernel t = transposed(c) { epilogue = bias, silu }\n")
    x = np.ones(p.arg_shapes[0], np.float32)
    w = np.ones(p.w_shape, np.float32)
    bias = np.array([[0.5, -2.0]], np.float32)
    y = api.get_kernel(p, "cpu")(x, w, bias)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    np.testing.assert_allclose(y[0, 1::2, 0, :], np.broadcast_to(silu(bias[0]), (4, 2)), rtol=1e-6)
    np.testing.assert_allclose(y[0, 0::2, 0, :], np.broadcast_to(silu(3 + bias[0]), (4, 2)), rtol=1e-6)


def _dispatches(p, target: Target = CPU, knobs=None) -> list[str]:
    """The names of the dispatches the kernel's allocating function runs, without IREE's copies and data-tiling
    encodings (which the unfused kernel has alike)."""
    mlir = lower_to_mlir([p], target, {p.name: knobs} if knobs is not None else None)
    ir = compile_mlir(mlir, target, ["--compile-to=stream"]).decode()
    start = ir.index(f"util.func public @{p.name}(")
    body = ir[start:ir.index("util.func", start + 10)]
    names = re.findall(r"dispatch @\S+::@(\w+)", body)
    return [n.split("_dispatch_")[-1] for n in names if "memcpy" not in n and not n.startswith("_encoding")]


@pytest.mark.parametrize("source, extra", [
    # the epilogue runs in the GEMM's dispatch (the CPU's im2col matmul), the interleaving pass of stride phases
    ("conv c { dims = 2; batch = 2; in_channels = 16; out_channels = 32; input = [12, 12]; filter = [3, 3]; "
     "padding = 1 }\nkernel y = forward(c) { epilogue = affine, residual, gelu }", 0),
    ("conv c { dims = 2; batch = 2; in_channels = 16; out_channels = 32; input = [12, 12]; filter = [3, 3]; "
     "padding = 1; stride = 2; layout = NGCHW }\nkernel y = transposed(c) { epilogue = bias, relu }", 0),
    # grad_weight's dY already passes an elementwise transpose: the prologue rides in it
    ("conv c { dims = 2; batch = 2; in_channels = 16; out_channels = 32; input = [12, 12]; filter = [3, 3]; "
     "padding = 1 }\nkernel y = grad_weight(c) { prologue = silu_backward }", 0),
    # grad_input reads dY through copies into its zero border: the prologue is one elementwise dispatch before them
    ("conv c { dims = 2; batch = 2; in_channels = 16; out_channels = 32; input = [12, 12]; filter = [3, 3]; "
     "padding = 1 }\nkernel y = grad_input(c) { prologue = relu_backward }", 1),
], ids=["forward", "transposed", "grad_weight", "grad_input"])
def test_fused_forms_add_no_dispatch_where_iree_can_fuse_them(source, extra):
    (p,) = parse(source)
    fused, plain = _dispatches(p), _dispatches(_unfused(p))
    # extra 0: no elementwise dispatch of its own, it runs inside the GEMM's (or the copy's, then named
    # elementwise_transpose where it was transpose)
    assert len(fused) == len(plain) + extra, (fused, plain)


@pytest.mark.parametrize("layout, extra", [("NHWGC", 1), ("NGCHW", 0)])
def test_on_cuda_the_steps_follow_the_triton_kernel(layout, extra):
    # the Triton GEMM core applies a scale at most: the steps are one elementwise dispatch after it (NHWGC), or ride
    # in the copy back from channels-last (NGCHW); Knobs(extern=False) fuses them into IREE's own GEMM instead
    pytest.importorskip("triton")
    from convdsl.passes.plan import plan_kernel
    from convdsl.tuning.knobs import Knobs
    cuda = Target("cuda", "sm_80")
    (p,) = parse("conv c { dims = 2; batch = 2; in_channels = 32; out_channels = 32; input = [8, 8]; filter = [3, 3]; "
                 f"padding = 1; layout = {layout}; dtype = f16 }}\nkernel y = forward(c) {{ epilogue = affine, residual, "
                 "relu }\n")
    assert plan_kernel(p, cuda).form == "extern"
    assert len(_dispatches(p, cuda)) == len(_dispatches(_unfused(p), cuda)) + extra
    linalg = Knobs(extern=False)
    assert plan_kernel(p, cuda, linalg).form != "extern"
    assert len(_dispatches(p, cuda, linalg)) == len(_dispatches(_unfused(p), cuda, linalg))


def test_api_takes_the_tensors_by_name_and_a_dynamic_batch():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1, 4, 3, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)  # (G * K,) as torch keeps it
    for n in (1, 3):  # one module for both batches
        x = rng.standard_normal((n, 5, 5, 1, 3)).astype(np.float32)
        r = rng.standard_normal((n, 5, 5, 1, 4)).astype(np.float32)
        y = convdsl.conv(x, w, padding=1, epilogue="bias, residual, hardswish", bias=bias, residual=r,
                         dynamic_batch=True)
        p = api.infer_problem("forward", x, w, padding=1, epilogue="bias, residual, hardswish", bias=bias, residual=r)
        assert p.arg_names == ("x", "w", "bias", "residual")
        assert relative_error(y, reference(p, x, w, bias.reshape(1, 4), r)) <= 1e-5
        dy = rng.standard_normal((n, 5, 5, 1, 4)).astype(np.float32)
        dw = convdsl.grad_weight(x, dy, filter=(3, 3), padding=1, prologue="relu_backward", saved=y,
                                 dynamic_batch=True)
        q = api.infer_problem("grad_weight", x, dy, filter=(3, 3), padding=1, prologue="relu_backward", saved=y)
        assert relative_error(dw, reference(q, x, dy, y)) <= 1e-5


@pytest.mark.parametrize("call, match", [
    (lambda x, w, v: convdsl.conv(x, w, epilogue="bias, relu"), r"epilogue bias, relu needs bias=, of shape \[1, 4\]"),
    (lambda x, w, v: convdsl.conv(x, w, epilogue="relu", bias=v), r"bias= is only used by the epilogue's bias step"),
    (lambda x, w, v: convdsl.conv(x, w, epilogue="affine", scale=v, shift=v[:3]),
     r"argument 'shift' expected shape \[1, 4\] \(groups, channels per group\) or \[4\], got \[3\]"),
    (lambda x, w, v: convdsl.conv(x, w, epilogue="residual", residual=np.zeros((2, 3, 3, 1, 4), np.float16)),
     r"argument 'residual' expected dtype f32 \(the result's\)"),
    (lambda x, w, v: convdsl.grad_weight(x, np.zeros((2, 3, 3, 1, 4), np.float32), filter=(3, 3),
                                         prologue="gelu_backward(tanh)"),
     r"prologue gelu_backward\(tanh\) needs saved=, of shape \[2, 3, 3, 1, 4\]"),
    (lambda x, w, v: convdsl.grad_weight(x, np.zeros((2, 3, 3, 1, 4), np.float32), filter=(3, 3), prologue="relu"),
     r"prologue: expected a Prologue or none, relu_backward, .*, got 'relu'; did you mean 'relu_backward'\?"),
    (lambda x, w, v: convdsl.conv(x, w, prologue="relu_backward"),
     r"unexpected keyword argument 'prologue'; prologue= belongs to grad_input and grad_weight"),
    (lambda x, w, v: convdsl.grad_input(np.zeros((2, 3, 3, 1, 4), np.float32), w, input=(5, 5), epilogue="relu"),
     r"epilogue: relu apply to the result of forward and transposed kernels, not of grad_input"),
], ids=["missing", "unused", "shape", "dtype", "missing-saved", "unknown-prologue", "prologue-on-conv",
        "step-on-grad-input"])
def test_api_refuses_tensors_and_forms_that_do_not_fit(call, match):
    x = np.zeros((2, 5, 5, 1, 3), np.float32)
    w = np.zeros((1, 4, 3, 3, 3), np.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, w, np.zeros(4, np.float32))


def test_spec_round_trip_and_unfused_specs_unchanged():
    (p,) = parse(CASES[next(iter(CASES))])
    assert problem_from_spec(problem_to_spec(p)) == p
    (q,) = parse(CASES[[n for n in CASES if n.startswith("grad_input")][0]])
    assert problem_from_spec(problem_to_spec(q)) == q and problem_to_spec(q)["prologue"] == q.prologue.kind
    # the tuning database keys problems by their spec: one without fused forms keeps the keys it had
    plain = problem_to_spec(_unfused(q))
    assert "prologue" not in plain and set(plain["epilogue"]) == {"kind", "alpha", "beta"}


# --- the reference's activations are torch's (float64, pure functions: cheap enough for hypothesis) ----------
torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from convdsl.reference import activation, activation_backward  # noqa: E402

_TORCH = {"relu": torch.nn.functional.relu, "silu": torch.nn.functional.silu,
          "gelu": lambda t: torch.nn.functional.gelu(t, approximate="none"),
          "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
          "hardswish": torch.nn.functional.hardswish}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(_TORCH)),
       xg=hnp.arrays(np.float64, st.tuples(st.just(2), st.integers(1, 32)),
                     elements=st.floats(-8, 8, allow_subnormal=False)))
def test_reference_activations_and_their_backward_are_torchs(name, xg):
    x, g = xg
    t = torch.tensor(x, requires_grad=True)
    y = _TORCH[name](t)
    (dx,) = torch.autograd.grad(y, t, torch.tensor(g))
    np.testing.assert_allclose(activation(name, x), y.detach().numpy(), rtol=1e-12, atol=1e-12)
    # relu's backward masks by the saved output, the others differentiate at the input, as torch saves them
    saved = y.detach().numpy() if name == "relu" else x
    np.testing.assert_allclose(activation_backward(name, g, saved), dx.numpy(), rtol=1e-10, atol=1e-12)
