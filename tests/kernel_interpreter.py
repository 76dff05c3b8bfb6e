"""Run convdsl's Triton kernels in Triton's interpreter (on the CPU) and print their relative errors.

Used by tests/test_extern.py in a subprocess: TRITON_INTERPRET must be set before triton is imported, and
the other tests import the compiled form.  stdin: a JSON list of problem specs; stdout: a JSON list of
{"name", "error", "unwritten"} (unwritten: output elements the launches never stored, filled with NaN first).
The tensors are f32 (16-bit values are exact in f32) unless a job asks for `native` storage: the problem's
own dtypes, so that 16-bit loads and the store's cast run too (Triton 3.9's interpreter multiplies bf16
operands of tl.dot wrongly: native bf16 is for the kernels without a dot).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from convdsl.kernels import igemm  # noqa: E402
from convdsl.policy import plan_launches  # noqa: E402
from convdsl.targets import Target  # noqa: E402
from convdsl.kernels.tiles import parse_tiles  # noqa: E402
from convdsl.passes.ir import activation_axes  # noqa: E402
from convdsl.problem import problem_from_spec  # noqa: E402
from convdsl.reference import random_inputs, reference, relative_error  # noqa: E402


# the chip whose facts size the grids (split-K and depthwise chunks)
HOPPER = Target("cuda", "sm_90")
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def run(spec: dict, tiles: str, x_layout: str | None = None, native: bool = False, wide: bool = False) -> dict:
    """x_layout: give the kernel X copied to that layout (policy.dy_read_in_place), as lowering does.
    native: tensors in the problem's dtypes (else f32).  wide: the launches' 64-bit offset form, which only
    tensors of 2^30 elements and more get on their own (launch.needs_wide)."""
    p = problem_from_spec(spec)
    args = random_inputs(p, seed=3)
    want = reference(p, *args)
    if x_layout:
        src, dst = activation_axes(p, "ch"), activation_axes(p.with_(layout=x_layout), "ch")
        args = [np.transpose(args[0], [src.index(a) for a in dst]), *args[1:]]
    tensors = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in args]
    if native:
        tensors = [t.to(TORCH[d]) for t, d in zip(tensors, p.arg_dtypes)]
    _, launches, partials_shape = plan_launches(p, parse_tiles(tiles) if tiles else None, HOPPER, x_layout)
    if wide:
        launches = [replace(la, constants=tuple((k, True if k == "WIDE" else v) for k, v in la.constants))
                    for la in launches]
    if p.op == "grad_weight":
        partials = torch.full(partials_shape, float("nan"))
        launch = launches[0]
        getattr(igemm, launch.kernel)[launch.grid](tensors[0], tensors[1], partials, **dict(launch.constants))
        # the linalg sum of the real kernel: chunks in order, then [G, K, taps(3D), C] in the weight layout
        total = partials.sum(0).reshape(p.groups, p.out_channels, *p.filter, p.in_channels).numpy()
        got = total if p.weight_layout == "GKYXC" else np.moveaxis(total, -1, 2)
    else:
        out = torch.full(p.result_shape, float("nan"), dtype=TORCH[p.result_dtype] if native else torch.float32)
        for launch in launches:
            getattr(igemm, launch.kernel)[launch.grid](tensors[0], tensors[1], out, **dict(launch.constants))
        got = out.float().numpy()
    unwritten = int(np.isnan(got).sum())
    return {"name": p.name, "error": relative_error(np.nan_to_num(got), want), "unwritten": unwritten}


def main() -> None:
    jobs = json.load(sys.stdin)
    json.dump([run(job["spec"], job["tiles"], job.get("x_layout"), job.get("native", False), job.get("wide", False))
               for job in jobs], sys.stdout)


if __name__ == "__main__":
    main()
