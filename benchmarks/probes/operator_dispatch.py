"""Probe: what an operator call costs in dispatch alone, convdsl's operators against their graph twins (the
operators Inductor's graphs call: no autograd or autocast kernel), on any machine with PyTorch:

    python3 benchmarks/probes/operator_dispatch.py [OUT.json]

Both run the same fake kernel on meta tensors, without gradients, as a compiled graph calls them (past autograd);
the difference is the dispatcher passing through the operator's Python autograd kernel (torch.library's
register_autograd).  Median of 15 rounds of 2000 calls each (ResNet-50's 3x3 layer shapes, batch 64).
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from convdsl.torch import ops  # noqa: E402


def per_call_us(op, args: tuple, calls: int = 2000, rounds: int = 15) -> float:
    times = []
    with torch.no_grad():
        for _ in range(200):
            op(*args)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                op(*args)
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x = torch.empty(64, 64, 56, 56, **meta).to(memory_format=torch.channels_last)
    w = torch.empty(64, 64, 3, 3, **meta).to(memory_format=torch.channels_last)
    dy = torch.empty(64, 64, 56, 56, **meta).to(memory_format=torch.channels_last)
    conv = ([1, 1], [1, 1], [1, 1], [1, 1], 1)
    cases = {"convolution": (x, w, None, *conv), "convolution_grad_input": (dy, w, list(x.shape), *conv),
             "convolution_grad_weight": (x, dy, list(w.shape), *conv)}
    rows = []
    for name, args in cases.items():
        operator, twin = getattr(ops, name), getattr(ops, ops.GRAPH_TWINS[name])
        rows.append({"operator": name, "operator_us": round(per_call_us(operator, args), 2),
                     "graph_twin_us": round(per_call_us(twin, args), 2)})
        print(json.dumps(rows[-1]))
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "command": "python3 benchmarks/probes/operator_dispatch.py", "rows": rows}
    if len(argv) > 1:
        Path(argv[1]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
