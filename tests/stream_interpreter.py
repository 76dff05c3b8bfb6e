"""Run convdsl's stream kernels (convdsl/stream.py, convdsl/torch/stream.py) in Triton's interpreter on the CPU
and print their relative errors against the float64 reference.

Used by tests/test_stream.py in a subprocess: TRITON_INTERPRET must be set before triton is imported.
stdin: a JSON list of {"spec", "tiles", "wide" (optional)}; stdout: a JSON list of {"name", "error", "unwritten", "repeat_equal"}.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from convdsl import policy, stream  # noqa: E402
from convdsl.kernels import elementwise, igemm  # noqa: E402
from convdsl.kernels.compile import ELEMENTWISE_KERNELS  # noqa: E402
from convdsl.problem import problem_from_spec  # noqa: E402
from convdsl.reference import random_inputs, reference, relative_error  # noqa: E402
from convdsl.targets import Target  # noqa: E402
from convdsl.torch.stream import StreamRunner  # noqa: E402
from convdsl.tuning.knobs import Knobs  # noqa: E402

HOPPER = Target("cuda", "sm_90")
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def interpreted(sl: stream.StreamLaunch, wide: bool = False):
    """wide: the launch's 64-bit offset form, which only tensors of 2^30 elements and more get on their own."""
    module = elementwise if sl.launch.kernel in ELEMENTWISE_KERNELS else igemm
    fn, grid, constants = getattr(module, sl.launch.kernel), sl.launch.grid, dict(sl.launch.constants)
    constants["WIDE"] = constants["WIDE"] or wide

    def launch(_stream: int, *tensors: torch.Tensor) -> None:
        tensors[-1].fill_(float("nan"))  # every element must be written
        if module is elementwise:
            fn[grid](*tensors, **constants)
            return
        # the interpreter runs the GEMM cores on f32 tensors (16-bit values are exact in f32), as
        # tests/kernel_interpreter.py does; the result is cast back into the runner's buffer
        wide = [t.float() for t in tensors]
        fn[grid](*wide, **constants)
        tensors[-1].copy_(wide[-1])
    return launch


def run(job: dict) -> dict:
    p = problem_from_spec(job["spec"])
    knobs = Knobs(tiles=job["tiles"]) if job.get("tiles") else Knobs()
    # a few-channel strided forward's launches are those of its space-to-depth form
    ext = policy.extern_launches(policy.space_to_depth_forward(p) or p, HOPPER, knobs)
    # the launches and steps stream_kernel builds, without compiling them (the interpreter runs the source)
    kernel = stream.planned_stream_kernel(p, HOPPER, knobs, tma=False)
    split = dict(kernel.launches[0].launch.constants).get("SPLIT", 1) > 1  # the stream's own split-K launch
    assert ext is not None and (split or kernel.launches[0].launch == ext.launches[0])
    runner = StreamRunner(kernel, torch.device("cpu"), launcher=lambda sl: interpreted(sl, job.get("wide", False)))
    args = random_inputs(p, seed=5)
    tensors = [torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(TORCH[d])
               for a, d in zip(args, p.arg_dtypes)]
    got = runner(*tensors)
    again = runner(*tensors)
    if runner.direct:  # the fast path writes the same result through the tensors' memory as it lies
        into = runner.run_into(tensors[0], tensors[1], torch.empty(p.result_shape, dtype=got.dtype))
        again = again if torch.equal(into, got) else into
    want = reference(p, *args)
    g = got.to(torch.float64).numpy()
    return {"name": p.name, "error": relative_error(g, want), "unwritten": int(np.isnan(g).sum()),
            "repeat_equal": bool(torch.equal(got, again)), "shape_ok": tuple(got.shape) == tuple(p.result_shape)}


if __name__ == "__main__":
    print(json.dumps([run(job) for job in json.loads(sys.stdin.read())]))
