"""The compile cache: keys, hits, damaged entries, atomic writes and concurrent writers.

A hit is proven by `cache.stats.compiles` not moving.  Every test gets its own cache folder through
CONVDSL_CACHE_DIR and fresh counters; the functional API's in-memory cache is cleared too, so that a
kernel compiled by another test cannot stand in for a disk hit.
"""
from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import convdsl
from convdsl import api, cache, compiler, policy
from convdsl.backends.iree import LoadedModule
from convdsl.problem import ConvProblem, Epilogue
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")
P = ConvProblem(op="grad_weight", dims=1, groups=2, batch=1, in_channels=2, out_channels=3, input=(6,), filter=(3,),
                stride=(1,), dilation=(1,), pad_lo=(1,), pad_hi=(1,))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "cache"
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(folder))
    cache.stats.reset()
    api.clear_memory_cache()
    yield folder
    api.clear_memory_cache()


def files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def run_ok(p: ConvProblem, vmfb: bytes) -> float:
    """Load `vmfb`, run `p` on random inputs and return the error against the reference."""
    inputs = random_inputs(p)
    got = LoadedModule(vmfb, CPU).call(p.name, *inputs, out_dtype=p.result_dtype)
    return relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))


# --- keys -------------------------------------------------------------------------------------------
def test_cache_dir_default_and_env(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    assert cache.cache_dir() == cache_dir
    monkeypatch.delenv("CONVDSL_CACHE_DIR")
    assert cache.cache_dir() == Path.home() / ".cache" / "convdsl"


def test_key_is_stable_and_hex() -> None:
    key = compiler.cache_key([P], CPU)
    assert key == compiler.cache_key([P.with_()], Target("cpu", "host"))
    assert len(key) == 64 and int(key, 16) >= 0


@pytest.mark.parametrize(
    "problems, target",
    [
        ([P.with_(stride=(2,))], CPU),
        ([P.with_(dtype="f16")], CPU),
        ([P.with_(out_dtype="f32", dtype="bf16")], CPU),
        ([P.with_(layout="GNHWC")], CPU),
        ([P.with_(pad_hi=(0,))], CPU),
        ([P.with_(split_k=2)], CPU),
        ([P.with_(epilogue=Epilogue("scale", 0.5))], CPU),
        ([P.with_(epilogue=Epilogue("scale", 0.25))], CPU),
        ([P.with_(name="dw")], CPU),  # the name is the module's function name
        ([P, P.with_(name="other")], CPU),
        ([P], Target("cuda", "sm_80")),
        ([P], Target("rocm", "gfx942")),
    ],
)
def test_key_changes_with_problem_and_target(problems: list[ConvProblem], target: Target) -> None:
    assert compiler.cache_key(problems, target) != compiler.cache_key([P], CPU)


def test_key_changes_with_arch_string() -> None:
    assert compiler.cache_key([P], Target("cuda", "sm_80")) != compiler.cache_key([P], Target("cuda", "sm_89"))


def test_key_changes_with_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    before = compiler.cache_key([P], CPU)
    assert compiler.cache_key([P], CPU, ["--iree-opt-level=O3"]) != before
    # The flags come from Target.compile_flags(), not from a table of backends in the cache.
    flags = CPU.compile_flags()
    monkeypatch.setattr(Target, "compile_flags",
                        lambda self, data_tiling=True: [*flags, "--iree-llvmcpu-enable-ukernels=all"])
    assert compiler.cache_key([P], CPU) != before


def test_key_changes_with_the_data_tiling_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    before = compiler.cache_key([P], CPU)
    monkeypatch.setattr(compiler.policy, "cpu_data_tiling",
                        lambda problems, target, choice=policy.cpu_data_tiling: not choice(problems, target))
    assert compiler.cache_key([P], CPU) != before


def test_key_changes_with_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    before = compiler.cache_key([P], CPU)
    with monkeypatch.context() as m:
        m.setattr(convdsl, "__version__", "99.0.0")
        assert compiler.cache_key([P], CPU) != before
    with monkeypatch.context() as m:
        m.setattr(compiler, "iree_version", lambda: "0.0.0-other")
        assert compiler.cache_key([P], CPU) != before
    with monkeypatch.context() as m:
        m.setattr(compiler, "source_digest", lambda: "edited")
        assert compiler.cache_key([P], CPU) != before
    assert compiler.cache_key([P], CPU) == before


# --- hits and misses ----------------------------------------------------------------------------
def test_hit_does_not_compile_again(cache_dir: Path) -> None:
    first = compiler.compile_vmfb([P], CPU)
    assert (cache.stats.compiles, cache.stats.hits, cache.stats.stores) == (1, 0, 1)
    second = compiler.compile_vmfb([P], CPU)
    assert (cache.stats.compiles, cache.stats.hits) == (1, 1)
    assert first == second
    assert files(cache_dir) == [cache.entry_path(compiler.cache_key([P], CPU))]
    assert run_ok(P, second) <= tolerance(P)


def test_functional_api_hits_disk_after_memory_is_cleared() -> None:
    inputs = random_inputs(P)
    first = convdsl.grad_weight(*inputs, filter=3, padding=1)
    assert cache.stats.compiles == 1
    api.clear_memory_cache()  # as in a new process: only the disk cache is left
    second = convdsl.grad_weight(*inputs, filter=3, padding=1)
    assert (cache.stats.compiles, cache.stats.hits) == (1, 1)
    np.testing.assert_array_equal(first, second)


def test_changed_parts_miss_and_compile(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    compiler.compile_vmfb([P], CPU)
    compiler.compile_vmfb([P.with_(stride=(2,))], CPU)
    assert cache.stats.compiles == 2
    compiler.compile_vmfb([P.with_(dtype="f16")], CPU)
    assert cache.stats.compiles == 3
    monkeypatch.setattr(convdsl, "__version__", "99.0.0")
    compiler.compile_vmfb([P], CPU)
    assert cache.stats.compiles == 4
    monkeypatch.setattr(compiler, "iree_version", lambda: "0.0.0-other")
    compiler.compile_vmfb([P], CPU)
    assert cache.stats.compiles == 5
    assert len(files(cache_dir)) == 5
    compiler.compile_vmfb([P], CPU)  # same versions as the last compile: a hit
    assert (cache.stats.compiles, cache.stats.hits) == (5, 1)


def test_functional_api_memory_cache_sees_version_change(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-memory cache is keyed like the disk: a new version in the same process compiles again.
    inputs = random_inputs(P)
    convdsl.grad_weight(*inputs, filter=3, padding=1)
    monkeypatch.setattr(compiler, "iree_version", lambda: "0.0.0-other")
    convdsl.grad_weight(*inputs, filter=3, padding=1)
    assert cache.stats.compiles == 2


# --- damaged entries ------------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a module\n" * 100)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _valid_checksum_bad_module(path: Path) -> None:
    # Written through store(), so the header and digest are right: only IREE's own check can catch it.
    cache.store(path.stem, b"PK\x03\x04 but not a vmfb" * 10)


@pytest.mark.parametrize("damage", [_truncate, _garbage, _empty, _flip_payload_byte, _valid_checksum_bad_module])
def test_damaged_entry_is_a_miss_and_is_rewritten(damage, cache_dir: Path) -> None:
    compiler.compile_vmfb([P], CPU)
    key = compiler.cache_key([P], CPU)
    path = cache.entry_path(key)
    damage(path)
    cache.stats.reset()
    vmfb = compiler.compile_vmfb([P], CPU)  # recompiles instead of failing
    assert (cache.stats.compiles, cache.stats.damaged, cache.stats.hits) == (1, 1, 0)
    assert cache.load(key) == vmfb  # rewritten with a good entry
    assert run_ok(P, vmfb) <= tolerance(P)
    # load() on its own: a damaged entry is a miss (None, not an exception) and is deleted.
    damage(path)
    assert cache.load(key) is None
    assert not path.exists()


def test_functional_api_recovers_from_damaged_entry(cache_dir: Path) -> None:
    inputs = random_inputs(P)
    want = convdsl.grad_weight(*inputs, filter=3, padding=1)
    _garbage(cache.entry_path(compiler.cache_key([P], CPU)))
    api.clear_memory_cache()
    got = convdsl.grad_weight(*inputs, filter=3, padding=1)
    assert cache.stats.compiles == 2 and cache.stats.damaged == 1
    np.testing.assert_array_equal(got, want)


# --- atomic writes ----------------------------------------------------------------------------------
def test_store_leaves_no_temporary_files(cache_dir: Path) -> None:
    for i in range(3):
        cache.store(f"{i:02d}" + "a" * 62, b"x" * 1000)
    names = [p.name for p in files(cache_dir)]
    assert len(names) == 3
    assert all(n.endswith(".vmfb") and not n.startswith(".") for n in names)


def test_failed_write_cleans_up_and_only_warns(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", broken_replace)
    with pytest.warns(RuntimeWarning, match="could not write"):
        vmfb = compiler.compile_vmfb([P], CPU)
    assert vmfb and cache.stats.compiles == 1
    assert files(cache_dir) == []  # neither an entry nor a stray temporary file


def test_unwritable_cache_dir_still_compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(blocker))  # a file where the folder should be
    with pytest.warns(RuntimeWarning):
        vmfb = compiler.compile_vmfb([P], CPU)
    assert run_ok(P, vmfb) <= tolerance(P)


def test_clear_removes_entries(cache_dir: Path) -> None:
    compiler.compile_vmfb([P], CPU)
    assert cache.clear() == 1
    assert files(cache_dir) == []
    compiler.compile_vmfb([P], CPU)
    assert cache.stats.compiles == 2


# --- two processes ----------------------------------------------------------------------------------
def _compile_in_child(barrier, results) -> None:
    # Runs in a spawned process: CONVDSL_CACHE_DIR comes from the parent's environment.
    try:
        barrier.wait(timeout=60)  # start compiling together, so that the writes overlap
        vmfb = compiler.compile_vmfb([P], CPU)
        results.put(("ok", cache.stats.compiles, cache.stats.hits, run_ok(P, vmfb)))
    except BaseException as err:  # report any failure to the parent instead of dying silently
        results.put(("error", repr(err), 0, 0.0))


def test_two_processes_compile_the_same_kernel(cache_dir: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    for status, compiles, hits, err in outcomes:
        assert status == "ok", compiles
        assert compiles + hits == 1  # each either compiled or found the other's entry
        assert err <= tolerance(P)
    names = [p.name for p in files(cache_dir)]
    assert names == [compiler.cache_key([P], CPU) + ".vmfb"]  # one entry, no temporary files left
    vmfb = cache.load(compiler.cache_key([P], CPU))
    assert vmfb is not None and run_ok(P, vmfb) <= tolerance(P)
