"""Cache keys follow everything that changes a kernel: a `convdsl tune collect` that rewrites the tuning database
must change the keys of the kernels whose knobs it changed (stream kernels and modules), and leave the others'."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from convdsl import cache, compiler, stream
from convdsl.backends.iree import iree_version as installed_iree_version
from convdsl.problem import ConvProblem
from convdsl.targets import Target
from convdsl.tuning import db

pytest.importorskip("triton")

HOPPER = Target("cuda", "sm_90")
# a small grad_weight on the cp.async kernel (too few channels for the TMA one): its tiles are knobs
WGRAD = ConvProblem(op="grad_weight", dims=2, groups=2, batch=2, in_channels=5, out_channels=6, input=(7, 6),
                    filter=(3, 2), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 0), pad_hi=(1, 1), dtype="f16",
                    name="k")
OTHER = WGRAD.with_(batch=3)


def _write_db(path: Path, entries: dict[ConvProblem, dict], version: str) -> None:
    section = {db.signature(p): {"knobs": knobs, "ms": 1.0, "default_ms": 2.0} for p, knobs in entries.items()}
    path.write_text(json.dumps({db.target_key(HOPPER, version): section}))


def _stream_key(p: ConvProblem) -> str:
    return stream.kernel_key(stream.plan(p, HOPPER))


@pytest.fixture
def db_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "db.json"
    monkeypatch.setattr(db, "DB_PATH", path)  # the database the compile driver and the stream path read
    return path


def test_stream_key_changes_with_the_kernels_tuned_knobs(db_path: Path) -> None:
    version = installed_iree_version()
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2"}}, version)
    before = _stream_key(WGRAD)
    # an unchanged database, written again: the same key
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2"}}, version)
    assert _stream_key(WGRAD) == before
    # another kernel's entry changed: this kernel's plan, and so its key, is the same
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2"}, OTHER: {"tiles": "t32x32x16w4s2"}}, version)
    assert _stream_key(WGRAD) == before
    # its own entry changed (another split): another plan, another key
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k3"}}, version)
    assert _stream_key(WGRAD) != before
    # knobs that leave the stream kernel's launches as they were still change the key (the knobs are hashed)
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2", "n_scale": 2}}, version)
    assert _stream_key(WGRAD) != before
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2"}}, version)
    assert _stream_key(WGRAD) == before


def test_stream_kernel_is_rebuilt_after_the_database_changes(db_path: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    version = installed_iree_version()
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k2"}}, version)
    cache.stats.reset()
    first = stream.stream_kernel(WGRAD, HOPPER)
    assert first.partials_shape[0] == 2 and cache.stats.stores == 1
    assert stream.stream_kernel(WGRAD, HOPPER).tiles == first.tiles and cache.stats.hits == 1
    _write_db(db_path, {WGRAD: {"tiles": "t16x16x16w4s2k3"}}, version)
    second = stream.stream_kernel(WGRAD, HOPPER)  # not the cached kernel of the old knobs
    assert second.partials_shape[0] == 3 and cache.stats.stores == 2


def test_module_key_changes_with_the_kernels_tuned_knobs(db_path: Path) -> None:
    version = compiler.iree_version()
    _write_db(db_path, {WGRAD: {"n_scale": 2}}, version)
    before = compiler.cache_key([WGRAD], HOPPER)
    _write_db(db_path, {WGRAD: {"n_scale": 2}, OTHER: {"n_scale": 4}}, version)
    assert compiler.cache_key([WGRAD], HOPPER) == before
    _write_db(db_path, {WGRAD: {"n_scale": 4}}, version)
    assert compiler.cache_key([WGRAD], HOPPER) != before
    _write_db(db_path, {WGRAD: {"n_scale": 2}}, version)
    assert compiler.cache_key([WGRAD], HOPPER) == before


def test_a_stream_kernel_is_planned_once(db_path: Path) -> None:
    # asking whether a kernel exists, then building it, plans its launches once (sm_80: no TMA kernel)
    from convdsl import policy

    ampere = Target("cuda", "sm_80")
    p = WGRAD.with_(name="planned_once")  # a name no other test planned: nothing cached yet
    from convdsl.passes import plan as planner

    launches, plans = policy.launches_or_reason.cache_info(), planner._stream_plan.cache_info()
    assert stream.unsupported_reason(p, ampere) is None
    plan = stream.plan(p, ampere)
    assert plan.stream is not None and plan.stream_reason is None
    assert policy.launches_or_reason.cache_info().misses - launches.misses == 1
    assert planner._stream_plan.cache_info().misses - plans.misses == 1
    # one plan: the module's launches are the stream kernel's
    assert plan.extern.launches == tuple(sl.launch for sl in plan.stream.launches)
    assert policy.launches_or_reason.cache_info().misses - launches.misses == 1
    # no kernel: the reason, planned once too
    why = stream.plan(p.with_(dynamic_batch=True), ampere)
    assert why.stream is None and "batch" in why.stream_reason
