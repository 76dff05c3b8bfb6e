"""A stream kernel as data: the launches of one convolution's kernel on a CUDA stream, and what surrounds them
(staging copies, layout copies, the split-K sum, TMA descriptors).  The planner (passes/plan.py) decides every
field; stream.py compiles the launches and writes bundles; convdsl/torch runs them.  Nothing here decides."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..problem import ConvProblem, weight_axes_name
from .launch import Binary, Launch, TmaMap


@dataclass(frozen=True)
class StreamLaunch:
    launch: Launch
    binary: Binary  # empty (kind "none") until compiled: Triton's interpreter runs the launch from its source


def uncompiled(la: Launch) -> StreamLaunch:
    """A planned launch: its binary is compiled later (stream.compile_kernel), or never (Triton's interpreter)."""
    return StreamLaunch(la, Binary(la.name, b"", "none", 32 * la.warps, 0, 0))


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
    # decisions compiled into the binary's constants, kept here so that a loaded bundle can still say them:
    # the halo kernel's plane ranges per row tile (policy.halo_forward_split), and how often the bf16-split
    # grad_weight adds wgmma's sums in f32 (policy.tma_grad_weight_promote); 0 where they do not apply
    halo_splits: int = 0
    promote_every: int = 0

    @property
    def result_copied(self) -> bool:
        """Whether the launches write an NHWGC result that is then copied to the problem's layout."""
        return bool(self.copied) and self.problem.op != "grad_weight"

    def describe(self) -> str:
        names = ", ".join(sl.launch.kernel for sl in self.launches)
        if self.tma_maps:
            return self._describe_tma(names)
        copies = f"; {', '.join(self.copied)} copied to NHWGC" if self.copied else ""
        if self.problem.op == "forward" and names == "grad_input_phases":  # forward runs as one phase of it
            names += " (the forward as one implicit GEMM, one stride phase of grad_input's kernel)"
        if self.staging:
            p = self.planned
            copies += (f"; x and w regrouped space-to-depth, stride 1 over {p.in_channels} channels and "
                       f"{'x'.join(map(str, p.filter))} taps")
        copies += f"; w copied to {weight_axes_name(self.problem, self.weight_axes)}" if self.weight_axes else ""
        if self.problem.op != "grad_weight" and self.partials_shape:  # forward / grad_input split-K
            copies += (f"; split-K: {self.partials_shape[0]} chunks of the reduction into f32 partials, summed in "
                       "order")
        return (f"stream path: Triton kernels {names} (tiles {self.tiles}, {self.arch}){copies}; "
                f"knobs from the {self.knobs_source}")

    def _describe_tma(self, names: str) -> str:
        how = "; grad_input as the forward convolution of dY with the flipped weight" if self.tma_flipped_weight else ""
        if self.weight_axes:  # one-pass TF32: the weight's K-innermost copy, its tap tiles read in reverse
            how += f"; w copied to {weight_axes_name(self.problem, self.weight_axes)}, read taps reversed"
        knobs = f"; knobs from the {self.knobs_source}"
        if names == "grad_input_phases_tma":
            return (f"stream path: Gluon kernel {names} (every stride phase a forward of dY over its taps of the "
                    f"weight, on TMA im2col copies and wgmma, all phases in one persistent launch, dX stored by "
                    f"address; tiles {self.tiles}, {self.arch}){knobs}")
        if names == "forward_halo":
            split = f", {self.halo_splits} plane range(s) per row tile" if self.halo_splits else ""
            return (f"stream path: Gluon kernel {names} (each input plane copied once into shared memory per "
                    f"row tile, every tap's rows gathered from it into wgmma, three output planes accumulated "
                    f"at once{split}; tiles {self.tiles}, {self.arch}){how}{knobs}")
        if names == "grad_weight_flat_tma":
            products = "fp8 wgmma (f32 sums)" if self.problem.fp8_compute else "one-pass TF32 wgmma"
            return (f"stream path: Gluon kernel {names} ({products} on TMA copies of X and dY laid "
                    f"channel-first on flat planes; tiles {self.tiles}, {self.arch}){knobs}")
        if self.problem.dtype == "f32" and names == "grad_weight_tma":
            blocks = self.staged_shapes[0][0] // self.problem.batch if self.staged_shapes else 0
            products = (f"16-bit wgmma over X and dY split into bf16 parts, {blocks} products per product "
                        f"(bf16x{blocks})")
            if self.promote_every:
                products += f", wgmma's sums added in f32 every {self.promote_every} steps"
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
                f"{self.arch}){how}{knobs}")
