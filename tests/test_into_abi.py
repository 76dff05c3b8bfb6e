"""The destination-passing twin of every kernel (`@"<name>$into"`, convdsl/abi.py) on llvm-cpu: it computes what
the allocating function computes, into the caller's buffer, with the caller's workspace, and allocates nothing."""
from __future__ import annotations

import re

import numpy as np
import pytest

from convdsl.abi import ASYNC_SUFFIX, INTO_SUFFIX
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.backends.into_call import IntoCall, allocate_result
from convdsl.module import manifest
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")

BASE = ConvProblem(op="grad_input", dims=2, groups=1, batch=2, in_channels=3, out_channels=4, input=(9, 8),
                   filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
PROBLEMS = {
    # split-K partials and the deterministic reduction: transients
    "grad_weight_split_k_grouped": BASE.with_(op="grad_weight", groups=2, batch=4, input=(9, 9), stride=(2, 2),
                                              split_k=3, name="gw"),
    # stride phases interleaved into dX, bf16 output
    "grad_input_strided_bf16": BASE.with_(stride=(2, 3), pad_hi=(1, 0), dtype="bf16", name="gi"),
    # a bilinear epilogue reads D, a third argument
    "forward_bilinear_f16": BASE.with_(op="forward", dtype="f16", epilogue=Epilogue("bilinear", 0.5, 2.0),
                                       name="fwd"),
    "transposed_3d": BASE.with_(op="transposed", dims=3, input=(3, 4, 3), filter=(2, 2, 2), stride=(2, 1, 2),
                                dilation=(1, 1, 1), pad_lo=(0, 1, 0), pad_hi=(1, 0, 0), name="tr"),
}


@pytest.fixture(scope="module")
def module() -> LoadedModule:
    return LoadedModule(compile_mlir(lower_to_mlir(list(PROBLEMS.values()), CPU), CPU), CPU)


def _into(module: LoadedModule, p: ConvProblem, inputs: list[np.ndarray]) -> tuple[IntoCall, list]:
    dev = [module.upload(a) for a in inputs]
    call = module.into_call(p.name, dev, p.result_shape, p.result_dtype)
    return call, dev


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


@pytest.mark.parametrize("key", list(PROBLEMS))
def test_into_call_writes_the_result_into_the_callers_buffer(module, key):
    p = PROBLEMS[key]
    inputs = random_inputs(p, seed=1)
    plain = module.call(p.name, *inputs, out_dtype=p.result_dtype)
    call, dev = _into(module, p, inputs)
    call.call(call.pack([d._buffer_view for d in dev]))
    got = module.download_view(call.out, p.result_dtype)
    # the same dispatches as the allocating function, so the same bits
    np.testing.assert_array_equal(_f64(got), _f64(plain))
    err = relative_error(_f64(got), reference(p, *inputs))
    assert err <= tolerance(p), (key, err)
    # a second call with new inputs overwrites the buffer (no stale partials from the reused workspace)
    again = random_inputs(p, seed=2)
    dev2 = [module.upload(a) for a in again]
    call.call(call.pack([d._buffer_view for d in dev2]))
    err2 = relative_error(_f64(module.download_view(call.out, p.result_dtype)), reference(p, *again))
    assert err2 <= tolerance(p), (key, err2)


def test_workspace_size_is_reflected_and_covers_the_split_k_partials(module):
    p = PROBLEMS["grad_weight_split_k_grouped"]
    call, _ = _into(module, p, random_inputs(p, seed=0))
    partials = 3 * int(np.prod(p.result_shape)) * 4  # split_k f32 partial results, before the reduction
    assert call.workspace_bytes >= partials


def _function_bodies(stream_ir: str) -> dict[str, str]:
    """util.func name -> its text, from IREE's stream-level IR."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'util\.func public @"?([^"(\s]+)"?\(', stream_ir)]
    bodies = {}
    for (start, name), (end, _) in zip(starts, [*starts[1:], (len(stream_ir), "")]):
        bodies[name] = stream_ir[start:end]
    return bodies


def test_into_function_allocates_nothing_and_the_plain_one_does():
    p = PROBLEMS["grad_weight_split_k_grouped"]
    stream_ir = compile_mlir(lower_to_mlir([p], CPU), CPU, ["--compile-to=stream"]).decode()
    bodies = _function_bodies(stream_ir)
    plain, into = bodies[p.name], bodies[p.name + INTO_SUFFIX]
    allocation = re.compile(r"stream\.resource\.(alloca|alloc)\b")
    assert allocation.search(plain), "the allocating function should allocate its result and partials"
    assert not allocation.search(into), into


def test_dynamic_batch_workspace_comes_from_the_size_function():
    p = BASE.with_(op="grad_weight", split_k=2, dynamic_batch=True, name="gwd")
    module = LoadedModule(compile_mlir(lower_to_mlir([p], CPU), CPU), CPU)
    sizes = {}
    for batch in (2, 6):
        concrete = p.with_(batch=batch)
        inputs = random_inputs(concrete, seed=batch)
        call, dev = _into(module, concrete, inputs)
        assert "iree.abi.transients.size.constant" not in call.function.reflection
        call.call(call.pack([d._buffer_view for d in dev]))
        err = relative_error(_f64(module.download_view(call.out, p.result_dtype)), reference(concrete, *inputs))
        assert err <= tolerance(concrete), (batch, err)
        sizes[batch] = call.workspace_bytes
    assert sizes[6] >= sizes[2] > 0


def test_a_module_without_the_into_function_is_refused_by_name(tmp_path):
    mlir = """func.func @plain(%a: tensor<4xf32>) -> tensor<4xf32> {
  return %a : tensor<4xf32>
}"""
    module = LoadedModule(compile_mlir(mlir, CPU), CPU)
    dev = module.upload(np.ones(4, np.float32))
    with pytest.raises(LookupError, match=r"plain\$into"):
        module.into_call("plain", [dev], (4,), "f32")


def test_timing_goes_through_the_into_call(module, monkeypatch):
    p = PROBLEMS["grad_weight_split_k_grouped"]
    calls = []
    original = IntoCall.call
    monkeypatch.setattr(IntoCall, "call", lambda self, packed: calls.append(self.name) or original(self, packed))
    seconds = module.time(p.name, random_inputs(p, seed=0), repeat=3, warmup=1,
                          out_shape=p.result_shape, out_dtype=p.result_dtype)
    assert seconds > 0
    assert calls == [p.name + INTO_SUFFIX] * 4


@pytest.mark.parametrize("key", ["grad_weight_split_k_grouped", "grad_input_strided_bf16"])
def test_polling_call_runs_the_fenced_twin_and_matches_the_blocking_call(module, key):
    p = PROBLEMS[key]
    fenced = module.vm_module.lookup_function(p.name + INTO_SUFFIX + ASYNC_SUFFIX)
    assert fenced.reflection["iree.abi.model"] == "coarse-fences"
    assert manifest([p], CPU)["kernels"][0]["into_async_function"] == fenced.name
    inputs = random_inputs(p, seed=4)
    dev = [module.upload(a) for a in inputs]
    views = [d._buffer_view for d in dev]
    polling = module.into_call(p.name, dev, p.result_shape, p.result_dtype, wait="poll")
    blocking = IntoCall(module.context, module.vm_module, p.name, views, allocate_result(
        module.device, p.result_shape, polling.out.element_type, 4 if p.result_dtype == "f32" else 2), wait="block")
    assert polling.async_function is not None and blocking.async_function is None
    for _ in range(3):
        polling.call(polling.pack(views))
    blocking.call(blocking.pack(views))
    assert polling.semaphore.query() == 3  # each call signalled its own value before it returned
    # queued calls, each after the one before, then one wait
    fences = [polling.submit(polling.pack(views)) for _ in range(4)]
    fences[-1].wait()
    assert polling.semaphore.query() == 7
    with pytest.raises(ValueError, match="submit"):
        blocking.submit(blocking.pack(views))
    got = module.download_view(polling.out, p.result_dtype)
    np.testing.assert_array_equal(_f64(got), _f64(module.download_view(blocking.out, p.result_dtype)))
    assert relative_error(_f64(got), reference(p, *inputs)) <= tolerance(p)
    with pytest.raises(ValueError, match="wait"):
        IntoCall(module.context, module.vm_module, p.name, views, polling.out, wait="spin")


def test_a_module_without_the_fenced_twin_gets_blocking_calls():
    mlir = """func.func @"plain$into"(%a: tensor<4xf32>, %o: tensor<4xf32> {iree.abi.output = 0 : index},
                                %w: !hal.buffer {iree.abi.transients}) -> tensor<4xf32> {
  %0 = arith.addf %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}"""
    module = LoadedModule(compile_mlir(mlir, CPU), CPU)
    call = module.into_call("plain", [module.upload(np.arange(4, dtype=np.float32))], (4,), "f32")
    assert call.async_function is None
    call.call(call.pack([module.upload(np.arange(4, dtype=np.float32))._buffer_view]))
    np.testing.assert_array_equal(module.download_view(call.out, "f32"), 2 * np.arange(4, dtype=np.float32))
