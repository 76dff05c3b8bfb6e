"""Probe: convdsl's CPU forms against IREE's own lowerings of the same convolutions, on the CPU that runs this.

    python3 benchmarks/probes/cpu_iree_forms.py OUT.json [--batch 4] [--repeat 7]

The suite's stride-1 f32 grad_inputs (ResNet-50's 3x3, DeepLab's dilated 3x3, CK 15's 3D 3x3x3) are, as
policy.grad_input_as_forward says, forward convolutions of the zero-bordered dY with the flipped weight.  IREE
has a named op for those (linalg.conv_2d_nhwc_hwcf, conv_3d_ndhwc_dhwcf), built here with the MLIR Python
bindings over an already bordered dY and an already flipped HWCF weight (so IREE's forms are timed without that
preparation), and compiled for this CPU four ways: as is; with IREE's own im2col rewrite
(--iree-global-opt-use-im2col-for-convs); each with and without data tiling and the matmul microkernels.
convdsl's kernel is compiled by convdsl.compile for the same CPU.  Every module is called through iree.runtime's
allocating function on the same random inputs (median of --repeat after warm-up; convdsl's destination-passing
call too), and every result checked against the float64 reference.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

CASES = ("r50_3x3_s1_dgrad", "deeplab_atrous_dgrad", "ck15_dgrad_3d_f16")
FORMS = {"named": [], "named, data tiling": ["--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all"],
         "IREE im2col": ["--iree-global-opt-use-im2col-for-convs"],
         "IREE im2col, data tiling": ["--iree-global-opt-use-im2col-for-convs", "--iree-opt-data-tiling",
                                      "--iree-llvmcpu-enable-ukernels=all"]}


def named_conv_mlir(q) -> str:
    """func @conv(x: the bordered input NHWC, w: HWCF) -> NHWC, one named linalg convolution (q: a forward
    problem of one group, stride 1)."""
    from iree.compiler import ir
    from iree.compiler.dialects import arith, func, linalg, tensor

    ops = {2: linalg.conv_2d_nhwc_hwcf, 3: linalg.conv_3d_ndhwc_dhwcf}
    x_shape = [q.batch, *[i + lo + hi for i, lo, hi in zip(q.input, q.pad_lo, q.pad_hi)], q.in_channels]
    w_shape = [*q.filter, q.in_channels, q.out_channels]
    y_shape = [q.batch, *q.output, q.out_channels]
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        f32 = ir.F32Type.get()
        with ir.InsertionPoint(module.body):
            @func.FuncOp.from_py_func(ir.RankedTensorType.get(x_shape, f32), ir.RankedTensorType.get(w_shape, f32))
            def conv(x, w):
                zero = arith.constant(f32, 0.0)
                filled = linalg.fill(zero, outs=[tensor.empty(y_shape, f32)])
                return ops[q.dims](x, w, outs=[filled], strides=[1] * q.dims, dilations=list(q.dilation))
        assert module.operation.verify()
        return str(module)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)

    import iree.compiler as ireec

    import convdsl
    from benchmarks.suite import load_suite
    from convdsl import policy
    from convdsl.backends.iree import LoadedModule, iree_version
    from convdsl.reference import random_inputs, reference, relative_error
    from convdsl.targets import Target
    from benchmarks.cpu_bench import cpu_model

    cpu = Target("cpu", "host")
    rows = []
    for case in load_suite(names=list(CASES)):
        p = case.problem.with_(batch=args.batch, dtype="f32", compute=None, out_dtype=None, split_k=None)
        q = policy.grad_input_as_forward(p)
        dy, w = random_inputs(p, seed=0)
        want = reference(p, dy, w).reshape(p.batch, *p.input, p.in_channels)
        # the bordered dY (NHWC) and the flipped weight W'[t', k, c] = W[k, F-1-t', c] as HWCF
        x = np.pad(dy.reshape(p.batch, *p.output, p.out_channels),
                   [(0, 0), *zip(q.pad_lo, q.pad_hi), (0, 0)])
        taps = w.reshape(p.out_channels, *p.filter, p.in_channels)[(slice(None),) + (slice(None, None, -1),) * p.dims]
        hwcf = np.ascontiguousarray(np.moveaxis(taps, 0, -2))
        mlir = named_conv_mlir(q)
        for form, flags in [("convdsl", None), *FORMS.items()]:
            t0 = time.perf_counter()
            if flags is None:
                mod = convdsl.compile([p], target=cpu)
                loaded, name, inputs = mod.loaded, p.name, [dy, w]
            else:
                vmfb = ireec.compile_str(mlir, extra_args=[*cpu.compile_flags(data_tiling=False), *flags])
                loaded, name, inputs = LoadedModule(vmfb, cpu), "conv", [x, hwcf]
            compile_s = time.perf_counter() - t0
            got = loaded.call(name, *inputs).reshape(want.shape)
            err = relative_error(got, want)
            ms = loaded.time(name, inputs, repeat=args.repeat) * 1e3
            row = {"case": case.name, "form": form, "ms": ms, "gflops": p.flops / ms / 1e6, "rel_err": err,
                   "compile_s": compile_s}
            if flags is None:
                row["into_ms"] = loaded.time(name, inputs, repeat=args.repeat, out_shape=p.result_shape,
                                             out_dtype=p.result_dtype) * 1e3
            rows.append(row)
            print(f"{case.name:<24} {form:<26} {ms:9.2f} ms {row['gflops']:7.1f} GFLOP/s err {err:.1e}"
                  + (f"  (destination-passing {row['into_ms']:.2f} ms)" if "into_ms" in row else ""), flush=True)
    record = {"command": "python3 benchmarks/probes/cpu_iree_forms.py OUT.json " + " ".join(sys.argv[2:]),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
              "versions": {"iree": iree_version()}, "batch": args.batch, "results": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
