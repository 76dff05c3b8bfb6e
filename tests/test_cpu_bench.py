"""benchmarks/cpu_bench.py in two steps: `build` compiles here, `run` loads and times without IREE's compiler."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "cpu_bench.py"
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

# `run` in a process where importing IREE's compiler or lark fails, as on a machine that has only NumPy,
# PyTorch and iree.runtime; afterwards no convdsl module that needs them (or ml_dtypes) was imported
RUN_WITHOUT_COMPILER = """
import runpy, sys
sys.modules["iree.compiler"] = None
sys.modules["lark"] = None
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as done:
    assert not done.code, done.code
imported = sorted(m for m in ("convdsl.reference", "convdsl.compiler", "convdsl.api", "convdsl.passes") if m in sys.modules)
assert not imported, imported
"""


def test_build_here_then_run_without_the_compiler(tmp_path):
    from benchmarks import cpu_bench

    build, results = tmp_path / "build", tmp_path / "results"
    assert cpu_bench.main(["build", str(build), "--arch", "host", "--cases", "mbv2_dw_dgrad", "--batch", "1"]) == 0
    built = json.loads((build / "cases.json").read_text())
    assert built["arch"] == "host" and "--iree-llvmcpu-target-cpu=host" in built["flags"]["mbv2_dw_dgrad"]
    assert built["versions"]["iree_compiler"] not in ("", "not installed")
    [entry] = built["cases"]
    assert entry["function"] == "mbv2_dw_dgrad" and entry["compile_s"] > 0
    assert (build / entry["vmfb"]).is_file() and (build / "mbv2_dw_dgrad.json").is_file()
    assert (build / built["peak"]["vmfb"]).is_file()

    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_COMPILER, str(BENCH), "run", str(build), "--out",
                           str(results), "--tag", "two-step", "--seconds", "0.01", "--most", "3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    [path] = results.glob("cpu-*-two-step.json")
    record = json.loads(path.read_text())
    for key in ("command", "date", "machine", "versions", "settings", "summary", "cases", "build", "matmul_peak"):
        assert key in record, key
    assert record["machine"]["cores"] > 0 and record["machine"]["cpu"]
    assert record["versions"]["iree_runtime"] not in ("", "not installed") and record["versions"]["torch"]
    assert record["settings"]["batch"] == 1 and record["settings"]["dtype"] == "f32"
    assert record["build"]["arch"] == "host" and record["build"]["versions"] == built["versions"]
    assert record["summary"]["mismatches"] == [] and record["summary"]["errors"] == []
    assert record["summary"]["geomean_ratio"] > 0
    [row] = record["cases"]
    assert row["name"] == "mbv2_dw_dgrad" and row["agrees"] and row["rel_err"] <= cpu_bench.TOLERANCE["f32"]
    assert row["compile_s"] == entry["compile_s"]  # the build machine's
    assert row["convdsl_s"] > 0 and row["torch_s"] == min(row["torch_contiguous_s"], row["torch_channels_last_s"])
    gflops = record["matmul_peak"]["gflops"]
    assert gflops > 0 and row["peak_share"] == pytest.approx(row["convdsl_gflops"] / gflops)
    assert "% of peak" in done.stdout and "matmul peak" in done.stdout


def test_run_refuses_a_case_that_was_not_built(tmp_path):
    from benchmarks import cpu_bench

    (tmp_path / "cases.json").write_text(json.dumps({"schema": cpu_bench.BUILD_SCHEMA, "arch": "host", "cases": []}))
    with pytest.raises(SystemExit):
        cpu_bench.main(["run", str(tmp_path), "--cases", "r50_1x1_dgrad"])
