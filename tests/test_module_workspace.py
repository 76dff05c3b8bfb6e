"""A module's plain functions keep their transient buffers in the module (passes/workspace.py,
docs/decisions.md#module-workspace): on CUDA by policy (compile-only here), on the CPU under a policy override, where
the module runs: no transient allocation in the call's stream plan, and the reference's result on every call."""
from __future__ import annotations

import re

import numpy as np
import pytest

from convdsl import policy
from convdsl.abi import INTO_SUFFIX
from convdsl.backends.iree import LoadedModule, compile_mlir, transient_sizes
from convdsl.passes import lower_to_mlir
from convdsl.passes.workspace import WORKSPACE_SUFFIX
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CUDA = Target("cuda", "sm_80")
CPU = Target("cpu", "host")
# split-K partials and their deterministic sum: a transient buffer on every target
SPLIT_K = ConvProblem(op="grad_weight", dims=2, groups=1, batch=4, in_channels=16, out_channels=32, input=(14, 14),
                      filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16",
                      split_k=4, name="gw")


def _function(mlir: str, name: str) -> str:
    """The text of `func.func @name` (or `util.func public @name`) in printed MLIR."""
    start = re.search(rf"func(\.func| public) @{re.escape(name)}\(", mlir)
    assert start is not None, f"no function {name} in the module"
    end = mlir.find("\n  }", start.start())
    return mlir[start.start():end]


def test_a_cuda_modules_plain_function_keeps_its_transients_in_the_module():
    mlir = lower_to_mlir([SPLIT_K], CUDA)
    size = transient_sizes(mlir, CUDA)["gw"]  # what the $into twin asks for: the same computation
    assert size > 0
    assert f"tensor<{size}xi8>" in mlir  # the buffer the module allocates once, of that size
    plain = _function(mlir, "gw")
    assert f"util.global.load immutable @gw{WORKSPACE_SUFFIX}" in plain and "hal.tensor.transients" in plain
    into = _function(mlir, "gw" + INTO_SUFFIX)
    assert "hal.tensor.transients" not in into and "iree.abi.transients" in into  # the caller's workspace
    plan = _stream_plan(mlir, CUDA, "gw")  # per call: the result's allocation only, no release to wait for
    assert plan.count("stream.resource.alloca") == 1 and "stream.resource.dealloca" not in plan
    assert compile_mlir(mlir, CUDA)[:8]  # and iree-compile takes it


def test_the_kept_workspace_is_sized_with_the_modules_own_iree_flags():
    # a caller's iree-compile flags can change what IREE plans (here transient slices aligned to 64 KiB): the module
    # is compiled with them, so its kept buffer is sized with them
    flags = ("--iree-stream-resource-min-offset-alignment=65536",)
    plain = lower_to_mlir([SPLIT_K], CUDA)
    default, aligned = transient_sizes(plain, CUDA)["gw"], transient_sizes(plain, CUDA, flags)["gw"]
    assert aligned > default
    assert f"tensor<{aligned}xi8>" in lower_to_mlir([SPLIT_K], CUDA, iree_flags=flags)


def test_large_transients_and_other_targets_allocate_per_call():
    with policy.overrides(MODULE_WORKSPACE_MOST_BYTES=1024):
        assert WORKSPACE_SUFFIX not in lower_to_mlir([SPLIT_K], CUDA)
    assert WORKSPACE_SUFFIX not in lower_to_mlir([SPLIT_K.with_(dtype="f32")], CPU)
    # `batch = ?`: no static size to allocate at load
    assert WORKSPACE_SUFFIX not in lower_to_mlir([SPLIT_K.with_(dynamic_batch=True)], CUDA)


def _stream_plan(mlir: str, target: Target, name: str) -> str:
    """The plain function `name` after iree-compile's stream phase (its allocations, executions and waits)."""
    import iree.compiler as ireec

    return _function(ireec.compile_str(mlir, extra_args=[*target.compile_flags(), "--compile-to=stream"]).decode(),
                     name)


@pytest.mark.parametrize("kept", [False, True], ids=["per-call", "kept"])
def test_the_kept_workspace_computes_the_same_and_is_not_allocated_per_call(kept: bool):
    p = SPLIT_K.with_(dtype="f32")
    rules = {"module_workspaces": lambda target: True} if kept else {}
    with policy.overrides(**rules):
        mlir = lower_to_mlir([p], CPU)
    assert (WORKSPACE_SUFFIX in mlir) == kept
    plan = _stream_plan(mlir, CPU, p.name)
    # per call: the result's allocation, and the transients' (with their release) unless the module keeps them
    assert plan.count("stream.resource.alloca") == (1 if kept else 2)
    assert ("stream.resource.dealloca" in plan) != kept
    module = LoadedModule(compile_mlir(mlir, CPU), CPU)
    x, dy = random_inputs(p, seed=5)
    want = reference(p, x, dy)
    for _ in range(3):  # the kept workspace is reused: every call's partials overwrite the last call's
        got = module.call(p.name, x, dy)
        assert relative_error(got.astype(np.float64), want) <= tolerance(p)
