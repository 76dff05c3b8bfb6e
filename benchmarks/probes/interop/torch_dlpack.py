"""Can convdsl's `$into` twin run on PyTorch's CUDA tensors without copies?  (A CUDA machine with the
iree-base-runtime wheel installed and benchmarks/build copied there.)

For a few f16 suite cases: dY/X, W and the result tensor are torch CUDA tensors imported into IREE through
DLPack (`HalDevice.from_dlpack_capsule`), the twin writes the result into torch's tensor, and the result is
compared with the same kernel called the usual way (numpy inputs uploaded, result downloaded).  Then the
zero-copy call is timed against cuDNN on the same tensors (torch.cuda.synchronize() before each IREE call, so
that IREE's stream sees torch's finished inputs; the IREE call itself returns after its work is done).

    python3 benchmarks/probes/interop/torch_dlpack.py --cases r50_1x1_dgrad,mbv2_dw_dgrad --out RESULTS
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))


def timed(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def probe(case: dict, build: Path, iree, rt) -> dict:
    from convdsl.backends.into_call import IntoCall
    from gpu_bench import TorchConv, random_args

    out: dict = {}
    ctx, f = iree.load(build / case["vmfbs"]["convdsl"], case["function"])
    vm_module = ctx.modules.module.vm_module
    args = [a.contiguous() for a in random_args(case, 3)]  # torch CUDA tensors in kernel order and layout
    want = iree.download(f(*[iree.upload(a, s["dtype"]) for a, s in zip(args, case["args"])]), case["result"]["dtype"])
    result = torch.empty(case["result"]["shape"], dtype=args[0].dtype, device="cuda")
    device = iree.device
    try:
        views = [device.from_dlpack_capsule(t.__dlpack__()) for t in args]
        out_view = device.from_dlpack_capsule(result.__dlpack__())
    except Exception as err:  # noqa: BLE001 - the finding is the error
        return {"import": f"{type(err).__name__}: {err}"}
    out["import"] = "ok"
    call = IntoCall(ctx, vm_module, case["function"], views, out_view)
    packed = call.pack(views)
    torch.cuda.synchronize()
    call.call(packed)
    got = result.float().cpu()
    out["max_abs_diff_vs_usual_call"] = float((got.double() - want.double()).abs().max())
    out["same_as_usual_call"] = bool(torch.equal(got, want.float()))

    def zero_copy():
        torch.cuda.synchronize()
        call.call(packed)

    out["zero_copy_ms"] = timed(zero_copy)
    conv = TorchConv(case)
    targs = conv.to_torch(args)
    fn = conv.fn(conv.like(args[0].dtype))

    def cudnn():
        fn(*targs)
        torch.cuda.synchronize()

    out["cudnn_ms"] = timed(cudnn)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "benchmarks/build"))
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import iree.runtime as rt
    from gpu_bench import Iree

    torch.backends.cudnn.benchmark = True
    iree = Iree("cuda")
    build = Path(args.build)
    cases = {c["name"]: c for c in json.loads((build / "cases.json").read_text())["cases"]}
    results = {}
    for name in args.cases.split(","):
        try:
            results[name] = probe(cases[name], build, iree, rt)
        except Exception as err:  # noqa: BLE001
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results[name]), flush=True)
    Path(args.out, "torch-dlpack.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
