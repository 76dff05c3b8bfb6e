"""The plan of a kernel: every decision made before IR is built, so `convdsl explain` can show it."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from ..algebra import Phase, SplitK, dy_padding, grad_input_phases, plan_split_k, x_window
from ..kernels.launch import (Launch, dy_read_in_place, kernel_tiles, plan_launches, relayout_ngchw,
                              unsupported_reason)
from ..kernels.tiles import TileConfig, parse_tiles
from ..problem import ConvProblem
from ..targets import Target
from . import bf16x3, gather

if TYPE_CHECKING:
    from ..tuning.knobs import Knobs


@dataclass(frozen=True)
class ExternPlan:
    """The Triton launch of a kernel (a tuple of one: grad_input covers all its stride phases in one launch,
    grad_weight produces f32 split-K partials [S, G, K, taps, C]) and its tiles."""

    tiles: TileConfig
    launches: tuple[Launch, ...]
    partials_shape: tuple[int, ...] = ()
    # arguments (by name) the launches read from NHWGC copies, the others in place (dy_read_in_place)
    copied_channels_last: tuple[str, ...] = ()


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
    # form "extern" (CUDA): the GEMM core as Triton kernels in IREE external dispatches (passes/extern.py)
    extern: Optional[ExternPlan] = None
    # why a CUDA kernel keeps the linalg form (shown by explain); None where not asked
    linalg_reason: Optional[str] = None

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
        if self.extern is not None:
            if self.channels_last is not None:
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
            lines.extend("  " + ln for ln in self.bf16x3.describe().splitlines()[1:])
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


# The zero border around X or dY.  Measured on an H200 (benchmarks/results/*padforms*): IREE copies a
# fill + insert_slice (or an unfused tensor.pad) with an element-at-a-time "slow_memcpy" dispatch, 10x
# below copy bandwidth; a gather generic runs as a vectorised elementwise dispatch; a tensor.pad fused
# into the contraction (IREE's fuse-padding-into-consumer) costs no pass at all and was fastest for
# stride-1 f16/bf16 grad_input, but 3-6x slower for f32, whose convolutions do not run on matrix units.
PAD_FORMS = {
    "insert": "zeros + tensor.insert_slice",
    "gather": "one elementwise generic reading the interior with a guarded tensor.extract",
    "fuse": "tensor.pad, fused by IREE into the contraction's dispatch",
}


def default_pad_form(problem: ConvProblem, target: Target) -> str:
    if target.backend == "cpu":
        return "insert"
    sixteen_bit = problem.dtype in ("f16", "bf16") or problem.fp8_compute
    if sixteen_bit and problem.op in ("grad_input", "transposed") and all(s == 1 for s in problem.stride):
        return "fuse"
    return "gather"


def _tuned(problem: ConvProblem, target: Target) -> Optional["Knobs"]:
    """The tuning database's knobs for this problem (None on the CPU or for shapes it does not hold)."""
    from ..tuning.db import lookup

    return lookup(problem, target) if target.backend != "cpu" else None


def _act(p: ConvProblem, name: str) -> str:
    if p.op == "transposed" and name == "x":
        return p.layout_name("y")
    return p.layout_name("x" if name in ("x", "d") else "y")


# Backends whose NGCHW kernels run channels-last between layout copies (see plan_kernel).
CHANNELS_LAST_BACKENDS = ("cuda", "rocm")


# Why the phase weights of grad_input may be stored K-innermost.  The contraction is dX = dY . Wphase, with
# the reduction over (taps, K).  IREE 3.13 lowers it to mma.sync m16n8k16.row.col without ldmatrix: each
# thread loads its B fragment (pairs along the reduction) straight from shared memory, one 16-bit load per
# element when Wphase is stored [G, K, taps, C] (the PTX of CK 3D dgrad: 64 ld.shared.b16 + 64 st.shared.b16
# per 32 mma), 32-bit loads and 64-bit stores when K is innermost.  The weights are small and rebuilt by the
# flip gather anyway, so the order costs nothing.  Measured on an H100, same process
# (results/*exp-kinner*): 0.92-1.03x the time on the five strided cases (geomean 0.97), but 1.14x and 1.18x
# on the stride-1 ResNet 1x1 and DeepLab dgrad, so it is used where there is more than one stride phase.
# Only CUDA was measured (ROCm's MFMA loads differ), so only CUDA uses it.
WEIGHT_K_INNER_BACKENDS = ("cuda",)


def weight_k_inner(problem: ConvProblem, target: Target) -> bool:
    strided = any(s > 1 for s in problem.stride)
    return target.backend in WEIGHT_K_INNER_BACKENDS and not problem.depthwise and strided


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
    if p.tf32 and any(dict(la.constants).get("PRECISION") == "tf32x3" for la in ext.launches):
        lines.append("  compute: tf32 allowed, not used: one pass measured slower for grad_weight (kernels/launch.py)")
    if p.fp8_compute:
        lines.append(f"  compute: operands rounded to {p.compute[0]} (first argument) and {p.compute[1]} (second)"
                     " by one linalg pass each, stored in f16 (exact), products summed in f32")
    return lines


def _extern_tiles(problem: ConvProblem, target: Target,
                  layers: list["Knobs"]) -> tuple[bool, Optional[TileConfig], str]:
    """(use, tiles, reason): whether the external kernels are used, with which tiles (None: the kernel's
    defaults), else why not.
    The rule (kernels.launch.unsupported_reason) decides unless a layer's `extern` says otherwise."""
    reason = unsupported_reason(problem, target.backend, target.arch) if target.backend == "cuda" else "cpu"
    use = reason is None
    tiles = None
    for layer in layers:
        if layer.extern is not None:
            if layer.extern and reason is not None:
                raise ValueError(f"extern: kernel {problem.name} cannot use the external kernels: {reason}")
            use = layer.extern
            if not use:
                reason = "extern = false (tuned or asked for)"
        if layer.tiles is not None:
            tiles = parse_tiles(layer.tiles)
    return use, tiles, ("" if use else reason or "")


def plan_kernel(problem: ConvProblem, target: Target, knobs: Optional["Knobs"] = None) -> KernelPlan:
    """The kernel's plan.  Its IR choices, the zero-border form (knob `pad`) and the phase weight order
    (`k_inner`), come field by field from `knobs` (a tuning candidate), else from the tuning database's entry
    for this problem, else from the rules (default_pad_form, weight_k_inner).  The order and the tiles
    interact: CK 17's best tiles with K outer took 1.9x longer with K inner (run 12), so both are tuned."""
    layers = [k for k in (_tuned(problem, target), knobs) if k is not None]  # the candidate's over the DB's
    for layer in layers:
        if layer.pad is not None and layer.pad not in PAD_FORMS:
            raise ValueError(f"pad: expected one of {', '.join(PAD_FORMS)}, got {layer.pad!r}")
    use, tiles, reason = _extern_tiles(problem, target, layers)
    if use:
        relayout = relayout_ngchw(problem)
        for layer in layers:
            relayout = layer.relayout if layer.relayout is not None else relayout
        if problem.layout == "NGCHW" and relayout:
            # the kernels on NHWGC copies of the activations (contiguous channels), made and undone by linalg
            inner = problem.with_(layout="NHWGC")
            tiles = kernel_tiles(inner, tiles)
            if dy_read_in_place(problem, tiles):
                # grad_weight: only X copied; dY is read where it lies (one copy fewer)
                _, launches, partials = plan_launches(problem, tiles, x_layout=inner.layout)
                return KernelPlan(problem, target, "extern",
                                  extern=ExternPlan(tiles, launches, partials, copied_channels_last=("x",)))
            _, launches, partials = plan_launches(inner, tiles)
            inner_plan = KernelPlan(inner, target, "extern", extern=ExternPlan(tiles, launches, partials))
            return KernelPlan(problem, target, "extern", extern=inner_plan.extern, channels_last=inner_plan)
        tiles, launches, partials = plan_launches(problem, tiles)
        return KernelPlan(problem, target, "extern", extern=ExternPlan(tiles, launches, partials))
    plan = _plan_by_rules(problem, target)
    for chosen in layers:
        plan = _with_ir_knobs(plan, chosen)
    return replace(plan, linalg_reason=reason) if target.backend == "cuda" else plan


def _plan_by_rules(problem: ConvProblem, target: Target) -> KernelPlan:
    if problem.bf16x3:
        return _plan_bf16x3(problem, target)
    if problem.layout == "NGCHW" and target.backend in CHANNELS_LAST_BACKENDS:
        # IREE 3.13's GPU backends miscompile channel-first implicit GEMMs in f16/bf16 (wrong results
        # on an H200 for forward, grad_input and grad_weight, whatever the loop order; f32 was right):
        # run the kernel channels-last, between two layout copies.  Measured: benchmarks/README.md.
        inner = _plan(problem.with_(layout="NHWGC"), target)
        return KernelPlan(problem, target, inner.form, inner.compute_a, inner.compute_b, channels_last=inner)
    return _plan(problem, target)


def _with_ir_knobs(plan: KernelPlan, knobs: "Knobs") -> KernelPlan:
    """The plan (and the plans it wraps) with the knobs' zero-border form and phase weight order, where set;
    the order applies only where there are stride phases with K and C loops."""
    inner = {k: _with_ir_knobs(getattr(plan, k), knobs) for k in ("channels_last", "bf16x3")
             if getattr(plan, k) is not None}
    changes = dict(inner)
    if knobs.pad is not None:
        changes["pad_form"] = knobs.pad
    if knobs.k_inner is not None and plan.phases and plan.form == "implicit-gemm":
        changes["weight_k_inner"] = knobs.k_inner
    return replace(plan, **changes)


def _plan_bf16x3(problem: ConvProblem, target: Target) -> KernelPlan:
    from ..tuning.knobs import Knobs

    # The f32 kernel's form decides.  Depthwise and gather kernels are bound by memory (a few MACs per
    # loaded value): matrix units bring them nothing and the split would triple their reads, so they
    # keep the plain f32 plan (on the FMA units).  The CPU runs the split kernel like a GPU does.
    plain = plan_kernel(problem.with_(compute=None), target)
    if plain.form != "implicit-gemm":
        return replace(plain, problem=problem)
    inner = plan_kernel(bf16x3.split_problem(problem), target)
    assert inner.form == "implicit-gemm", inner.form  # a longer reduction never turns a GEMM into a gather
    if inner.pad_form == "fuse":
        # the hi/lo split feeding a tensor.pad fused into the contraction computed garbage on an H200
        # (CK 3D grad_input, rel. err 1.4; benchmarks/results/*run9*): the border gets its own pass
        inner = _with_ir_knobs(inner, Knobs(pad="gather"))
    return KernelPlan(problem, target, "implicit-gemm", bf16x3=inner)


def _plan(problem: ConvProblem, target: Target) -> KernelPlan:
    compute_a = compute_b = None
    if problem.fp8_compute:
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
        return KernelPlan(problem, target, form, compute_a, compute_b, phases=phases, dy_pad_lo=lo, dy_pad_hi=hi,
                          pad_form=default_pad_form(problem, target), weight_k_inner=weight_k_inner(problem, target))
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
                      dy_first=dy_first, pad_form=default_pad_form(problem, target))
