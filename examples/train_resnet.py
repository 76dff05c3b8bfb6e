"""Train a ResNet-50 on synthetic data with convdsl's convolutions or cuDNN's, and compare.

    python3 examples/train_resnet.py --backend convdsl --steps 300 --out convdsl.json
    python3 examples/train_resnet.py --backend cudnn --steps 300 --out cudnn.json
    python3 examples/train_resnet.py --compare convdsl.json cudnn.json
    python3 examples/train_resnet.py --backend both --out run.json    # run-convdsl.json, run-cudnn.json

`--backend both` trains the two models in one process, in alternating blocks of `--log-every` steps, so that a
shared host's changing load reaches both alike (separate runs on such a host differ by tens of percent in eager
mode, where the step is bound by the host's Python time).

To run on a GPU machine without a compiler, compile the kernels of one training step ahead into a bundle
(the shapes are traced on fake tensors, so this needs no GPU) and point convdsl at it:

    python3 examples/train_resnet.py --bundle-out resnet50.convk --arch sm_90
    CONVDSL_STREAM_BUNDLES=resnet50.convk python3 examples/train_resnet.py --backend convdsl

On CUDA the step runs in bf16 autocast with channels-last tensors (the way cuDNN is fastest), or with `--f32` in
f32 with PyTorch's default TF32 for convolutions (`torch.backends.cudnn.allow_tf32`: one-pass TF32 for both
backends; build its bundle with `--f32` too); on the CPU, for a quick check, in f32 (`--steps 2 --batch 2
--image-size 32`).  The data are made here from a fixed seed (nothing
is downloaded): images drawn per class around a class template, so the loss falls as the model learns.  Both
backends start from the same weights and see the same batches; `--compare` reports how far apart the loss
curves are and the images per second of each.

Several GPUs: start it with torchrun; each process trains a DistributedDataParallel replica on its GPU (NCCL on
CUDA, gloo on the CPU) with its share of the global `--batch`, and rank 0 writes the result (the loss averaged
over the ranks, images per second of the whole job):

    CONVDSL_STREAM_BUNDLES=resnet50.convk torchrun --nproc_per_node=2 examples/train_resnet.py --backend convdsl

Each replica normalises its batch share with its own BatchNorm statistics (DDP's default), so the loss curve
follows the one-GPU run of the same global batch within `--compare`'s tolerance, not bit for bit.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convdsl.torch as ct  # noqa: E402
from convdsl.torch.testing import compare_gradients  # noqa: E402


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        width = int(planes * (width_per_group / 64.0)) * groups
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet-50 layout (ResNeXt-50 32x4d with groups=32, width_per_group=4)."""

    def __init__(self, layers=(3, 4, 6, 3), classes: int = 100, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        self.inplanes = 64
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages = []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(self.inplanes, planes, 2 if (b == 0 and i > 0) else 1, groups,
                                        width_per_group))
                self.inplanes = planes * 4
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def synthetic_batches(steps: int, batch: int, size: int, classes: int, device: torch.device, seed: int):
    """The same batches for every run: class templates plus noise, labels uniform."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 3, size, size, generator=g)
    pool = []
    for _ in range(min(steps, 16)):  # a pool of batches reused in order: the step time excludes data making
        labels = torch.randint(0, classes, (batch,), generator=g)
        images = templates[labels] + 0.8 * torch.randn(batch, 3, size, size, generator=g)
        pool.append((images.to(device), labels.to(device)))
    for i in range(steps):
        yield pool[i % len(pool)]


def _distributed(cuda: bool) -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun, with the process group started; (0, 1, 0) otherwise."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), local


def _training_step(args: argparse.Namespace, backend: str, device: torch.device, world: int, local: int):
    """One backend's model (from args.seed: both backends start from the same weights), optimizer and step."""
    torch.manual_seed(args.seed)
    groups, width = (32, 4) if args.resnext else (1, 64)
    model = ResNet(groups=groups, width_per_group=width, classes=args.classes)
    if backend == "convdsl":
        model = ct.fuse(model) if args.fuse else ct.convert(model)
    cuda = device.type == "cuda"
    fmt = torch.channels_last if cuda else torch.contiguous_format
    model = model.to(device).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    if world > 1:  # gradients averaged over the replicas as they are computed (bucketed all-reduces)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    # torch.compile takes the model (forward and its backward); the optimizer stays eager
    forward = torch.compile(model, mode=args.compile_mode) if args.compile else model

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and not args.f32):
            loss = loss_fn(forward(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step, fmt


def train(args: argparse.Namespace) -> dict:
    """Train args.backend's model, or with --backend both the two models in one process, in alternating blocks
    of --log-every steps (the order swapped every block): each backend's time then comes from the same minutes
    of a shared host, not from runs minutes apart."""
    cuda_present = torch.cuda.is_available() and not args.cpu
    rank, world, local = _distributed(cuda_present)
    if args.batch % world:
        raise SystemExit(f"--batch: {args.batch} does not split evenly over {world} processes")
    backends = ("convdsl", "cudnn") if args.backend == "both" else (args.backend,)
    if world > 1 and len(backends) > 1:
        raise SystemExit("--backend both: one process only (start it without torchrun)")
    device = torch.device("cuda", local) if cuda_present else torch.device("cpu")
    cuda = device.type == "cuda"
    steps = {b: _training_step(args, b, device, world, local) for b in backends}
    share = args.batch // world

    if args.profile:
        step, fmt = steps[backends[0]]
        return _profile(step, args, device, fmt)
    batches = list(synthetic_batches(args.steps, args.batch, args.image_size, args.classes, device, args.seed))
    losses: dict[str, list] = {b: [] for b in backends}
    times: dict[str, list[float]] = {b: [] for b in backends}
    for block, first in enumerate(range(0, args.steps, args.log_every)):
        last = min(first + args.log_every, args.steps)
        for b in (backends if block % 2 == 0 else backends[::-1]):
            step, fmt = steps[b]
            start = time.perf_counter()
            for images, labels in batches[first:last]:
                if args.compile_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be reused
                # every rank makes the same global batch and trains on its own slice of it
                mine = slice(rank * share, (rank + 1) * share)
                loss = step(images[mine].contiguous(memory_format=fmt), labels[mine])
                losses[b].append(loss.detach().clone())
            if cuda:
                torch.cuda.synchronize()
            times[b].append((time.perf_counter() - start) / (last - first))
            if rank == 0:
                print(f"{b:8s} step {last:5d} loss {float(loss.detach()):.4f} {args.batch / times[b][-1]:8.1f} images/s",
                      flush=True)
    results = {b: _result(args, b, losses[b], times[b], world, cuda) for b in backends}
    if args.out and rank == 0:
        for b, result in results.items():
            path = Path(args.out) if len(backends) == 1 else _suffixed(Path(args.out), b)
            path.write_text(json.dumps(result) + "\n")
    if len(backends) > 1 and rank == 0:
        a, b = (results[x]["images_per_s"] for x in backends)
        print(f"interleaved: convdsl {a:.1f}, cudnn {b:.1f} images/s, ratio {a / b:.3f}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return results[backends[0]]


def _suffixed(path: Path, backend: str) -> Path:
    """--out for one backend of --backend both: run.json -> run-convdsl.json."""
    return path.with_name(f"{path.stem}-{backend}{path.suffix}")


def _result(args: argparse.Namespace, backend: str, losses: list, times: list[float], world: int,
            cuda: bool) -> dict:
    # the first interval holds compilation and warm-up: images per second from the others
    steady = times[1:] if len(times) > 1 else times
    curve = torch.stack(losses).float()
    if world > 1:  # the global batch's loss: the mean of the ranks' equal shares
        torch.distributed.all_reduce(curve)
        curve /= world
    return {"backend": backend, "processes": world, "compile": args.compile and (args.compile_mode or "default"),
            "interleaved": args.backend == "both",
            "precision": "f32 (TF32 convolutions)" if args.f32 else "bf16 autocast", "steps": args.steps,
            "batch": args.batch,
            "image_size": args.image_size, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__, "losses": curve.tolist(),
            "block_step_ms": [t * 1e3 for t in times],  # per block of --log-every steps, the first one's warm-up too
            "images_per_s": args.batch / statistics.median(steady)}


def _profile(step, args: argparse.Namespace, device: torch.device, fmt) -> dict:
    """The GPU kernels of a few steps after warm-up, by total time (where a step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    batches = list(synthetic_batches(6, args.batch, args.image_size, args.classes, device, args.seed))
    for images, labels in batches[:3]:
        step(images.contiguous(memory_format=fmt), labels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for images, labels in batches[3:]:
            step(images.contiguous(memory_format=fmt), labels)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    return {}


def check_gradients(args: argparse.Namespace) -> int:
    """One training step's gradients of every parameter from the same weights and batch, with convdsl's
    convolutions and with cuDNN's (both under bf16 autocast, channels-last), each against a float64 step, judged
    by `convdsl.torch.testing.compare_gradients`: a parameter's error is ||g - exact|| / max(||exact||, 1e-3 x the
    step's largest gradient norm), and convdsl's must be at most max(2 x cuDNN's, 1e-2).  This holds the gradients
    to account where loss curves cannot: bf16 training drifts apart step by step for either backend."""
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    groups, width = (32, 4) if args.resnext else (1, 64)
    base = ResNet(groups=groups, width_per_group=width, classes=args.classes)
    images, labels = next(iter(synthetic_batches(1, args.batch, args.image_size, args.classes, device, args.seed)))
    grads = {}
    for name, dtype, autocast in (("exact", torch.float64, False), ("cudnn", torch.float32, True),
                                  ("convdsl", torch.float32, True)):
        model = copy.deepcopy(base)
        if name == "convdsl":
            model = ct.fuse(model) if args.fuse else ct.convert(model)
        model = model.to(device).to(dtype).to(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.CrossEntropyLoss()(model(images.to(dtype).contiguous(memory_format=torch.channels_last)),
                                         labels)
        loss.backward()
        names = ct.original_names(model) if name == "convdsl" and args.fuse else {}  # fused: the unfused names
        grads[name] = {names.get(n, n): p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    result = compare_gradients(grads["exact"], grads["cudnn"], grads["convdsl"])
    for n, mine, theirs in sorted(result.rows, key=lambda r: -r.candidate)[:8]:
        print(f"{n:<40} convdsl {mine:.2e}  cuDNN {theirs:.2e}")
    print(f"{len(result.rows)} parameters: largest convdsl error / max(2 x cuDNN's, 1e-2) = "
          f"{result.worst_ratio:.2f} -> {'agree' if result.agree else 'DIFFER'}")
    if args.out:
        args.out.write_text(json.dumps({"parameters": [{"name": n, "convdsl": a, "cudnn": b}
                                                       for n, a, b in result.rows],
                                        "worst_ratio": result.worst_ratio, "floor": result.floor}, indent=1) + "\n")
    return 0 if result.agree else 1


def build_bundle(args: argparse.Namespace) -> int:
    """Trace one training step on fake tensors (on the CPU: no GPU, no compute) and compile the stream kernels
    of every convolution it makes, forward and backward, into one bundle file."""
    from convdsl.problem import problem_to_spec

    groups, width = (32, 4) if args.resnext else (1, 64)
    model = ct.convert(ResNet(groups=groups, width_per_group=width, classes=args.classes))
    model = model.to(memory_format=torch.channels_last)
    images = torch.empty(args.batch, 3, args.image_size, args.image_size).contiguous(memory_format=torch.channels_last)
    labels = torch.zeros(args.batch, dtype=torch.long)
    step = ct.record_step(model, lambda m: nn.CrossEntropyLoss()(m(images), labels),
                          autocast=None if args.f32 else torch.bfloat16)
    # every recorded problem's stream kernel; those without one are left out (with why)
    without = step.write_bundle(args.bundle_out, arch=args.arch)
    # how often each kernel runs in a step, beside the bundle (benchmarks/torch_layers.py weighs by it)
    counts = args.bundle_out.with_suffix(".calls.json")
    counts.write_text(json.dumps([{"problem": problem_to_spec(p), "calls": n} for p, n in step.calls.items()])
                      + "\n")
    print(f"wrote {args.bundle_out} and {counts}: {len(step.problems) - len(without)} stream kernels, "
          f"{sum(step.calls.values())} convolution calls per step")
    return 0


def compare(a_path: Path, b_path: Path, window: int, agree_steps: int) -> int:
    """The loss curves agree where the running means over `window` steps differ by at most 5% of the first
    loss plus twice the run-to-run noise (the standard deviation within the window), at every step up to
    `agree_steps`.  Past about 200 steps, where the model starts to memorise the 16 reused batches, bf16 runs
    drift apart for either backend (cuDNN eager against cuDNN in CUDA graphs, same seed, leaves the band at step
    264: docs/decisions.md#loss-curves), so later steps are reported, not judged; --check-gradients judges
    the gradients themselves."""
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    la, lb = a["losses"], b["losses"]
    n = min(len(la), len(lb))
    worst, first_out = 0.0, None
    for i in range(window, n + 1):
        wa, wb = la[i - window:i], lb[i - window:i]
        gap = abs(statistics.fmean(wa) - statistics.fmean(wb))
        allowed = 0.05 * la[0] + 2 * max(statistics.pstdev(wa), statistics.pstdev(wb))
        if gap > allowed and first_out is None:
            first_out = i
        if i <= agree_steps:
            worst = max(worst, gap / allowed)
    ok = worst <= 1
    print(f"{a['backend']}: {a['images_per_s']:.1f} images/s, {b['backend']}: {b['images_per_s']:.1f} images/s, "
          f"ratio {a['images_per_s'] / b['images_per_s']:.3f}")
    print(f"loss: first {la[0]:.3f} / {lb[0]:.3f}, last {statistics.fmean(la[-window:]):.3f} / "
          f"{statistics.fmean(lb[-window:]):.3f}; up to step {agree_steps}: largest gap {worst:.2f} of the allowed -> "
          f"{'agree' if ok else 'DIFFER'}; first step beyond the band: {first_out or 'none'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("convdsl", "cudnn", "both"), default="convdsl",
                    help="whose convolutions (cudnn: torch.nn's own, cuDNN on CUDA; both: the two models in one "
                         "process, alternating blocks of --log-every steps, --out's name suffixed per backend)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--resnext", action="store_true", help="ResNeXt-50 32x4d instead of ResNet-50")
    ap.add_argument("--f32", action="store_true",
                    help="f32 without autocast (convolutions in one-pass TF32, PyTorch's default) instead of bf16")
    ap.add_argument("--fuse", action="store_true",
                    help="convdsl's model through ct.fuse(): Conv -> BatchNorm (-> ReLU, + residual) fused")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training step")
    ap.add_argument("--compile-mode", default=None, help="torch.compile's mode, e.g. reduce-overhead")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of three steps by total time")
    ap.add_argument("--check-gradients", action="store_true",
                    help="one step's parameter gradients, convdsl and cuDNN each against float64 (GPU)")
    ap.add_argument("--out", type=Path, help="write the loss curve and images/s here (JSON)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two --out files")
    ap.add_argument("--window", type=int, default=20, help="--compare: steps per running mean")
    ap.add_argument("--agree-steps", type=int, default=200, help="--compare: the steps the curves must agree over")
    ap.add_argument("--bundle-out", type=Path, help="compile one step's kernels ahead into this bundle file")
    ap.add_argument("--arch", default="sm_90", help="--bundle-out: the CUDA arch to compile for")
    args = ap.parse_args(argv)
    if args.bundle_out:
        # checked and made before the minutes of compiling, not after them
        if args.bundle_out.is_dir():
            ap.error(f"--bundle-out {args.bundle_out}: is a directory, expected a bundle file (e.g. resnet50.convk)")
        try:
            args.bundle_out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            ap.error(f"--bundle-out {args.bundle_out}: cannot create its folder {args.bundle_out.parent}: "
                     f"{err.strerror or err}")
        if not os.access(args.bundle_out.parent, os.W_OK):
            ap.error(f"--bundle-out {args.bundle_out}: its folder {args.bundle_out.parent} is not writable")
        return build_bundle(args)
    if args.compare:
        return compare(*args.compare, args.window, args.agree_steps)
    # modes that only mean something on a GPU: said before any model is built
    needs_cuda = [(flag, what) for flag, on, what in (
        ("--check-gradients", args.check_gradients, "it compares convdsl's gradients with cuDNN's"),
        ("--profile", args.profile, "it lists the GPU kernels")) if on]
    if needs_cuda and (args.cpu or not torch.cuda.is_available()):
        why = "--cpu was given" if args.cpu else "no CUDA device is available here"
        ap.error(f"{needs_cuda[0][0]}: needs a CUDA GPU ({needs_cuda[0][1]}), but {why}")
    if args.check_gradients:
        return check_gradients(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
