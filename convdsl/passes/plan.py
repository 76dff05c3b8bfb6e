"""The plan of a kernel: every decision made before any IR or binary is built, gathered in one frozen record
that both artifacts are built from (compiler.compile: the .vmfb module's pipeline lowers it; the stream bundle
compiles its `stream` launches) and that `convdsl explain` shows (passes/explain.py).  The decisions themselves
are convdsl/policy's; `plan` looks the kernel's knobs up once (the tuning database's entry, else the rules').

    plan = plan(problem, Target("cuda", "sm_90"))   # form, phases, split, tiles, launches; stream kernel or why not
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

from .. import policy
from ..algebra import Phase, SplitK, bf16x3_split_problem, dy_padding, grad_input_phases, plan_split_k, x_window
from ..backends.iree import iree_version
from ..kernels.elementwise_launches import round_fp8_launch, space_to_depth_launch, transpose_launch
from ..kernels.launch import Launch
from ..kernels.stream_kernel import StreamKernel, uncompiled
from ..problem import ConvProblem
from ..targets import Target
from ..tuning import db
from ..tuning.knobs import Knobs


@dataclass(frozen=True)
class KernelPlan:
    problem: ConvProblem
    target: Target
    # "implicit-gemm"; "depthwise" (a stencil / reduction with no K or C loop); "gather" (few channels
    # per group: one gather per output, see passes/gather.py); "im2col" (CPU: window gather + named
    # matmul, see passes/gemm.py); "depthwise-named" (CPU depthwise gradients: named depthwise convs)
    form: str
    compute_a: Optional[str] = None  # MLIR element type of operand A when computing in fp8
    compute_b: Optional[str] = None
    phases: tuple[Phase, ...] = ()  # grad_input / transposed
    dy_pad_lo: tuple[int, ...] = ()
    dy_pad_hi: tuple[int, ...] = ()
    x_pad_lo: tuple[int, ...] = ()  # forward / grad_weight
    x_pad_hi: tuple[int, ...] = ()
    split: Optional[SplitK] = None  # grad_weight
    # GPU + 1x1 grad_weight: dY is the contraction's first operand (see _plan)
    dy_first: bool = False
    row_blocks: int = 0  # gather grad_weight: blocks of the first output dim (partial sums)
    # how the zero border of X (forward, grad_weight) or dY (grad_input) is built: see PAD_FORMS
    pad_form: str = "insert"
    # GPU + NGCHW: the plan of the same kernel in NHWGC, run between layout copies
    channels_last: Optional["KernelPlan"] = None
    # compute = "bf16x3" (implicit-GEMM form only): the plan of the bf16 problem with the tripled
    # reduction (passes/bf16x3.py), run on the hi/lo split of the f32 operands
    bf16x3: Optional["KernelPlan"] = None
    # grad_input / transposed: the flipped phase weights are built as [G, C, taps, K] (the reduction
    # channel K innermost) instead of [G, K, taps, C]; see weight_k_inner()
    weight_k_inner: bool = False
    # form "extern" (CUDA): the GEMM core as Triton kernels in IREE external dispatches (passes/extern.py), as
    # policy plans them for both artifacts (the stream kernel reads the same record); in a plan with
    # `channels_last`, the NHWGC plan's record copies nothing (the outer plan's copies every activation)
    extern: Optional[policy.ExternLaunches] = None
    # form "extern", a few-channel strided forward: the plan of the stride-1 forward over X and W regrouped
    # space-to-depth (policy.space_to_depth_forward); `extern` holds the two regrouping copies, then its launches
    space_to_depth: Optional["KernelPlan"] = None
    # why a CUDA kernel keeps the linalg form (shown by explain); None where not asked
    linalg_reason: Optional[str] = None
    # depthwise-named grad_weight: the channels each convolution runs over (G*C and zeros up to it), and the taps
    # along the innermost filter dimension it computes (the filter's, or more: policy.cpu_depthwise_width)
    depthwise_channels: int = 0
    depthwise_taps: int = 0
    # depthwise-named grad_input: per stride phase, the innermost output width its convolution computes (the
    # phase's, or more: policy.cpu_depthwise_width); dY's border reaches that far
    depthwise_widths: tuple[int, ...] = ()
    # im2col grad_weight: split-K chunks per image along the first output dimension (policy.cpu_im2col_row_chunks)
    row_chunks: int = 1
    # the knobs every field above was decided with, and where they come from (the tuning database or the rules)
    knobs: Knobs = Knobs()
    knobs_source: str = "knobs given"
    # CUDA: the same kernel on a framework's stream (convdsl.torch), its launches planned, not yet compiled; on
    # Hopper it may take TMA kernels, which an IREE module cannot (its dispatches get buffers, not the tensor
    # maps the runner makes per call), so the module embeds `extern`'s cp.async launches.  None with the reason
    # in `stream_reason` where there is none.
    stream: Optional[StreamKernel] = None
    stream_reason: Optional[str] = None


ON_CPU = "none on the CPU (IREE's own configuration)"
BY_RULES = "rules (convdsl/policy): no tuning database entry for this problem and target"


def lookup_knobs(p: ConvProblem, target: Target) -> tuple[Knobs, str]:
    """`p`'s knobs on `target` and where they come from (`convdsl explain` prints it): the tuning database's
    entry (db.lookup: this IREE's, else the newest other version's), else policy's rules; none on the CPU."""
    if target.backend == "cpu":
        return Knobs(), ON_CPU
    version = iree_version()  # "not installed" (a machine that only runs kernels): the newest entry serves
    tuned = db.lookup(p, target, version)
    if tuned is None and p.op == "grad_weight" and p.out_dtype is not None:
        # grad_weight's result dtype is the sum's store only: the GEMM tuned for the arguments' dtype serves
        tuned = db.lookup(p.with_(out_dtype=None), target, version)
    if tuned is not None:
        return tuned.knobs, tuned.source
    return policy.knobs_for(p, target, None), BY_RULES


def plan(problem: ConvProblem, target: Target) -> KernelPlan:
    """The kernel's plan with its knobs looked up once (lookup_knobs): both artifacts are built from it, so the
    IREE module and the stream kernel of a problem never take different knobs."""
    knobs, source = lookup_knobs(problem, target)
    return plan_kernel(problem, target, knobs, source)


def plan_kernel(problem: ConvProblem, target: Target, knobs: Optional[Knobs] = None,
                knobs_source: str = "knobs given", tma: bool = True) -> KernelPlan:
    """The kernel's plan, with `knobs` (looked up by `plan`, or a tuning candidate laid over them: Knobs.over);
    the fields they leave None follow policy's rules.  tma: whether the stream kernel may take a TMA kernel
    (Triton's interpreter runs none; sweeps of cp.async tiles plan without them)."""
    knobs = knobs if knobs is not None else Knobs()
    module = _module_plan(problem, target, knobs)
    stream, reason = _stream_plan(problem, target, knobs, knobs_source, tma, module.extern, module.space_to_depth,
                                  policy.overrides_generation())
    return replace(module, knobs=knobs, knobs_source=knobs_source, stream=stream, stream_reason=reason)


def _module_plan(problem: ConvProblem, target: Target, knobs: Knobs) -> KernelPlan:
    policy.pad_form(problem, target, knobs)  # a bad zero-border form is refused whichever form is taken
    use, _, reason = policy.extern_choice(problem, target, knobs)
    if use:
        return _plan_extern(problem, target, knobs)
    planned = _with_ir_knobs(_plan_by_rules(problem, target), knobs, target)
    return replace(planned, linalg_reason=reason) if target.backend == "cuda" else planned


def _plan_extern(problem: ConvProblem, target: Target, knobs: Knobs) -> KernelPlan:
    # a few-channel strided forward runs stride 1 over its operands regrouped space-to-depth, as the stream
    # kernel does (docs/decisions.md#stem-space-to-depth)
    regrouped = policy.space_to_depth_forward(problem)
    if regrouped is not None and policy.extern_launches(regrouped, target, knobs) is not None:
        inner = _plan_extern(regrouped, target, knobs)
        base = inner.extern.launches[0].name
        copies = tuple(space_to_depth_launch(problem, regrouped, name, base)[0] for name in ("x", "w"))
        # the two copies run first: their launches lead the outer record's, which the pipeline compiles
        return KernelPlan(problem, target, "extern", extern=replace(inner.extern, launches=(
            *copies, *inner.extern.launches)), space_to_depth=inner)
    ext = policy.extern_launches(problem, target, knobs)
    assert ext is not None  # extern_choice said use
    if ext.problem is problem:
        return KernelPlan(problem, target, "extern", extern=ext)
    # every activation copied channels-last: the NHWGC plan runs between two layout copies
    inner_plan = KernelPlan(ext.problem, target, "extern", extern=replace(ext, copied_channels_last=()))
    return KernelPlan(problem, target, "extern", extern=ext, channels_last=inner_plan)


def _plan_by_rules(problem: ConvProblem, target: Target) -> KernelPlan:
    if problem.bf16x3:
        return _plan_bf16x3(problem, target)
    if problem.layout == "NGCHW" and target.backend in policy.CHANNELS_LAST_BACKENDS:
        # IREE 3.13's GPU backends miscompile channel-first implicit GEMMs in f16/bf16 (wrong results
        # for forward, grad_input and grad_weight, whatever the loop order; f32 was right):
        # run the kernel channels-last, between two layout copies.
        inner = _plan(problem.with_(layout="NHWGC"), target)
        return KernelPlan(problem, target, inner.form, inner.compute_a, inner.compute_b, channels_last=inner)
    return _plan(problem, target)


def _with_ir_knobs(plan: KernelPlan, knobs: Knobs, target: Target) -> KernelPlan:
    """The plan (and the plans it wraps) with the knobs' zero-border form and phase weight order, where set;
    the order applies only where there are stride phases with K and C loops."""
    changes: dict = {k: _with_ir_knobs(getattr(plan, k), knobs, target) for k in ("channels_last", "bf16x3")
                     if getattr(plan, k) is not None}
    if knobs.pad is not None:
        changes["pad_form"] = policy.pad_form(plan.problem, target, knobs)
    if knobs.k_inner is not None and plan.phases and plan.form == "implicit-gemm":
        changes["weight_k_inner"] = knobs.k_inner
    return replace(plan, **changes)


def _plan_bf16x3(problem: ConvProblem, target: Target) -> KernelPlan:
    # The f32 kernel's form decides.  Depthwise and gather kernels are bound by memory (a few MACs per
    # loaded value): matrix units bring them nothing and the split would triple their reads, so they
    # keep the plain f32 plan (on the FMA units).  The CPU runs the split kernel like a GPU does.
    plain = _implicit_gemm(_module_plan(problem.with_(compute=None), target, Knobs()))
    if plain.form != "implicit-gemm":
        return replace(plain, problem=problem)
    inner = _implicit_gemm(_module_plan(bf16x3_split_problem(problem), target, Knobs()))
    assert inner.form == "implicit-gemm", inner.form  # a longer reduction never turns a GEMM into a gather
    if inner.pad_form == "fuse":
        # the hi/lo split feeding a tensor.pad fused into the contraction computed garbage (CK 3D
        # grad_input): the border gets its own pass
        inner = _with_ir_knobs(inner, Knobs(pad="gather"), target)
    return KernelPlan(problem, target, "implicit-gemm", bf16x3=inner)


def _implicit_gemm(plan: KernelPlan) -> KernelPlan:
    """The CPU's im2col plan as the implicit-GEMM plan: bf16x3 keeps that form (policy.cpu_im2col), its split
    operands feeding the implicit GEMM directly."""
    if plan.form != "im2col":
        return plan
    p = plan.problem
    return replace(plan, form="implicit-gemm", split=plan_split_k(p) if p.op == "grad_weight" else None)


def _plan(problem: ConvProblem, target: Target) -> KernelPlan:
    compute_a = compute_b = None
    if problem.fp8_compute:
        if target.fp8_native:
            compute_a, compute_b = (target.fp8_type(c) for c in problem.compute)
        else:
            compute_a, compute_b = (f"{c} values in f16" for c in problem.compute)
    form = "depthwise" if problem.depthwise else "implicit-gemm"
    if policy.cpu_im2col(problem, target):
        form = "im2col"  # the CPU's matmul path: window gather + named matmul (passes/gemm.py)
    if policy.cpu_depthwise_named(problem, target):
        # CPU depthwise gradients: IREE's named depthwise convolution per phase (grad_input) or image (grad_weight)
        form = "depthwise-named"
    if (policy.gather_applies(problem) or policy.cpu_gather_forward(problem, target)) and form != "depthwise-named":
        # few channels per group: bound by memory, a gather per output beats any GEMM form
        return KernelPlan(problem, target, "gather",
                          row_blocks=policy.gather_row_blocks(problem) if problem.op == "grad_weight" else 0)
    if problem.op in ("grad_input", "transposed"):
        phases = tuple(grad_input_phases(problem))
        lo, hi = dy_padding(problem, list(phases))
        widths: tuple[int, ...] = ()
        if form == "depthwise-named":  # each phase's innermost output maybe widened: dY's border reaches that far
            widths = tuple(ph.dims[-1].Q if ph.empty else policy.cpu_depthwise_width(ph.dims[-1].Q, ph.dims[-1].J)
                           for ph in phases)
            reach = max((width - 1 + ph.dims[-1].off - (problem.output[-1] - 1)
                         for ph, width in zip(phases, widths) if not ph.empty), default=hi[-1])
            hi = (*hi[:-1], max(hi[-1], reach))
        return KernelPlan(problem, target, form, compute_a, compute_b, phases=phases, dy_pad_lo=lo, dy_pad_hi=hi,
                          pad_form=policy.default_pad_form(problem, target),
                          weight_k_inner=policy.weight_k_inner(problem, target), depthwise_widths=widths)
    lo, hi = x_window(problem)
    # im2col: one matmul whose reduction IREE tiles itself; depthwise-named: one convolution per image; no split-K
    whole = form in ("im2col", "depthwise-named")
    split = plan_split_k(problem) if problem.op == "grad_weight" and not whole else None
    channels = problem.groups * problem.in_channels
    if form == "depthwise-named" and not problem.depthwise and problem.dims == 2:
        channels = policy.cpu_depthwise_channels(channels)  # few channels per group: pad to the fast count
    return KernelPlan(problem, target, form, compute_a, compute_b, x_pad_lo=lo, x_pad_hi=hi, split=split,
                      dy_first=policy.dy_first(problem, target), pad_form=policy.default_pad_form(problem, target),
                      depthwise_channels=channels if form == "depthwise-named" else 0,
                      depthwise_taps=policy.cpu_depthwise_width(problem.filter[-1], problem.output[-1])
                      if form == "depthwise-named" else 0,
                      row_chunks=policy.cpu_im2col_row_chunks(problem)
                      if form == "im2col" and problem.op == "grad_weight" else 1)


# --- the stream kernel ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _stream_plan(p: ConvProblem, target: Target, knobs: Knobs, source: str, tma: bool,
                 extern: Optional[policy.ExternLaunches], space_to_depth: Optional[KernelPlan], rules: int
                 ) -> tuple[Optional[StreamKernel], Optional[str]]:
    # a pure function of frozen arguments (policy.overrides arrives as the rules' generation): cached, so that asking
    # whether a kernel exists and then building it plans it once
    if target.backend != "cuda":
        return None, f"stream kernels are CUDA kernels; target is {target.backend}"
    if p.epilogue.steps or p.prologue.kind != "none":  # the stream kernels apply a scale at most
        return None, "the stream kernels take no fused epilogue steps or prologue"
    use, _, reason = policy.extern_choice(p, target, knobs)
    if not use:
        return None, reason
    try:
        return _stream_kernel(p, target, knobs, source, tma, extern, space_to_depth), None
    except ValueError as err:  # a plan the kernels cannot run (a split_k the TMA kernel cannot cut, ...)
        return None, str(err)


def _stream_kernel(p: ConvProblem, target: Target, knobs: Knobs, source: str, tma: bool,
                   extern: Optional[policy.ExternLaunches], space_to_depth: Optional[KernelPlan]) -> StreamKernel:
    """The stream kernel's launches as policy decides them with `knobs`: a TMA kernel where one applies, else the
    module plan's cp.async launches (`extern`), or those of its space-to-depth regrouped forward (`space_to_depth`)."""
    tma_plan = policy.tma_stream_launch(p, target, knobs) if tma else None
    if tma_plan is not None:
        launch, maps, flipped, partials, tiles, staging, weight_copy = tma_plan
        summed = uncompiled(policy.split_k_sum(p, partials, launch.name, target)) if p.op == "grad_weight" else None
        q = policy.grad_input_as_forward(p) if flipped else p
        halo_splits = policy.halo_forward_split(q, target) if launch.kernel == "forward_halo" else 0
        promote = (policy.tma_grad_weight_promote(p, tiles)
                   if p.dtype == "f32" and launch.kernel == "grad_weight_tma" else 0)
        return StreamKernel(p, target.arch, p, (), (uncompiled(launch),), partials, tiles.label(), source, summed,
                            weight_axes=weight_copy, tma_maps=maps, tma_flipped_weight=flipped,
                            staging=tuple(uncompiled(la) for la, _ in staging),
                            staged_shapes=tuple(shape for _, shape in staging),
                            halo_splits=halo_splits, promote_every=promote)
    # a few-channel strided forward runs stride 1 over its operands regrouped space-to-depth, as the module plan
    # has it (two copies first)
    regrouped = space_to_depth.problem if space_to_depth is not None else None
    ext = space_to_depth.extern if space_to_depth is not None else extern
    if ext is None:
        _, _, reason = policy.extern_choice(p, target, knobs)
        raise ValueError(f"kernel {p.name}: no stream kernel on {target}: {reason}")
    if p.op != "grad_weight" and not regrouped:  # few output tiles over a long reduction: split-K
        ext = policy.split_output_launches(p, ext, target)
    base = ext.launches[0].name
    staging = tuple(space_to_depth_launch(p, regrouped, name, base) for name in p.arg_names) if regrouped else ()
    summed = uncompiled(policy.split_k_sum(p, ext.partials_shape, base, target)) if ext.partials_shape else None
    rounds = ()
    if p.fp8_compute:
        rounds = tuple(uncompiled(round_fp8_launch(math.prod(shape), dtype, kind, f"{base}_{i}"))
                       for i, (shape, dtype, kind) in enumerate(zip(p.arg_shapes, p.arg_dtypes, p.compute)))
    copy_in, copy_out = _layout_copies(p, ext.copied_channels_last, base, p.op != "grad_weight")
    return StreamKernel(p, target.arch, ext.problem, ext.copied_channels_last, tuple(map(uncompiled, ext.launches)),
                        ext.partials_shape, ext.tiles.label(), source, summed, rounds, ext.weight_axes,
                        tuple(map(uncompiled, copy_in)), uncompiled(copy_out) if copy_out else None,
                        staging=tuple(uncompiled(la) for la, _ in staging),
                        staged_shapes=tuple(shape for _, shape in staging))


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
