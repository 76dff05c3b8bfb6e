"""compile(problems, target, artifact=...): both artifacts built from one plan per problem, keyed on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from convdsl import compiler, stream
from convdsl.backends.iree import iree_version as installed_iree_version
from convdsl.module import CompiledModule
from convdsl.problem import ConvProblem, Epilogue
from convdsl.targets import Target
from convdsl.passes import plan as planner
from convdsl.tuning import db
from convdsl.tuning.knobs import Knobs

CPU = Target("cpu", "host")
AMPERE = Target("cuda", "sm_80")
SMALL = ConvProblem(op="forward", dims=2, groups=1, batch=1, in_channels=3, out_channels=4, input=(5, 5),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f32",
                    name="small")
# a small grad_weight on the cp.async kernel (sm_80): its tiles, split included, are knobs
WGRAD = ConvProblem(op="grad_weight", dims=2, groups=2, batch=2, in_channels=5, out_channels=6, input=(7, 6),
                    filter=(3, 2), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 0), pad_hi=(1, 1), dtype="f16",
                    name="artifact_wgrad")


def test_vmfb_and_module_artifacts_are_one_compile() -> None:
    built = compiler.compile([SMALL], CPU, artifact="vmfb")
    assert built.kind == "vmfb" and built.data and built.problems == [SMALL]
    (plan,) = built.plans
    assert (plan.knobs, plan.knobs_source) == compiler.tuned_knobs(SMALL, CPU)
    # the module's key is the plan's: what cache_key (and so convdsl.api) computes for the same problems
    assert built.key == compiler.cache_key([SMALL], CPU)
    assert compiler.compile_vmfb([SMALL], CPU) == built.data
    module = compiler.compile([SMALL], CPU)  # the default artifact: the same bytes as a module
    assert isinstance(module, CompiledModule) and module.vmfb == built.data
    with pytest.raises(ValueError, match="no IREE module"):
        compiler.compile([SMALL], AMPERE, artifact="bundle").module()


def test_the_module_key_follows_the_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    before = compiler.cache_key([SMALL], CPU)
    monkeypatch.setattr(planner, "lookup_knobs", lambda p, target: (Knobs(pad="gather"), "test"))
    assert compiler.plan(SMALL, CPU).knobs == Knobs(pad="gather")
    assert compiler.cache_key([SMALL], CPU) != before


def test_bad_artifacts_are_refused() -> None:
    with pytest.raises(ValueError, match="artifact: expected one of module, vmfb, bundle"):
        compiler.compile([SMALL], CPU, artifact="cubin")
    with pytest.raises(ValueError, match="stream kernels are CUDA kernels"):
        compiler.compile([SMALL], CPU, artifact="bundle")


def test_a_bundle_without_kernels_lists_why() -> None:
    problems = [SMALL.with_(name="dynamic", dynamic_batch=True),
                SMALL.with_(name="fused", dtype="f16", epilogue=Epilogue(steps=("bias", "relu")))]
    built = compiler.compile(problems, AMPERE, artifact="bundle")
    assert built.kernels == () and [name for name, _ in built.skipped] == [p.name for p in problems]
    assert "batch" in built.skipped[0][1] and "fused epilogue" in built.skipped[1][1]
    assert json.loads(built.data)["kernels"] == []


@pytest.fixture
def db_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "db.json"
    monkeypatch.setattr(db, "DB_PATH", path)  # the database both artifacts' plans read
    return path


def _write_db(path: Path, tiles: str) -> None:
    section = {db.signature(WGRAD): {"knobs": {"tiles": tiles}, "ms": 1.0, "default_ms": 2.0}}
    path.write_text(json.dumps({db.target_key(AMPERE, installed_iree_version()): section}))


def test_the_bundle_is_built_from_the_plan_and_keyed_on_its_knobs(db_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    _write_db(db_path, "t16x16x16w4s2k2")
    first = compiler.compile([WGRAD], AMPERE, artifact="bundle")
    (plan,), (kernel,) = first.plans, first.kernels
    assert plan.knobs.tiles is not None and first.skipped == ()
    # one plan per problem: the module's plan and the stream kernel read the same launches
    assert plan.extern.launches == tuple(sl.launch for sl in kernel.launches) == tuple(sl.launch for sl in plan.stream.launches)
    assert kernel.partials_shape[0] == 2 and all(sl.binary.data for sl in kernel.launches)
    # the bytes are the bundle file stream.load_bundle reads
    (loaded,) = stream.load_bundle(first.write(tmp_path / "k.convk"))
    assert loaded.problem == WGRAD and loaded.launches[0].binary.data == kernel.launches[0].binary.data
    # the same knobs: the same key; the database changes this kernel's knobs: another plan, another key
    assert compiler.compile([WGRAD], AMPERE, artifact="bundle").key == first.key
    _write_db(db_path, "t16x16x16w4s2k3")
    second = compiler.compile([WGRAD], AMPERE, artifact="bundle")
    assert second.key != first.key and second.kernels[0].partials_shape[0] == 3
