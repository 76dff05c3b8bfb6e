"""Results of the NumPy API own their memory: a view of a result stays valid after the result is dropped.

The CPU's results map IREE buffers; a view that outlived the mapping read freed memory (other calls' results,
or a segfault for big ones).  Each test keeps only a view, runs more calls that reuse freed memory, then compares
the view with the float64 reference."""
from __future__ import annotations

import gc
from typing import Iterator

import numpy as np
import pytest

import convdsl
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVDSL_CACHE_DIR", str(tmp_path_factory.mktemp("convdsl-cache")))
        yield


FORWARD = ConvProblem(op="forward", dims=2, groups=1, batch=2, in_channels=3, out_channels=4, input=(16, 16),
                      filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))


def _churn(fn, *args) -> None:
    """Free what can be freed, then run more calls whose buffers reuse that memory."""
    gc.collect()
    for scale in (3.0, -5.0, 7.0, -2.0, 9.0):
        fn(*[a * scale for a in args])


def _close(view: np.ndarray, want: np.ndarray, p: ConvProblem) -> None:
    err = relative_error(view.astype(np.float64), want)
    assert err <= tolerance(p), f"a view of a dropped result changed: relative error {err:.2e}"


def test_index_view_outlives_the_result() -> None:
    x, w = random_inputs(FORWARD, seed=3)
    want = reference(FORWARD, x, w)
    view = convdsl.conv(x, w, padding=1)[0]  # the full result is dropped at once
    _churn(lambda a, b: convdsl.conv(a, b, padding=1), x, w)
    _close(view, want[0], FORWARD)


def test_reshape_view_outlives_the_result() -> None:
    x, w = random_inputs(FORWARD, seed=4)
    y = convdsl.conv(x, w, padding=1)
    view = y.reshape(-1)
    del y
    _churn(lambda a, b: convdsl.conv(a, b, padding=1), x, w)
    _close(view, reference(FORWARD, x, w).reshape(-1), FORWARD)


def test_module_kernel_view_outlives_the_result() -> None:
    p = FORWARD.with_(op="grad_input", dtype="f16", name="dgrad")
    mod = convdsl.compile([p], target="cpu")
    dy, w = random_inputs(p, seed=5)
    want = reference(p, dy, w)
    view = mod.dgrad(dy, w)[1]
    _churn(mod.dgrad, dy, w)
    _close(view, want[1], p)


def test_big_result_view_outlives_the_result() -> None:
    # above 2**20 elements the freed mapping is returned to the OS: reading it crashed
    p = FORWARD.with_(batch=1, in_channels=1, out_channels=16, input=(260, 260), filter=(1, 1), pad_lo=(0, 0),
                      pad_hi=(0, 0))
    x, w = random_inputs(p, seed=6)
    assert np.prod(p.result_shape) > 2**20
    view = convdsl.conv(x, w)[0, 100:]
    _churn(convdsl.conv, x, w)
    _close(view, reference(p, x, w)[0, 100:], p)


def test_kept_workspace_call_view_outlives_the_result(policy_rules) -> None:
    # the destination-passing path (a kept workspace, module.CompiledModule.call) makes its result buffer itself
    policy_rules(cpu_keeps_workspace=lambda *args: True)
    p = FORWARD.with_(op="grad_weight", name="wgrad")
    mod = convdsl.compile([p], target="cpu")
    x, dy = random_inputs(p, seed=7)
    want = reference(p, x, dy)
    view = mod.wgrad(x, dy)[:, 1:]
    assert mod._into_calls["wgrad"][1] is not None  # the call went through the kept workspace
    _churn(mod.wgrad, x, dy)
    _close(view, want[:, 1:], p)
