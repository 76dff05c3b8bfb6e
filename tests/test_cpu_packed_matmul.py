"""The workgroup tiles of data-tiled CPU matmuls (policy.cpu_packed_matmul_distribution, backends/iree_cpu_config.py):
the rule, the edit of IREE's configured executables, and whole kernels compiled through it against the float64
reference, including the fallback to IREE's own tiles when the edited compile fails."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from convdsl import policy
from convdsl.backends import iree as _iree
from convdsl.backends.iree import LoadedModule, compile_mlir
from convdsl.backends.iree_cpu_config import packed_matmul, PACKED_MATMUL, with_distribution
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.reference import random_inputs, reference, relative_error, tolerance
from convdsl.targets import Target

CPU = Target("cpu", "host")
MIB = 1024 * 1024

CONFIGURED = """
  %12 = linalg.mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 1, 0, 0, 0, 0], \
vector_common_parallel = [1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 1, 0, 0, 1]>} \
ins(%8, %9 : tensor<8x12544x8x1xf32>, tensor<72x12544x8x1xf32>) outs(%11 : tensor<8x72x8x8xf32>) -> tensor<8x72x8x8xf32>
  %13 = linalg.batch_mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [1, 1, 1, 0, 0, 0, 0], \
vector_common_parallel = [1, 1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 0, 1, 0, 0, 1]>} \
ins(%3, %4 : tensor<32x24x3136x8x1xf32>, tensor<32x216x3136x8x1xf32>) outs(%5 : tensor<32x24x216x8x8xf32>) -> ...
  %14 = linalg.mmt4d {lowering_config = #iree_cpu.lowering_config<distribution = [14, 8, 0, 0, 0, 0], \
vector_common_parallel = [1, 1, 0, 8, 8, 0], vector_reduction = [0, 0, 1, 0, 0, 1]>} \
ins(%6, %7 : tensor<98x256x8x1xf32>, tensor<128x256x8x1xf32>) outs(%8 : tensor<98x128x8x8xf32>) -> ...
"""


# --- the rule -----------------------------------------------------------------------------------------------

def test_long_reductions_take_every_row_tile_that_fits_and_one_column_tile():
    # ResNet's 3x3 grad_weight at batch 4: 8 row tiles of 12544 x 8 f32 (392 KiB each), 72 column tiles
    assert policy.cpu_packed_matmul_distribution(1, 8, 72, 12544 * 8 * 4) == (8, 1)
    # CK 11's grouped one: 24 row tiles of 98 KiB per group, all of them (2.4 MiB)
    assert policy.cpu_packed_matmul_distribution(32, 24, 216, 3136 * 32) == (24, 1)


def test_row_tiles_are_bounded_by_the_workgroup_budget():
    panel = 6396 * 32  # wav2vec2's grad_weight: 64 row tiles of 200 KiB; 16 of them fit 4 MiB, 32 do not
    rows, columns = policy.cpu_packed_matmul_distribution(1, 64, 192, panel)
    assert (rows, columns) == (16, 1)
    assert rows * panel <= policy.CPU_WORKGROUP_ROW_BYTES < 2 * rows * panel


def test_row_tiles_divide_and_leave_enough_workgroups():
    # 12 row tiles x 16 column tiles: 4 row tiles a workgroup would leave 48 workgroups, 3 leave 64
    assert policy.cpu_packed_matmul_distribution(1, 12, 16, 64 * 1024) == (3, 1)
    # 10 row tiles: 3 does not divide them, 2 leaves 80
    assert policy.cpu_packed_matmul_distribution(1, 10, 16, 64 * 1024) == (2, 1)


def test_short_reductions_and_too_few_workgroups_keep_irees_tiles():
    assert policy.cpu_packed_matmul_distribution(1, 98, 128, 256 * 32) is None  # a 1x1's 256-value reduction
    assert policy.cpu_packed_matmul_distribution(1, 4, 8, MIB) is None  # 32 tiles in all: below 64 workgroups


# --- the edit -----------------------------------------------------------------------------------------------

def test_packed_matmuls_are_read_from_the_configured_executables():
    found = [packed_matmul(m) for m in PACKED_MATMUL.finditer(CONFIGURED)]
    assert [(f.batch, f.row_tiles, f.column_tiles, f.row_panel_bytes, f.distribution) for f in found] == [
        (1, 8, 72, 12544 * 8 * 4, (1, 1, 0, 0, 0, 0)),
        (32, 24, 216, 3136 * 8 * 4, (1, 1, 1, 0, 0, 0, 0)),
        (1, 98, 128, 256 * 8 * 4, (14, 8, 0, 0, 0, 0)),
    ]


def test_the_rule_sets_each_distribution_and_leaves_the_rest_of_the_config():
    edited, changes = with_distribution(CONFIGURED, policy.cpu_packed_matmul_distribution)
    assert [new for _, new in changes] == [(8, 1, 0, 0, 0, 0), (1, 24, 1, 0, 0, 0, 0)]
    assert "distribution = [8, 1, 0, 0, 0, 0], vector_common_parallel = [1, 1, 0, 8, 8, 0]" in edited
    assert "distribution = [1, 24, 1, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 0, 8, 8, 0]" in edited
    assert "distribution = [14, 8, 0, 0, 0, 0]" in edited  # short reduction: IREE's own
    assert edited.replace("[8, 1, 0", "[1, 1, 0").replace("[1, 24, 1", "[1, 1, 1") == CONFIGURED


def test_a_rule_that_keeps_everything_changes_nothing():
    edited, changes = with_distribution(CONFIGURED, lambda *shape: None)
    assert edited == CONFIGURED and changes == []


# --- whole kernels --------------------------------------------------------------------------------------------

def long_wgrad() -> ConvProblem:
    # 2 x 32 x 32 = 2048 positions, 32 x (9 x 128) weights: 4 x 144 tiles of 8 x 8 (AVX2), 2 x 72 of 16 x 16 (AVX-512)
    return ConvProblem(op="grad_weight", dims=2, groups=1, batch=2, in_channels=128, out_channels=32, input=(32, 32),
                       filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), layout="NHWGC",
                       weight_layout="GKYXC", dtype="f32", name="k")


def run(p: ConvProblem, vmfb: bytes) -> float:
    inputs = random_inputs(p, seed=3)
    got = LoadedModule(vmfb, CPU).call(p.name, *inputs, out_dtype=p.result_dtype)
    return relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs))


def two_row_tiles_a_workgroup(batch: int, rows: int, columns: int, panel: int) -> tuple[int, int]:
    # unlike IREE's own choice for long_wgrad, which depends on the host: all row tiles by one column tile (AVX2, and
    # AVX-512 on some hosts) or one tile a workgroup (AVX-512 on others)
    return (2, 1)


def test_a_kernel_compiled_with_a_rule_takes_its_tiles_and_is_right(caplog):
    p = long_wgrad()
    with caplog.at_level(logging.DEBUG, logger="convdsl.iree"):
        vmfb = compile_mlir(lower_to_mlir([p], CPU), CPU, packed_matmul_tiles=two_row_tiles_a_workgroup)
    assert any(re.search(r"-> \[2, 1, 0, 0, 0, 0\]$", r.getMessage()) for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert run(p, vmfb) <= tolerance(p)


def test_an_edit_iree_rejects_falls_back_to_its_own_tiles(monkeypatch, caplog):
    import subprocess

    import iree.compiler as ireec
    from iree.compiler.tools import CompilerToolError

    real = ireec.compile_str
    phases = []

    def compile_str(mlir, extra_args):
        phases.append(next((a for a in extra_args if a.startswith("--compile-")), "whole"))
        if "--compile-from=executable-configurations" in extra_args:
            raise CompilerToolError(subprocess.CompletedProcess(["iree-compile"], 1, b"", b"error: rejected"))
        return real(mlir, extra_args=extra_args)

    monkeypatch.setattr(ireec, "compile_str", compile_str)
    p = long_wgrad()
    with caplog.at_level(logging.WARNING, logger="convdsl.iree"):
        vmfb = compile_mlir(lower_to_mlir([p], CPU), CPU, packed_matmul_tiles=two_row_tiles_a_workgroup)
    assert phases == ["--compile-to=executable-configurations", "--compile-from=executable-configurations", "whole"]
    assert any("workgroup tiles" in r.getMessage() for r in caplog.records)
    assert run(p, vmfb) <= tolerance(p)


@pytest.fixture
def rules_passed(monkeypatch, tmp_path) -> list:
    """The packed_matmul_tiles rule of each compile_mlir call convdsl.compile makes (in an empty cache)."""
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path))
    seen: list = []
    real = _iree.compile_mlir

    def spy(*args, **kwargs):
        seen.append(kwargs.get("packed_matmul_tiles"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_iree, "compile_mlir", spy)
    return seen


@pytest.mark.parametrize("groups", [1, 4])
def test_the_compile_driver_passes_the_rule_for_matmul_kernels(groups, rules_passed):
    import convdsl

    p = long_wgrad().with_(groups=groups, in_channels=128 // groups, out_channels=32 // groups * 2)
    module = convdsl.compile([p], target=CPU)
    assert rules_passed == [policy.cpu_packed_matmul_distribution]
    inputs = random_inputs(p, seed=4)
    got = module.loaded.call(p.name, *inputs, out_dtype=p.result_dtype)
    assert relative_error(np.asarray(got, dtype=np.float64), reference(p, *inputs)) <= tolerance(p)


def test_kernels_without_a_matmul_compile_in_one_phase(rules_passed):
    import convdsl

    depthwise = long_wgrad().with_(op="grad_input", groups=16, in_channels=1, out_channels=1)
    assert not policy.cpu_im2col(depthwise, CPU)
    convdsl.compile([depthwise], target=CPU)
    assert rules_passed == [None]
