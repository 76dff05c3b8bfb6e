"""compute = "tf32": f32 products allowed in one-pass TF32, as cuDNN and PyTorch allow for convolutions.

A permission, like torch.backends.cudnn.allow_tf32: the CUDA kernels take it (Triton's one-pass tf32 dot), the
linalg forms compute f32 products and say so.  Checked here: the canonical form, the frontend's and the API's
spellings and errors, the tolerance, the kernels' precision, the CPU result (f32-accurate), and that explain
names the products.  The GPU tests run examples/ck15_conv3d_bwd_data.conv's dgrad_tf32 on a chip.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
HERE = Path(__file__).resolve().parent


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


def test_cuda_kernels_take_one_pass_tf32_and_explain_says_so():
    for op in ("grad_input", "transposed", "grad_weight", "forward"):
        assert _precision(_p(op=op)) == "tf32" and _precision(_p(op=op, compute=None)) == "tf32x3"
        assert "1-pass TF32 products" in describe_plan(plan_kernel(_p(op=op), HOPPER))
    # grad_weight's operands are position-major (NHWGC): rounded in registers on their way to the products
    wgrad = describe_plan(plan_kernel(_p(op="grad_weight"), HOPPER))
    assert "rounded to TF32 in registers" in wgrad and "not used" not in wgrad
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


def _round_to_tf32(v: np.ndarray) -> np.ndarray:
    """The nearest TF32 value of each f32 (10 mantissa bits, ties away from zero: PTX's cvt.rna.tf32.f32), in
    float64 arithmetic; NaN and infinities stay."""
    with np.errstate(invalid="ignore"):  # NaN payloads
        x = v.astype(np.float64)
    _, e = np.frexp(np.where(np.isfinite(x), x, 1.0))  # |x| in [2**(e-1), 2**e)
    unit = 2.0 ** np.maximum(e - 11, -136)  # 10 bits below the leading one; subnormals: f32's 2**-149 times 2**13
    rounded = np.sign(x) * np.floor(np.abs(x) / unit + 0.5) * unit
    with np.errstate(over="ignore"):  # past f32's largest finite value: infinity, as the hardware's
        return np.where(np.isfinite(x), rounded, x).astype(np.float32)


def test_tf32_round_is_round_to_nearest_ties_away():
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # exactly half a TF32 unit above a TF32 value
    specials = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, -1e-45, 1.17549435e-38],
                        dtype=np.float32)
    # NaNs whose payload lies in the 13 low bits only: rounding their bits alone would make them infinities
    low_nans = np.array([0x7F800001, 0xFF800FFF, 0x7F801000 - 1], dtype=np.uint32).view(np.float32)
    values = np.concatenate([bits.view(np.float32), ties.view(np.float32), specials, low_nans])
    done = subprocess.run([sys.executable, str(HERE / "tf32_round_interpreter.py")], input=values.tobytes(),
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    got = np.frombuffer(done.stdout, dtype=np.float32)
    want = _round_to_tf32(values)
    nan = np.isnan(values)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # a TF32 value has its 13 low bits clear, and a tie rounds away from zero
    assert not (got[~nan].view(np.uint32) & np.uint32(0x1FFF)).any()
    tie, tie_got = values[20000:40000], got[20000:40000]
    finite = np.isfinite(tie)
    assert (np.abs(tie_got[finite].astype(np.float64)) > np.abs(tie[finite].astype(np.float64))).all()
