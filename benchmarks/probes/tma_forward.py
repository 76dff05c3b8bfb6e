"""Probe: forward convolution with TMA im2col copies and wgmma (convdsl/kernels/tma.py) against cuDNN and the
cp.async stream kernels, on the suite's dense 16-bit forward shapes, per tile candidate.

    python3 benchmarks/probes/tma_forward.py build TMA.convk          # where Triton 3.9 is (no GPU needed)
    python3 benchmarks/probes/tma_forward.py run TMA.convk OUT.json   # on an H100/H200

    python3 benchmarks/probes/tma_forward.py build WIDE.convk --wide --from resnet50.convk

`build` compiles the kernel for sm_90 per shape and tile candidate (persistent where the rule would make it so)
into a stream bundle (kernels named <case>:<tiles>), with the cp.async kernel the shape had before
(<case>:cp.async, its rule's tiles).  `--wide`: the candidates are the rule's tiles and the wide ones of two warp
groups (128 x 256, 256 x 128), over the suite's shapes with at least 256 output channels and the TMA forwards
(stride-1 grad_inputs included, as the forwards they run as) of the bundle named by `--from`
(examples/train_resnet.py --bundle-out makes ResNet-50's).
`run` calls each through the stream runner, checks it against cuDNN on the same tensors and times both by
CUDA-graph replay.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ["r50_3x3_s1_dgrad_fwd", "ck17_dgrad_2d_s2_fwd", "deeplab_atrous_dgrad_fwd", "ck15_dgrad_3d_f16_fwd",
         "unet3d_dgrad_fwd"]
TILES = ["t128x128x64w8s4", "t128x64x64w4s4", "t128x128x64w4s4", "t128x256x64w8s3", "t64x128x64w4s5",
         "t128x128x64w8s5"]
WIDE_TILES = ["rule", "t128x256x64w8s3", "t256x128x64w8s3"]


def _compile(job):
    from convdsl import policy
    from convdsl.kernels.compile import compile_tma_launch
    from convdsl.kernels.tma_launches import forward_tma_launch
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.stream import StreamKernel, StreamLaunch, planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    p, label = job
    if label == "rule":
        label = policy.tma_forward_tiles(p, Target("cuda", "sm_90")).label()
    if label == "cp.async":
        return planned_stream_kernel(p.with_(name=f"{p.name}:{label}"), Target("cuda", "sm_90"), Knobs(),
                                  compile=True, tma=False)
    tiles = parse_tiles(label)  # persistent where the rule makes these tiles so (policy.tma_forward_programs)
    launch, maps = forward_tma_launch(p, tiles, f"k_{label}",
                                      programs=policy.tma_forward_programs(p, tiles, Target("cuda", "sm_90")))
    binary, maps, kinds = compile_tma_launch(launch, maps, "sm_90")
    named = p.with_(name=f"{p.name}:{label}")
    return StreamKernel(named, "sm_90", named, (), (StreamLaunch(launch, binary),), (), label, "probe",
                        tma_maps=maps, tma_params=kinds)


def _wide_problems(bundle: Path | None) -> list:
    # the suite's and the bundle's problems that run on the TMA forward kernel with at least 256 columns
    from benchmarks.torch_bench import problems
    from convdsl import policy, stream
    from convdsl.targets import Target

    hopper = Target("cuda", "sm_90")
    found = [p for p in problems([c.removesuffix("_fwd") for c in CASES]) if p.name in CASES]
    for k in stream.load_bundle(bundle) if bundle else ():
        q = policy.grad_input_as_forward(k.problem) if k.problem.op == "grad_input" else k.problem
        if q is not None and q.op == "forward":
            found.append(q.with_(name=f"r50_{k.problem.op}_c{q.in_channels}_k{q.out_channels}_"
                                      f"{'x'.join(map(str, q.input))}_s{q.stride[0]}"))
    out, seen = [], set()
    for p in found:
        key = repr(p.with_(name="").record())
        if p.out_channels >= 256 and policy.tma_forward_reason(p, hopper) is None and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def build(out: Path, wide: bool = False, source: Path | None = None) -> None:
    from benchmarks.torch_bench import problems
    from convdsl import stream

    if wide:
        jobs = [(p, t) for p in _wide_problems(source) for t in WIDE_TILES]
    else:
        found = [p for p in problems([c.removesuffix("_fwd") for c in CASES]) if p.name in CASES]
        jobs = [(p, t) for p in found for t in ["cp.async", *TILES]]
    with ProcessPoolExecutor(2) as pool:
        kernels = list(pool.map(_compile, jobs))
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def narrow_grad_inputs_2d(base) -> list:
    """2D stride-1 grad_inputs with 64 output channels outside the suite, from ResNet-50's 3x3 one (`base`): its
    first stage at other sizes and batches, 128 -> 64 channels, and a VGG-like 112x112 layer."""
    return [base.with_(name=f"dgrad2d_k{k}_c64_{size}_n{n}", batch=n, out_channels=k, input=(size, size))
            for k, size, n in ((64, 56, 32), (64, 112, 16), (128, 56, 64), (128, 28, 64), (64, 28, 128))] + [
        base.with_(name="dgrad2d_k64_c64_5x5_56_n32", batch=32, filter=(5, 5), pad_lo=(2, 2), pad_hi=(2, 2))]


def plan_variant(p, label: str, **policy_names):
    """p's stream kernel for sm_90 as the rules plan it, named <case>:<label>, with the policy's names in
    `policy_names` replaced for the planning: how a probe builds a variant of a rule."""
    from convdsl import policy
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    with policy.overrides(**policy_names):
        return planned_stream_kernel(p.with_(name=f"{p.name}:{label}"), Target("cuda", "sm_90"), Knobs(), compile=True)


def build_variants(out: Path, found: list, variants, compile_job) -> None:
    """Each problem of `found` in each variant, compiled on two processes by compile_job((problem, variant)) (None
    where it cannot be built), saved as a bundle at `out` (build_jobs)."""
    print("problems:", [p.name for p in found], flush=True)
    build_jobs(out, [(p, v) for p in found for v in variants], compile_job)


def build_jobs(out: Path, jobs: list, compile_job) -> None:
    """Each job compiled on two processes by compile_job(job) (None where it cannot be built), saved as a bundle at
    `out`; a ring too deep for the SM's shared memory compiles but would not launch, so such kernels are left out."""
    from convdsl import stream
    from convdsl.targets import Target

    with ProcessPoolExecutor(2) as pool:
        kernels = [k for k in pool.map(compile_job, jobs) if k is not None]
    hopper = Target("cuda", "sm_90").gpu
    kernels = [k for k in kernels if all(sl.binary.shared_bytes <= hopper.workgroup_memory for sl in k.launches)]
    stream.save_bundle(kernels, out)
    print(f"wrote {out}: {len(kernels)} kernels")


def compile_candidate(job: tuple[dict, str]):
    """One probe candidate (spec, label) compiled for sm_90 as a kernel named <spec name>:<label>, or None where
    the problem cannot take it (said): "rule" the plan as policy makes it; "cpasync" the plan without TMA kernels;
    "cp:<tiles>" (or plain "<tiles>") forced cp.async tiles; "split<S>" the cp.async kernel with S split-K chunks;
    "tma" the TMA grad_weight, 1x1 layers in whole 64-channel blocks included; "tma:<tiles>" a forced TMA forward
    tile (of the forward a stride-1 grad_input runs as)."""
    from convdsl import policy
    from convdsl.kernels.tiles import parse_tiles
    from convdsl.policy import hopper
    from convdsl.problem import problem_from_spec
    from convdsl.stream import planned_stream_kernel
    from convdsl.targets import Target
    from convdsl.tuning.knobs import Knobs

    spec, label = job
    p = problem_from_spec({**spec, "name": f"{spec['name']}:{label}"})
    target = Target("cuda", "sm_90")
    try:
        if label == "rule":
            return planned_stream_kernel(p, target, Knobs(), compile=True)
        if label == "cpasync":
            return planned_stream_kernel(p, target, Knobs(), compile=True, tma=False)
        if label.startswith("split"):
            return planned_stream_kernel(p.with_(split_k=int(label[5:])), target, Knobs(), compile=True, tma=False)
        if label == "tma":  # the one-tap exclusion lifted, the kernel's other needs kept
            rule = policy.tma_grad_weight_reason

            def lifted(q, t):
                one_tap_only = (q.op == "grad_weight" and math.prod(q.filter) == 1 and q.dtype != "f32"
                                and hopper._tma_common_reason(q, t) is None
                                and q.in_channels % 64 == 0 and q.out_channels % 64 == 0)
                return None if one_tap_only else rule(q, t)

            with policy.overrides(tma_grad_weight_reason=lifted):
                kernel = planned_stream_kernel(p, target, Knobs(), compile=True)
            return kernel if "grad_weight_tma" in kernel.describe() else None
        if label.startswith("tma:"):
            forced = parse_tiles(label[4:])
            with policy.overrides(tma_forward_tiles=lambda q, t: forced, tma_forward_slower=lambda q, t: None):
                kernel = planned_stream_kernel(p, target, Knobs(), compile=True)
            return kernel if "forward_tma" in kernel.describe() else None
        return planned_stream_kernel(p, target, Knobs(tiles=label.removeprefix("cp:")), compile=True, tma=False)
    except Exception as err:  # a candidate the problem cannot take: left out, said
        print(f"skip {spec['name']} {label}: {type(err).__name__}: {str(err)[:100]}", flush=True)
        return None


def timed_rows(bundle: Path, cudnn_benchmark: bool = False) -> list[dict]:
    """Each kernel of the bundle (named <case>:<label>) called through the stream runner on random inputs,
    checked against cuDNN on the same tensors, both timed by CUDA-graph replay (cudnn_benchmark: cuDNN times its
    algorithms per shape first, as benchmarks/models.py trains)."""
    import torch

    from benchmarks.gpu_bench import TorchConv, random_args, reference, rel_error
    from benchmarks.torch_bench import _case_dict, graph_ms
    from convdsl import stream
    from convdsl.torch.stream import StreamRunner

    torch.backends.cudnn.benchmark = cudnn_benchmark
    dev = torch.device("cuda", 0)
    rows, cudnn_times = [], {}
    for k in stream.load_bundle(bundle):
        case, label = k.problem.name.split(":", 1)
        p = k.problem.with_(name=case)
        cd = _case_dict(p)
        args = random_args(cd, seed=1)
        conv = TorchConv(cd)
        targs = conv.to_torch(args)
        cudnn = conv.fn(conv.like(targs[0].dtype))
        if case not in cudnn_times:
            cudnn_times[case] = graph_ms(lambda: cudnn(*targs))
        cudnn_ms = cudnn_times[case]
        runner = StreamRunner(k, dev)
        if p.fp8_compute:  # cuDNN computes in f16: the check is against the reference on the rounded operands
            err = rel_error(runner(*args), reference(cd, conv, args)[0])
            checked = "error_vs_reference"
        else:
            err = rel_error(runner(*args), conv.from_torch(cudnn(*targs)).double())
            checked = "error_vs_cudnn"
        ms = graph_ms(lambda: runner(*args))
        rows.append({"case": case, "kernel": label, "tiles": k.tiles, "describe": k.describe(), "ms": ms,
                     checked: err, "cudnn_ms": cudnn_ms, "tflops": p.flops / ms / 1e9})
        print(f"{case:<44} {label:<16} {k.tiles:<22} {ms:.4f} ms err {err:.1e} cuDNN {cudnn_ms:.4f} -> "
              f"{cudnn_ms / ms:.2f}x {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
        del args, targs
        torch.cuda.empty_cache()
    return rows


def versions(command: str) -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "command": command}


def ms_by_case(rows: list[dict]) -> dict:
    """{case: {kernel label: ms}} of timed_rows' rows."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["kernel"]] = r["ms"]
    return by_case


def geomean_ratio(by_case: dict, base: str, other: str) -> float | None:
    """The geometric mean over cases of base's time / other's, where a case has both."""
    pairs = [(t[base], t[other]) for t in by_case.values() if base in t and other in t]
    return math.exp(sum(math.log(a / b) for a, b in pairs) / len(pairs)) if pairs else None


def write_record(result: Path, command: str, rows: list[dict], summary: dict | None = None) -> None:
    record = {"versions": versions(command), **({"summary": summary} if summary is not None else {}),
              "results": rows}
    result.write_text(json.dumps(record, indent=1) + "\n")


def run(bundle: Path, result: Path) -> None:
    write_record(result, "python3 benchmarks/probes/tma_forward.py run TMA.convk OUT.json", timed_rows(bundle))


def probe_main(doc: str, build, run, argv=None, extra=None) -> int:
    """A probe's command line: `build BUNDLE` (build(bundle, **extra options)) where Triton is, `run BUNDLE OUT.json`
    on the GPU.  extra: (flag, argparse keyword arguments) of build's further options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("build", "run"))
    ap.add_argument("bundle", type=Path)
    ap.add_argument("result", type=Path, nargs="?")
    for flag, kwargs in extra or ():
        ap.add_argument(flag, **kwargs)
    args = vars(ap.parse_args(argv))
    mode, bundle, result = args.pop("mode"), args.pop("bundle"), args.pop("result")
    if mode == "build":
        build(bundle, **args)
    elif result is None:
        ap.error("run: OUT.json is required")
    else:
        run(bundle, result)
    return 0


def main(argv=None) -> int:
    return probe_main(__doc__, build, run, argv,
                      extra=[("--wide", dict(action="store_true")), ("--from", dict(type=Path, dest="source"))])


if __name__ == "__main__":
    raise SystemExit(main())
