"""The benchmark harness on the CPU: the suite loads as the header says, and the iree-today baseline forms
(benchmarks/iree_today.py) compute a real convolution, checked against convdsl.reference on llvm-cpu."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks.iree_today import ORDERS, TODAY_FLAGS, today_mlir
from benchmarks.suite import SUITE_PATH, load_suite, minimal_bytes
from convdsl.options import padding
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

try:  # pragma: no cover - python 3.10
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def _header_flops(case: dict) -> int:
    # flops = 2 * groups * batch * prod(out_spatial) * out_channels * in_channels * prod(filter)
    dims = case["dims"]
    one = lambda v: [v] * dims if isinstance(v, int) else list(v)  # noqa: E731
    lo, hi = padding(case.get("padding", 0), dims, form="sides")
    out = [
        (i + l + h - d * (r - 1) - 1) // s + 1
        for i, r, s, d, l, h in zip(one(case["input"]), one(case["filter"]), one(case.get("stride", 1)),
                                    one(case.get("dilation", 1)), lo, hi)
    ]
    return (2 * case.get("groups", 1) * case["batch"] * math.prod(out) * case["out_channels"]
            * case["in_channels"] * math.prod(one(case["filter"])))


def test_suite_loads_27_valid_problems_with_header_flops():
    raw = tomllib.loads(SUITE_PATH.read_text())["case"]
    cases = load_suite()
    assert len(cases) == len(raw) == 27
    assert len({c.name for c in cases}) == 27
    for c, r in zip(cases, raw):
        p = c.problem
        assert isinstance(p, ConvProblem) and p.name == r["name"] and p.op == r["op"]
        assert p.weight_layout == r.get("weight_layout", "GKYXC")
        assert p.flops == c.flops == _header_flops(r) > 0
        assert all(o >= 1 for o in p.output)
        # minimal bytes: the two inputs read once, the output written once
        want = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(p.arg_shapes, p.arg_dtypes))
        assert c.bytes == minimal_bytes(p) == want + math.prod(p.result_shape) * DTYPE_BYTES[p.result_dtype]
    fp8 = [c for c in cases if c.problem.compute]
    assert [c.problem.compute for c in fp8] == [("bf8", "fp8")]


def test_suite_padding_forms():
    # the suite's [[low per dim], [high per dim]], where the language has [lo, hi] per dim
    assert padding(1, 2, form="sides") == ((1, 1), (1, 1))
    assert padding([[0, 1], [2, 3]], 2, form="sides") == ((0, 1), (2, 3))
    assert padding([[0, 1], [2, 3]], 2) == ((0, 2), (1, 3))
    assert padding([[1], [2]], 1, form="sides") == ((1,), (2,))
    assert padding([1, 2], 2, form="sides") == ((1, 2), (1, 2))


def _small(op, dims=2, **kw):
    base = dict(op=op, dims=dims, groups=2, batch=2, in_channels=3, out_channels=4, input=(9,) * dims,
                filter=(3,) * dims, stride=(2,) * dims, dilation=(1,) * dims, pad_lo=(1,) * dims,
                pad_hi=(1,) * dims, dtype="f32", name=f"k_{op}")
    base.update(kw)
    return ConvProblem(**base)


CPU_CASES = [
    # the three forms the brief names: strided grad_input, grad_weight, forward
    _small("grad_input"),
    _small("grad_weight", stride=(2, 1), dilation=(1, 2), pad_lo=(1, 2), pad_hi=(0, 2), layout="GNHWC"),
    _small("forward", layout="NGCHW", weight_layout="GKCYX", stride=(1, 2)),
    # what the suite also exercises: 3D asymmetric-stride grad_input in NGCHW, dilation, lo > (R-1)*d,
    # depthwise, fp8 compute, 1D stride 2 without padding
    _small("grad_input", dims=3, input=(4, 7, 6), stride=(1, 2, 2), layout="NGCHW", dtype="bf16"),
    _small("grad_input", stride=(1, 1), dilation=(2, 2), pad_lo=(2, 2), pad_hi=(2, 2), dtype="f16"),
    _small("grad_input", filter=(2, 2), stride=(3, 3), pad_lo=(3, 2), pad_hi=(0, 3), input=(11, 10)),
    _small("grad_weight", groups=5, in_channels=1, out_channels=1, stride=(1, 1), dtype="bf16"),
    _small("grad_weight", dims=3, input=(5, 5, 3), stride=(1, 1, 1), dtype="f16", compute=("bf8", "fp8")),
    _small("grad_input", dims=1, input=(15,), filter=(3,), stride=(2,), pad_lo=(0,), pad_hi=(0,), dtype="f16"),
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("problem", CPU_CASES, ids=lambda p: f"{p.op}-{p.dims}d-{p.layout}-{p.dtype}"
                         f"-s{'x'.join(map(str, p.stride))}")
def test_iree_today_forms_compute_the_convolution_on_cpu(problem, order):
    from convdsl.backends.iree import LoadedModule, compile_mlir

    target = Target("cpu")
    vmfb = compile_mlir(today_mlir([problem], order), target, extra_flags=TODAY_FLAGS)
    args = random_inputs(problem, seed=7)
    got = LoadedModule(vmfb, target).call(problem.name, *args, out_dtype=problem.result_dtype)
    assert got.shape == tuple(problem.result_shape)
    want = reference(problem, *args)
    assert relative_error(got, want) <= tolerance(problem)


def test_iree_today_grad_input_is_the_zero_inserted_form():
    """The baseline keeps torch-mlir's zero insertion: one strided insert_slice into zeros for stride > 1."""
    text = today_mlir([_small("grad_input")])  # dY 2x5x5x2x4 (NHWGC), stride 2, R 3, pad 1
    # zero-inserted length (5-1)*2+1 = 9, padded by (R-1)*d - lo = 1 on each side: 11
    assert "tensor.insert_slice %arg0 into %1[0, 1, 1, 0, 0] [2, 5, 5, 2, 4] [1, 2, 2, 1, 1]" in text
    assert "tensor<2x11x11x2x4xf32>" in text
    assert text.count("linalg.generic") == 2  # the flip gather and the stride-1 convolution
    assert "tensor.extract %arg1" in text


def test_merged_builds_put_each_variant_beside_the_base_module(tmp_path):
    from benchmarks.merge_builds import merge

    def build(name: str, cases: dict[str, dict[str, str]]):
        d = tmp_path / name
        d.mkdir()
        for vmfbs in cases.values():
            for module in vmfbs.values():
                (d / module).write_bytes(f"{name}/{module}".encode())
        (d / "cases.json").write_text(json.dumps(
            {"target": "cuda:sm_90", "cases": [{"name": n, "vmfbs": v} for n, v in cases.items()]}))
        return d

    base = build("base", {"a": {"convdsl": "a.convdsl.vmfb", "iree-today": "a.iree.vmfb"},
                          "b": {"convdsl": "b.convdsl.vmfb"}, "c": {"convdsl": "c.convdsl.vmfb"}})
    new = build("new", {"a": {"convdsl": "a.convdsl.vmfb", "convdsl@t64": "a.t64.vmfb"}})
    merged = merge(tmp_path / "out", base, [("new", new, "convdsl"), ("convdsl@t64", new, "convdsl@t64")])
    assert [c["name"] for c in merged] == ["a"]  # only the cases a variant has
    vmfbs = merged[0]["vmfbs"]
    assert set(vmfbs) == {"convdsl", "new", "convdsl@t64"}  # the base's other impls are not timed
    out = tmp_path / "out"
    assert (out / vmfbs["convdsl"]).read_bytes() == b"base/a.convdsl.vmfb"
    assert (out / vmfbs["new"]).read_bytes() == b"new/a.convdsl.vmfb"
    assert (out / vmfbs["convdsl@t64"]).read_bytes() == b"new/a.t64.vmfb"
    assert json.loads((out / "cases.json").read_text())["cases"] == merged


def test_variants_table_sets_the_blocking_into_call_beside_the_polled_one():
    pytest.importorskip("torch")
    from benchmarks.gpu_bench import variants_table

    def case(name: str, ms: float, blocking_ms: float, blocking_err: float) -> dict:
        return {"name": name, "tolerance": 1e-2, "impls": {"convdsl": {
            "ms": ms, "ok": True, "err": 1e-4, "blocking": {"ms": blocking_ms}, "blocking_err": blocking_err}}}

    rows = variants_table([case("a", 1.0, 1.25, 1e-4), case("b", 2.0, 2.2, 0.5)])
    assert "convdsl (blocking $into) ms" in rows[1]
    a_row = next(r for r in rows if r.startswith("| a |"))
    b_row = next(r for r in rows if r.startswith("| b |"))
    assert "| 1.250 | 0.80x |" in a_row and "WRONG" not in a_row
    assert "WRONG" in b_row  # the blocking call's own error is gated
    assert rows[-1].endswith("convdsl (blocking $into) 0.800x over 1 cases")  # wrong results left out


def test_roofline_floor_takes_the_compute_type_and_the_slower_bound():
    from benchmarks.roofline import MEMORY_BYTES_PER_S, PEAK_FLOPS, floor_s

    (ck11,) = [c.problem for c in load_suite(names=["ck11_wgrad_3d_g8_f16"])]
    floor, kind, moved = floor_s(ck11)
    assert kind == "16-bit" and moved == minimal_bytes(ck11)
    assert floor == max(ck11.flops / PEAK_FLOPS["16-bit"], moved / MEMORY_BYTES_PER_S) == ck11.flops / 989e12
    assert floor_s(ck11.with_(compute=("bf8", "fp8")))[1] == "fp8"
    f32 = ck11.with_(dtype="f32")
    assert floor_s(f32)[1] == "f32" and floor_s(f32.with_(compute="tf32"))[1] == "tf32"
    assert floor_s(f32)[0] == pytest.approx(ck11.flops / 67e12)
    # a depthwise gradient is bound by its bytes
    (dw,) = [c.problem for c in load_suite(names=["mbv2_dw_wgrad"])]
    assert floor_s(dw)[0] == minimal_bytes(dw) / MEMORY_BYTES_PER_S
