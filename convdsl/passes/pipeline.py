"""The pipeline: ConvProblem -> plan -> linalg on tensors -> canonical IR ready for iree-compile.

Each pass is a plain function `(Stage) -> Stage`; `run_pipeline` runs them in order, verifies the
IR after every pass that produced one, and hands each stage to `observe` (`convdsl explain`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from iree.compiler import ir
from iree.compiler.passmanager import PassManager

from .. import policy
from ..backends.iree import transient_sizes
from ..kernels.compile import compile_launch
from ..kernels.launch import Binary
from ..problem import ConvProblem
from ..progress import CompileStep, ProgressFn
from ..targets import Target
from ..tuning.knobs import Knobs
from .lower import emit_kernel
from .plan import KernelPlan, plan_kernel
from .workspace import keep_workspaces


log = logging.getLogger(__name__)


class LoweringError(RuntimeError):
    """The pipeline produced IR that does not verify or breaks a form contract (a convdsl bug)."""


@dataclass(frozen=True)
class Stage:
    problems: tuple[ConvProblem, ...]
    target: Target
    plans: tuple[KernelPlan, ...] = ()
    module: Optional[ir.Module] = None
    # per kernel name: its knobs (tuned, or a tuning candidate over the tuned ones), looked up by the compile
    # driver; kernels without an entry follow the rules (convdsl/policy)
    knobs: tuple[tuple[str, Knobs], ...] = ()
    # launch name -> its Triton binary (form "extern" kernels; kernels/compile.py)
    binaries: tuple[tuple[str, Binary], ...] = ()
    # told as each kernel is lowered (the caller shows it; compiler.compile's `progress`)
    progress: Optional[ProgressFn] = field(default=None, compare=False, repr=False)
    # kernel name -> bytes of transient storage its plain function keeps in the module (passes/workspace.py)
    workspaces: tuple[tuple[str, int], ...] = ()
    # the caller's own iree-compile flags: the module is compiled with them, so what IREE plans is planned with them
    iree_flags: tuple[str, ...] = ()


def plan_kernels(stage: Stage) -> Stage:
    # every decision (stride phases, split-K, fp8 types, depthwise form) is made before any IR exists; plans
    # the compile driver made (compiler.plan, shared with the stream bundle) are taken as they are
    if stage.plans:
        return stage
    knobs = dict(stage.knobs)
    return replace(stage, plans=tuple(plan_kernel(p, stage.target, knobs.get(p.name)) for p in stage.problems))


def compile_gemm_cores(stage: Stage) -> Stage:
    # CUDA: IREE's own GEMM code is 5-10x slower than the chip allows; the planned Triton kernels are
    # compiled here (no GPU needed) so that the IR can embed their binaries
    binaries = {}
    for index, plan in enumerate(stage.plans, 1):
        # per kernel, here: the Triton compiles are the slow per-kernel step of the pipeline
        if stage.progress is not None:
            stage.progress(CompileStep("kernel", index, len(stage.plans), plan.problem.name))
        if plan.extern is not None:
            for launch in plan.extern.launches:
                try:
                    binaries[launch.name] = compile_launch(launch, stage.target.arch)
                except Exception as err:  # noqa: BLE001 - Triton's errors, named and with a way around them
                    first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                    raise LoweringError(
                        f"kernel {plan.problem.name}: Triton could not compile launch {launch.name} "
                        f"(tiles {plan.extern.tiles.label()}, {stage.target.arch}): {first}. Other tiles "
                        f"(Knobs(tiles=...)) or the linalg form (Knobs(extern=False), label 'linalg') avoid it."
                    ) from err
    return replace(stage, binaries=tuple(binaries.items()))


def emit_linalg(stage: Stage) -> Stage:
    # one func.func per kernel, built with the MLIR Python bindings as linalg.generic implicit GEMMs
    # (or as flow.dispatch of the external GEMM cores, with linalg around them)
    ctx = ir.Context()
    binaries = dict(stage.binaries)
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            for plan in stage.plans:
                emit_kernel(plan, binaries)
    return replace(stage, module=module)


def canonicalize(stage: Stage) -> Stage:
    # fold the zero-size and whole-tensor slices and constants the emitter leaves, so IREE sees minimal IR
    with stage.module.context:
        PassManager.parse("builtin.module(canonicalize,cse)").run(stage.module.operation)
    return stage


def keep_module_workspaces(stage: Stage) -> Stage:
    # a CUDA module's plain functions take their transients from a buffer the module allocates once: IREE's
    # allocations around every call cost the call host waits (docs/decisions.md#module-workspace)
    if not policy.module_workspaces(stage.target):
        return stage
    try:
        sizes = transient_sizes(str(stage.module), stage.target, stage.iree_flags)
    except Exception as err:  # noqa: BLE001 - the module's own compile reports (and saves) what iree-compile rejects
        log.debug("no module workspaces: IREE's stream phase failed (%s)", str(err).strip().splitlines()[-1:])
        return stage
    kept = {p.name: sizes[p.name] for p in stage.problems
            if p.name in sizes and policy.module_keeps_workspace(stage.target, sizes[p.name])}
    if kept:
        keep_workspaces(stage.module, kept)
    return replace(stage, workspaces=tuple(kept.items()))


def check_iree_forms(stage: Stage) -> Stage:
    # IREE's CUDA backend fails ("failed to pack reduction dimensions") on a contraction whose first
    # operand is not the image; refuse to hand such IR on instead of failing deep in iree-compile.
    def walk(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "linalg.generic":
                        _check_contraction(child.operation)
                    walk(child.operation)

    walk(stage.module.operation)
    return stage


def _check_contraction(op: ir.Operation) -> None:
    iterators = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    if not any("reduction" in it for it in iterators) or len(op.operands) < 3:
        return
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    first_windowed, second_windowed = (any(_reads_window(e) for e in m.results) for m in maps[:2])
    if second_windowed and not first_windowed:
        raise LoweringError(f"contraction reads its windowed (image) operand second:\n{op}")


def _reads_window(expr: ir.AffineExpr) -> bool:
    """Whether an operand's index `expr` reads a window: somewhere in it a sum over two or more loop dims, the
    output position and the tap (o*s + y*d, also under a floordiv).  A constant offset (d0 + 1) is no window."""
    expr = expr.maybe_downcast()
    if isinstance(expr, ir.AffineAddExpr) and len(_dims_in(expr)) >= 2:
        return True
    if isinstance(expr, ir.AffineBinaryExpr):
        return _reads_window(expr.lhs) or _reads_window(expr.rhs)
    return False


def _dims_in(expr: ir.AffineExpr) -> set[int]:
    expr = expr.maybe_downcast()
    if isinstance(expr, ir.AffineDimExpr):
        return {expr.position}
    if isinstance(expr, ir.AffineBinaryExpr):
        return _dims_in(expr.lhs) | _dims_in(expr.rhs)
    return set()


PIPELINE: tuple[tuple[str, Callable[[Stage], Stage]], ...] = (
    ("plan", plan_kernels),
    ("gemm-cores", compile_gemm_cores),
    ("linalg", emit_linalg),
    ("canonical", canonicalize),
    ("iree-forms", check_iree_forms),
    ("workspaces", keep_module_workspaces),
)
STAGE_NAMES = tuple(name for name, _ in PIPELINE)


def run_pipeline(
    problems: Sequence[ConvProblem],
    target: Target,
    observe: Optional[Callable[[str, Stage], None]] = None,
    knobs: Optional[Mapping[str, Knobs]] = None,
    progress: Optional[ProgressFn] = None,
    plans: Sequence[KernelPlan] = (),
    iree_flags: Sequence[str] = (),
) -> Stage:
    """The pipeline over `problems`, planned with `knobs` (by kernel name; the rules' where absent), or taking
    `plans` already made for them (one per problem, in order); `iree_flags`: the extra iree-compile flags the module
    will be compiled with."""
    if plans and [pl.problem for pl in plans] != list(problems):
        raise ValueError("plans: expected one plan per problem, in the problems' order")
    stage = Stage(tuple(problems), target, plans=tuple(plans), knobs=tuple(sorted((knobs or {}).items())),
                  progress=progress, iree_flags=tuple(iree_flags))
    for name, pass_fn in PIPELINE:
        stage = pass_fn(stage)
        if stage.module is not None and not stage.module.operation.verify():
            raise LoweringError(f"IR after pass {name!r} does not verify")
        if observe is not None:
            observe(name, stage)
    return stage


def lower_to_mlir(problems: Sequence[ConvProblem], target: Target,
                  knobs: Optional[Mapping[str, Knobs]] = None, progress: Optional[ProgressFn] = None,
                  plans: Sequence[KernelPlan] = (), iree_flags: Sequence[str] = ()) -> str:
    return str(run_pipeline(problems, target, knobs=knobs, progress=progress, plans=plans,
                            iree_flags=iree_flags).module)
