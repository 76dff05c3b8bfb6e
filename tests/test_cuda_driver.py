"""backends/cuda_driver.py without a GPU: a launch from a thread with no current CUDA context (autograd's device
threads, before the runtime API binds one) binds the device's primary context and launches again."""
from __future__ import annotations

import ctypes

import pytest

from convdsl.backends import cuda_driver


class FakeDriver:
    """cuLaunchKernel answering each call with the next of `statuses`, recording its stream argument."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses, self.streams = list(statuses), []

    def cuLaunchKernel(self, *args) -> int:  # noqa: N802 - the driver's name
        self.streams.append(args[8])  # (function, grid, block, shared bytes, stream, ...)
        return self.statuses.pop(0)

    def cuGetErrorName(self, status, name) -> int:  # noqa: N802
        return 0


@pytest.fixture
def driver(monkeypatch):
    def install(statuses: list[int]) -> tuple[FakeDriver, list[int]]:
        fake, bound = FakeDriver(statuses), []
        monkeypatch.setattr(cuda_driver, "_driver", lambda: fake)
        monkeypatch.setattr(cuda_driver, "_ensure_context", bound.append)
        return fake, bound
    return install


def test_a_launch_without_a_context_binds_the_primary_context_and_launches_again(driver):
    fake, bound = driver([cuda_driver._INVALID_CONTEXT, 0])
    function = cuda_driver.LoadedFunction("k", ctypes.c_void_p(1), 128, 0, 2, device=3)
    function.launch((1, 1, 1), 77, [16, 32])
    assert bound == [3] and fake.streams == [77, 77]


def test_a_raw_launch_without_a_context_binds_it_too(driver):
    fake, bound = driver([cuda_driver._INVALID_CONTEXT, 0])
    function = cuda_driver.LoadedFunction("k", ctypes.c_void_p(1), 128, 0, 1, device=1)
    cuda_driver.bind_raw(function, (2, 1, 1), None)(5)
    assert bound == [1] and fake.streams == [5, 5]


def test_a_launch_that_fails_again_raises_naming_the_kernel(driver):
    fake, bound = driver([cuda_driver._INVALID_CONTEXT, cuda_driver._INVALID_CONTEXT])
    function = cuda_driver.LoadedFunction("grad_stats", ctypes.c_void_p(1), 128, 0, 1)
    with pytest.raises(cuda_driver.CudaDriverError, match=r"cuLaunchKernel\(grad_stats\)"):
        function.launch((1, 1, 1), 0, [16])
    assert bound == [0]


def test_other_failures_raise_without_binding(driver):
    fake, bound = driver([1])
    function = cuda_driver.LoadedFunction("k", ctypes.c_void_p(1), 128, 0, 1)
    with pytest.raises(cuda_driver.CudaDriverError):
        function.launch((1, 1, 1), 0, [16])
    assert bound == [] and len(fake.streams) == 1
