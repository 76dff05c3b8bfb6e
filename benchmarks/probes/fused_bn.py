"""Probe: the fused BatchNorm + activation (convdsl/torch/fused.py) against torch.nn's BatchNorm2d + ReLU on
ResNet-50's activation shapes (batch 64, bf16, channels-last and contiguous), on a CUDA GPU:

    python3 benchmarks/probes/fused_bn.py OUT.json

Per shape: GPU time of a forward and of a forward + backward (torch_bench.graph_ms: 20 calls in a CUDA graph,
replayed), host time per call queued (forward + backward, 200 calls, the GPU never waiting), each against float64
(relative error of the output and the input gradient); and whether a fused training step synchronises the host
(torch.cuda.set_sync_debug_mode("error")).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.torch_bench import graph_ms  # noqa: E402  (GPU time per call, 20 calls in one CUDA graph)

SHAPES = [(64, 64, 112, 112), (64, 256, 56, 56), (64, 128, 28, 28), (64, 512, 28, 28), (64, 1024, 14, 14),
          (64, 2048, 7, 7), (64, 512, 7, 7)]


def _layers(channels: int):
    import torch
    from torch import nn

    import convdsl.torch as ct
    bn = nn.BatchNorm2d(channels).cuda()
    fused = ct.ConvBNAct(nn.Conv2d(channels, channels, 1), bn, "relu").cuda()  # its convolution not called
    reference = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(inplace=True)).cuda()
    return {"convdsl": fused.batch_norm_activation, "torch": reference}


def main(out: Path) -> int:
    import torch
    rows = []
    for shape in SHAPES:
        for fmt_name, fmt in (("channels_last", torch.channels_last), ("contiguous", torch.contiguous_format)):
            torch.manual_seed(0)
            y = (torch.randn(shape, device="cuda") * 2 + 0.3).to(torch.bfloat16).to(memory_format=fmt)
            grad = torch.randn_like(y)
            exact_y = y.double().requires_grad_()
            exact = torch.nn.functional.relu(torch.nn.functional.batch_norm(
                exact_y, None, None, torch.ones(shape[1], dtype=torch.float64, device="cuda"),
                torch.zeros(shape[1], dtype=torch.float64, device="cuda"), True, 0.1, 1e-5))
            exact.backward(grad.double())
            row = {"shape": list(shape), "format": fmt_name}
            for name, layer in _layers(shape[1]).items():
                yg = y.clone().requires_grad_()

                def forward():
                    with torch.no_grad():
                        layer(y)

                def both():
                    out = layer(yg)
                    out.backward(grad)
                row[f"{name}_forward_ms"] = round(graph_ms(forward), 4)
                row[f"{name}_train_ms"] = round(graph_ms(both), 4)
                yg.grad = None
                result = layer(yg)
                result.backward(grad)
                row[f"{name}_error_out"] = float((result.double() - exact).norm() / exact.norm())
                row[f"{name}_error_grad"] = float((yg.grad.double() - exact_y.grad).norm() / exact_y.grad.norm())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    layer(yg).backward(grad)
                row[f"{name}_host_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
                torch.cuda.synchronize()
            row["train_speedup"] = round(row["torch_train_ms"] / row["convdsl_train_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    # a fused training step must not wait for the GPU
    y = torch.randn(SHAPES[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer = _layers(SHAPES[1][1])["convdsl"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(y).backward(torch.ones_like(y))
        syncs = "none"
    except RuntimeError as e:
        syncs = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python3 benchmarks/probes/fused_bn.py OUT.json", "synchronises": syncs, "rows": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("synchronises:", syncs)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
