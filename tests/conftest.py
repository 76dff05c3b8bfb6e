"""Shared test setup: hypothesis profiles, the GPU marker and replaced policy rules."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

from convdsl import policy

# CI runs on 2 cores: keep the example counts modest there; `HYPOTHESIS_PROFILE=thorough` for more.
settings.register_profile(
    "ci", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests never read or fill the user's cache; tests of the cache itself set their own directory.
os.environ.setdefault("CONVDSL_CACHE_DIR", tempfile.mkdtemp(prefix="convdsl-test-cache-"))



@pytest.fixture
def policy_rules() -> Iterator[Callable[..., None]]:
    """policy_rules(name=rule, ...) replaces policy's rules until the test ends (policy.overrides: every module that
    reads the rule sees the replacement, which monkeypatching the package's name alone would not give)."""
    with contextlib.ExitStack() as stack:
        yield lambda **rules: stack.enter_context(policy.overrides(**rules))


def _cuda_present() -> bool:
    try:  # PyTorch sees the device without IREE's runtime (the stream path's GPU tests need only PyTorch)
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    from convdsl.module import cuda_available

    return cuda_available()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _cuda_present():
        skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
