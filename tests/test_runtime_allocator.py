"""The devices convdsl creates reuse released memory (a caching allocator): the allocating functions of a
module, which the NumPy API calls, then stop asking the device for result memory on every call.

Observable through IREE's own allocator statistics: after every buffer is released, a caching allocator
still holds their bytes (allocated - freed > 0) until trim() hands them back; a plain device holds none.
"""
from __future__ import annotations

import gc
from typing import Iterator

import numpy as np
import pytest

import convdsl
from convdsl.backends.iree import runtime_config
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVDSL_CACHE_DIR", str(tmp_path_factory.mktemp("convdsl-cache")))
        yield


def held_bytes(device) -> int:
    stats = device.allocator.statistics
    return stats["device_bytes_allocated"] - stats["device_bytes_freed"]


def test_the_cpu_device_keeps_released_memory_for_reuse():
    import iree.runtime as rt

    device = runtime_config("local-task").device
    device.allocator.trim()
    before = held_bytes(device)
    size = 1 << 20
    buffer = device.allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                              allowed_usage=rt.BufferUsage.DEFAULT, allocation_size=size)
    del buffer
    gc.collect()
    assert held_bytes(device) - before >= size  # released, yet kept by the cache
    device.allocator.trim()
    assert held_bytes(device) == before


def test_the_cache_keeps_the_buffers_of_many_kernels():
    """Released buffers of more sizes than IREE's default free list holds (64) are all served again from the
    cache: a process that calls a model's kernels, each with its own result and workspace sizes."""
    import iree.runtime as rt

    from convdsl.backends.iree import CACHED_FREE_BUFFERS

    device = runtime_config("local-task").device
    device.allocator.trim()
    sizes = [4096 * (i + 1) for i in range(min(200, CACHED_FREE_BUFFERS))]

    def allocate_all() -> list:
        return [device.allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                 allowed_usage=rt.BufferUsage.DEFAULT, allocation_size=size)
                for size in sizes]

    buffers = allocate_all()
    del buffers
    gc.collect()
    allocated = device.allocator.statistics["device_bytes_allocated"]
    buffers = allocate_all()
    assert device.allocator.statistics["device_bytes_allocated"] == allocated  # every one from the cache
    del buffers
    gc.collect()
    device.allocator.trim()


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` whose data starts 16 bytes past a 64-byte boundary."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + 16
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_api_results_come_from_the_caching_device():
    p = ConvProblem(op="grad_input", dims=2, groups=1, batch=2, in_channels=8, out_channels=8, input=(16, 16),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    # inputs off IREE's 64-byte import alignment, as NumPy's own often are: the call copies them into device buffers
    # (aligned ones it reads in place, allocating nothing: docs/decisions.md#cpu-api-input-alignment)
    dy, w = (_misaligned(a) for a in random_inputs(p, seed=3))
    device = runtime_config("local-task").device
    got = convdsl.grad_input(dy, w, input=(16, 16), padding=1)
    assert relative_error(got.astype(np.float64), reference(p, dy, w)) <= tolerance(p)
    del got
    gc.collect()
    device.allocator.trim()
    trimmed = held_bytes(device)
    got = convdsl.grad_input(dy, w, input=(16, 16), padding=1)
    del got
    gc.collect()
    # the call's buffers (dy's copy: 2*8*16*16 floats) went back to the cache, not to the system
    assert held_bytes(device) - trimmed >= 2 * 8 * 16 * 16 * 4
