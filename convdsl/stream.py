"""Stream kernels: a kernel's Triton launches, compiled ahead of time, with what a framework needs to run them
on its own CUDA stream (convdsl/torch/stream.py does it for PyTorch).

    kernel = stream_kernel(problem, Target("cuda", "sm_90"))     # planned and compiled once, cached on disk
    save_bundle([kernel, ...], "kernels.convk")                  # a deployable file: no Triton needed to load it
    register_bundle(load_bundle("kernels.convk"))                # later stream_kernel() calls find them here

A stream kernel is the `stream` of the kernel's one plan (passes/plan.py: the same knobs, looked up once, and
the same cp.async launches the IREE module embeds, or on Hopper a TMA kernel), compiled with the same compile
driver (kernels.compile).  Around the GEMM core the module's linalg steps become launches too
(kernels/elementwise.py): the fp8 rounding of the operands, grad_weight's split-K sum in chunk order with its
epilogue and cast; NHWGC copies of NGCHW activations are transpose launches or left to the framework.
"""
from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from . import cache, policy
from .kernels.compile import compile_launch, compile_tma_launch, triton_version
from .kernels.launch import Binary, Launch, TmaMap
from .kernels.stream_kernel import StreamKernel, StreamLaunch
from .kernels.tiles import parse_tiles
from .passes.plan import KernelPlan, plan, plan_kernel
from .problem import ConvProblem, problem_from_spec, problem_to_spec
from .targets import Target
from .tuning.knobs import Knobs

__all__ = ["Knobs", "StreamKernel", "StreamLaunch", "build_kernel", "bundle_bytes", "compile_kernel", "kernel_key",
           "load_bundle", "planned_stream_kernel", "register_bundle", "save_bundle", "stream_kernel",
           "unsupported_reason"]

BUNDLE_FORMAT = "convdsl-stream-kernels/1"
_SUFFIX = ".stream.json"


def unsupported_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why `p` has no stream kernel on `target` (None: it has one)."""
    return plan(p, target).stream_reason


def planned_stream_kernel(p: ConvProblem, target: Target, knobs: Knobs, source: str = "knobs given",
                          compile: bool = False, tma: bool = True) -> StreamKernel:
    """The stream kernel of p's plan with `knobs` (passes/plan.plan_kernel), compiled for target.arch with
    `compile` (else the binaries are empty: Triton's interpreter runs the launches from their source); a
    ValueError says why where the plan has none.  tma: whether a TMA kernel may be chosen."""
    planned = plan_kernel(p, target, knobs, source, tma=tma)
    if planned.stream is None:
        raise ValueError(f"kernel {p.name}: no stream kernel on {target}: {planned.stream_reason}")
    return compile_kernel(planned.stream) if compile else planned.stream


def kernel_key(planned: KernelPlan) -> str:
    """Everything that changes a stream kernel: its plan (every launch with its compile-time constants, the
    tiles, the split, the copies: all the tuning database's knobs decided), those knobs, convdsl's source and the
    Triton that compiles it (None where Triton is absent: such a machine only runs what was compiled elsewhere).
    Keyed on the plan rather than on the database, a `convdsl tune collect` that changes a kernel's knobs changes
    its key, and one that changes other kernels' entries leaves it."""
    kernel = planned.stream
    assert kernel is not None, planned.stream_reason
    material = {"format": BUNDLE_FORMAT, "problem": kernel.problem.record(), "arch": kernel.arch,
                "plan": _to_record(kernel, _planned_launch_record), "knobs": planned.knobs.as_dict(),
                "source": cache.source_digest(), "triton": triton_version()}
    return cache.cache_key(material)


def compile_kernel(planned: StreamKernel) -> StreamKernel:
    """The planned kernel with every launch compiled for its arch (Triton): the plan decides, this only builds.
    A TMA kernel's maps come back with the binary's boxes and swizzles, and its parameters' kinds."""
    arch = planned.arch

    def plain(sl: StreamLaunch) -> StreamLaunch:
        return StreamLaunch(sl.launch, compile_launch(sl.launch, arch))

    changes: dict = {}
    if planned.tma_maps:
        (core,) = planned.launches
        binary, maps, kinds = compile_tma_launch(core.launch, planned.tma_maps, arch)
        changes.update(launches=(StreamLaunch(core.launch, binary),), tma_maps=maps, tma_params=kinds)
    else:
        changes.update(launches=tuple(map(plain, planned.launches)))
    return replace(planned, **changes, sum=plain(planned.sum) if planned.sum else None,
                   rounds=tuple(map(plain, planned.rounds)), copy_in=tuple(map(plain, planned.copy_in)),
                   copy_out=plain(planned.copy_out) if planned.copy_out else None,
                   staging=tuple(map(plain, planned.staging)))


_registered: dict[tuple[str, str], StreamKernel] = {}


def _bundle_key(p: ConvProblem, arch: str) -> tuple[str, str]:
    return json.dumps(p.record(), sort_keys=True), arch


def register_bundle(kernels: Iterable[StreamKernel]) -> None:
    """Make these kernels (from load_bundle) the ones stream_kernel returns for their problems and arch."""
    for k in kernels:
        _registered[_bundle_key(k.problem, k.arch)] = k


def stream_kernel(p: ConvProblem, target: Target) -> StreamKernel:
    """The stream kernel of `p` on `target`: a registered bundle's, else the disk cache's, else compiled
    (with Triton) and cached."""
    found = _registered.get(_bundle_key(p, target.arch))
    if found is not None:
        return found
    return build_kernel(plan(p, target))


def build_kernel(planned_kernel: KernelPlan) -> StreamKernel:
    """The compiled stream kernel of a plan: the disk cache's, else compiled (with Triton) and cached under the
    plan's key (kernel_key)."""
    planned = planned_kernel.stream
    if planned is None:
        p = planned_kernel.problem
        raise ValueError(f"kernel {p.name}: no stream kernel on {planned_kernel.target}: "
                         f"{planned_kernel.stream_reason}")
    key = kernel_key(planned_kernel)
    data = cache.load(key, verify=False, suffix=_SUFFIX)
    if data is not None:
        try:
            return _from_record(json.loads(data))
        except (ValueError, KeyError, TypeError):
            cache.evict(key)
    kernel = compile_kernel(planned)
    cache.store(key, json.dumps(_to_record(kernel)).encode(), suffix=_SUFFIX)
    return kernel


# --- the bundle format ------------------------------------------------------------------------------

def _to_record(k: StreamKernel, launch_record: Optional[Callable[[StreamLaunch], dict]] = None) -> dict:
    """The kernel as JSON; `launch_record` writes each launch (default: _launch_record, binary and all)."""
    record = launch_record or _launch_record
    return {
        "problem": problem_to_spec(k.problem), "arch": k.arch, "planned": problem_to_spec(k.planned),
        "copied": list(k.copied), "partials_shape": list(k.partials_shape), "tiles": k.tiles,
        "knobs_source": k.knobs_source, "triton": triton_version(),
        "launches": [record(sl) for sl in k.launches],
        "sum": record(k.sum) if k.sum else None,
        "rounds": [record(sl) for sl in k.rounds],
        "weight_axes": list(k.weight_axes),
        "copy_in": [record(sl) for sl in k.copy_in],
        "copy_out": record(k.copy_out) if k.copy_out else None,
        "tma_maps": [asdict(m) for m in k.tma_maps], "tma_params": list(k.tma_params),
        "tma_flipped_weight": k.tma_flipped_weight,
        "staging": [record(sl) for sl in k.staging], "staged_shapes": [list(v) for v in k.staged_shapes],
        "halo_splits": k.halo_splits, "promote_every": k.promote_every,
    }


def _planned_launch_record(sl: StreamLaunch) -> dict:
    # what decides a launch's binary and its call, before compiling: the kernel, its constants and its grid
    la = sl.launch
    return {"kernel": la.kernel, "name": la.name, "pointer_types": list(la.pointer_types),
            "constants": [[name, value] for name, value in la.constants], "grid": list(la.grid), "warps": la.warps,
            "stages": la.stages}


def _launch_record(sl: StreamLaunch) -> dict:
    return {
        "kernel": sl.launch.kernel, "name": sl.launch.name, "pointer_types": list(sl.launch.pointer_types),
        "grid": list(sl.launch.grid), "warps": sl.launch.warps, "stages": sl.launch.stages,
        "binary": {"name": sl.binary.name, "kind": sl.binary.kind, "threads": sl.binary.threads,
                   "shared_bytes": sl.binary.shared_bytes, "params": sl.binary.params,
                   "data": base64.b64encode(sl.binary.data).decode()},
    }


def _launch_from_record(la: dict) -> StreamLaunch:
    b = la["binary"]
    # the launch's compile-time constants live in the binary; the runtime needs only its grid and name
    launch = Launch(la["kernel"], la["name"], tuple(la["pointer_types"]), (), tuple(la["grid"]), la["warps"],
                    la["stages"])
    binary = Binary(b["name"], base64.b64decode(b["data"]), b["kind"], b["threads"], b["shared_bytes"], b["params"])
    return StreamLaunch(launch, binary)


def _from_record(r: dict) -> StreamKernel:
    problem = problem_from_spec(r["problem"])
    planned = problem_from_spec(r["planned"])
    return StreamKernel(problem, r["arch"], problem if planned == problem else planned, tuple(r["copied"]),
                        tuple(_launch_from_record(la) for la in r["launches"]), tuple(r["partials_shape"]),
                        r["tiles"], r["knobs_source"], _launch_from_record(r["sum"]) if r["sum"] else None,
                        tuple(_launch_from_record(la) for la in r["rounds"]), tuple(r.get("weight_axes", ())),
                        tuple(_launch_from_record(la) for la in r.get("copy_in", [])),
                        _launch_from_record(r["copy_out"]) if r.get("copy_out") else None,
                        tuple(TmaMap(**{key: tuple(v) if isinstance(v, list) else v for key, v in m.items()})
                              for m in r.get("tma_maps", [])),
                        tuple(r.get("tma_params", [])), bool(r.get("tma_flipped_weight", False)),
                        tuple(_launch_from_record(la) for la in r.get("staging", [])),
                        tuple(tuple(v) for v in r.get("staged_shapes", [])),
                        *_compiled_in_decisions(r, problem))


def _compiled_in_decisions(r: dict, problem: ConvProblem) -> tuple[int, int]:
    """The record's halo_splits and promote_every; a bundle written before they were recorded has the rules'
    values (they have not changed since), so that its kernels still say them."""
    if "halo_splits" in r:
        return r["halo_splits"], r["promote_every"]
    kernels = [la["kernel"] for la in r["launches"]]
    arch = Target("cuda", r["arch"])
    halo = 0
    if kernels == ["forward_halo"]:
        flipped = bool(r.get("tma_flipped_weight", False))
        halo = policy.halo_forward_split(policy.grad_input_as_forward(problem) if flipped else problem, arch)
    promote = (policy.tma_grad_weight_promote(problem, parse_tiles(r["tiles"]))
               if problem.dtype == "f32" and kernels == ["grad_weight_tma"] else 0)
    return halo, promote


def save_bundle(kernels: Iterable[StreamKernel], path: Union[str, Path]) -> Path:
    """Write the kernels to one JSON file (binaries in base64)."""
    path = Path(path)
    path.write_bytes(bundle_bytes(kernels))
    return path


def bundle_bytes(kernels: Iterable[StreamKernel]) -> bytes:
    """The bundle file's contents (save_bundle writes them): JSON, the binaries in base64, with a checksum."""
    records = [_to_record(k) for k in kernels]
    digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
    return (json.dumps({"format": BUNDLE_FORMAT, "sha256": digest, "kernels": records}) + "\n").encode()


def load_bundle(path: Union[str, Path]) -> list[StreamKernel]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{path}: expected a {BUNDLE_FORMAT} bundle, got format {data.get('format')!r}")
    digest = hashlib.sha256(json.dumps(data["kernels"], sort_keys=True).encode()).hexdigest()
    if digest != data.get("sha256"):
        raise ValueError(f"{path}: the bundle's checksum does not match its contents (truncated or edited)")
    return [_from_record(r) for r in data["kernels"]]
