"""The plan of a kernel: every decision made before IR is built, gathered in one frozen record so that
`convdsl explain` can show it (passes/explain.py).  The decisions themselves are convdsl/policy's."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .. import policy
from ..algebra import Phase, SplitK, dy_padding, grad_input_phases, plan_split_k, x_window
from ..problem import ConvProblem
from ..targets import Target
from ..tuning.knobs import Knobs
from . import bf16x3


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


def plan_kernel(problem: ConvProblem, target: Target, knobs: Optional[Knobs] = None) -> KernelPlan:
    """The kernel's plan, with `knobs` (the tuned ones the compile driver looked up, or a tuning candidate
    laid over them: Knobs.over); the fields they leave None follow policy's rules."""
    knobs = knobs if knobs is not None else Knobs()
    policy.pad_form(problem, target, knobs)  # a bad zero-border form is refused whichever form is taken
    use, _, reason = policy.extern_choice(problem, target, knobs)
    if use:
        return _plan_extern(problem, target, knobs)
    plan = _with_ir_knobs(_plan_by_rules(problem, target), knobs, target)
    return replace(plan, linalg_reason=reason) if target.backend == "cuda" else plan


def _plan_extern(problem: ConvProblem, target: Target, knobs: Knobs) -> KernelPlan:
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
    plain = _implicit_gemm(plan_kernel(problem.with_(compute=None), target))
    if plain.form != "implicit-gemm":
        return replace(plain, problem=problem)
    inner = _implicit_gemm(plan_kernel(bf16x3.split_problem(problem), target))
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
