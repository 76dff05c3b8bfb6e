"""CPU kernels called from the Python API keep a large workspace from call to call (CompiledModule.call,
policy.cpu_keeps_workspace): the results stay right, each call returns its own array, and the workspace is made
again only when the argument shapes change."""
from __future__ import annotations

import numpy as np
import pytest

from convdsl import policy
from convdsl.compiler import compile as compile_module
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance

MiB = 2**20
SPLIT = ConvProblem(op="grad_weight", dims=2, groups=2, batch=4, in_channels=3, out_channels=4, input=(9, 9),
                    filter=(3, 3), stride=(2, 2), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), split_k=3, name="gw")
DYNAMIC = ConvProblem(op="grad_input", dims=2, groups=1, batch=2, in_channels=16, out_channels=16, input=(9, 8),
                      filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dynamic_batch=True,
                      name="gi")


def test_the_rule_keeps_large_workspaces_within_a_share_of_memory():
    keeps = policy.cpu_keeps_workspace
    memory = 16 * 1024 * MiB
    assert not keeps(31 * MiB, 0, memory), "below glibc's largest mmap threshold malloc reuses freed transients"
    assert keeps(32 * MiB, 0, memory) and keeps(1200 * MiB, 0, memory)
    assert not keeps(4097 * MiB, 0, memory), "a quarter of the memory at most"
    assert keeps(2048 * MiB, 2048 * MiB, memory) and not keeps(2048 * MiB, 2049 * MiB, memory), \
        "counting what the module keeps already"
    assert not keeps(64 * MiB, 0, 0), "memory unknown: nothing kept"


@pytest.fixture(scope="module")
def module():
    return compile_module([SPLIT, DYNAMIC], target="cpu")


def test_a_kept_workspace_is_reused_and_each_call_returns_its_own_array(module, policy_rules):
    policy_rules(CPU_KEPT_WORKSPACE_LEAST=1)  # these small kernels keep theirs too
    module._into_calls.clear()
    x, dy = random_inputs(SPLIT, seed=2)
    first = module.gw(x, dy)
    (shapes, kept), = module._into_calls.values()
    assert kept is not None and kept.workspace_bytes > 0
    second = module.gw(x, 2 * dy)
    assert module._into_calls["gw"][1] is kept, "the same call, workspace and all"
    assert not np.shares_memory(first, second)
    want = reference(SPLIT, x, dy)
    assert relative_error(first, want) <= tolerance(SPLIT)
    assert relative_error(second, 2 * want) <= tolerance(SPLIT), "the second call did not disturb the first result"
    assert relative_error(first, want) <= tolerance(SPLIT)
    module.clear_workspaces()
    assert not module._into_calls
    assert relative_error(module.gw(x, dy), want) <= tolerance(SPLIT) and module._into_calls["gw"][1] is not kept


def test_a_new_batch_makes_a_new_call_and_small_workspaces_are_not_kept(module, policy_rules):
    module._into_calls.clear()
    dy, w = random_inputs(DYNAMIC.with_(dynamic_batch=False), seed=3)
    assert relative_error(module.gi(dy, w), reference(DYNAMIC.with_(dynamic_batch=False), dy, w)) <= 1e-5
    assert module._into_calls["gi"][1] is None, "a small workspace: the allocating function, as before"
    policy_rules(CPU_KEPT_WORKSPACE_LEAST=1)
    module._into_calls.clear()
    calls = []
    for batch in (2, 3, 3):
        p = DYNAMIC.with_(batch=batch, dynamic_batch=False)
        dy, w = random_inputs(p, seed=batch)
        assert relative_error(module.gi(dy, w), reference(p, dy, w)) <= 1e-5
        shapes, kept = module._into_calls["gi"]
        assert kept is not None and shapes[0][0] == batch
        calls.append(kept)
    assert calls[1] is not calls[0], "batch 3: a workspace of its own size"
    assert calls[2] is calls[1], "batch 3 again: the same"
