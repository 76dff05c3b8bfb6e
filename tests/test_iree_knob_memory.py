"""IREE knobs fit the target's workgroup memory (gfx942: 64 KB), CUDA's fitting knobs are kept as asked, and a
kernel whose edited configuration IREE rejects is reported, not silently compiled with IREE's own."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from convdsl import compiler
from convdsl.backends import iree as _iree
from convdsl.backends.iree import compile_mlir
from convdsl.backends.iree_config import (apply_knobs, compile_with_knobs, compile_with_knobs_reported, fit_knobs,
                                          workgroup_memory_bytes)
from convdsl.cli import main
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.targets import Target
from convdsl.tuning import Knobs

ROCM = Target("rocm", "gfx942")
HOPPER = Target("cuda", "sm_90")
# a small f16 grad_input on IREE's lowering (extern=False): its contraction's default tile on gfx942 is
# 128 rows x 64 columns over 128 reduction elements, 48 KB of f16 tiles
DGRAD = ConvProblem(
    op="grad_input", dims=2, groups=1, batch=1, in_channels=128, out_channels=128, input=(16, 16), filter=(3, 3),
    stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16", name="dgrad",
)
LINALG = Knobs(extern=False)


def _configs(problem: ConvProblem, target: Target, folder: Path) -> list[str]:
    """IREE's own configurations of the kernel's contraction dispatches."""
    compile_mlir(lower_to_mlir([problem], target, knobs={problem.name: LINALG}), target,
                 ["--compile-to=executable-configurations", f"--iree-hal-dump-executable-configurations-to={folder}"])
    return [t for t in (p.read_text() for p in sorted(folder.glob("*.mlir"))) if "mma_kind" in t]


def _tile_bytes(config: str) -> int:
    """The f16 A + B tiles of an edited config, computed here from its lists (rows x K + K x columns)."""
    lists = {k: [int(v) for v in re.search(rf"\b{k} = \[([0-9, ]*)\]", config).group(1).split(",")]
             for k in ("workgroup", "subgroup", "reduction")}
    tiled = [i for i, (w, s) in enumerate(zip(lists["workgroup"], lists["subgroup"])) if w and s]
    rows = 1
    for i in tiled[:-1]:
        rows *= lists["workgroup"][i]
    k_units = [r for r in lists["reduction"] if r]
    intrinsic_k = int(re.search(r"_\d+x\d+x(\d+)_", config).group(1))
    depth = k_units[-1] * intrinsic_k
    for r in k_units[:-1]:
        depth *= r
    return (rows + lists["workgroup"][tiled[-1]]) * depth * 2


@pytest.fixture(scope="module")
def rocm_config(tmp_path_factory) -> str:
    (config,) = _configs(DGRAD, ROCM, tmp_path_factory.mktemp("rocm"))
    return config


def test_gpu_facts_agree_with_iree_target_descriptions(rocm_config, tmp_path):
    # IREE rejects a kernel over its target's max_workgroup_memory_bytes: the facts must be the same limit
    assert f"max_workgroup_memory_bytes = {ROCM.gpu.workgroup_memory}" in rocm_config
    assert f"subgroup_size = {ROCM.gpu.subgroup_size}" in rocm_config
    (cuda,) = _configs(DGRAD, HOPPER, tmp_path)
    assert f"max_workgroup_memory_bytes = {HOPPER.gpu.workgroup_memory}" in cuda
    assert f"subgroup_size = {HOPPER.gpu.subgroup_size}" in cuda


def test_memory_model_reads_the_config(rocm_config):
    assert workgroup_memory_bytes(rocm_config) == _tile_bytes(rocm_config) == (128 + 64) * 128 * 2
    # n4-m2 (the rules' choice for large grad_input GEMMs): 256 columns over 128 channels, so IREE clamps B to 128
    # columns and stages the 256 x 128 f32 accumulator: 64 + 32 + 128 KB, the 229,376 bytes iree-compile reports
    assert workgroup_memory_bytes(rocm_config, Knobs(n_scale=4, m_scale=2)) == 229376


@pytest.mark.parametrize("asked, fitted", [
    (Knobs(n_scale=4, m_scale=2), Knobs(n_scale=2)),               # 128 KB -> 128 x 128 tiles, 64 KB
    (Knobs(n_scale=2, m_scale=2, prefetch=3), Knobs(n_scale=2, prefetch=3)),
    (Knobs(m_scale=2), Knobs()),                                    # 80 KB: nothing below m2 but IREE's own
    (Knobs(n_scale=2, pad="gather"), Knobs(n_scale=2, pad="gather")),  # fits: as asked
])
def test_rocm_knobs_scale_less_to_fit(rocm_config, asked, fitted):
    assert fit_knobs(rocm_config, asked, ROCM.gpu.workgroup_memory) == fitted
    edited = apply_knobs(rocm_config, asked, ROCM.gpu.workgroup_memory)
    assert _tile_bytes(edited) <= 65536
    assert edited == apply_knobs(rocm_config, fitted)


def test_rocm_compile_applies_the_fitting_configuration(caplog):
    mlir = lower_to_mlir([DGRAD], ROCM, knobs={"dgrad": LINALG})
    with caplog.at_level(logging.INFO, logger="convdsl.iree_config"):
        # strict: the fitted configuration itself must compile (no fallback can hide a wrong fit)
        vmfb, results = compile_with_knobs_reported(mlir, ROCM, {"dgrad": Knobs(n_scale=4, m_scale=2)}, strict=True)
    result = results["dgrad"]
    assert vmfb and result.default_kept is None and result.fitted
    (dispatch,) = result.dispatches
    assert dispatch.applied == Knobs(n_scale=2)
    assert dispatch.asked_memory_bytes == 229376 and dispatch.memory_bytes == 65536
    assert dispatch.workgroup[0] * dispatch.workgroup[1] == 128 and dispatch.workgroup[2] == 128  # rows, columns
    assert "scaled to n2" in result.describe() and "scaled to n2" in caplog.text
    assert vmfb != compile_mlir(mlir, ROCM)  # the edited configuration was substituted, not IREE's own


@pytest.mark.parametrize("knobs", [Knobs(n_scale=4, m_scale=2), Knobs(n_scale=2, m_scale=2, prefetch=3),
                                   Knobs(n_scale=2)])
@pytest.mark.parametrize("problem", [DGRAD, DGRAD.with_(in_channels=256, out_channels=64, stride=(2, 2)),
                                     DGRAD.with_(op="grad_weight", dtype="bf16")])
def test_cuda_sm90_knobs_unchanged(tmp_path, problem, knobs):
    for config in _configs(problem, HOPPER, tmp_path):
        assert fit_knobs(config, knobs, HOPPER.gpu.workgroup_memory) == knobs
        assert apply_knobs(config, knobs, HOPPER.gpu.workgroup_memory) == apply_knobs(config, knobs)


def _reject_edited(monkeypatch) -> None:
    real = _iree.compile_mlir

    def compile_mlir(mlir, target, flags=()):
        if any(f.startswith("--iree-hal-substitute-executable-configurations-from") for f in flags):
            raise _iree.CompileError("<stdin>:1:1: error: function 'dgrad_dispatch_1_conv_16x16x128x128x3x3_f16xf16xf32' "
                                     "uses 999999 bytes of shared memory; exceeded the limit of 65536 bytes")
        return real(mlir, target, flags)

    monkeypatch.setattr(_iree, "compile_mlir", compile_mlir)


def test_rejected_configuration_is_reported(monkeypatch, caplog):
    _reject_edited(monkeypatch)
    mlir = lower_to_mlir([DGRAD], ROCM, knobs={"dgrad": LINALG})
    with caplog.at_level(logging.WARNING, logger="convdsl.iree_config"):
        vmfb, results = compile_with_knobs_reported(mlir, ROCM, {"dgrad": Knobs(n_scale=2)})
    assert vmfb  # IREE's own configuration compiled
    assert "999999 bytes of shared memory" in results["dgrad"].default_kept
    assert "IREE's default configuration kept" in caplog.text and "dgrad" in caplog.text
    assert compile_with_knobs(mlir, ROCM, {"dgrad": Knobs(n_scale=2)})  # the bytes-only form still works
    with pytest.raises(_iree.CompileError):
        compile_with_knobs(mlir, ROCM, {"dgrad": Knobs(n_scale=2)}, strict=True)


def test_explain_and_manifest_say_which_kernels_kept_irees_configuration(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "k.conv"
    source.write_text("conv c { dims = 2; batch = 1; in_channels = 128; out_channels = 128; input = [16, 16]; "
                      "filter = [3, 3]; padding = 1; dtype = f16 }\nkernel dgrad = grad_input(c)\n")
    knobs = Knobs(n_scale=2)
    # the one lookup both `compile` and `explain` plan with
    monkeypatch.setattr("convdsl.passes.plan.lookup_knobs", lambda p, target: (knobs, "test"))
    assert main(["explain", str(source), "--target", "rocm", "--stage", "plan"]) == 0
    assert "not compiled into the cache yet" in capsys.readouterr().out
    _reject_edited(monkeypatch)
    module = compiler.compile(str(source), target="rocm")
    kept = module.manifest()["kernels"][0]["iree_config"]["default_kept"]
    assert "999999 bytes" in kept
    assert main(["explain", str(source), "--target", "rocm", "--stage", "plan"]) == 0
    out = capsys.readouterr().out
    assert "IREE's default configuration kept (knobs n2 not applied)" in out and "999999 bytes" in out
