"""Stream kernels: a kernel's Triton launches, compiled ahead of time, with what a framework needs to run them
on its own CUDA stream (convdsl/torch/stream.py does it for PyTorch).

    kernel = stream_kernel(problem, Target("cuda", "sm_90"))     # planned and compiled once, cached on disk
    save_bundle([kernel, ...], "kernels.convk")                  # a deployable file: no Triton needed to load it
    register_bundle(load_bundle("kernels.convk"))                # later stream_kernel() calls find them here

They are the kernels the IREE modules embed: the same decisions (policy.extern_launches, with the tuning
database's knobs, looked up as the compile driver does) and the same binaries (kernels.compile.compile_launch).
Around the GEMM core the module's linalg steps become launches too (kernels/elementwise.py): the fp8 rounding
of the operands, grad_weight's split-K sum in chunk order with its epilogue and cast; NHWGC copies of NGCHW
activations are left to the framework (a permuted copy).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from . import cache, policy
from .kernels.compile import compile_launch, compile_tma_launch, triton_version
from .kernels.elementwise_launches import round_fp8_launch, space_to_depth_launch, transpose_launch
from .kernels.launch import Binary, Launch, TmaMap
from .kernels.tiles import parse_tiles
from .problem import ConvProblem, problem_from_spec, problem_to_spec, weight_axes_name
from .targets import Target
from .tuning import resolve
from .tuning.knobs import Knobs

__all__ = ["Knobs", "StreamKernel", "StreamLaunch", "StreamPlan", "build_kernel", "bundle_bytes", "compile_kernel",
           "load_bundle", "plan_stream_kernel", "register_bundle", "save_bundle", "stream_kernel", "stream_plan",
           "unsupported_reason"]

BUNDLE_FORMAT = "convdsl-stream-kernels/1"
_SUFFIX = ".stream.json"


@dataclass(frozen=True)
class StreamLaunch:
    launch: Launch
    binary: Binary


@dataclass(frozen=True)
class StreamKernel:
    """One kernel's launches and what surrounds them.  `planned` is the problem the launches were planned for:
    `problem` itself, its NHWGC twin where the arguments named in `copied` are copied to NHWGC first (and
    the result, if it is an activation, copied back), or the stride-1 forward its staging copies regroup its
    operands for (policy.space_to_depth_forward)."""

    problem: ConvProblem
    arch: str
    planned: ConvProblem
    copied: tuple[str, ...]
    launches: tuple[StreamLaunch, ...]  # the GEMM core (one launch)
    partials_shape: tuple[int, ...]
    tiles: str
    knobs_source: str
    sum: Optional[StreamLaunch] = None  # grad_weight: the split-K sum, epilogue and cast
    rounds: tuple[StreamLaunch, ...] = ()  # fp8 compute: operand A's rounding, then B's
    # the launches read a copy of the weight with its axes in this order (policy.weight_copy_axes; empty: none)
    weight_axes: tuple[str, ...] = ()
    # the NGCHW -> NHWGC copies of the arguments in `copied` (in that order) and the result's copy back, as
    # transpose launches (kernels/elementwise.py); empty where a grid would pass CUDA's limits (then the runner
    # copies with PyTorch)
    copy_in: tuple[StreamLaunch, ...] = ()
    copy_out: Optional[StreamLaunch] = None
    # a TMA kernel (forward on Hopper, kernels/tma.py): the descriptors the runner makes per call over its
    # operands and result, and the kinds of the binary's parameters ("map", "u32", "u64") in order
    tma_maps: tuple[TmaMap, ...] = ()
    tma_params: tuple[str, ...] = ()
    # grad_input as forward on the TMA kernel (policy.grad_input_as_forward), its weight read with the taps reversed
    tma_flipped_weight: bool = False
    # the operands' staging copies, in operand order, and their shapes: the kernel reads these instead (the
    # flat-plane grad_weight's, policy.tma_flat_grad_weight_reason; space-to-depth's, space_to_depth_forward)
    staging: tuple[StreamLaunch, ...] = ()
    staged_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def result_copied(self) -> bool:
        """Whether the launches write an NHWGC result that is then copied to the problem's layout."""
        return bool(self.copied) and self.problem.op != "grad_weight"

    def describe(self) -> str:
        names = ", ".join(sl.launch.kernel for sl in self.launches)
        if self.tma_maps:
            how = "; grad_input as the forward convolution of dY with the flipped weight" \
                if self.tma_flipped_weight else ""
            if self.weight_axes:  # one-pass TF32: the weight's K-innermost copy, its tap tiles read in reverse
                how += f"; w copied to {weight_axes_name(self.problem, self.weight_axes)}, read taps reversed"
            if names == "grad_input_phases_tma":
                return (f"stream path: Gluon kernel {names} (every stride phase a forward of dY over its taps of the "
                        f"weight, on TMA im2col copies and wgmma, all phases in one persistent launch, dX stored by "
                        f"address; tiles {self.tiles}, {self.arch}); knobs from the {self.knobs_source}")
            if names == "forward_halo":
                # (a bundle's launches keep no constants: the rule says it, from the problem)
                q = policy.grad_input_as_forward(self.problem) if self.tma_flipped_weight else self.problem
                split = policy.halo_forward_split(q, Target("cuda", self.arch))
                return (f"stream path: Gluon kernel {names} (each input plane copied once into shared memory per "
                        f"row tile, every tap's rows gathered from it into wgmma, three output planes accumulated "
                        f"at once, {split} plane range(s) per row tile; tiles {self.tiles}, {self.arch}){how}; knobs "
                        f"from the {self.knobs_source}")
            if names == "grad_weight_flat_tma":
                products = ("fp8 wgmma (f32 sums)" if self.problem.fp8_compute else "one-pass TF32 wgmma")
                return (f"stream path: Gluon kernel {names} ({products} on TMA copies of X and dY laid "
                        f"channel-first on flat planes; tiles {self.tiles}, {self.arch}); knobs from the "
                        f"{self.knobs_source}")
            if self.problem.dtype == "f32" and names == "grad_weight_tma":
                blocks = self.staged_shapes[0][0] // self.problem.batch if self.staged_shapes else 0
                products = (f"16-bit wgmma over X and dY split into bf16 parts, {blocks} products per product "
                            f"(bf16x{blocks})")
                # (a bundle's launches keep no constants: the rule says it, from the problem and the tiles)
                promote = policy.tma_grad_weight_promote(self.problem, parse_tiles(self.tiles))
                if promote:
                    products += f", wgmma's sums added in f32 every {promote} steps"
            elif not self.problem.fp8_compute:
                products = "wgmma"
            elif names == "grad_weight_tma":
                products = "16-bit wgmma over X and dY rounded to fp8 values in f16 copies"
            else:
                products = "fp8 wgmma (f32 sums) over X and W rounded into fp8 copies"
            # a warp-specialised binary runs more threads than its product warps (its copy warp's warp group)
            if any(sl.binary.threads > 32 * sl.launch.warps for sl in self.launches):
                products += ", the copies issued by a warp of their own"
            return (f"stream path: Gluon kernel {names} (TMA im2col copies and {products}; tiles {self.tiles}, "
                    f"{self.arch}){how}; knobs from the {self.knobs_source}")
        copies = f"; {', '.join(self.copied)} copied to NHWGC" if self.copied else ""
        if self.problem.op == "forward" and names == "grad_input_phases":  # forward runs as one phase of it
            names += " (the forward as one implicit GEMM, one stride phase of grad_input's kernel)"
        if self.staging:
            p = self.planned
            copies += (f"; x and w regrouped space-to-depth, stride 1 over {p.in_channels} channels and "
                       f"{'x'.join(map(str, p.filter))} taps")
        copies += f"; w copied to {weight_axes_name(self.problem, self.weight_axes)}" if self.weight_axes else ""
        return (f"stream path: Triton kernels {names} (tiles {self.tiles}, {self.arch}){copies}; "
                f"knobs from the {self.knobs_source}")


def _knobs(p: ConvProblem, target: Target) -> tuple[Knobs, str]:
    # the compile driver's lookup: the stream kernel and the IREE module of a problem take the same knobs
    return resolve.lookup(p, target)


@dataclass(frozen=True)
class StreamPlan:
    """The stream kernel of a problem as planned with its knobs, its launches not yet compiled, or why there is
    none (then `kernel` is None)."""

    knobs: Knobs
    kernel: Optional[StreamKernel]
    reason: Optional[str] = None


def stream_plan(p: ConvProblem, target: Target, looked_up: Optional[tuple[Knobs, str]] = None) -> StreamPlan:
    """The plan of p's stream kernel on `target` with its knobs (the tuning database's, else the rules'), or why
    there is none: what unsupported_reason says and what stream_kernel compiles, planned once.  `looked_up`: the
    knobs and their source as the caller looked them up (compiler.plan, for both artifacts), else looked up here."""
    if target.backend != "cuda":
        return StreamPlan(Knobs(), None, f"stream kernels are CUDA kernels; target is {target.backend}")
    if p.epilogue.steps or p.prologue.kind != "none":  # the stream kernels apply a scale at most
        return StreamPlan(Knobs(), None, "the stream kernels take no fused epilogue steps or prologue")
    knobs, source = looked_up if looked_up is not None else _knobs(p, target)
    return _planned(p, target, knobs, source, policy.overrides_generation())


@functools.lru_cache(maxsize=256)
def _planned(p: ConvProblem, target: Target, knobs: Knobs, source: str, rules: int) -> StreamPlan:
    # a pure function of frozen arguments (the database's entry arrives as the knobs, policy.overrides as the rules'
    # generation): cached, so that asking whether a kernel exists and then building it plans it once
    use, _, reason = policy.extern_choice(p, target, knobs)
    if not use:
        return StreamPlan(knobs, None, reason)
    try:
        return StreamPlan(knobs, plan_stream_kernel(p, target, knobs, source))
    except ValueError as err:  # a plan the kernels cannot run (a split_k the TMA kernel cannot cut, ...)
        return StreamPlan(knobs, None, str(err))


def unsupported_reason(p: ConvProblem, target: Target) -> Optional[str]:
    """Why `p` has no stream kernel on `target` (None: it has one)."""
    return stream_plan(p, target).reason


def kernel_key(planned: StreamKernel, knobs: Knobs) -> str:
    """Everything that changes a stream kernel: its plan (every launch with its compile-time constants, the
    tiles, the split, the copies: all the tuning database's knobs decided), those knobs, convdsl's source and the
    Triton that compiles it (None where Triton is absent: such a machine only runs what was compiled elsewhere).
    Keyed on the plan rather than on the database, a `convdsl tune collect` that changes a kernel's knobs changes
    its key, and one that changes other kernels' entries leaves it."""
    material = {"format": BUNDLE_FORMAT, "problem": planned.problem.record(), "arch": planned.arch,
                "plan": _to_record(planned, _planned_launch_record), "knobs": knobs.as_dict(),
                "source": cache.source_digest(), "triton": triton_version()}
    return cache.cache_key(material)


def plan_stream_kernel(p: ConvProblem, target: Target, knobs: Knobs, source: str = "knobs given",
                       compile: bool = False, tma: bool = True) -> StreamKernel:
    """The stream kernel's launches as policy decides them with `knobs`; compiled for target.arch with
    `compile` (else the binaries are empty: Triton's interpreter runs the launches from their source).  tma:
    whether a TMA kernel may be chosen (Triton's interpreter runs none)."""
    tma_plan = policy.tma_stream_launch(p, target, knobs) if tma else None
    if tma_plan is not None:
        launch, maps, flipped, partials, tiles, staging, weight_copy = tma_plan
        summed = _uncompiled(policy.split_k_sum(p, partials, launch.name, target)) if p.op == "grad_weight" else None
        planned = StreamKernel(p, target.arch, p, (), (_uncompiled(launch),), partials, tiles.label(), source, summed,
                               weight_axes=weight_copy, tma_maps=maps, tma_flipped_weight=flipped,
                               staging=tuple(_uncompiled(la) for la, _ in staging),
                               staged_shapes=tuple(shape for _, shape in staging))
        return compile_kernel(planned) if compile else planned
    # a few-channel strided forward runs stride 1 over its operands regrouped space-to-depth (two copies first)
    regrouped = policy.space_to_depth_forward(p)
    ext = policy.extern_launches(regrouped or p, target, knobs)
    if ext is None:
        _, _, reason = policy.extern_choice(regrouped or p, target, knobs)
        raise ValueError(f"kernel {p.name}: no stream kernel on {target}: {reason}")

    base = ext.launches[0].name
    staging = tuple(space_to_depth_launch(p, regrouped, name, base) for name in p.arg_names) if regrouped else ()
    summed = (_uncompiled(policy.split_k_sum(p, ext.partials_shape, base, target)) if p.op == "grad_weight"
              else None)
    rounds = ()
    if p.fp8_compute:
        rounds = tuple(_uncompiled(round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}"))
                       for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute)))
    copy_in, copy_out = _layout_copies(p, ext.copied_channels_last, base, p.op != "grad_weight")
    planned = StreamKernel(p, target.arch, ext.problem, ext.copied_channels_last,
                           tuple(map(_uncompiled, ext.launches)), ext.partials_shape, ext.tiles.label(), source,
                           summed, rounds, ext.weight_axes, tuple(map(_uncompiled, copy_in)),
                           _uncompiled(copy_out) if copy_out else None,
                           staging=tuple(_uncompiled(la) for la, _ in staging),
                           staged_shapes=tuple(shape for _, shape in staging))
    return compile_kernel(planned) if compile else planned


def _uncompiled(la: Launch) -> StreamLaunch:
    # a planned launch: its binary is compiled later (compile_kernel), or never (Triton's interpreter runs it)
    return StreamLaunch(la, Binary(la.name, b"", "none", 32 * la.warps, 0, 0))


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


def _layout_copies(p: ConvProblem, copied: tuple[str, ...], base: str, result_copied: bool
                   ) -> tuple[tuple[Launch, ...], Optional[Launch]]:
    """The transposes of the NGCHW arguments in `copied` to NHWGC (per image: [G*C, positions] to its transpose)
    and of the NHWGC result back; none at all where one would not fit CUDA's grid."""
    if not copied:
        return (), None
    ins = []
    for name in copied:
        i = p.arg_names.index(name)
        shape = p.arg_shapes[i]  # (N, G, C, spatial...)
        ins.append(transpose_launch(shape[0], shape[1] * shape[2], math.prod(shape[3:]), p.arg_dtypes[i],
                                    f"{base}_{name}"))
    out = None
    if result_copied:
        shape = p.result_shape
        out = transpose_launch(shape[0], math.prod(shape[3:]), shape[1] * shape[2], p.result_dtype, f"{base}_out")
    if any(la is None for la in ins) or (result_copied and out is None):
        return (), None
    return tuple(ins), out


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
    return build_kernel(stream_plan(p, target), p, target)


def build_kernel(plan: StreamPlan, p: ConvProblem, target: Target) -> StreamKernel:
    """The compiled kernel of `plan` (p's on `target`): the disk cache's, else compiled (with Triton) and cached
    under its plan's key (kernel_key)."""
    if plan.kernel is None:
        raise ValueError(f"kernel {p.name}: no stream kernel on {target}: {plan.reason}")
    planned = plan.kernel
    key = kernel_key(planned, plan.knobs)
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
                        tuple(tuple(v) for v in r.get("staged_shapes", [])))


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
