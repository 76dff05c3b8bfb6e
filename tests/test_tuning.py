"""Tuning: knobs edit IREE's configuration consistently, the database round-trips, the heuristic is sane."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from convdsl.backends.iree import compile_mlir
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.targets import Target
from convdsl.backends.iree_config import apply_knobs, compile_with_knobs
from convdsl.tuning import Knobs
from convdsl.compiler import iree_version, knobs_by_kernel, tuned_knobs
from convdsl.policy import iree_knobs as heuristic
from convdsl.tuning import db as tuning_db
from convdsl.tuning.db import signature, target_key
from convdsl.tuning.knobs import parse_label
from convdsl.tune import collect

CUDA = Target("cuda", "sm_80")
DGRAD = ConvProblem(
    op="grad_input", dims=2, groups=1, batch=8, in_channels=64, out_channels=64, input=(28, 28), filter=(3, 3),
    stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16", name="dgrad",
)
LINALG = {"dgrad": Knobs(extern=False)}  # these tests tune IREE's lowering of the linalg form


@pytest.fixture(scope="module")
def configured(tmp_path_factory) -> str:
    """IREE's own configuration of the contraction dispatch, as the tuner sees it."""
    folder = tmp_path_factory.mktemp("cfg")
    compile_mlir(lower_to_mlir([DGRAD], CUDA, knobs=LINALG), CUDA,
                 ["--compile-to=executable-configurations", f"--iree-hal-dump-executable-configurations-to={folder}"])
    texts = [p.read_text() for p in folder.glob("*.mlir") if "mma_kind" in p.read_text()]
    assert len(texts) == 1
    return texts[0]


def _lists(text: str) -> dict[str, list[int]]:
    return {k: [int(v) for v in re.search(rf"\b{k} = \[([0-9, ]*)\]", text).group(1).split(",")]
            for k in ("workgroup", "subgroup", "reduction")}


def test_knobs_scale_tiles_and_keep_the_subgroup_count(configured):
    before = _lists(configured)
    after = _lists(apply_knobs(configured, Knobs(n_scale=2, m_scale=2, prefetch=3)))
    changed = [i for i, (a, b) in enumerate(zip(before["workgroup"], after["workgroup"])) if a != b]
    assert len(changed) == 2 and all(after["workgroup"][i] == 2 * before["workgroup"][i] for i in changed)
    # subgroups per workgroup = prod(workgroup / subgroup) over tiled dims: unchanged, so is the workgroup size
    ratio = lambda d: [w // s for w, s in zip(d["workgroup"], d["subgroup"]) if s]  # noqa: E731
    assert ratio(before) == ratio(after)
    assert "prefetch_num_stages = 3" in apply_knobs(configured, Knobs(prefetch=3))
    assert apply_knobs(configured, Knobs()) == configured
    assert apply_knobs("func.func @f() { }", Knobs(n_scale=2)) is None  # no matrix-unit config


def test_compile_with_knobs_substitutes_the_configuration():
    mlir = lower_to_mlir([DGRAD], CUDA, knobs=LINALG)
    default = compile_mlir(mlir, CUDA)
    tuned = compile_with_knobs(mlir, CUDA, {"dgrad": Knobs(n_scale=2, m_scale=2)}, strict=True)
    assert tuned != default and len(tuned) > 0


def test_labels_round_trip():
    for knobs in (Knobs(), Knobs(n_scale=2), Knobs(n_scale=2, m_scale=2, prefetch=3), Knobs(k_scale=0.5),
                  Knobs(n_scale=4, m_scale=2, k_inner=False), Knobs(k_scale=0.5, k_inner=True, pad="gather")):
        assert parse_label(knobs.label()) == knobs
    assert Knobs(n_scale=4, m_scale=2, k_inner=False).label() == "n4-m2-ko"
    assert Knobs(k_inner=True).config_default  # the order acts on the IR, not on IREE's configuration
    with pytest.raises(ValueError, match="expected parts"):
        parse_label("x3")


def test_heuristic_follows_the_measurements():
    big = DGRAD.with_(batch=64, input=(56, 56))
    assert heuristic(big, CUDA) == Knobs(n_scale=2, m_scale=2)
    assert heuristic(big.with_(dtype="f32"), CUDA) == Knobs()  # f32: no matrix units
    assert heuristic(big.with_(groups=16, in_channels=1, out_channels=1), CUDA) == Knobs()  # depthwise
    assert heuristic(big, Target("cpu", "host")) == Knobs()
    small_k = big.with_(op="grad_weight")
    assert heuristic(small_k, CUDA) == Knobs()
    wide = big.with_(in_channels=256)
    assert heuristic(wide, CUDA) == Knobs(n_scale=4, m_scale=2)
    assert heuristic(wide.with_(batch=8), CUDA) == Knobs(n_scale=2)  # small M: the wider N tile is not tried
    assert heuristic(wide.with_(stride=(2, 2), input=(112, 112)), CUDA) == Knobs(n_scale=2, m_scale=2)  # strided


def _results(tmp_path: Path, impls: dict) -> tuple[Path, Path]:
    from convdsl.problem import problem_to_spec

    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"cases": [{"name": "k", "spec": problem_to_spec(DGRAD)}]}))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [{"name": "k", "impls": impls}]}))
    return results, cases


def test_collect_keeps_the_fastest_correct_candidate(tmp_path, monkeypatch):
    import convdsl.tuning.db as db

    db_path = tmp_path / "db.json"
    results, cases = _results(tmp_path, {
        "convdsl": {"ok": True, "ms": 1.0},
        "convdsl@n2": {"ok": True, "ms": 0.8},
        "convdsl@n2-m2": {"ok": False, "ms": 0.5},  # wrong result: never chosen
        "convdsl@m2": {"ok": True, "ms": 0.99},
    })
    chosen = collect(results, cases, CUDA, db_path)
    assert chosen == {"k": ("n2", 1.0, 0.8)}
    assert _lookup(DGRAD, CUDA, db_path) == Knobs(n_scale=2)
    assert _lookup(DGRAD.with_(name="other_name"), CUDA, db_path) == Knobs(n_scale=2)  # the name is not the key
    assert _lookup(DGRAD.with_(batch=9), CUDA, db_path) is None
    monkeypatch.setattr(db, "DB_PATH", db_path)
    assert signature(DGRAD) in json.loads(db_path.read_text())[target_key(CUDA, iree_version())]


def test_collect_keeps_the_ir_knobs_and_the_default_time(tmp_path):
    db_path = tmp_path / "db.json"
    results, cases = _results(tmp_path, {"convdsl": {"ok": True, "ms": 1.0},
                                         "convdsl@n2-wgather-ko": {"ok": True, "ms": 0.8}})
    collect(results, cases, CUDA, db_path)
    # a later run whose candidates were compiled with that entry's zero-border form and phase weight order
    # (plan reads them from the database), so their labels carry neither
    results, cases = _results(tmp_path, {"convdsl": {"ok": True, "ms": 0.8}, "convdsl@n4": {"ok": True, "ms": 0.5}})
    collect(results, cases, CUDA, db_path)
    assert _lookup(DGRAD, CUDA, db_path) == Knobs(n_scale=4, pad="gather", k_inner=False)
    entry = json.loads(db_path.read_text())[target_key(CUDA, iree_version())][signature(DGRAD)]
    assert entry["default_ms"] == 1.0 and entry["ms"] == 0.5


def _lookup(p, target, path):
    tuned = tuning_db.lookup(p, target, iree_version(), path)
    return tuned.knobs if tuned is not None else None


def test_phase_weight_order_candidates_only_where_there_are_phases():
    from convdsl.tune import CANDIDATES, candidates_for

    orders = [k for k in CANDIDATES if k.k_inner is not None]
    assert orders and all(k in candidates_for(DGRAD) for k in orders)
    assert not any(k.k_inner is not None for k in candidates_for(DGRAD.with_(op="grad_weight")))


def test_a_tuned_phase_weight_order_overrides_the_rule(tmp_path, monkeypatch):
    from convdsl.passes.plan import plan_kernel

    strided = DGRAD.with_(stride=(2, 2))
    linalg = Knobs(extern=False)
    assert plan_kernel(strided, CUDA, linalg).weight_k_inner  # the rule: strided grad_input on CUDA
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({target_key(CUDA, iree_version()): {signature(strided): {
        "knobs": {"n_scale": 4, "k_inner": False, "extern": False}}}}))
    monkeypatch.setattr(tuning_db, "DB_PATH", db_path)
    tuned = knobs_by_kernel([strided], CUDA)[strided.name]  # the compile driver's lookup
    assert not plan_kernel(strided, CUDA, tuned).weight_k_inner
    assert plan_kernel(strided, CUDA, Knobs(k_inner=True).over(tuned)).weight_k_inner  # a candidate's override wins


def test_collect_ignores_gains_within_noise(tmp_path):
    results, cases = _results(tmp_path, {"convdsl": {"ok": True, "ms": 1.0}, "convdsl@n2": {"ok": True, "ms": 0.99}})
    assert collect(results, cases, CUDA, tmp_path / "db.json") == {}


def test_shipped_database_is_used_for_its_shapes():
    # the suite's ck15 3D f16 backward data, as the shipped database holds it
    p = ConvProblem(op="grad_input", dims=3, groups=1, batch=64, in_channels=64, out_channels=128,
                    input=(28, 28, 28), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1),
                    pad_hi=(1, 1, 1), dtype="f16", name="anything")
    knobs, source = tuned_knobs(p, CUDA)
    assert knobs == Knobs(n_scale=2, m_scale=4) and "tuning database" in source
    assert heuristic(p, CUDA) != knobs  # so the database, not the heuristic, decided


def test_an_entry_tuned_with_another_iree_version_still_serves(tmp_path, monkeypatch):
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({target_key(CUDA, "3.12.0"): {signature(DGRAD): {"knobs": {"n_scale": 4}}},
                                   target_key(CUDA, "3.11.0"): {signature(DGRAD): {"knobs": {"n_scale": 2}}}}))
    monkeypatch.setattr(tuning_db, "DB_PATH", db_path)
    knobs, source = tuned_knobs(DGRAD, CUDA)
    assert knobs == Knobs(n_scale=4)  # the newest version's entry
    assert "tuned with IREE 3.12.0" in source and iree_version() in source
    assert tuned_knobs(DGRAD.with_(batch=9), CUDA)[1].startswith("rules")  # no entry: the rules decide


def test_extern_kernels_get_tile_candidates():
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.tune import candidates_for

    hopper = Target("cuda", "sm_90")
    tiles = candidates_for(DGRAD, hopper)
    assert tiles and all(k.tiles is not None and k.config_default for k in tiles)
    assert all(parse_tiles(k.tiles).block_n <= 2 * 64 for k in tiles)  # no column tile wider than twice C
    wgrad = candidates_for(DGRAD.with_(op="grad_weight"), hopper)
    assert any(parse_tiles(k.tiles).split for k in wgrad)  # split-K variants around the automatic S
    f32 = candidates_for(DGRAD.with_(dtype="f32"), hopper)
    assert all(parse_tiles(k.tiles).block_k <= 32 and parse_tiles(k.tiles).stages <= 3 for k in f32)
    assert candidates_for(DGRAD, CUDA.__class__("cpu", "host")) == candidates_for(DGRAD)  # IREE's knobs elsewhere


def test_few_channel_kernels_get_their_own_candidates():
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.tune import DEPTHWISE_TILES, candidates_for

    hopper = Target("cuda", "sm_90")
    grouped = DGRAD.with_(groups=32, in_channels=4, out_channels=4)
    for op in ("grad_input", "grad_weight"):
        knobs = candidates_for(grouped.with_(op=op), hopper)
        packs = {parse_tiles(k.tiles).pack for k in knobs if k.tiles}
        assert packs == {8, 16}  # the default pack (8 groups of 4 channels reach 32) and twice that
        assert Knobs(extern=False) in knobs  # the gather form they replaced, where it applies
    dw = DGRAD.with_(groups=64, in_channels=1, out_channels=1, op="grad_weight", filter=(3, 3))
    tiles = [parse_tiles(k.tiles) for k in candidates_for(dw, hopper) if k.tiles]
    # a 3x3 keeps every tap in a thread (TAP_ROWS 1): one warp for 32 channels, one or two for 64
    assert {(t.block_n, t.warps) for t in tiles} == {(32, 1), (64, 1), (64, 2)}
    assert set(tiles) < set(DEPTHWISE_TILES["grad_weight"])
    # a 7x7 spreads its 7 tap rows (8 with padding) over threads: 256 or 512 elements, 4 to 16 warps
    tiles = [parse_tiles(k.tiles) for k in candidates_for(dw.with_(filter=(7, 7), pad_lo=(3, 3), pad_hi=(3, 3)), hopper)
             if k.tiles]
    assert {(t.block_n, t.warps) for t in tiles} == {(32, 4), (32, 8), (64, 8), (64, 16)}
    dgrad = candidates_for(dw.with_(op="grad_input"), hopper)
    assert [parse_tiles(k.tiles) for k in dgrad if k.tiles] == list(DEPTHWISE_TILES["grad_input"])
