"""compute = "tf32": f32 products allowed in one-pass TF32, as cuDNN and PyTorch allow for convolutions.

A permission, like torch.backends.cudnn.allow_tf32: the CUDA kernels take it (Triton's one-pass tf32 dot), the
linalg forms compute f32 products and say so.  Checked here: the canonical form, the frontend's and the API's
spellings and errors, the tolerance, the kernels' precision, the CPU result (f32-accurate), and that explain
names the products.  The GPU tests run examples/ck15_conv3d_bwd_data.conv's dgrad_tf32 on a chip.
"""
from __future__ import annotations

import numpy as np
import pytest

import convdsl
from convdsl.api import infer_problem
from convdsl.compiler import cache_key
from convdsl.frontend import ConvSyntaxError, parse
from convdsl.policy import plan_launches
from convdsl.passes.explain import describe_plan
from convdsl.passes.plan import plan_kernel
from convdsl.problem import TF32_COMPUTE, ConvProblem, ProblemError, problem_from_spec, problem_to_spec
from convdsl.reference import TF32_TOLERANCE, TOLERANCE, reference, relative_error, tolerance
from convdsl.targets import Target

HOPPER, CPU = Target("cuda", "sm_90"), Target("cpu", "host")


def _p(**kw) -> ConvProblem:
    base = dict(op="grad_input", dims=2, groups=1, batch=2, in_channels=32, out_channels=32, input=(9, 9),
                filter=(3, 3), stride=(2, 2), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f32",
                compute="tf32", name="k")
    base.update(kw)
    return ConvProblem(**base)


def test_problem_canonical_form_and_tolerance():
    p = _p()
    assert p.compute == TF32_COMPUTE and p.tf32 and not p.bf16x3 and not p.fp8_compute
    assert p == p.with_(compute=["tf32", "tf32"]) == p.with_(compute=("tf32", "tf32"))
    assert problem_from_spec(problem_to_spec(p)) == p
    assert "compute=tf32" in p.describe()
    assert cache_key([p], HOPPER) != cache_key([p.with_(compute=None)], HOPPER)
    assert tolerance(p) == TF32_TOLERANCE > TOLERANCE["f32"] == tolerance(p.with_(compute=None))


@pytest.mark.parametrize("changes, message", [
    (dict(dtype="f16"), r"compute: tf32 rounds f32 operands to TF32: expected dtype f32, got dtype f16"),
    (dict(compute=("tf32", "bf16x3")), r'compute: expected "tf32" for both operands \(it treats A and B alike\)'),
    (dict(compute=("fp8", "tf32")), r"not mixed with fp8, bf8, bf16x3, got \['fp8', 'tf32'\]"),
])
def test_problem_errors(changes, message):
    with pytest.raises(ProblemError, match=message):
        _p(**changes)


CONV = "conv c {{\n  dims = 2; batch = 2; in_channels = 3; out_channels = 5\n  input = [9, 7]; filter = [3, 3]\n  {extra}\n}}\n"


@pytest.mark.parametrize("spelling", ['"tf32"', "tf32", "[tf32, tf32]"])
def test_frontend_accepts_tf32(spelling):
    conv_level = parse(CONV.format(extra=f"compute = {spelling}") + "kernel k = grad_input(c)\n", "x.conv")[0]
    kernel_level = parse(CONV.format(extra="") + f"kernel k = grad_input(c) {{ compute = {spelling} }}\n", "x.conv")[0]
    assert conv_level.compute == kernel_level.compute == TF32_COMPUTE


@pytest.mark.parametrize("extra, kernel, where, message", [
    ("dtype = bf16", "{ compute = tf32 }", "6:38",
     "expected dtype f32 for compute = tf32 (it rounds f32 operands to TF32), got dtype bf16"),
    ("compute = [tf32, fp8]", "", "4:13", "expected tf32 for both operands or for neither (it treats A and B "
                                          "alike), got [tf32, fp8]"),
    ("compute = tf31", "", "4:13", "got 'tf31'; did you mean 'tf32'?"),
])
def test_frontend_errors(extra, kernel, where, message):
    with pytest.raises(ConvSyntaxError) as info:
        parse(CONV.format(extra=extra) + f"kernel k = grad_input(c) {kernel}\n", "x.conv")
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"x.conv:{where}: error: ") and message in first, str(info.value)


def _precision(p: ConvProblem) -> str:
    return dict(plan_launches(p, None, HOPPER)[1][0].constants)["PRECISION"]


def test_cuda_grad_input_takes_one_pass_tf32_and_explain_says_so():
    for op in ("grad_input", "transposed"):
        assert _precision(_p(op=op)) == "tf32" and _precision(_p(op=op, compute=None)) == "tf32x3"
        assert "1-pass TF32 products" in describe_plan(plan_kernel(_p(op=op), HOPPER))
    # grad_weight keeps three passes: one pass measured 1.6x slower there (Triton's 4-byte copies)
    assert _precision(_p(op="grad_weight")) == "tf32x3"
    wgrad = describe_plan(plan_kernel(_p(op="grad_weight"), HOPPER))
    assert "3-pass TF32 products" in wgrad and "tf32 allowed, not used" in wgrad
    assert "tf32 allowed, not used" in describe_plan(plan_kernel(_p(), CPU))


def test_cpu_computes_f32_products_where_tf32_is_allowed():
    # llvm-cpu has no TF32 path: the permission is not used, so the result has f32's accuracy, far inside
    # TF32's tolerance, and equals the plain f32 kernel's
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2, 9, 8, 1, 8)).astype(np.float32)  # NHWGC, C = 8
    w = rng.uniform(-1, 1, (1, 6, 3, 3, 8)).astype(np.float32)  # GKYXC, K = 6
    got = convdsl.conv(x, w, padding=1, compute="tf32")
    plain = convdsl.conv(x, w, padding=1)
    p = infer_problem("forward", x, w, padding=1, compute="tf32")
    assert p.tf32
    assert relative_error(got.astype(np.float64), reference(p, x, w)) < TOLERANCE["f32"]
    np.testing.assert_array_equal(got, plain)
    with pytest.raises(ProblemError, match=r"conv: compute: tf32 rounds f32 operands to TF32: .* got dtype f16"):
        convdsl.conv(x.astype(np.float16), w.astype(np.float16), padding=1, compute="tf32")
