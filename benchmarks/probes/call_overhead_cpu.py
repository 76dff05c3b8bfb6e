"""Probe: the Python around one small CPU kernel call, with the tree at ROOT.

  - torch: convdsl.torch's CPU path (runtime.run: layout views, DLPack import, checks, result) on a training layer's
    tensors (batch 16, 32 -> 64 channels, 32x32, 3x3 stride 2, channels-last, f32), the kernel itself stubbed out
    (IntoCall.call does nothing), so the time is Python alone: the median over rounds of the best of 7 x 500 calls;
  - numpy: a 13 us grad_input (1 x 8x8 x 8 -> 8 channels, 3x3, f32) called four ways, interleaved, the median over
    rounds of the best of 3 x 200 calls: the kept-buffer `$into` call on device arrays, the module's allocating
    function on device arrays (iree.runtime's invoker), convdsl.grad_input with NumPy's own arrays, and the Kernel
    call with 64-byte aligned arrays (convdsl.empty).

    python3 benchmarks/probes/call_overhead_cpu.py ROOT [ROUNDS]

Run it for two checkouts in turn (ROOT: the repository root of each) to compare them on one machine.
"""
import os
import statistics
import sys
import timeit

root = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
sys.path.insert(0, root)

import numpy as np  # noqa: E402

import convdsl  # noqa: E402
from convdsl.api import get_kernel, infer_problem  # noqa: E402
from convdsl.interop import empty  # noqa: E402

print(f"convdsl from {os.path.dirname(convdsl.__file__)}")


def best(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def numpy_calls() -> None:
    dy = np.random.rand(1, 8, 8, 1, 8).astype(np.float32)
    w = np.random.rand(1, 8, 3, 3, 8).astype(np.float32)
    dy64, w64 = empty(dy.shape), empty(w.shape)
    dy64[...], w64[...] = dy, w
    p = infer_problem("grad_input", dy, w, input=(8, 8), padding=1)
    kernel = get_kernel(p, "cpu")
    loaded = kernel.module.loaded
    dev = [loaded.upload(a) for a in (dy, w)]
    function = loaded.module[p.name]
    into = loaded.into_call(p.name, dev, p.result_shape, p.result_dtype)
    packed = into.pack([a._buffer_view for a in dev])
    ways = {"kept $into call": lambda: into.call(packed), "allocating function": lambda: function(*dev),
            "convdsl.grad_input": lambda: convdsl.grad_input(dy, w, input=(8, 8), padding=1),
            "Kernel, aligned": lambda: kernel(dy64, w64)}
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(best(fn, 200, 3))
    for name, ts in times.items():
        print(f"numpy  {name:22s} {statistics.median(ts):7.1f} us")


def torch_calls() -> None:
    import torch

    from convdsl.backends import into_call
    from convdsl.torch import runtime

    x = torch.randn(16, 32, 32, 32).to(memory_format=torch.channels_last)
    w = torch.randn(64, 32, 3, 3).to(memory_format=torch.channels_last)
    conv = dict(spatial=(32, 32), filt=(3, 3), stride=(2, 2), pad_lo=(1, 1), pad_hi=(1, 1), dilation=(1, 1), groups=1)
    dy = torch.randn_like(runtime.run("forward", x, w, **conv))
    calls = (("forward", x, w), ("grad_input", dy, w), ("grad_weight", x, dy))
    for op, a, b in calls:  # compiled, and each signature seen twice
        runtime.run(op, a, b, **conv)
        runtime.run(op, a, b, **conv)
    into_call.IntoCall.call = lambda self, packed: None
    for op, a, b in calls:
        ts = [best(lambda: runtime.run(op, a, b, **conv), 500, 7) for _ in range(rounds)]
        print(f"torch  {op:22s} {statistics.median(ts):7.1f} us a call outside the kernel")


numpy_calls()
torch_calls()
