"""`convdsl explain`'s text: a kernel's plan in words (its form, the launches and their tiles, stride
phases, split-K, zero borders, the operand precision)."""
from __future__ import annotations

import math
from typing import Sequence

from ..kernels.launch import Binary
from ..policy import PAD_FORMS
from ..problem import ConvProblem, step_text, weight_axes_name
from ..targets import GPU_FACTS, Target
from . import bf16x3
from .plan import KernelPlan


def describe_binaries(binaries: Sequence[tuple[str, Binary]]) -> str:
    """The GEMM-core binaries the 'gemm-cores' pass compiled, one line each."""
    return "\n".join(f"{name}: {b.kind}, {len(b.data)} bytes, {b.threads} threads, {b.shared_bytes} bytes of shared "
                     f"memory, {b.params} parameters" for name, b in binaries)


def describe_target(target: Target) -> str:
    """The target, and for a GPU the figures its kernels are planned and their IREE configurations sized with
    (Target.gpu): a chip's compute units, the shared memory (LDS) one workgroup may use, its subgroup size and
    matrix instructions."""
    if target.backend == "cpu":
        return str(target)
    gpu = target.gpu
    units = "compute units" if target.backend == "rocm" else "SMs"
    memory = "LDS per workgroup" if target.backend == "rocm" else "shared memory per block"
    if target.backend == "rocm":
        waves = f"wave{gpu.subgroup_size}" + "".join(f" (wave{s} also)" for s in gpu.subgroup_sizes[1:])
    else:
        waves = f"warps of {gpu.subgroup_size}"
    figures = f"{gpu.sm_count} {units}, {gpu.workgroup_memory // 1024} KB of {memory}, {waves}" + (
        f", {gpu.matrix_unit} matrix instructions" if gpu.matrix_unit else "")
    own = GPU_FACTS.get(target.arch) is gpu
    planned = next((a for a, f in GPU_FACTS.items() if f is gpu), target.arch)
    chip = f"{gpu.chip}: " if gpu.chip and own else (f"{gpu.chip}, " if gpu.chip else "")
    return f"{target} ({chip}{figures})" if own else f"{target} (planned with {planned}'s figures: {chip}{figures})"


def describe_plan(self: KernelPlan) -> str:
    p = self.problem
    lines = [f"kernel {p.name}: {p.describe()}", f"  target: {describe_target(self.target)}", f"  form: {self.form}"]
    lines.append(
        "  args: " + ", ".join(
            f"{n}: {p.layout_name('w') if n == 'w' else _act(p, n)} {list(s)} {dt}"
            for n, s, dt in zip(p.arg_names, p.arg_shapes, p.arg_dtypes)
        )
        + f" -> {p.result_name} {list(p.result_shape)} {p.result_dtype}"
    )
    lines.extend(_describe_fused(p, self.extern is not None))
    if self.extern is not None:
        if self.extern.weight_axes:
            why = ("K innermost: TF32 matrix products read their operands reduction-major"
                   if self.extern.weight_axes[-1] == "k" else "GKCYX tiles load element by element")
            lines.append(f"  layout: w copied to {weight_axes_name(p, self.extern.weight_axes)} for the kernels below"
                         f" ({why})")
        if self.space_to_depth is not None:
            q = self.space_to_depth.problem
            lines.append(f"  layout: X and W regrouped space-to-depth (two copies) for the kernels below: a stride-1 "
                         f"forward over {q.in_channels} channels, {'x'.join(map(str, q.filter))} taps")
            lines.extend(_describe_extern(self.space_to_depth))
        elif self.channels_last is not None:
            lines.append("  layout: NGCHW activations copied to NHWGC and back around the kernels below")
            lines.extend(_describe_extern(self.channels_last))
        else:
            if self.extern.copied_channels_last:
                lines.append(f"  layout: {', '.join(self.extern.copied_channels_last)} copied to NHWGC for the"
                             " kernels below; the other activations read in place")
            lines.extend(_describe_extern(self))
        return "\n".join(lines)
    if self.linalg_reason:
        lines.append(f"  GEMM core: IREE's lowering of the linalg form ({self.linalg_reason})")
    if self.compute_a:
        lines.append(f"  compute: A in {self.compute_a}, B in {self.compute_b}, products summed in f32")
    if self.bf16x3 is not None:
        axis = bf16x3.reduction_axis(p)
        lines.append(
            f"  compute: bf16x3: f32 operands split into bf16 hi + lo, concatenated along {axis} as"
            f" [A_hi|A_hi|A_lo] x [B_hi|B_lo|B_hi] ({axis} x 3); bf16 products summed in f32, in the kernel below"
        )
        lines.extend("  " + ln for ln in describe_plan(self.bf16x3).splitlines()[1:])
        return "\n".join(lines)
    if p.bf16x3:
        lines.append(f"  compute: bf16x3 not applied: the {self.form} form is bound by memory; f32 on FMA units")
    if p.tf32:
        lines.append("  compute: tf32 allowed, not used: IREE's lowering of this form has no TF32 path; f32 products")
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
    if self.form != "gather" and (any(self.x_pad_lo + self.x_pad_hi) or any(self.dy_pad_lo + self.dy_pad_hi)):
        lines.append(f"  zero border: {self.pad_form} ({PAD_FORMS[self.pad_form]})")
    if len(self.phases) > 1:
        lines.append("  phases interleaved into dX by one elementwise generic (no strided insert_slice)")
    if self.weight_k_inner:
        lines.append("  phase weights: [G, C, taps, K], the reduction channel innermost (contiguous GEMM B columns)")
    if self.channels_last is not None:
        lines.append("  layout: NGCHW activations copied to NHWGC and back around the kernel below (GPU)")
        lines.extend("  " + ln for ln in describe_plan(self.channels_last).splitlines()[1:])
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
    if self.form == "depthwise-named":
        lines.extend(_describe_depthwise_named(self))
    return "\n".join(lines)


def _describe_depthwise_named(plan: KernelPlan) -> list[str]:
    p = plan.problem
    if p.op == "grad_weight":
        per = "image" if p.out_channels == 1 else "image and output channel"
        channels = p.groups * p.in_channels
        padded = f" ({channels} and zeros)" if plan.depthwise_channels > channels else ""
        lines = [f"  depthwise-named: one named depthwise convolution per {per}, X as its image and dY as its filter,"
                 f" over {plan.depthwise_channels} channels{padded}"]
        if plan.depthwise_taps != p.filter[-1]:
            lines.append(f"    innermost taps computed {plan.depthwise_taps} wide, {p.filter[-1]} kept (IREE's CPU"
                         " depthwise pipeline is slow where its step does not divide the width)")
        return lines
    lines = ["  depthwise-named: one named depthwise convolution per stride phase"]
    for ph, widened in zip(plan.phases, plan.depthwise_widths):
        if widened != ph.dims[-1].Q:
            lines.append(f"    residue {list(ph.residue)}: innermost output computed {widened} wide,"
                         f" {ph.dims[-1].Q} kept (IREE's CPU depthwise pipeline is slow where its step does not"
                         " divide the width)")
    return lines



def _act(p: ConvProblem, name: str) -> str:
    if name in ("bias", "scale", "shift"):  # per-channel vectors
        return "GC" if p.op == "transposed" else "GK"
    if name in ("d", "residual"):  # the result's layout
        return {"forward": p.layout_name("y"), "grad_weight": p.layout_name("w")}.get(p.op, p.layout_name("x"))
    if p.op == "transposed" and name == "x":
        return p.layout_name("y")
    return p.layout_name("x" if name in ("x", "d") else "y")


def _describe_fused(p: ConvProblem, extern: bool) -> list[str]:
    """The fused epilogue steps and the prologue: what each computes and where it runs (`extern`: after the
    Triton GEMM core, which applies a scale at most)."""
    lines = []
    ep = p.epilogue
    if ep.steps:
        ch = "c" if p.op == "transposed" else "k"
        words = {"bias": f"+ bias[g, {ch}]", "affine": f"* scale[g, {ch}] + shift[g, {ch}]", "residual": "+ residual"}
        head = {"none": [], "scale": [f"* {ep.alpha:g}"], "bilinear": [f"* {ep.alpha:g} + {ep.beta:g} * d"]}[ep.kind]
        chain = ", ".join(head + [words.get(s, step_text(s)) for s in ep.steps])
        where = ("one elementwise generic after the Triton kernel (which applies the scale and the cast), a dispatch "
                 "of its own; Knobs(extern=False) fuses it into IREE's GEMM instead" if extern else
                 "one elementwise generic on the GEMM's result, which IREE fuses into its dispatch")
        lines.append(f"  epilogue: {ep}: in f32, in order: {chain} (per-channel vectors broadcast over N and space); "
                     f"{where}")
    if p.prologue.kind != "none":
        saved = "the activation's output (mask > 0)" if p.prologue.saves_output else "the activation's input"
        lines.append(f"  prologue: {p.prologue}: dY * {step_text(p.prologue.activation)}'(saved), saved being {saved};"
                     f" in f32, rounded to {p.dtype}, one elementwise generic on dY before the GEMM reads it")
    return lines


# Triton's dot precisions as explain names them
PRODUCTS = {"ieee": "exact 16-bit", "tf32x3": "3-pass TF32", "bf16x3": "3-pass bf16", "tf32": "1-pass TF32"}


def _describe_extern(plan: KernelPlan) -> list[str]:
    p, ext = plan.problem, plan.extern
    assert ext is not None
    lines = [f"  GEMM core: Triton kernels in IREE external dispatches, tiles {ext.tiles.label()}"]
    if ext.tiles.pack > 1 and ext.launches[0].kernel in ("grad_input_phases", "grad_weight_partials"):
        pack = ext.tiles.pack
        lines.append(f"  packed groups: {pack} groups per GEMM (C={pack * p.in_channels}, K={pack * p.out_channels},"
                     f" block-diagonal weight: {pack}x the useful products in matrix-instruction tiles)")
    for launch in ext.launches:
        c = dict(launch.constants)
        lines_of_phases: list[str] = []
        products = PRODUCTS.get(c.get("PRECISION", ""), "f32 FMA")
        detail = f"grid {list(launch.grid)}, {launch.warps} warps, {products} products"
        if launch.kernel == "grad_input_direct":
            what = (f"direct sums of {math.prod(p.filter)} taps per dX element, a dY window of rows of"
                    f" {c['BLOCK_W']} positions in registers (depthwise: bound by memory)")
        elif launch.kernel == "forward_direct":
            what = (f"direct sums of {math.prod(p.filter)} taps per Y element, chunks of {c['BLOCK_W']} positions"
                    f" sharing an X window in registers (depthwise: bound by memory)")
        elif p.op == "forward":
            what = (f"forward as one implicit GEMM on grad_input's kernel: rows Y's positions, columns its K channels,"
                    f" reduction taps x C with X read at s*q - lo + j*d")
        elif launch.kernel == "grad_input_phases":
            what = f"{c['PHASES']} stride phase(s) in one launch, heaviest first"
            for ph in range(c["PHASES"]):
                q, j, r = ([c[x][i][ph] for i in range(3)][3 - p.dims:] for x in ("Q", "J", "R"))
                lines_of_phases.append(f"      residue {r}: positions {q}, taps {j}, programs "
                                       f"[{c['FIRST'][ph]}, {c['FIRST'][ph + 1]})"
                                       + (" (no tap: stores zeros)" if 0 in j else ""))
        elif launch.kernel == "grad_weight_depthwise_rows":
            what = (f"f32 partials {list(ext.partials_shape)}: S={launch.grid[1]} segments of {c['SEG']} dY rows"
                    f" per plane, windows of {c['BLOCK_W']} positions, one accumulator per tap"
                    f" ({math.prod(p.filter)}, every tap in each thread), sliding along the rows (the X rows"
                    " shared with the next row kept in registers), summed in segment order by one linalg reduction")
        elif launch.kernel == "grad_weight_depthwise":
            across = f"{c['TAP_ROWS']} tap rows across threads" if c["TAP_ROWS"] > 1 else "every tap in each thread"
            what = (f"f32 partials {list(ext.partials_shape)}: S={launch.grid[1]} chunks of {c['ROWS_PER']} dY rows"
                    f" in windows of {c['BLOCK_W']} positions, one accumulator per tap ({math.prod(p.filter)},"
                    f" {across}), summed in chunk order by one linalg reduction")
        else:
            what = (f"f32 partials {list(ext.partials_shape)}: split-K S={launch.grid[2]} chunks of {c['CHUNK']}"
                    " reduction steps, summed in chunk order by one linalg reduction")
        lines.append(f"    {launch.name}: {what}; {detail}")
        lines += lines_of_phases
    rounded = [la for la in ext.launches if dict(la.constants).get("ROUND_A") or dict(la.constants).get("ROUND_B")]
    if rounded:
        lines.append("  compute: operands stored position-major rounded to TF32 in registers, then stored "
                     "reduction-major for the matrix products")
    if p.fp8_compute:
        lines.append(f"  compute: operands rounded to {p.compute[0]} (first argument) and {p.compute[1]} (second)"
                     " by one linalg pass each, stored in f16 (exact), products summed in f32")
    return lines
