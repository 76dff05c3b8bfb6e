"""Real models trained with convdsl.torch.convert() against the same models on cuDNN, interleaved in one process.

torchvision's models (and a ConvTranspose decoder on a ResNet-18 encoder), bf16 autocast, SGD with momentum, the
same initial weights and batches for both backends; per model, memory format (contiguous, channels-last) and mode
(eager, torch.compile, the whole step captured in a CUDA graph; `inductor`: torch.compile(backend="convdsl") on the
unconverted model against plain torch.compile) it reports images/s of each backend (the median over interleaved blocks of steps), GPU time
per step (the sum of every GPU kernel's time in profiled steps), host time per step (the time to queue one step
on an idle GPU), whether the loss curves agree, and whether one step's gradients agree with a float64 step (as
`examples/train_resnet.py --check-gradients` judges them, by `convdsl.torch.testing.compare_gradients`: each
parameter's error is ||g - exact|| / max(||exact||, 1e-3 x the step's largest gradient norm), and convdsl's must be
at most max(2 x cuDNN's, 1e-2)).

Three stages; torchvision is needed where models are built (record, run), Triton where kernels are compiled
(bundle), a CUDA GPU where they run (run):

    python3 benchmarks/models.py record -o build/models.problems.json            # on a machine with CUDA PyTorch
    python3 benchmarks/models.py bundle build/models.problems.json -o build/models.convk --arch sm_90
    CONVDSL_STREAM_BUNDLES=build/models.convk python3 benchmarks/models.py run -o results.json

`record` traces one training step of each model on fake tensors under autocast (`--device cpu` where PyTorch has
no CUDA; the gradients take dY in the forward's memory format, so the problems do not depend on the device), `bundle` compiles their stream kernels ahead, `run` trains.  A kernel missing
from the bundles is compiled at its first call with the installed Triton, or, where none can be had, the layer
runs cuDNN's convolution with a one-line warning (counted in the results as `fallbacks`).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convdsl.torch as ct  # noqa: E402
from convdsl.torch import fallback, inductor, runtime  # noqa: E402
from convdsl.torch.testing import compare_gradients  # noqa: E402

FORMATS = {"contiguous": (torch.contiguous_format, torch.contiguous_format),
           "channels_last": (torch.channels_last, torch.channels_last_3d)}


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    batch: int
    input_shape: tuple[int, ...]  # one sample
    video: bool = False
    segmentation: bool = False


class _UNetTransposed(nn.Module):
    """A ResNet-18 encoder with a ConvTranspose2d decoder (the upsampling of segmentation and generator nets)."""

    def __init__(self, classes: int = 21) -> None:
        super().__init__()
        import torchvision

        r = torchvision.models.resnet18(weights=None)
        self.encoder = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        layers, width = [], 512
        for _ in range(5):
            layers += [nn.ConvTranspose2d(width, width // 2, 2, stride=2), nn.BatchNorm2d(width // 2),
                       nn.ReLU(inplace=True)]
            width //= 2
        self.decoder = nn.Sequential(*layers, nn.Conv2d(width, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def model_cases() -> dict[str, ModelCase]:
    import torchvision.models as tvm

    image = (3, 224, 224)
    cases = [
        ModelCase("resnet50", lambda: tvm.resnet50(num_classes=100), 64, image),
        ModelCase("resnext50_32x4d", lambda: tvm.resnext50_32x4d(num_classes=100), 64, image),
        ModelCase("mobilenet_v2", lambda: tvm.mobilenet_v2(num_classes=100), 128, image),
        ModelCase("mobilenet_v3_large", lambda: tvm.mobilenet_v3_large(num_classes=100), 128, image),
        ModelCase("efficientnet_b0", lambda: tvm.efficientnet_b0(num_classes=100), 64, image),
        ModelCase("convnext_tiny", lambda: tvm.convnext_tiny(num_classes=100), 64, image),
        ModelCase("regnet_y_800mf", lambda: tvm.regnet_y_800mf(num_classes=100), 64, image),
        ModelCase("densenet121", lambda: tvm.densenet121(num_classes=100), 64, image),
        ModelCase("deeplabv3_mobilenet_v3_large",
                  lambda: tvm.segmentation.deeplabv3_mobilenet_v3_large(num_classes=21, weights_backbone=None),
                  16, (3, 320, 320), segmentation=True),
        ModelCase("unet_transposed", _UNetTransposed, 32, (3, 224, 224), segmentation=True),
        ModelCase("r2plus1d_18", lambda: tvm.video.r2plus1d_18(num_classes=100), 8, (3, 8, 112, 112), video=True),
    ]
    return {c.name: c for c in cases}


def _format(case: ModelCase, fmt: str) -> torch.memory_format:
    return FORMATS[fmt][1 if case.video else 0]


def _batches(case: ModelCase, count: int, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(case.batch, *case.input_shape, generator=g)
        if case.segmentation:
            y = torch.randint(0, 21, (case.batch, *case.input_shape[1:]), generator=g)
        else:
            y = torch.randint(0, 100, (case.batch,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def _loss(case: ModelCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if isinstance(out, dict):
        out = out["out"]
    return nn.functional.cross_entropy(out.float(), y)


# --- record ----------------------------------------------------------------------------------------------

def record(args: argparse.Namespace) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl.problem import problem_to_spec

    cases = model_cases()
    problems: dict[str, dict] = {}
    per_model = {}
    for name in args.models:
        case = cases[name]
        for fmt in args.formats:
            memory_format = _format(case, fmt)
            model = ct.convert(case.build()).to(memory_format=memory_format)
            if args.device == "cpu":  # the library's tracer (convdsl/torch/bundles.py)
                x = torch.empty(case.batch, *case.input_shape).to(memory_format=memory_format)
                y = (torch.zeros(case.batch, *case.input_shape[1:], dtype=torch.long) if case.segmentation
                     else torch.zeros(case.batch, dtype=torch.long))
                step = ct.record_step(model, lambda m: _loss(case, m, x, y), autocast=torch.bfloat16)
                recorded, calls = step.problems, step.calls
            else:  # fake CUDA tensors under CUDA autocast (a CUDA build of PyTorch)
                model = model.to(args.device)
                calls = {}
                with runtime.recording(as_cuda=True, calls=calls) as recorded, \
                        FakeTensorMode(allow_non_fake_inputs=True):
                    x = torch.empty(case.batch, *case.input_shape, device=args.device).to(memory_format=memory_format)
                    y = (torch.zeros(case.batch, *case.input_shape[1:], dtype=torch.long, device=args.device)
                         if case.segmentation else torch.zeros(case.batch, dtype=torch.long, device=args.device))
                    with torch.autocast(args.device, dtype=torch.bfloat16):
                        loss = _loss(case, model, x, y)
                    loss.backward()
            # every recorded problem: also those no call of the traced path counts (the eager path's grad_weight
            # into the parameter's dtype), which the run asks for
            for p in recorded:
                spec = json.dumps(problem_to_spec(p), sort_keys=True)
                entry = problems.setdefault(spec, {"problem": problem_to_spec(p), "calls": {}})
                entry["calls"][f"{name}/{fmt}"] = calls.get(p, 0)
            per_model[f"{name}/{fmt}"] = sum(calls.values())
            print(f"{name:<30} {fmt:<14} {len(recorded):4d} problems, {sum(calls.values()):4d} calls a step",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"problems": list(problems.values()), "calls_per_step": per_model},
                                   indent=1) + "\n")
    print(f"wrote {args.out}: {len(problems)} distinct problems")
    return 0


# --- bundle ----------------------------------------------------------------------------------------------

def bundle(args: argparse.Namespace) -> int:
    from convdsl import stream
    from convdsl.problem import problem_from_spec
    from convdsl.targets import Target

    data = json.loads(args.problems.read_text())
    target = Target("cuda", args.arch)
    kernels, skipped = [], []
    started = time.perf_counter()
    shard, shards = (int(v) for v in args.shard.split("/"))
    for i, entry in enumerate(data["problems"]):
        if i % shards != shard:
            continue
        p = problem_from_spec(entry["problem"])
        reason = stream.unsupported_reason(p, target)
        if reason is not None:
            skipped.append((p.describe(), reason))
            continue
        try:
            kernels.append(stream.stream_kernel(p, target))
        except Exception as err:  # noqa: BLE001 - report and go on: the run falls back for this layer
            skipped.append((p.describe(), f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{len(data['problems'])} problems, {time.perf_counter() - started:.0f} s", flush=True)
    stream.save_bundle(kernels, args.out)
    print(f"wrote {args.out}: {len(kernels)} stream kernels; {len(skipped)} problems without one")
    for what, why in skipped:
        print(f"  no stream kernel: {what}: {why}")
    return 0


# --- run -------------------------------------------------------------------------------------------------

def _gradient_check(case: ModelCase, base: nn.Module, fmt: torch.memory_format, batch) -> tuple[float, str]:
    """One step's gradients of convdsl and of cuDNN, each against a float64 step, judged by
    `convdsl.torch.testing.compare_gradients` (convdsl's error at most max(2 x cuDNN's, 1e-2), errors relative to
    max(||exact||, 1e-3 x the largest gradient norm)): the worst ratio, and that parameter with both errors."""
    x, y = batch
    grads = {}
    for name, dtype, autocast in (("exact", torch.float64, False), ("cudnn", torch.float32, True),
                                  ("convdsl", torch.float32, True)):
        model = copy.deepcopy(base)
        if name == "convdsl":
            ct.convert(model)
        model = model.cuda().to(dtype).to(memory_format=fmt)
        torch.manual_seed(0)  # the same dropout and stochastic-depth masks in the three steps
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _loss(case, model, x.to(dtype).contiguous(memory_format=fmt), y).backward()
        grads[name] = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        del model
    result = compare_gradients(grads["exact"], grads["cudnn"], grads["convdsl"])
    worst = result.worst
    which = f"{worst.name}: convdsl {worst.candidate:.2e}, cuDNN {worst.reference:.2e}" if worst else ""
    return result.worst_ratio, which


def _gpu_ms_per_step(step: Callable[[int], float], steps: int, kernels: int = 0) -> tuple[float, list[list]]:
    """GPU time per step (the sum of every kernel's time in profiled steps), and the `kernels` kernels with the most
    time per step ([name, microseconds, launches]): where two backends' steps differ outside the convolutions."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name[:100], [0.0, 0])
        entry[0] += e.device_time_total
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:kernels]
    return (sum(e.device_time_total for e in events) / steps / 1e3,
            [[name, round(us / steps, 1), count // steps] for name, (us, count) in top])


def _host_ms_per_step(step: Callable[[int], float], steps: int) -> float:
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def _host_profile(step: Callable[[int], float], steps: int, top: int = 25) -> list[list]:
    """Where a step's host time goes: the operators and runtime calls with the most self CPU time, per step
    ([name, microseconds, calls]), from PyTorch's profiler; to tell two backends' host-bound steps apart.  CUDA
    activity is on so that the CUDA runtime's calls (launches, allocations, synchronisations) are listed too."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [[e.key[:80], round(e.self_cpu_time_total / steps), e.count // steps] for e in events]


def _graphed_step(case: ModelCase, model: nn.Module, opt: torch.optim.Optimizer, losses: list,
                  batches: list) -> Callable[[int], float]:
    """The whole training step (forward, backward, optimizer step) captured in one CUDA graph, as PyTorch's
    documentation captures a whole network: warmed up on a side stream, then each step copies its batch into the
    captured input and replays."""
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()

    def eager_step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # no cached casts across replays
            loss = _loss(case, model, static_x, static_y)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # plans, kernels, cuDNN's autotuning and the optimizer's state, before capture
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = eager_step()

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.detach().clone())
        return 0.0
    return step


def _fused(model: nn.Module, row: dict) -> nn.Module:
    """ct.fuse(model) (Conv -> BatchNorm -> activation fused), or convert() where torch.fx cannot trace it."""
    try:
        fused = ct.fuse(model)
    except ValueError as e:
        row["fused"] = str(e)
        return ct.convert(model)
    row["fused"] = sum(isinstance(m, ct.ConvBNAct) for m in fused.modules())
    row["fused_batch_norms"] = sum(isinstance(m, (ct.FusedBatchNorm1d, ct.FusedBatchNorm2d, ct.FusedBatchNorm3d))
                                   for m in fused.modules())
    return fused


def run_case(case: ModelCase, fmt_name: str, mode: str, args: argparse.Namespace) -> dict:
    fmt = _format(case, fmt_name)
    torch.manual_seed(args.seed)
    base = case.build()
    batches = _batches(case, 4, torch.device("cuda"), args.seed)
    batches = [(x.contiguous(memory_format=fmt), y) for x, y in batches]
    row: dict = {"model": case.name, "format": fmt_name, "mode": mode, "batch": case.batch}
    fallbacks: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fallback.KernelFallbackWarning)
        if args.check_gradients and mode == "eager":
            worst, which = _gradient_check(case, base, fmt, batches[0])
            row["gradients_worst_ratio"], row["gradients_worst"] = round(worst, 3), which
        backends = {}
        for name in ("cudnn", "convdsl"):
            model = copy.deepcopy(base)
            if name == "convdsl" and mode != "inductor":
                model = _fused(model, row) if args.fuse else ct.convert(model)
            model = model.cuda().to(memory_format=fmt).train()
            opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
            if mode == "inductor":  # the model's own torch.nn convolutions, compiled as convdsl's or as aten's
                runner = torch.compile(model, backend=inductor.backend) if name == "convdsl" else torch.compile(model)
            else:
                runner = torch.compile(model) if mode == "compile" else model
            backends[name] = (runner, opt, [])

        def step_of(name: str) -> Callable[[int], float]:
            runner, opt, losses = backends[name]
            if mode == "graphs":
                return _graphed_step(case, runner, opt, losses, batches)

            def step(i: int) -> float:
                x, y = batches[i % len(batches)]
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = _loss(case, runner, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                return 0.0
            return step

        steps = {name: step_of(name) for name in backends}
        for name in backends:  # warm-up: module loads, plans, autotuning, torch.compile
            for i in range(args.warmup):
                steps[name](i)
        torch.cuda.synchronize()
        for name in backends:
            backends[name][2].clear()
        rates = {name: [] for name in backends}
        for block in range(args.blocks):
            order = ("cudnn", "convdsl") if block % 2 == 0 else ("convdsl", "cudnn")
            for name in order:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(args.block_steps):
                    steps[name](block * args.block_steps + i)
                torch.cuda.synchronize()
                rates[name].append(case.batch * args.block_steps / (time.perf_counter() - t0))
        losses = {name: [float(v) for v in backends[name][2]] for name in backends}
        for name in backends:
            row[f"{name}_images_per_s"] = round(statistics.median(rates[name]), 1)
            gpu_ms, top = _gpu_ms_per_step(steps[name], 3, args.gpu_kernels)
            row[f"{name}_gpu_ms_per_step"] = round(gpu_ms, 2)
            if args.gpu_kernels:
                row[f"{name}_gpu_kernels"] = top
            row[f"{name}_host_ms_per_step"] = round(_host_ms_per_step(steps[name], 5), 2)
            if args.host_profile:
                row[f"{name}_host_profile"] = _host_profile(steps[name], 3)
        fallbacks = sorted({str(w.message) for w in caught if issubclass(w.category, fallback.KernelFallbackWarning)})
    row["speedup"] = round(row["convdsl_images_per_s"] / row["cudnn_images_per_s"], 3)
    row["gpu_speedup"] = round(row["cudnn_gpu_ms_per_step"] / row["convdsl_gpu_ms_per_step"], 3)
    a, b = losses["convdsl"], losses["cudnn"]
    # the same batches from the same weights: the mean losses over the interleaved steps agree within 5%
    row["loss_convdsl"], row["loss_cudnn"] = round(statistics.mean(a), 4), round(statistics.mean(b), 4)
    row["losses_agree"] = abs(row["loss_convdsl"] - row["loss_cudnn"]) <= 0.05 * abs(row["loss_cudnn"])
    row["fallbacks"] = fallbacks
    return row


def check_layers(args: argparse.Namespace) -> int:
    """Every distinct convolution of each model on random bf16 inputs of the shapes the model gives it: forward,
    grad_input and grad_weight of convdsl and of cuDNN against float64; a layer fails where convdsl's error
    exceeds twice cuDNN's plus 1e-3.  (Random inputs give no near-zero outputs or gradients here, so plain
    relative errors do; a whole step's parameter gradients are judged by `compare_gradients`, as `run` does.)"""
    cases = model_cases()
    failures = 0
    for name in args.models:
        case = cases[name]
        for fmt_name in args.formats:
            fmt = _format(case, fmt_name)
            model = case.build().cuda().to(memory_format=fmt)
            shapes: dict = {}

            def hook(module, inputs, output, shapes=shapes):
                key = (repr(module), tuple(inputs[0].shape))
                shapes.setdefault(key, (module, tuple(inputs[0].shape)))

            handles = [m.register_forward_hook(hook) for m in model.modules()
                       if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d))]
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                model(torch.randn(2, *case.input_shape, device="cuda").to(memory_format=fmt))
            for h in handles:
                h.remove()
            for (text, _), (module, shape) in shapes.items():
                shape = (case.batch, *shape[1:])
                ref = copy.deepcopy(module).double()
                results = {}
                x = torch.randn(shape, device="cuda", dtype=torch.float64).to(memory_format=fmt)
                for backend in ("exact", "cudnn", "convdsl"):
                    m = copy.deepcopy(ref)
                    if backend == "convdsl":
                        ct.convert(m)
                    if backend != "exact":
                        m = m.to(torch.bfloat16)
                    m = m.to(memory_format=fmt)
                    xi = x.detach().to(torch.bfloat16 if backend != "exact" else torch.float64).requires_grad_()
                    y = m(xi)
                    if backend == "exact":
                        dy = torch.randn(y.shape, device="cuda", dtype=torch.float64).to(memory_format=fmt)
                    y.backward(dy.to(y.dtype))
                    results[backend] = (y.detach().double(), xi.grad.double(), m.weight.grad.double())
                errors = {}
                for backend in ("cudnn", "convdsl"):
                    errors[backend] = [float((got - want).norm() / want.norm().clamp_min(1e-30))
                                       for got, want in zip(results[backend], results["exact"])]
                bad = [i for i in range(3) if errors["convdsl"][i] > 2 * errors["cudnn"][i] + 1e-3]
                failures += bool(bad)
                print(f"{name:<14} {fmt_name:<13} {'FAIL' if bad else 'ok  '} {text[:70]:<70} x{list(shape)} "
                      + " ".join(f"{what} {errors['convdsl'][i]:.1e}/{errors['cudnn'][i]:.1e}"
                                 for i, what in enumerate(("y", "dx", "dw"))), flush=True)
    print(f"{failures} layers where convdsl's error exceeds twice cuDNN's + 1e-3")
    return 1 if failures else 0


def run(args: argparse.Namespace) -> int:
    torch.backends.cudnn.benchmark = True
    cases = model_cases()
    rows = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "command": " ".join(sys.argv)}
    for name in args.models:
        for fmt in args.formats:
            for mode in args.modes:
                try:
                    row = run_case(cases[name], fmt, mode, args)
                except Exception as err:  # noqa: BLE001 - a crash is a result too
                    row = {"model": name, "format": fmt, "mode": mode,
                           "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
                rows.append(row)
                torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                if args.out:
                    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"\n{'model':<30} {'format':<14} {'mode':<8} {'img/s x':>8} {'GPU x':>6} {'host ms c/d':>12} "
          f"{'loss':>5} {'grads':>6} fallbacks")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<30} {r['format']:<14} {r['mode']:<8} ERROR {r['error'][:80]}")
            continue
        print(f"{r['model']:<30} {r['format']:<14} {r['mode']:<8} {r['speedup']:8.3f} {r['gpu_speedup']:6.3f} "
              f"{r['convdsl_host_ms_per_step']:5.1f}/{r['cudnn_host_ms_per_step']:<5.1f} "
              f"{'ok' if r['losses_agree'] else 'DIFF':>5} {r.get('gradients_worst_ratio', '-')!s:>6} "
              f"{len(r['fallbacks'])}")
    ok = [r for r in rows if "error" not in r]
    if ok:
        geo = statistics.geometric_mean([r["speedup"] for r in ok])
        print(f"geomean images/s convdsl / cuDNN: {geo:.3f} over {len(ok)} runs; {len(rows) - len(ok)} errors")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    names = ["resnet50", "resnext50_32x4d", "mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0",
             "convnext_tiny", "regnet_y_800mf", "densenet121", "deeplabv3_mobilenet_v3_large", "unet_transposed",
             "r2plus1d_18"]

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", type=lambda s: s.split(","), default=names)
        p.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))

    rec = sub.add_parser("record", help="trace each model's training step: the problems it calls")
    common(rec)
    rec.add_argument("-o", "--out", type=Path, required=True)
    rec.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                     help="trace on fake tensors of this device under its autocast (cpu: no CUDA build needed; "
                          "the problems recorded are the same)")
    bun = sub.add_parser("bundle", help="compile the recorded problems' stream kernels into a bundle")
    bun.add_argument("problems", type=Path)
    bun.add_argument("-o", "--out", type=Path, required=True)
    bun.add_argument("--arch", default="sm_90")
    bun.add_argument("--shard", default="0/1", help="i/n: compile every n-th problem from the i-th (n processes "
                     "compile n bundles in parallel; CONVDSL_STREAM_BUNDLES takes several, separated by ':')")
    chk = sub.add_parser("check", help="each distinct convolution of the models against float64 and cuDNN")
    common(chk)
    r = sub.add_parser("run", help="train each model on both backends, interleaved")
    common(r)
    r.add_argument("--modes", type=lambda s: s.split(","), default=["eager", "compile"],
                   help="eager, compile (torch.compile, default mode), graphs (the whole step in a CUDA graph), "
                        "inductor (torch.compile(backend=\"convdsl\") without convert())")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--blocks", type=int, default=4)
    r.add_argument("--block-steps", type=int, default=5)
    r.add_argument("--lr", type=float, default=0.01)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--check-gradients", action="store_true")
    r.add_argument("--fuse", action="store_true",
                   help="convdsl's model through ct.fuse(): Conv -> BatchNorm -> activation fused (convdsl/torch/fused.py)")
    r.add_argument("--host-profile", action="store_true",
                   help="also record each backend's operators with the most self CPU time per step")
    r.add_argument("--gpu-kernels", type=int, default=0, metavar="N",
                   help="also record each backend's N GPU kernels with the most time per step")
    r.add_argument("-o", "--out", type=Path)
    args = ap.parse_args(argv)
    return {"record": record, "bundle": bundle, "check": check_layers, "run": run}[args.stage](args)


if __name__ == "__main__":
    raise SystemExit(main())
