"""What a repeated CPU call skips (convdsl/interop.py's DLPackKernel, convdsl.torch's IREE path, the NumPy API): each
test undoes nothing by timing; it counts the checks, lookups and copies a second call of the same signature makes."""
from __future__ import annotations

import numpy as np
import pytest

import convdsl
from convdsl import interop
from convdsl.interop import DLPackKernel, InteropError
from convdsl.module import Kernel
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance

GI = ConvProblem(op="grad_input", dims=2, groups=2, batch=2, in_channels=4, out_channels=6, input=(9, 7),
                 filter=(3, 3), stride=(2, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), name="gi")
ALIGN = interop.HOST_ALIGNMENT


def aligned(a: np.ndarray) -> np.ndarray:
    out = interop.empty(a.shape, a.dtype)
    out[...] = a
    return out


def misaligned(a: np.ndarray, by: int = 4) -> np.ndarray:
    raw = np.empty(a.nbytes + 2 * ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + by
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.fixture(scope="module")
def module():
    return convdsl.compile([GI], target="cpu")


def test_a_known_signature_skips_the_checks_but_not_alignment_or_overlap(module, monkeypatch):
    kernel = DLPackKernel(module, "gi")
    dy, w = random_inputs(GI, seed=1)
    want = reference(GI, dy, w)
    out = aligned(np.zeros(GI.result_shape, np.float32))
    kernel(aligned(dy), aligned(w), out=out)
    assert kernel.signature_hits == 0 and len(kernel._plans) == 1

    def no_checks(*_):
        raise AssertionError("a known signature was checked again")

    monkeypatch.setattr(kernel, "_check", no_checks)
    out[...] = np.nan
    assert kernel(aligned(dy), aligned(w), out=out) is out and kernel.signature_hits == 1
    assert relative_error(out.astype(np.float64), want) <= tolerance(GI)
    # misaligned memory of the same signature still goes through the aligned copies IREE asks for
    late = misaligned(np.full(GI.result_shape, np.nan, np.float32))
    assert kernel(misaligned(dy), misaligned(w, 8), out=late) is late and kernel.signature_hits == 2
    assert relative_error(late.astype(np.float64), want) <= tolerance(GI)
    # and memory shared between out and an argument is refused per call
    shared = aligned(np.zeros(2 * out.size, np.float32))
    with pytest.raises(InteropError, match="shares memory"):
        kernel(aligned(dy), shared[:w.size].reshape(w.shape), out=shared[:out.size].reshape(out.shape))


def test_an_aligned_input_is_read_in_place_by_the_numpy_api(module):
    loaded = module.loaded
    dy = random_inputs(GI, seed=2)[0]
    inplace, copied = aligned(dy), misaligned(dy, 16)

    def address(view):
        return view.map().asarray(view.shape, np.dtype(np.float32)).ctypes.data

    assert address(loaded.import_view(inplace)) == inplace.ctypes.data  # the array's own memory: no copy
    assert address(loaded.import_view(copied)) != copied.ctypes.data  # NumPy's 16-byte alignment: a copy


class _Counting:
    """A VmModule stand-in that counts lookup_function calls."""

    def __init__(self, vm_module) -> None:
        self.vm_module, self.lookups = vm_module, []

    def lookup_function(self, name):
        self.lookups.append(name)
        return self.vm_module.lookup_function(name)


def test_a_repeated_api_call_reads_no_problem_shapes_and_invokes_its_function_directly(monkeypatch):
    dy, w = random_inputs(GI.with_(name="kernel"), seed=3)
    kwargs = dict(input=(9, 7), stride=(2, 1), padding=1, layout="NHWGC", weight_layout="GKYXC")
    first = convdsl.grad_input(dy, w, **kwargs)
    assert "grad_input" in vars(convdsl), "the package keeps the lazily imported function as its attribute"
    from convdsl import api

    kernel = api.get_kernel(api.infer_problem("grad_input", dy, w, **kwargs), "cpu")
    loaded = kernel.module.loaded
    counting = _Counting(loaded.vm_module)
    monkeypatch.setattr(loaded, "vm_module", counting)
    monkeypatch.setattr(loaded, "module", None)  # no iree.runtime FunctionInvoker is made per call
    reads = []
    shapes = ConvProblem.arg_shapes
    monkeypatch.setattr(ConvProblem, "arg_shapes", property(lambda p: reads.append(p) or shapes.fget(p)))
    for _ in range(3):
        np.testing.assert_array_equal(convdsl.grad_input(dy, w, **kwargs), first)
    assert reads == [], "the argument check and the extra tensors' spec are remembered per signature"
    assert kernel.checked and counting.lookups == [], "the function was looked up by the first call"


def test_kernel_checks_a_signature_once(module, monkeypatch):
    kernel = module["gi"]
    dy, w = random_inputs(GI, seed=4)
    checks = []
    check = Kernel.check_args
    monkeypatch.setattr(Kernel, "check_args", lambda self, args: checks.append(1) or check(self, args))
    first = kernel(dy, w)
    second = kernel(dy, w)
    np.testing.assert_array_equal(first, second)
    assert len(checks) == 1
    with pytest.raises(convdsl.module.ArgumentError, match="expected shape"):
        kernel(dy[:1], w)  # a new signature is checked


def test_torch_cpu_calls_take_the_kept_signature():
    torch = pytest.importorskip("torch")
    from convdsl.torch import runtime

    x = torch.randn(2, 8, 9, 9).to(memory_format=torch.channels_last)
    w = torch.randn(12, 4, 3, 3).to(memory_format=torch.channels_last)
    conv = dict(spatial=(9, 9), filt=(3, 3), stride=(2, 2), pad_lo=(1, 1), pad_hi=(1, 1), dilation=(1, 1), groups=2)
    y = runtime.run("forward", x, w, **conv)
    call = runtime._calls[runtime._key("forward", x, w, **conv)]
    assert call.iree_views is not None and isinstance(call.dlpack, DLPackKernel)
    hits = call.dlpack.signature_hits
    plan, = call.dlpack._plans.values()
    assert plan.exports[0] is torch._C._to_dlpack  # the capsule without __dlpack__'s checks, made once

    def laid_out(*_):
        raise AssertionError("a repeated call of tensors laid out as they come considered copies")

    original = runtime._as_laid_out
    runtime._as_laid_out = laid_out
    try:
        again = runtime.run("forward", x, w, **conv)
    finally:
        runtime._as_laid_out = original
    assert call.dlpack.signature_hits == hits + 1
    torch.testing.assert_close(again, y, rtol=0, atol=0)
    want = torch.nn.functional.conv2d(x.double(), w.double(), stride=2, padding=1, groups=2)
    torch.testing.assert_close(again.double(), want, rtol=1e-5, atol=1e-5)
    assert again.is_contiguous(memory_format=torch.channels_last)
