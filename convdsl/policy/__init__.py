"""Every planning decision in one package: which form a kernel takes, its tiles, packed groups, split-K, the
zero-border form, the operand precision, and the knobs over IREE's own GPU configuration.

The decisions are plain functions of the problem, the target (whose hardware facts, `Target.gpu`, size the
grids) and the kernel's knobs (tuned or asked for; convdsl/tuning).  The passes ask these functions and build
IR; convdsl/kernels builds the launches they decide; nothing here builds IR or reads the tuning database.

The rules live by target family, each module importing only those below it:
  common.py  what every family reads: the gather forms, the 1x1 grad_weight's operand order, split-K chunks;
  cpu.py     the CPU's forms, data tiling, workgroups and kept workspaces;
  iree.py    the linalg forms IREE compiles (zero border, phase weights) and the knobs over its GPU configuration;
  cuda.py    the Triton GEMM cores (cp.async, sm_80 and newer) and their launches;
  hopper.py  Hopper's TMA kernels (TMA im2col, halo, stride phases, flat planes) for the stream runner.
Every public rule is also a name of this package (`policy.X`), and `overrides` replaces a rule wherever it is read.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import common, cpu, cuda, hopper, iree
from .common import (CHANNELS_LAST_BACKENDS, FAST_WEIGHT_LAYOUT, MAX_GROUP_MACS, MAX_WEIGHT_SLICES, MIN_PARTIALS,
                     dy_first, even_chunks, gather_applies, gather_row_blocks, honoured_split, reduction_split)
from .cpu import (CPU_DEPTHWISE_CHANNELS, CPU_DEPTHWISE_WIDENED, CPU_KEPT_WORKSPACE_LEAST, CPU_KEPT_WORKSPACE_SHARE,
                  CPU_LEAST_WORKGROUPS, CPU_LONG_PANEL_BYTES, CPU_SPLIT_MOST, CPU_SPLIT_POSITIONS,
                  CPU_UNPACKED_MOST_COLUMNS, CPU_WORKGROUP_ROW_BYTES, cpu_data_tiling, cpu_depth_to_space,
                  cpu_depthwise_channels, cpu_depthwise_named, cpu_depthwise_width, cpu_gather_forward, cpu_im2col,
                  cpu_im2col_row_chunks, cpu_im2col_split_reason, cpu_keeps_workspace, cpu_packed_matmul_distribution)
from .cuda import (DENSE_WIDE_ROWS, FEW_STEPS_EIGHT_WARPS, OUTPUT_SPLIT_LEAST_REDUCTION, OUTPUT_SPLIT_LEAST_STEPS,
                   OUTPUT_SPLIT_MOST, SPACE_TO_DEPTH_MOST_CHANNELS, TAPS_PER_THREAD_MOST, TINY_ROWS, ExternLaunches,
                   LaunchPlan,
                   default_forward_tiles, default_grad_input_tiles, default_grad_weight_tiles, default_pack,
                   depthwise_grad_weight_parts, depthwise_grad_weight_split, depthwise_grad_weight_tiles,
                   direct_forward, direct_grad_input, direct_grad_input_tiles, dot_precision, dy_read_in_place,
                   extern_choice, extern_launches, fullest_split, grad_weight_parts, grad_weight_split, kernel_tiles,
                   last_wave_fill, launches_or_reason, output_split, plan_launches, relayout_ngchw,
                   resident_programs, slides_along_rows, space_to_depth_forward, split_k_sum, split_output_launches,
                   tap_rows, unsupported_reason, weight_copy_axes)
from .hopper import (FLAT_PLANES_MOST_BYTES, HALO_LEAST_EFFICIENCY, HALO_SHARED_BYTES, PHASES_STORE_SCRATCH,
                     PROMOTED_ACCUMULATOR_MOST, PROMOTED_ROWS, TF32_NARROW_STEPS, TMA_ONE_TAP_LEAST_ROWS,
                     WIDE_TILE_GAIN, TmaPlan,
                     grad_input_as_forward, halo_forward_efficiency, halo_forward_reason, halo_forward_split,
                     halo_tiles, phases_forward, promoted_tiles, tma_flat_grad_weight_parts,
                     tma_flat_grad_weight_reason, tma_flat_grad_weight_split, tma_flat_grad_weight_tiles,
                     tma_forward_programs, tma_forward_reason, tma_forward_shared_bytes, tma_forward_slower,
                     tma_forward_tiles, tma_fp8_promote, tma_grad_input_phases_programs, tma_grad_input_phases_reason,
                     tma_grad_input_phases_shared_bytes, tma_grad_input_phases_tiles, tma_grad_weight_parts,
                     tma_grad_weight_promote, tma_grad_weight_reason, tma_grad_weight_specialised,
                     tma_grad_weight_split, tma_grad_weight_tiles, tma_split_grad_weight, tma_stream_launch)
from .iree import (MODULE_WORKSPACE_MOST_BYTES, PAD_FORMS, WEIGHT_K_INNER_BACKENDS, default_pad_form, iree_knobs,
                   knobs_for, module_keeps_workspace, module_workspaces, pad_form, weight_k_inner)

__all__ = [
    "CHANNELS_LAST_BACKENDS", "FAST_WEIGHT_LAYOUT", "MAX_GROUP_MACS", "MAX_WEIGHT_SLICES", "MIN_PARTIALS",
    "dy_first", "even_chunks", "gather_applies", "gather_row_blocks", "honoured_split", "reduction_split",
    "CPU_DEPTHWISE_CHANNELS", "CPU_DEPTHWISE_WIDENED", "CPU_KEPT_WORKSPACE_LEAST", "CPU_KEPT_WORKSPACE_SHARE",
    "CPU_LEAST_WORKGROUPS", "CPU_LONG_PANEL_BYTES", "CPU_SPLIT_MOST", "CPU_SPLIT_POSITIONS",
    "CPU_UNPACKED_MOST_COLUMNS", "CPU_WORKGROUP_ROW_BYTES", "cpu_data_tiling", "cpu_depth_to_space",
    "cpu_depthwise_channels", "cpu_depthwise_named", "cpu_depthwise_width", "cpu_gather_forward", "cpu_im2col",
    "cpu_im2col_row_chunks", "cpu_im2col_split_reason", "cpu_keeps_workspace", "cpu_packed_matmul_distribution",
    "DENSE_WIDE_ROWS", "FEW_STEPS_EIGHT_WARPS", "OUTPUT_SPLIT_LEAST_REDUCTION", "OUTPUT_SPLIT_LEAST_STEPS",
    "OUTPUT_SPLIT_MOST",
    "SPACE_TO_DEPTH_MOST_CHANNELS", "TAPS_PER_THREAD_MOST", "TINY_ROWS", "ExternLaunches", "LaunchPlan",
    "default_forward_tiles", "default_grad_input_tiles", "default_grad_weight_tiles", "default_pack",
    "depthwise_grad_weight_parts", "depthwise_grad_weight_split", "depthwise_grad_weight_tiles", "direct_forward",
    "direct_grad_input", "direct_grad_input_tiles", "dot_precision", "dy_read_in_place", "extern_choice",
    "extern_launches", "fullest_split", "grad_weight_parts", "grad_weight_split", "kernel_tiles", "last_wave_fill",
    "launches_or_reason", "output_split", "plan_launches", "relayout_ngchw", "resident_programs",
    "slides_along_rows", "space_to_depth_forward", "split_k_sum", "split_output_launches", "tap_rows",
    "unsupported_reason", "weight_copy_axes",
    "FLAT_PLANES_MOST_BYTES", "HALO_LEAST_EFFICIENCY", "HALO_SHARED_BYTES", "PHASES_STORE_SCRATCH",
    "PROMOTED_ACCUMULATOR_MOST", "PROMOTED_ROWS", "TF32_NARROW_STEPS", "TMA_ONE_TAP_LEAST_ROWS", "WIDE_TILE_GAIN",
    "TmaPlan",
    "grad_input_as_forward", "halo_forward_efficiency", "halo_forward_reason", "halo_forward_split", "halo_tiles",
    "phases_forward", "promoted_tiles", "tma_flat_grad_weight_parts", "tma_flat_grad_weight_reason",
    "tma_flat_grad_weight_split", "tma_flat_grad_weight_tiles", "tma_forward_programs", "tma_forward_reason",
    "tma_forward_shared_bytes", "tma_forward_slower", "tma_forward_tiles", "tma_fp8_promote",
    "tma_grad_input_phases_programs",
    "tma_grad_input_phases_reason", "tma_grad_input_phases_shared_bytes", "tma_grad_input_phases_tiles",
    "tma_grad_weight_parts", "tma_grad_weight_promote", "tma_grad_weight_reason", "tma_grad_weight_specialised",
    "tma_grad_weight_split", "tma_grad_weight_tiles", "tma_split_grad_weight", "tma_stream_launch",
    "MODULE_WORKSPACE_MOST_BYTES", "PAD_FORMS", "WEIGHT_K_INNER_BACKENDS", "default_pad_form", "iree_knobs",
    "knobs_for", "module_keeps_workspace", "module_workspaces", "pad_form", "weight_k_inner",
    "overrides", "overrides_generation", "RULE_MODULES"
]

# --- overrides: a rule's variant, for probes and tests ---------------------------------------------------

# the modules whose names are rules; each reads the others' rules through the names it imported
RULE_MODULES = (common, cpu, iree, cuda, hopper)
# the launch plans' cache, held here: a probe may replace launches_or_reason itself
_launch_plans = cuda.launches_or_reason
_generation = 0


def overrides_generation() -> int:
    """Changes whenever `overrides` replaces or restores rules: plans cached outside this package (stream.py) key
    on it, so that none planned under other rules is served."""
    return _generation


@contextlib.contextmanager
def overrides(**rules: object) -> Iterator[None]:
    """Replace policy's rules (functions or constants, by name) while the block runs.  A rule is read through the
    name its caller's module binds: the module that defines it, every rule module that imported it (the launch
    builders they call too) and this package.  All of those bindings are replaced, so a replaced rule is what
    the planner sees (passes/plan.plan_kernel: the module's form and launches, the stream kernel's), whichever module asks; plans cached
    before are not served inside the block, nor those made inside after it.

        with policy.overrides(tma_grad_weight_parts=lambda p, tiles, target: 4):
            kernel = stream.planned_stream_kernel(p, target, Knobs(), compile=True)
    """
    global _generation
    modules = tuple(vars(m) for m in RULE_MODULES)
    unknown = sorted(name for name in rules if name.startswith("__") or not any(name in ns for ns in modules))
    if unknown:
        raise ValueError(f"policy.overrides: expected names of convdsl/policy's rules, got {', '.join(unknown)}")
    saved = [(ns, name, ns[name]) for ns in (globals(), *modules) for name in rules if name in ns]
    for ns, name, _ in saved:
        ns[name] = rules[name]
    _generation += 1
    _launch_plans.cache_clear()
    try:
        yield
    finally:
        for ns, name, value in saved:
            ns[name] = value
        _generation += 1
        _launch_plans.cache_clear()
