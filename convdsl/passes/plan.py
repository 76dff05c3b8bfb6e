"""The plan of a kernel: every decision made before IR is built, so `convdsl explain` can show it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..algebra import Phase, SplitK, dy_padding, grad_input_phases, plan_split_k, x_window
from ..problem import ConvProblem
from ..targets import Target
from . import gather


@dataclass(frozen=True)
class KernelPlan:
    problem: ConvProblem
    target: Target
    # "implicit-gemm"; "depthwise" (a stencil / reduction with no K or C loop); "gather" (few channels
    # per group: one gather per output, see passes/gather.py)
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
    # GPU + NGCHW: the plan of the same kernel in NHWGC, run between layout copies
    channels_last: Optional["KernelPlan"] = None

    def describe(self) -> str:
        p = self.problem
        lines = [f"kernel {p.name}: {p.describe()}", f"  target: {self.target}", f"  form: {self.form}"]
        lines.append(
            "  args: " + ", ".join(
                f"{n}: {p.layout_name('w') if n == 'w' else _act(p, n)} {list(s)} {dt}"
                for n, s, dt in zip(p.arg_names, p.arg_shapes, p.arg_dtypes)
            )
            + f" -> {p.result_name} {list(p.result_shape)} {p.result_dtype}"
        )
        if self.compute_a:
            lines.append(f"  compute: A in {self.compute_a}, B in {self.compute_b}, products summed in f32")
        if self.phases:
            live = [ph for ph in self.phases if not ph.empty]
            lines.append(
                f"  stride phases: {len(self.phases)} ({len(live)} computed, {len(self.phases) - len(live)} all-zero);"
                f" dY zero border lo={list(self.dy_pad_lo)} hi={list(self.dy_pad_hi)}"
            )
            for ph in self.phases:
                if ph.empty:
                    lines.append(f"    residue {list(ph.residue)}: no tap reaches it -> zeros, sizes {list(ph.sizes)}")
                    continue
                taps = ["y%d in %s" % (i, list(range(d.y0, d.y0 + d.J * d.tap_step, d.tap_step)))
                        for i, d in enumerate(ph.dims)]
                lines.append(f"    residue {list(ph.residue)}: sizes {list(ph.sizes)}, taps {'; '.join(taps)}")
        if self.x_pad_lo:
            lines.append(f"  X window: pad lo={list(self.x_pad_lo)}, hi={list(self.x_pad_hi)} (negative = crop)")
        if self.channels_last is not None:
            lines.append("  layout: NGCHW activations copied to NHWGC and back around the kernel below (GPU)")
            lines.extend("  " + ln for ln in self.channels_last.describe().splitlines()[1:])
        if self.dy_first:
            lines.append("  operands: dY first (GPU 1x1 grad_weight: IREE's X-first matmul form computed garbage)")
        if self.form == "gather":
            lines.append("  gather: one generic, the other operand read by tensor.extract at computed positions,"
                         " out-of-range taps masked")
            if self.row_blocks:
                lines.append(f"  partial sums: N x {self.row_blocks} row blocks of the first output dim,"
                             " f32, added in order")
        if self.split:
            lines.append(
                f"  split-K: S={self.split.parts} along {self.split.axis}, chunks {list(self.split.chunks)};"
                f" f32 partials summed in chunk order"
            )
        return "\n".join(lines)


def _act(p: ConvProblem, name: str) -> str:
    if p.op == "transposed" and name == "x":
        return p.layout_name("y")
    return p.layout_name("x" if name in ("x", "d") else "y")


# Backends whose NGCHW kernels run channels-last between layout copies (see plan_kernel).
CHANNELS_LAST_BACKENDS = ("cuda", "rocm")


def plan_kernel(problem: ConvProblem, target: Target) -> KernelPlan:
    if problem.layout == "NGCHW" and target.backend in CHANNELS_LAST_BACKENDS:
        # IREE 3.13's GPU backends miscompile channel-first implicit GEMMs in f16/bf16 (wrong results
        # on an H200 for forward, grad_input and grad_weight, whatever the loop order; f32 was right):
        # run the kernel channels-last, between two layout copies.  Measured: benchmarks/README.md.
        inner = _plan(problem.with_(layout="NHWGC"), target)
        return KernelPlan(problem, target, inner.form, inner.compute_a, inner.compute_b, channels_last=inner)
    return _plan(problem, target)


def _plan(problem: ConvProblem, target: Target) -> KernelPlan:
    compute_a = compute_b = None
    if problem.compute:
        if target.fp8_native:
            compute_a, compute_b = (target.fp8_type(c) for c in problem.compute)
        else:
            compute_a, compute_b = (f"{c} values in f16" for c in problem.compute)
    form = "depthwise" if problem.depthwise else "implicit-gemm"
    if gather.applies(problem):
        # few channels per group: bound by memory, a gather per output beats any GEMM form
        return KernelPlan(problem, target, "gather",
                          row_blocks=gather.row_blocks(problem) if problem.op == "grad_weight" else 0)
    if problem.op in ("grad_input", "transposed"):
        phases = tuple(grad_input_phases(problem))
        lo, hi = dy_padding(problem, list(phases))
        return KernelPlan(problem, target, form, compute_a, compute_b, phases=phases, dy_pad_lo=lo, dy_pad_hi=hi)
    lo, hi = x_window(problem)
    split = plan_split_k(problem) if problem.op == "grad_weight" else None
    # On GPUs a grad_weight with one tap is IREE's plain matmul path, which computed garbage for it with
    # X as the first operand (ResNet and MobileNet 1x1 layers on an H200, rel. err 1.0); with dY first
    # the same contraction is right (benchmarks/README.md, 1x1 grad_weight probe).
    dy_first = (
        problem.op == "grad_weight" and math.prod(problem.filter) == 1 and not problem.depthwise
        and target.backend in CHANNELS_LAST_BACKENDS
    )
    return KernelPlan(problem, target, form, compute_a, compute_b, x_pad_lo=lo, x_pad_hi=hi, split=split,
                      dy_first=dy_first)
