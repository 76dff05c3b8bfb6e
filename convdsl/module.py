"""A compiled module on its device: its kernels called with NumPy arrays, its manifest, and the target it
was built for.  Needs only `iree.runtime`: deployed `.vmfb` files are loaded without the compiler.

    mod = convdsl.compile("examples/resnext.conv", target="cpu")    # a CompiledModule (convdsl/compiler.py)
    dx = mod.dgrad(dy, w)
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from . import __version__, policy
from .abi import ASYNC_SUFFIX, INTO_SUFFIX
from .backends.into_call import IntoCall
from .backends.iree import LoadedModule, iree_version
from .problem import ConvProblem, problem_to_spec
from .reference import NUMPY_DTYPES
from .targets import Target, native_cuda_arch


# the argument signatures a Kernel remembers as checked (a program that calls with ever new shapes only refills them)
CHECKED_SIGNATURES_KEPT = 256


class ArgumentError(TypeError):
    """A kernel was called with arguments of the wrong number, shape or dtype."""


def resolve_target(target: Union[str, Target] = "cpu", arch: Optional[str] = None) -> Target:
    """'auto' picks CUDA when a CUDA device is present, for that device's arch unless `arch` names one
    (targets.native_cuda_arch: sm_90 on H100/H200, for wgmma cubins and the tiles tuned there), else the host
    CPU (an arch given with 'auto' names the GPU's and applies only when a GPU is picked; `target="cpu"` takes
    an LLVM CPU name).
    An explicit 'cuda' keeps the portable default arch (sm_80 PTX, which runs on any recent NVIDIA GPU)."""
    if isinstance(target, Target):
        return target
    if target == "auto":
        target = "cuda" if cuda_available() else "cpu"
        if target == "cuda" and arch is None:
            arch = native_cuda_arch()
        elif target == "cpu":
            arch = None  # an arch names the GPU to use when there is one; the CPU fallback compiles for the host
    return Target.parse(target, arch)


def cuda_available() -> bool:
    try:
        import iree.runtime as rt  # optional here: no runtime means no CUDA

        return bool(rt.get_driver("cuda").query_available_devices())
    except Exception:  # no driver, no device, or no libcuda: all mean "no CUDA here"
        return False


def manifest(problems: Sequence[ConvProblem], target: Target,
             iree_config: Optional[Mapping[str, dict]] = None) -> dict:
    """What `convdsl compile` writes beside the .vmfb: enough to call every function without convdsl; and,
    where the compile recorded it, what each kernel's knobs over IREE's configuration became (`iree_config`:
    the scaling applied, or `default_kept`: why IREE's own configuration was kept)."""
    kernels = []
    for p in problems:
        kernels.append(
            {
                "function": p.name,
                # the destination-passing twin: (args..., out, workspace) -> out, allocating nothing
                "into_function": p.name + INTO_SUFFIX,
                # the same with a wait and a signal fence after its arguments (IREE's coarse-fences model)
                "into_async_function": p.name + INTO_SUFFIX + ASYNC_SUFFIX,
                "op": p.op,
                "problem": p.describe(),
                # a dynamic batch (`batch = ?`) is written as null
                "args": [
                    {"name": n, "shape": _manifest_shape(p, s, batched), "dtype": d, "layout": _layout_of(p, n)}
                    for n, s, d, batched in zip(p.arg_names, p.arg_shapes, p.arg_dtypes, p.arg_batched)
                ],
                "result": {"name": p.result_name, "shape": _manifest_shape(p, p.result_shape, p.op != "grad_weight"),
                           "dtype": p.result_dtype, "layout": _layout_of(p, p.result_name)},
                "flops": p.flops,
                "spec": problem_to_spec(p),
            }
        )
        if iree_config and p.name in iree_config:
            kernels[-1]["iree_config"] = iree_config[p.name]
    return {
        "target": target.backend,
        "arch": target.arch,
        "convdsl_version": __version__,
        "iree_version": iree_version(),
        "kernels": kernels,
    }


def _memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the OS does not say: then no workspace is kept)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def concrete_problem(p: ConvProblem, args: Sequence) -> ConvProblem:
    """p at the batch of these arguments (arrays or tensors with a .shape): with `batch = ?`, the first
    activation's; otherwise p itself."""
    if not p.dynamic_batch:
        return p
    first = next(a for a, batched in zip(args, p.arg_batched) if batched)
    return p.with_(batch=int(first.shape[p.batch_axis("x")]), dynamic_batch=False)


def _result_shape(p: ConvProblem, args: Sequence[np.ndarray]) -> tuple[int, ...]:
    return concrete_problem(p, args).result_shape


def _manifest_shape(p: ConvProblem, shape: tuple[int, ...], batched: bool) -> list:
    sizes: list = list(shape)
    if p.dynamic_batch and batched:
        sizes[p.batch_axis("x")] = None
    return sizes


def _layout_of(p: ConvProblem, name: str) -> str:
    if name in ("w", "dw"):
        return p.layout_name("w")
    if name in ("bias", "scale", "shift"):  # per-channel vectors (G, channels of the result)
        return "GC" if p.op == "transposed" else "GK"
    if name == "residual":
        return _layout_of(p, p.result_name)
    if name == "saved":
        return p.layout_name("y")
    if p.op == "transposed":
        return p.layout_name("y" if name == "x" else "x")
    return p.layout_name("y" if name in ("dy", "y") else "x")


@dataclass
class Kernel:
    """One compiled function: checks its arguments, then runs on the module's device."""

    problem: ConvProblem
    module: "CompiledModule"
    # the (shape, dtype) signatures of NumPy arguments that passed check_args: the problem's shapes are properties
    # worked out on every read, and checking them took about 8 us a call, more than a small kernel's Python besides
    checked: set = field(default_factory=set, repr=False, compare=False)

    def __call__(self, *args: np.ndarray) -> np.ndarray:
        signature = tuple((a.shape, a.dtype) for a in args) if all(type(a) is np.ndarray for a in args) else None
        if signature is None or signature not in self.checked:
            self.check_args(args)
            if signature is not None:
                if len(self.checked) >= CHECKED_SIGNATURES_KEPT:
                    self.checked.clear()
                self.checked.add(signature)
        self._check_same_batch(args)
        return self.module.call(self.problem, args)

    def _check_same_batch(self, args: Sequence[np.ndarray]) -> None:
        p = self.problem
        if not p.dynamic_batch:
            return
        axis = p.batch_axis("x")
        batches = {n: a.shape[axis] for n, batched, a in zip(p.arg_names, p.arg_batched, args) if batched}
        if len(set(batches.values())) > 1:
            raise ArgumentError(f"{p.name}: activation arguments must share one batch size, got {batches}")

    def check_args(self, args: Sequence[np.ndarray]) -> None:
        p = self.problem
        sig = ", ".join(p.arg_names)
        if len(args) != len(p.arg_names):
            raise ArgumentError(f"{p.name}({sig}): expected {len(p.arg_names)} arrays, got {len(args)}")
        for name, shape, dt, a, batched in zip(p.arg_names, p.arg_shapes, p.arg_dtypes, args, p.arg_batched):
            got_shape = tuple(getattr(a, "shape", ()))
            if p.dynamic_batch and batched and len(got_shape) == len(shape):
                # `batch = ?`: any batch is fine, as long as every activation argument has the same one
                axis = p.batch_axis("x")
                shape = shape[:axis] + (got_shape[axis],) + shape[axis + 1:]
            if got_shape != tuple(shape):
                raise ArgumentError(
                    f"{p.name}: argument {name!r} expected shape {list(shape)} ({_layout_of(p, name)}), "
                    f"got {list(got_shape)}"
                )
            want = np.dtype(NUMPY_DTYPES[dt])
            if np.dtype(getattr(a, "dtype", None)) != want:
                raise ArgumentError(f"{p.name}: argument {name!r} expected dtype {dt} ({want}), got {a.dtype}")


class CompiledModule:
    """A .vmfb with one function per kernel, loaded on its target's device; kernels are attributes."""

    def __init__(self, problems: Sequence[ConvProblem], target: Target, vmfb: bytes,
                 iree_config: Optional[Mapping[str, dict]] = None) -> None:
        self.problems = {p.name: p for p in problems}
        self.target = target
        self.vmfb = vmfb
        # per kernel, what its knobs over IREE's configuration became (compiler.iree_config_notes); None: unknown
        self.iree_config = dict(iree_config) if iree_config is not None else None
        self._loaded: Optional[LoadedModule] = None
        # per kernel: the argument shapes of its last call, and the destination-passing call with the workspace it
        # keeps for them (None: it keeps none; see call)
        self._into_calls: dict[str, tuple[tuple, Optional[IntoCall]]] = {}
        self._calling = threading.Lock()

    @property
    def loaded(self) -> LoadedModule:
        if self._loaded is None:
            self._loaded = LoadedModule(self.vmfb, self.target)
        return self._loaded

    def call(self, p: ConvProblem, args: Sequence[np.ndarray]) -> np.ndarray:
        """Kernel p on host arrays (checked by Kernel), its result as a new host array.

        On the CPU, a kernel with a large workspace is called through its destination-passing twin
        (convdsl/abi.py) with a workspace kept from its first call on (and made again when its argument shapes
        change), where policy.cpu_keeps_workspace says so; other kernels, and GPU ones (whose allocations IREE
        makes stream-ordered, from a pool), through the allocating function.  Calls of one module that keep a
        workspace run one at a time."""
        loaded = self.loaded
        if self.target.backend != "cpu":
            return loaded.call(p.name, *[loaded.upload(a) for a in args], out_dtype=p.result_dtype)
        # 64-byte aligned inputs are read in place, the function invoked directly and its result mapped
        # (docs/decisions.md#cpu-api-input-alignment)
        views = [loaded.import_view(a) for a in args]
        into = self._kept_workspace_call(p, args, views)
        if into is None:
            return loaded.host_result(loaded.call_views(p.name, views), p.result_dtype)
        # a new result buffer each call, returned as it is (the host array of a CPU buffer maps it)
        out = loaded.allocate_result(_result_shape(p, args), p.result_dtype)
        with self._calling:
            into.call(into.pack(views, out=out))
        return loaded.host_result(out, p.result_dtype)

    def clear_workspaces(self) -> None:
        """Give back the workspaces the module's kernels keep (see call); the next calls make them again."""
        with self._calling:
            self._into_calls.clear()

    def _kept_workspace_call(self, p: ConvProblem, args: Sequence[np.ndarray], views: Sequence
                             ) -> Optional[IntoCall]:
        """The destination-passing call of p for these argument shapes, with its kept workspace, or None where p
        keeps none (policy.cpu_keeps_workspace)."""
        shapes = tuple(tuple(a.shape) for a in args)
        with self._calling:
            known = self._into_calls.get(p.name)
            if known is not None and known[0] == shapes:
                return known[1]
            self._into_calls.pop(p.name, None)
            loaded = self.loaded
            if loaded.vm_module.lookup_function(p.name + INTO_SUFFIX) is None:
                return None  # a module compiled before convdsl exported the twin
            # the workspace is allocated here (address space only: its pages come with the first call)
            into = IntoCall(loaded.context, loaded.vm_module, p.name, views,
                            loaded.allocate_result(_result_shape(p, args), p.result_dtype), wait="block")
            kept = sum(c.workspace_bytes for _, c in self._into_calls.values() if c is not None)
            keep = policy.cpu_keeps_workspace(into.workspace_bytes, kept, _memory_bytes())
            self._into_calls[p.name] = (shapes, into if keep else None)
            return into if keep else None

    def __getattr__(self, name: str) -> Kernel:
        problems = self.__dict__.get("problems", {})
        if name in problems:
            return Kernel(problems[name], self)
        raise AttributeError(f"module has no kernel {name!r}; kernels: {', '.join(problems)}")

    def __getitem__(self, name: str) -> Kernel:
        """Every kernel, also one whose name is an attribute of the module (`save`, `manifest`, ...)."""
        if name in self.problems:
            return Kernel(self.problems[name], self)
        raise KeyError(f"module has no kernel {name!r}; kernels: {', '.join(self.problems)}")

    @property
    def kernels(self) -> list[str]:
        return list(self.problems)

    def manifest(self) -> dict:
        return manifest(list(self.problems.values()), self.target, self.iree_config)

    def save(self, path: Union[str, Path]) -> Path:
        """Write OUT.vmfb and OUT.json beside it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.vmfb)
        path.with_suffix(".json").write_text(json.dumps(self.manifest(), indent=2) + "\n")
        return path
