"""The functional JIT API (convdsl.conv, grad_input, grad_weight, conv_transpose) on the CPU.

Each correctness test writes the ConvProblem it expects by hand, so the test checks the inference of sizes
from the arrays as well as the numbers: the arrays come from random_inputs(expected problem), the result
is compared with the float64 reference, and infer_problem must rebuild exactly that problem.
Shapes are tiny: each kernel compiles in about half a second.
"""
from __future__ import annotations

from typing import Iterator

import ml_dtypes
import numpy as np
import pytest

import convdsl
from convdsl import api, cache
from convdsl.module import ArgumentError
from convdsl.problem import ConvProblem, Epilogue, ProblemError
from convdsl.reference import NUMPY_DTYPES, random_inputs, reference, relative_error, tolerance

OPS = {"forward": convdsl.conv, "grad_input": convdsl.grad_input, "grad_weight": convdsl.grad_weight,
       "transposed": convdsl.conv_transpose}


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # One disk cache for the module, never the user's ~/.cache; kernels shared by tests compile once.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVDSL_CACHE_DIR", str(tmp_path_factory.mktemp("convdsl-cache")))
        yield


def make(op: str, **fields) -> ConvProblem:
    base = dict(dims=2, groups=1, batch=2, in_channels=3, out_channels=2, input=(5, 5), filter=(3, 3),
                stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    base.update(fields)
    return ConvProblem(op=op, **base)


def options_of(p: ConvProblem) -> dict:
    """The keyword arguments that describe `p` to the functional API (sizes in arrays are left out)."""
    kw: dict = dict(stride=list(p.stride), dilation=list(p.dilation), padding=list(zip(p.pad_lo, p.pad_hi)),
                    groups=p.groups, layout=p.layout, weight_layout=p.weight_layout)
    if p.op in ("grad_input", "transposed"):
        kw["input"] = p.input
    if p.op == "grad_weight":
        kw["filter"] = p.filter
        if p.split_k is not None:
            kw["split_k"] = p.split_k
    if p.out_dtype is not None:
        kw["out_dtype"] = p.out_dtype
    if p.epilogue.kind != "none":
        kw["epilogue"] = str(p.epilogue)  # the string form, to exercise its parser
    return kw


def check(p: ConvProblem, seed: int = 0) -> None:
    inputs = random_inputs(p, seed=seed)
    kw = options_of(p)
    if p.epilogue.has_tensor:
        kw["d"] = inputs[2]
    assert api.infer_problem(p.op, inputs[0], inputs[1], **kw) == p
    got = OPS[p.op](inputs[0], inputs[1], **kw)
    assert got.shape == p.result_shape
    assert got.dtype == np.dtype(NUMPY_DTYPES[p.result_dtype])
    err = relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))
    assert err <= tolerance(p), f"{p.describe()}: relative error {err:.2e} > {tolerance(p):.0e}"


@pytest.mark.parametrize(
    "problem",
    [
        # grouped forward, f32
        make("forward", groups=2, layout="NHWGC"),
        # strided, asymmetric padding, f16, the other weight layout
        make("forward", stride=(2, 1), pad_lo=(0, 1), pad_hi=(1, 0), dtype="f16", weight_layout="GKCYX"),
        # grouped, strided backward data, GNHWC
        make("grad_input", groups=2, input=(6, 5), stride=(2, 2), layout="GNHWC"),
        # 1D, dilated, f16
        make("grad_input", dims=1, input=(9,), filter=(3,), stride=(1,), dilation=(2,), pad_lo=(2,),
             pad_hi=(2,), dtype="f16", layout="NGCHW"),
        # strided backward weight, f32, explicit split-K and a scale epilogue
        make("grad_weight", groups=2, stride=(2, 2), split_k=2, epilogue=Epilogue("scale", 0.5)),
        # bf16 in, f32 out
        make("grad_weight", dtype="bf16", out_dtype="f32", layout="NGCHW"),
        # transposed conv, strided, with a bilinear epilogue and its D tensor
        make("transposed", input=(6, 6), stride=(2, 2), epilogue=Epilogue("bilinear", 1.5, -0.5)),
    ],
    ids=lambda p: p.describe(),
)
def test_op_matches_reference(problem: ConvProblem) -> None:
    check(problem)


def test_readme_call_shapes() -> None:
    # The README's spelling: scalar options, groups given, NHWGC; the result shapes follow the layouts.
    x = np.ones((1, 8, 8, 4, 2), np.float32)  # N, H, W, G, C
    dy = np.ones((1, 4, 4, 4, 3), np.float32)  # N, Ho, Wo, G, K
    dw = convdsl.grad_weight(x, dy, filter=(3, 3), stride=2, padding=1, groups=4, layout="NHWGC")
    assert dw.shape == (4, 3, 3, 3, 2)  # G, K, Y, X, C
    dx = convdsl.grad_input(dy, dw, input=(8, 8), stride=2, padding=1, groups=4, layout="NHWGC")
    assert dx.shape == x.shape


def test_second_call_uses_memory_cache() -> None:
    p = make("forward", groups=2)
    x, w = random_inputs(p)
    first = convdsl.conv(x, w, padding=1)
    compiles, hits = cache.stats.compiles, cache.stats.hits
    second = convdsl.conv(x, w, padding=1, groups=2, layout="NHWGC", out_dtype="f32")  # same problem, spelt out
    assert (cache.stats.compiles, cache.stats.hits) == (compiles, hits)  # not even a disk read
    np.testing.assert_array_equal(first, second)


def test_numpy_integer_options_and_rank_specific_layout() -> None:
    # NumPy integers from shape arithmetic are accepted; NDHWGC spells NHWGC for 3D.
    p = make("forward", dims=3, input=(3, 3, 3), filter=(1, 1, 1), stride=(1, 1, 1), dilation=(1, 1, 1),
             pad_lo=(0, 0, 0), pad_hi=(0, 0, 0))
    x, w = random_inputs(p)
    got = api.infer_problem("forward", x, w, stride=np.int64(1), padding=np.array([0, 0, 0]), layout="NDHWGC",
                            weight_layout="GKZYXC")
    assert got == p


# --- errors: raised before anything compiles, naming the argument ---------------------------------
f32 = np.float32
X = np.zeros((2, 5, 5, 2, 3), f32)  # NHWGC: N=2, 5x5, G=2, C=3
W = np.zeros((2, 4, 3, 3, 3), f32)  # GKYXC: G=2, K=4, 3x3, C=3
DY = np.zeros((2, 5, 5, 2, 4), f32)  # stride 1, padding 1: 5x5, K=4


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: convdsl.conv(X[0], W), ArgumentError, r"argument 'w' expected rank 4 .* got rank 5"),
        (lambda: convdsl.conv(X[..., 0], W), ArgumentError, r"argument 'w' expected rank 4"),
        (lambda: convdsl.conv(np.zeros((2, 3, 4), f32), W), ArgumentError,
         r"argument 'x' expected rank 4, 5 or 6 for layout NHWGC = \(N, spatial\.\.\., G, C\).* got rank 3"),
        (lambda: convdsl.conv(X, W, groups=4), ArgumentError,
         r"argument 'x' .* has G = 2 on its G axis, but groups = 4"),
        (lambda: convdsl.conv(X, W[:1]), ArgumentError, r"argument 'w' .* has G = 1, expected G = 2 to match 'x'"),
        (lambda: convdsl.conv(X, W, layout="NGCHW"), ArgumentError, r"argument 'w' .* has G = 2, expected G = 5"),
        (lambda: convdsl.conv(X, W[..., :2]), ArgumentError, r"argument 'w' .* has C = 2, expected C = 3"),
        (lambda: convdsl.conv(X.astype(np.float64), W), ArgumentError,
         r"argument 'x' expected dtype f32, f16 or bf16 .*got float64"),
        (lambda: convdsl.conv(X, W.astype(np.float16)), ArgumentError,
         r"argument 'w' expected dtype float32 to match 'x', got float16"),
        (lambda: convdsl.conv(X.astype(ml_dtypes.bfloat16), W), ArgumentError, r"argument 'w' expected dtype bfloat16"),
        (lambda: convdsl.conv(X.tolist(), W), ArgumentError, r"argument 'x' expected a NumPy array, got list"),
        (lambda: convdsl.conv(X[:0], W), ArgumentError, r"argument 'x' has an empty axis"),
        (lambda: convdsl.grad_input(DY, W, stride=2, padding=1), ArgumentError,
         r"grad_input: missing input=: the spatial size of dx.* fits input= 9\.\.10 x 9\.\.10"),
        (lambda: convdsl.conv_transpose(DY, W, padding=1), ArgumentError, r"conv_transpose: missing input="),
        (lambda: convdsl.grad_weight(X, DY, padding=1), ArgumentError, r"grad_weight: missing filter="),
        (lambda: convdsl.grad_input(DY, W, input=(8, 8), stride=2, padding=1), ArgumentError,
         r"argument 'dy' .* has spatial size \[5, 5\], expected \[4, 4\].*input= sizes that fit it: 9\.\.10 x 9\.\.10"),
        (lambda: convdsl.grad_weight(X, DY, filter=3, stride=2, padding=1), ArgumentError,
         r"argument 'dy' .* has spatial size \[5, 5\], expected \[3, 3\]"),
        (lambda: convdsl.grad_weight(X, DY[:1], filter=3, padding=1), ArgumentError,
         r"argument 'dy' .* has N = 1, expected N = 2"),
        (lambda: convdsl.grad_input(DY[..., :3], W, input=5, padding=1), ArgumentError,
         r"argument 'w' .* has K = 4, expected K = 3 to match 'dy'"),
        (lambda: convdsl.conv(X, W, epilogue="bilinear(1, 1)"), ArgumentError, r"needs d=, .* shape \[2, 3, 3, 2, 4\]"),
        (lambda: convdsl.conv(X, W, epilogue="bilinear(1, 1)", d=np.zeros((2, 5, 5, 2, 4), f32)), ArgumentError,
         r"argument 'd' expected shape \[2, 3, 3, 2, 4\]"),
        (lambda: convdsl.conv(X, W, d=np.zeros((2, 3, 3, 2, 4), f32)), ArgumentError,
         r"d= is only used by a bilinear epilogue"),
        (lambda: convdsl.conv(X, W, epilogue="scal(2)"), ProblemError, r"epilogue: expected an Epilogue or none"),
        (lambda: convdsl.conv(X, W, epilogue="scale(1, 2)"), ProblemError, r"scale takes 1 argument"),
        (lambda: convdsl.conv(X, W, padding=[1, 1, 1]), ProblemError, r"padding: expected .* 2 \(lo, hi\) pairs"),
        (lambda: convdsl.conv(X, W, stride=1.5), ProblemError, r"stride: expected an integer, got 1\.5"),
        (lambda: convdsl.conv(X, W, stride=0), ProblemError, r"conv: stride: expected positive values"),
        (lambda: convdsl.conv(X, W, layout="NCHW"), ProblemError, r"layout: expected one of NHWGC, GNHWC, NGCHW"),
        (lambda: convdsl.conv(X, W, layout="NDHWGC"), ArgumentError, r"argument 'x' expected rank 6 for layout NDHWGC"),
        (lambda: convdsl.conv(X, W, out_dtype="f64"), ProblemError, r"out_dtype: expected one of f32, f16, bf16"),
        (lambda: convdsl.conv(X, W, dilation=3), ProblemError, r"output size .* is empty"),
        (lambda: convdsl.conv(X, W, target="tpu"), ValueError, r"--target: expected one of cpu, cuda, rocm"),
        # alpha * acc is cast to the result's dtype: 1e30 would make every nonzero f16 result inf
        (lambda: convdsl.conv(X.astype(np.float16), W.astype(np.float16), epilogue="scale(1e30)"), ProblemError,
         r"conv: epilogue: expected alpha representable in the output dtype f16 \(\|alpha\| <= 65504\) in "
         r"scale\(alpha\), got 1e\+30"),
        (lambda: convdsl.grad_weight(X, DY, filter=3, padding=1, split_k=2**63), ProblemError,
         r"grad_weight: split_k: expected at most 2147483647 \(2\^31 - 1\), got 9223372036854775808"),
    ],
)
def test_errors(call, error: type, message: str) -> None:
    compiles = cache.stats.compiles
    with pytest.raises(error, match=message):
        call()
    assert cache.stats.compiles == compiles  # rejected before lowering or compiling


def test_argument_errors_are_type_errors_and_problem_errors_value_errors() -> None:
    # Callers may catch the builtin families; ArgumentError is what Kernel raises for wrong arrays too.
    assert issubclass(ArgumentError, TypeError) and issubclass(ProblemError, ValueError)


def test_dynamic_batch_compiles_once_for_every_batch(tmp_path, monkeypatch):
    import convdsl
    from convdsl import api, cache

    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path))
    api.clear_memory_cache()
    cache.stats.reset()
    rng = np.random.default_rng(5)
    for n in (1, 3, 4):
        x = rng.uniform(-1, 1, (n, 8, 8, 2, 3)).astype(np.float32)
        dy = rng.uniform(-1, 1, (n, 4, 4, 2, 5)).astype(np.float32)
        dw = convdsl.grad_weight(x, dy, filter=(3, 3), stride=2, padding=1, dynamic_batch=True)
        problem = api.infer_problem("grad_weight", x, dy, filter=(3, 3), stride=2, padding=1)
        assert relative_error(dw.astype(np.float64), reference(problem, x, dy)) <= 1e-5
    assert cache.stats.compiles == 1


def test_a_repeated_call_skips_the_key_until_what_it_reads_changes(tmp_path, monkeypatch) -> None:
    # the key hashes every field (as long as a small kernel runs): a repeated call finds its kernel without it,
    # but a change of version, source digest or tuning database makes the full key again
    from convdsl import compiler
    from convdsl.tuning import db as tuning_db

    p = make("forward", groups=2)
    x, w = random_inputs(p)
    first = convdsl.conv(x, w, padding=1)
    keys = []
    real_key = api.cache_key
    monkeypatch.setattr(api, "cache_key", lambda *a, **k: keys.append(1) or real_key(*a, **k))
    np.testing.assert_array_equal(convdsl.conv(x, w, padding=1), first)
    assert keys == []
    database = tmp_path / "db.json"
    database.write_text("{}\n")
    monkeypatch.setattr(tuning_db, "DB_PATH", database)
    convdsl.conv(x, w, padding=1)
    assert len(keys) == 1
    convdsl.conv(x, w, padding=1)
    assert len(keys) == 1
    database.write_text('{"edited": {}}\n')  # another size: read again
    convdsl.conv(x, w, padding=1)
    assert len(keys) == 2
    monkeypatch.setattr(compiler, "source_digest", lambda: "edited")
    compiles = cache.stats.compiles
    np.testing.assert_array_equal(convdsl.conv(x, w, padding=1), first)
    assert len(keys) == 3 and cache.stats.compiles == compiles + 1  # a new key: compiled again


def test_a_repeated_call_reuses_its_problem_but_never_a_refused_spelling(monkeypatch) -> None:
    p = make("forward", groups=2)
    x, w = random_inputs(p)
    first = convdsl.conv(x, w, padding=[1, 1], stride=1)
    inferred = []
    real = api.infer_problem
    monkeypatch.setattr(api, "infer_problem", lambda *a, **k: inferred.append(1) or real(*a, **k))
    np.testing.assert_array_equal(convdsl.conv(x, w, padding=[1, 1], stride=1), first)
    assert inferred == []  # the same shapes, dtypes and options: the problem made last time
    # equal values of another type are another spelling: checked again, and refused where they were refused
    with pytest.raises(ProblemError, match=r"stride: expected an integer, got 1\.0"):
        convdsl.conv(x, w, padding=[1, 1], stride=1.0)
    with pytest.raises(ProblemError, match=r"padding"):
        convdsl.conv(x, w, padding=[True, 1], stride=1)
    # other shapes or dtypes are other problems
    with pytest.raises(ArgumentError, match=r"argument 'w' .* has C = 2, expected C = 3"):
        convdsl.conv(x, w[..., :2], padding=[1, 1], stride=1)
    got = convdsl.conv(x[:1], w, padding=[1, 1], stride=1)
    assert got.shape == (1, *first.shape[1:])
    assert len(inferred) == 4
