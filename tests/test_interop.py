"""Kernels on DLPack tensors (convdsl/interop.py), on llvm-cpu with NumPy arrays: zero-copy import, the result
written into the caller's array, clear errors.  The CUDA + PyTorch path is tests/test_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import convdsl
from convdsl.interop import DLPackKernel, InteropError
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance

BASE = ConvProblem(op="grad_weight", dims=2, groups=2, batch=3, in_channels=4, out_channels=6, input=(9, 7),
                   filter=(3, 3), stride=(2, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), split_k=2, name="gw")
PROBLEMS = [BASE, BASE.with_(op="grad_input", dtype="f16", split_k=None, name="gi"),
            BASE.with_(op="grad_input", dynamic_batch=True, split_k=None, name="gi_any_batch")]
ALIGN = 64  # IREE's CPU device imports host memory aligned to 64 bytes


def aligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` whose data starts on a 64-byte boundary."""
    raw = np.empty(a.nbytes + ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    out = raw[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.fixture(scope="module")
def module():
    return convdsl.compile(PROBLEMS, target="cpu")


@pytest.mark.parametrize("name", ["gw", "gi"])
def test_result_is_written_into_the_callers_array(module, name):
    p = module.problems[name]
    kernel = DLPackKernel(module, name)
    for seed in (1, 2):  # the second call reuses the workspace and overwrites the same output
        inputs = random_inputs(p, seed=seed)
        out = aligned(np.zeros(p.result_shape, inputs[0].dtype if p.op != "grad_weight" else np.float32))
        returned = kernel(*[aligned(a) for a in inputs], out=out)
        assert returned is out
        np.testing.assert_array_equal(out, module[name](*inputs))  # same bits as the usual call
        assert relative_error(out.astype(np.float64), reference(p, *inputs)) <= tolerance(p)


def test_dynamic_batch_takes_the_batch_from_the_tensors(module):
    p = module.problems["gi_any_batch"]
    kernel = DLPackKernel(module, "gi_any_batch")
    for batch in (1, 4):
        concrete = p.with_(batch=batch, dynamic_batch=False)
        inputs = random_inputs(concrete, seed=batch)
        args = [aligned(a) for a in inputs]
        assert kernel.result_shape(*args) == concrete.result_shape
        out = kernel(*args, out=aligned(np.zeros(concrete.result_shape, np.float32)))
        assert relative_error(out.astype(np.float64), reference(concrete, *inputs)) <= tolerance(concrete)


class _FakeCudaTensor:
    def __init__(self, like: np.ndarray) -> None:
        self.shape, self.dtype = like.shape, like.dtype

    def __dlpack__(self):
        raise AssertionError("must be refused before import")

    def __dlpack_device__(self):
        return (2, 0)


def test_bad_tensors_get_errors_that_name_the_argument(module):
    p = module.problems["gw"]
    kernel = DLPackKernel(module, "gw")
    x, dy = (aligned(a) for a in random_inputs(p, seed=0))
    out = aligned(np.zeros(p.result_shape, np.float32))
    with pytest.raises(InteropError, match=r"argument 'x' expected shape"):
        kernel(x[:1], dy, out=out)
    with pytest.raises(InteropError, match=r"argument 'dy' expected dtype f32, got float16"):
        kernel(x, dy.astype(np.float16), out=out)
    with pytest.raises(InteropError, match=r"argument 'dw' must be contiguous"):
        kernel(x, dy, out=np.zeros(p.result_shape[::-1], np.float32).T)
    with pytest.raises(InteropError, match=r"argument 'x' lives on DLPack device type 2"):
        kernel(_FakeCudaTensor(x), dy, out=out)
    with pytest.raises(InteropError, match=r"expected 2 tensors, got 1"):
        kernel(x, out=out)
    unaligned = np.empty(x.nbytes + 4, np.uint8)[4 if x.ctypes.data % ALIGN == 0 else 0:][: x.nbytes]
    misaligned = unaligned.view(x.dtype).reshape(x.shape)
    if misaligned.ctypes.data % ALIGN:
        misaligned[...] = x
        with pytest.raises(InteropError, match=r"IREE could not import argument 'x'"):
            kernel(misaligned, dy, out=out)


def test_interop_is_reachable_from_the_package():
    assert convdsl.interop.DLPackKernel is DLPackKernel
