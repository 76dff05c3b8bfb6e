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


def misaligned(a: np.ndarray, by: int = 4) -> np.ndarray:
    """A copy of `a` whose data starts `by` bytes past a 64-byte boundary."""
    raw = np.empty(a.nbytes + ALIGN + by, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + by
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("name", ["gw", "gi"])
def test_plain_misaligned_numpy_arrays_work(module, name):
    # the README's call with ordinary NumPy arrays: misaligned ones are copied, `out` is written back
    p = module.problems[name]
    kernel = DLPackKernel(module, name)
    inputs = random_inputs(p, seed=7)
    args = [misaligned(a, by) for a, by in zip(inputs, (4, 8))]
    out = misaligned(np.full(p.result_shape, np.nan, np.float32 if p.op == "grad_weight" else inputs[0].dtype), 2)
    assert all(a.ctypes.data % ALIGN for a in (*args, out))
    assert kernel(*args, out=out) is out
    assert relative_error(out.astype(np.float64), reference(p, *inputs)) <= tolerance(p)
    np.testing.assert_array_equal(out, module[name](*inputs))


def test_empty_is_aligned_and_imported_as_is(module):
    p = module.problems["gi"]
    dy, w = random_inputs(p, seed=8)
    args = []
    for a in (dy, w):
        e = convdsl.interop.empty(a.shape, a.dtype)
        assert e.ctypes.data % ALIGN == 0 and e.shape == a.shape and e.dtype == a.dtype
        e[...] = a
        args.append(e)
    out = convdsl.interop.empty(p.result_shape, np.float16)
    assert DLPackKernel(module, "gi")(*args, out=out) is out
    assert relative_error(out.astype(np.float64), reference(p, dy, w)) <= tolerance(p)


def test_output_sharing_memory_with_an_argument_is_refused(module):
    # grad_input with C == K: dx has dy's shape, so out=dy type-checks; the kernel would read what it wrote
    p = module.problems["gi"].with_(in_channels=6, input=(5, 5), stride=(1, 1), name="gi_square")
    mod = convdsl.compile([p], target="cpu")
    assert p.result_shape == p.arg_shapes[0]
    dy, w = (aligned(a) for a in random_inputs(p, seed=9))
    kernel = DLPackKernel(mod, "gi_square")
    before = dy.copy()
    with pytest.raises(InteropError, match=r"out \('dx'\) shares memory with argument 'dy'"):
        kernel(dy, w, out=dy)
    np.testing.assert_array_equal(dy, before)  # refused before anything ran
    # a view into the same buffer overlaps too; a separate array is fine
    whole = aligned(np.concatenate([dy.reshape(-1), dy.reshape(-1)]))
    first, second = whole[:dy.size].reshape(dy.shape), whole[dy.size:].reshape(dy.shape)
    with pytest.raises(InteropError, match=r"shares memory"):
        kernel(first, w, out=whole[dy.size // 2:dy.size // 2 + dy.size].reshape(dy.shape))
    out = kernel(first, w, out=second)
    assert relative_error(out.astype(np.float64), reference(p, before, w)) <= tolerance(p)


def test_interop_is_reachable_from_the_package():
    assert convdsl.interop.DLPackKernel is DLPackKernel
