"""On a CUDA device: run artifacts compiled here (tests/gpu/build_artifacts.sh) and check them.

The GPU machine has iree-runtime, NumPy and ml_dtypes but no iree-compile, so the modules are
compiled on the CPU machine with their manifests; this test loads each one, runs every kernel on
fresh random inputs and compares with the float64 reference.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from convdsl.problem import problem_from_spec
from convdsl.reference import random_inputs, reference, relative_error, tolerance

ARTIFACTS = Path(os.environ.get("CONVDSL_GPU_ARTIFACTS", Path(__file__).parent.parent / "build" / "gpu"))
MANIFESTS = sorted(ARTIFACTS.glob("*.json"))


@pytest.mark.gpu
def test_artifacts_exist():
    assert MANIFESTS, f"no artifacts in {ARTIFACTS}: run tests/gpu/build_artifacts.sh where iree-compile is"


@pytest.mark.gpu
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
def test_artifact_kernels_match_reference(manifest: Path):
    from convdsl.backends.iree import LoadedModule
    from convdsl.targets import Target

    info = json.loads(manifest.read_text())
    module = LoadedModule(manifest.with_suffix(".vmfb").read_bytes(), Target(info["target"], info["arch"]))
    failures = []
    for kernel in info["kernels"]:
        p = problem_from_spec(kernel["spec"])
        # the plain function twice, on other inputs the second time: a module may keep its transients between calls
        first = random_inputs(p, seed=8)
        got = module.call(p.name, *first, out_dtype=p.result_dtype)
        err_first = relative_error(np.asarray(got, dtype=np.float64), reference(p, *first))
        if not err_first <= tolerance(p):
            failures.append(f"{p.name} (first call): {err_first:.3e}")
        inputs = random_inputs(p, seed=7)
        want = reference(p, *inputs)
        got = module.call(p.name, *inputs, out_dtype=p.result_dtype)
        err = relative_error(np.asarray(got, dtype=np.float64), want)
        # the destination-passing twin (convdsl/abi.py), as frameworks and the benchmarks call it
        device_inputs = [module.upload(a) for a in inputs]
        into = module.into_call(kernel["function"], device_inputs, p.result_shape,
                                p.result_dtype)
        into.call(into.pack([a._buffer_view for a in device_inputs]))
        err_into = relative_error(np.asarray(module.download_view(into.out, p.result_dtype), dtype=np.float64), want)
        print(f"{manifest.stem}.{p.name}: rel.err {err:.2e}, into {err_into:.2e} (tol {tolerance(p):.0e})")
        if not err <= tolerance(p):
            failures.append(f"{p.name}: {err:.3e}")
        if not err_into <= tolerance(p):
            failures.append(f"{p.name} (into): {err_into:.3e}")
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("stem", ["resnext", "unet3d_level", "ck15_conv3d_bwd_data"])
def test_torch_tensors_run_without_copies(stem: str):
    """convdsl.interop.torch_call on CUDA tensors (f16, bf16, f32): the same bits as the usual call."""
    import torch

    from convdsl.module import CompiledModule
    from convdsl.interop import torch_call
    from convdsl.targets import Target

    manifest = ARTIFACTS / f"{stem}.json"
    info = json.loads(manifest.read_text())
    problems = [problem_from_spec(k["spec"]) for k in info["kernels"]]
    module = CompiledModule(problems, Target(info["target"], info["arch"]), manifest.with_suffix(".vmfb").read_bytes())
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    for p in problems:
        inputs = random_inputs(p, seed=11)
        tensors = [torch.from_numpy(np.asarray(a, dtype=np.float32)).to("cuda", dtypes[d])
                   for a, d in zip(inputs, p.arg_dtypes)]
        got = torch_call(module, p.name, *tensors)
        want = np.asarray(module[p.name](*inputs), dtype=np.float32)
        assert got.dtype == dtypes[p.result_dtype] and got.is_cuda
        assert torch.equal(got.float().cpu(), torch.from_numpy(want)), p.name
        print(f"{stem}.{p.name}: torch_call matches the usual call")
