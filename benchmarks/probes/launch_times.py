"""Probe: the GPU time of each launch of a stream kernel (layout copies, staging copies, the GEMM core, the
partials' sum), from PyTorch's profiler over repeated calls on random inputs.

    python3 benchmarks/probes/launch_times.py BUNDLE.convk [NAME_SUBSTRING ...]   # on a CUDA GPU

Prints, per kernel of the bundle whose problem name contains one of the substrings (all without any), each
launched function's median time in microseconds.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_bench import random_args
    from benchmarks.torch_bench import _case_dict
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    bundle, wanted = Path(argv[0]), argv[1:]
    dev = torch.device("cuda", 0)
    for k in stream.load_bundle(bundle):
        if wanted and not any(w in k.problem.name for w in wanted):
            continue
        case = k.problem.name.split(":")[0]
        args = random_args(_case_dict(k.problem.with_(name=case)), seed=1)
        runner = StreamRunner(k, dev)
        for _ in range(3):
            runner(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner(*args)
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(e.name, []).append(e.device_time)
        print(f"{k.problem.name} ({k.tiles})")
        for name, ts in times.items():
            print(f"  {statistics.median(ts):9.1f} us  x{len(ts) // 10}  {name[:90]}")
        del args
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
