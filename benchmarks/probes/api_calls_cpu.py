"""Probe: a CPU kernel called through the Python API (convdsl.api.get_kernel(p, "cpu")(*arrays)), per call, on the
suite's shapes at batch 4 in f32: the median of N calls after the first (which compiles), here with the tree at ROOT.

    python3 benchmarks/probes/api_calls_cpu.py ROOT CASE[,CASE...] N

Run it for two checkouts of convdsl in turn (ROOT: the repository root of each) to compare them on one machine.
"""
import os
import statistics
import sys
import tempfile
import time

root = sys.argv[1]
sys.path.insert(0, root)
os.environ.setdefault("CONVDSL_CACHE_DIR", tempfile.mkdtemp(prefix="convdsl-api-calls-"))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.cpu_bench import bench_problems  # noqa: E402
from convdsl.api import get_kernel  # noqa: E402
from convdsl.reference import random_inputs, reference, relative_error, tolerance  # noqa: E402

for name in sys.argv[2].split(","):
    p = bench_problems(4, "f32", [name])[0]
    kernel = get_kernel(p, "cpu")
    args = random_inputs(p, 0)
    err = relative_error(kernel(*args), reference(p, *args))
    assert err <= tolerance(p), f"{name}: relative error {err:.2e}"
    times = []
    for _ in range(int(sys.argv[3])):
        t0 = time.perf_counter()
        kernel(*args)
        times.append(time.perf_counter() - t0)
    print(f"{root} {name} {statistics.median(times) * 1e3:.2f} ms (relative error {err:.1e})", flush=True)
