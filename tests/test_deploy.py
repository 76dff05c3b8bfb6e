"""A .vmfb from `convdsl compile` runs without convdsl: through iree-run-module and plain iree.runtime."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convdsl.cli import main
from convdsl.problem import problem_from_spec
from convdsl.reference import random_inputs, reference, relative_error, tolerance

SOURCE = """
conv c { dims = 2; groups = 2; batch = 2; in_channels = 3; out_channels = 5; input = [9, 8]; filter = [3, 3]
         stride = 2; padding = [[1, 0], [1, 1]]; layout = NHWGC; dtype = f32 }
kernel dgrad = grad_input(c)
kernel wgrad = grad_weight(c) { split_k = 2 }
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deploy")
    src = folder / "c.conv"
    src.write_text(SOURCE)
    assert main(["compile", str(src), "--target", "cpu", "-o", str(folder / "c.vmfb")]) == 0
    return folder / "c.vmfb"


def _iree_run_module() -> str:
    exe = shutil.which("iree-run-module") or str(Path(sys.executable).parent / "iree-run-module")
    assert Path(exe).exists(), "iree-run-module (from iree-base-runtime) is not installed"
    return exe


def test_iree_run_module_runs_the_artifact(artifact: Path):
    info = json.loads(artifact.with_suffix(".json").read_text())
    for kernel in info["kernels"]:
        p = problem_from_spec(kernel["spec"])
        inputs = random_inputs(p, seed=11)
        args = [_iree_run_module(), f"--module={artifact}", f"--function={kernel['function']}", "--device=local-task"]
        for i, a in enumerate(inputs):
            np.save(artifact.parent / f"in{i}.npy", a)
            args.append(f"--input=@{artifact.parent / f'in{i}.npy'}")
        out = artifact.parent / "out.npy"
        args.append(f"--output=@{out}")
        # a fresh process with no convdsl on its path: only the IREE tool and the files
        subprocess.run(args, check=True, capture_output=True, text=True, cwd=artifact.parent)
        got = np.load(out)
        assert list(got.shape) == kernel["result"]["shape"]
        assert relative_error(got.astype(np.float64), reference(p, *inputs)) <= tolerance(p)


def test_plain_iree_runtime_loads_the_artifact(artifact: Path, tmp_path: Path):
    info = json.loads(artifact.with_suffix(".json").read_text())
    kernel = info["kernels"][0]
    p = problem_from_spec(kernel["spec"])
    inputs = random_inputs(p, seed=12)
    for i, a in enumerate(inputs):
        np.save(tmp_path / f"in{i}.npy", a)
    script = f"""
import numpy as np, iree.runtime as rt
config = rt.Config("local-task")
ctx = rt.SystemContext(config=config)
ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, {str(artifact)!r}))
args = [np.load({str(tmp_path)!r} + f"/in{{i}}.npy") for i in range({len(inputs)})]
np.save({str(tmp_path / 'out.npy')!r}, ctx.modules.module[{kernel['function']!r}](*args).to_host())
"""
    # -I: isolated mode, so the repository (and convdsl) is not importable in that process
    subprocess.run([sys.executable, "-I", "-c", script], check=True, cwd=tmp_path)
    got = np.load(tmp_path / "out.npy")
    assert relative_error(got.astype(np.float64), reference(p, *inputs)) <= tolerance(p)
