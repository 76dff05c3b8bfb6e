"""The linalg forms IREE compiles and its GPU configuration: the zero border's form, the phase weights' order,
and the knobs over IREE's own tiles where the tuning database has none."""
from __future__ import annotations

import math
from typing import Optional

from ..problem import ConvProblem
from ..targets import Target
from ..tuning.knobs import Knobs
from .cpu import cpu_depthwise_named


# The zero border around X or dY: the forms, and what each builds.
PAD_FORMS = {
    "insert": "zeros + tensor.insert_slice",
    "gather": "one elementwise generic reading the interior with a guarded tensor.extract",
    "fuse": "tensor.pad, fused by IREE into the contraction's dispatch",
}


def default_pad_form(problem: ConvProblem, target: Target) -> str:
    # IREE copies an unfused border element by element; a fused tensor.pad costs no pass but only pays on
    # matrix units (docs/decisions.md#zero-border-forms)
    if target.backend == "cpu":
        # depthwise-named grad_weight pads each image for its own convolution, which IREE fuses: an unfused
        # padded X cost as much as the convolutions (docs/decisions.md#cpu-depthwise-wgrad)
        return "fuse" if problem.op == "grad_weight" and cpu_depthwise_named(problem, target) else "insert"
    sixteen_bit = problem.dtype in ("f16", "bf16") or problem.fp8_compute
    if sixteen_bit and problem.op in ("grad_input", "transposed") and all(s == 1 for s in problem.stride):
        return "fuse"
    return "gather"


# Why the phase weights of grad_input may be stored K-innermost.  The contraction is dX = dY . Wphase, with
# the reduction over (taps, K).  IREE 3.13 lowers it to mma.sync m16n8k16.row.col without ldmatrix: each
# thread loads its B fragment (pairs along the reduction) straight from shared memory, one 16-bit load per
# element when Wphase is stored [G, K, taps, C] (the PTX of CK 3D dgrad: 64 ld.shared.b16 + 64 st.shared.b16
# per 32 mma), 32-bit loads and 64-bit stores when K is innermost.  The weights are small and rebuilt by the
# flip gather anyway, so the order costs nothing.  It pays only where there is more than one stride phase, and
# only on CUDA (docs/decisions.md#weight-k-inner).
WEIGHT_K_INNER_BACKENDS = ("cuda",)


def weight_k_inner(problem: ConvProblem, target: Target) -> bool:
    strided = any(s > 1 for s in problem.stride)
    return target.backend in WEIGHT_K_INNER_BACKENDS and not problem.depthwise and strided


def pad_form(problem: ConvProblem, target: Target, knobs: Knobs) -> str:
    """The zero-border form: the knobs' (tuned or a candidate's), else the rule's."""
    if knobs.pad is not None and knobs.pad not in PAD_FORMS:
        raise ValueError(f"pad: expected one of {', '.join(PAD_FORMS)}, got {knobs.pad!r}")
    return knobs.pad if knobs.pad is not None else default_pad_form(problem, target)


def iree_knobs(p: ConvProblem, target: Target) -> Knobs:
    """Knobs for a shape the tuning database does not hold, generalised from the shapes tuned on an H200.

    Large f16/bf16 GEMMs take doubled tiles (and a third prefetch stage for long reductions), small ones a
    doubled N tile, f32 and depthwise none (docs/decisions.md#iree-knob-rules).  They are fitted to the target's
    workgroup memory where IREE's configuration is known (backends/iree_config.fit_knobs reads
    Target.gpu.workgroup_memory: 64 KB per workgroup on gfx942, gfx90a and gfx1100).
    """
    sixteen_bit = p.dtype in ("f16", "bf16") or p.fp8_compute or p.bf16x3  # tf32: f32 on the linalg form
    if target.backend == "cpu" or p.depthwise or not sixteen_bit:
        return Knobs()
    if p.op == "grad_weight":
        if p.out_channels >= 128 and p.in_channels * math.prod(p.filter) >= 2048:
            return Knobs(n_scale=2, m_scale=2)
        return Knobs()
    if p.op == "forward":
        m, n, reduction = p.batch * math.prod(p.output), p.out_channels, p.in_channels * math.prod(p.filter)
    else:
        # grad_input / transposed: one GEMM per stride phase, each over ~1/prod(s) of dX and of the taps
        m = p.batch * math.prod(-(-i // s) for i, s in zip(p.input, p.stride))
        n = p.in_channels
        reduction = p.out_channels * math.prod(p.filter) // math.prod(p.stride)
    if n < 64:
        return Knobs()
    if m >= 60_000 and n >= 128 and p.op != "forward" and all(s == 1 for s in p.stride):
        # stride 1 only: with K-innermost phase weights a strided GEMM lost with it (docs/decisions.md#iree-knob-rules)
        return Knobs(n_scale=4, m_scale=2)
    if m >= 60_000:
        return Knobs(n_scale=2, m_scale=2, prefetch=3 if reduction >= 1024 else None)
    return Knobs(n_scale=2)


def knobs_for(p: ConvProblem, target: Target, tuned: Optional[Knobs]) -> Knobs:
    """A kernel's knobs: the tuning database's entry where it has one (`tuned`), else the rules'.  The CPU has
    no knobs (IREE's CPU configuration is kept)."""
    if target.backend == "cpu":
        return Knobs()
    return tuned if tuned is not None else iree_knobs(p, target)


# A plain (allocating) function of a CUDA module keeps transient buffers of at most this many bytes in the module
# between calls: beyond it a kernel runs for milliseconds, where an allocation per call costs little, and a module
# should not hold so much memory for its whole life (docs/decisions.md#module-workspace).
MODULE_WORKSPACE_MOST_BYTES = 64 << 20


def module_workspaces(target: Target) -> bool:
    """Whether the plain functions of `target`'s modules may keep their transient buffers in the module (CUDA:
    measured there; ROCm's runtime was not, the CPU's allocations cost nothing measurable)."""
    return target.backend == "cuda"


def module_keeps_workspace(target: Target, transient_bytes: int) -> bool:
    """Whether a module's plain function takes its transient buffers (split-K partials, zero borders, stride
    phases) from one buffer the module allocates once, instead of from IREE's allocations around every call."""
    return module_workspaces(target) and 0 < transient_bytes <= MODULE_WORKSPACE_MOST_BYTES
