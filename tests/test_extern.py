"""The Triton GEMM cores (convdsl/kernels) and their IREE external dispatches (passes/extern.py).

Numerics: the kernels run in Triton's interpreter on the CPU (a subprocess, tests/kernel_interpreter.py)
against the float64 reference, over layouts, ranks, strides, dilations, paddings and groups.
Compilation: the same launches compile to cubin (sm_90) and PTX (sm_80) here, where no GPU exists, and
iree-compile accepts the modules that embed them.  The GPU tests (tests/test_gpu.py) run them on a chip.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convdsl.algebra import grad_input_phases
from convdsl.backends.iree import compile_mlir
from convdsl.kernels.compile import compile_launch
from convdsl.kernels.igemm_launches import FORWARD_WINDOW_MOST, grad_input_launch
from convdsl.kernels.launch import activation_strides, depthwise_chunk, flat_positions, weight_strides
from convdsl.passes.explain import describe_plan
from convdsl.policy import (
    default_pack,
    dy_read_in_place,
    fullest_split,
    grad_weight_parts,
    grad_weight_split,
    last_wave_fill,
    plan_launches,
    resident_programs,
    slides_along_rows,
    tap_rows,
    unsupported_reason,
)
from convdsl.kernels.tiles import TileConfig, parse_tiles
from convdsl.passes import lower_to_mlir
from convdsl.passes.plan import plan_kernel
from convdsl.problem import ConvProblem, Epilogue, problem_to_spec
from convdsl.reference import tolerance
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs, parse_label

pytest.importorskip("triton")

HOPPER, AMPERE, CPU = Target("cuda", "sm_90"), Target("cuda", "sm_80"), Target("cpu", "host")
SMALL_TILES = "t16x16x16w4s2g2"
HERE = Path(__file__).resolve().parent


def _p(**kw) -> ConvProblem:
    base = dict(op="grad_input", dims=2, groups=2, batch=2, in_channels=5, out_channels=6, input=(7, 6),
                filter=(3, 2), stride=(2, 1), dilation=(1, 2), pad_lo=(1, 0), pad_hi=(1, 1), dtype="f32", name="k")
    base.update(kw)
    return ConvProblem(**base)


def _interpret(problems: list[ConvProblem], tiles: str = SMALL_TILES, x_layout: str | None = None,
               native: bool = False, wide: bool = False) -> list[dict]:
    """native: the tensors in the problems' own dtypes (kernel_interpreter.py), else f32; wide: the launches'
    64-bit offset form."""
    pytest.importorskip("torch")  # Triton's interpreter runs on torch CPU tensors
    jobs = [{"spec": problem_to_spec(p), "tiles": tiles, "x_layout": x_layout, "native": native, "wide": wide}
            for p in problems]
    done = subprocess.run([sys.executable, str(HERE / "kernel_interpreter.py")], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=HERE.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _check(problems: list[ConvProblem], results: list[dict]) -> None:
    for p, r in zip(problems, results):
        assert r["unwritten"] == 0, f"{p.describe()}: {r['unwritten']} output elements never stored"
        assert r["error"] <= tolerance(p), f"{p.describe()}: relative error {r['error']:.2e}"


NAMED = [
    *(_p(op=op, layout=layout, weight_layout=wl, name=f"{op}-{layout}-{wl}")
      for op in ("grad_input", "grad_weight") for layout in ("NHWGC", "GNHWC", "NGCHW") for wl in ("GKYXC", "GKCYX")),
    # 1D stride 3 (a residue with no tap: its launch stores zeros), 3D strided and dilated
    _p(dims=1, input=(11,), filter=(3,), stride=(3,), dilation=(1,), pad_lo=(2,), pad_hi=(0,), name="1d-s3"),
    _p(op="grad_weight", dims=1, input=(11,), filter=(3,), stride=(3,), dilation=(1,), pad_lo=(2,), pad_hi=(0,),
       name="1d-s3-w"),
    _p(dims=3, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2), pad_lo=(1, 1, 2),
       pad_hi=(0, 1, 1), name="3d"),
    _p(op="grad_weight", dims=3, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
       pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="3d-w"),
    # transposed is grad_input's arithmetic; a scale epilogue is applied by the kernel
    _p(op="transposed", name="transposed"),
    _p(epilogue=Epilogue("scale", 0.5), name="scaled"),
    # stride 1, same size (X's positions at dY's: the kernel's X_FLAT addressing), both channels-last layouts
    *(_p(op="grad_weight", stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 0), layout=layout,
         name=f"same-w-{layout}") for layout in ("NHWGC", "GNHWC")),
    # more channels than one tile, an explicit split-K
    _p(op="grad_weight", in_channels=33, out_channels=17, groups=1, split_k=3, name="split"),
    # few channels per group: the direct kernel (depthwise strided and dilated; grouped, channel-first)
    _p(groups=6, in_channels=1, out_channels=1, stride=(2, 2), dilation=(1, 2), name="depthwise"),
    _p(groups=5, in_channels=1, out_channels=1, layout="NGCHW", weight_layout="GKCYX", name="depthwise-ngchw"),
    _p(dims=3, groups=4, in_channels=1, out_channels=1, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2),
       dilation=(1, 1, 2), pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="depthwise-3d"),
    # depthwise grad_weight: every tap of a block in registers (strided and dilated, 3D, channel-first)
    _p(op="grad_weight", groups=6, in_channels=1, out_channels=1, stride=(2, 2), dilation=(1, 2), name="dw-w"),
    _p(op="grad_weight", dims=3, groups=4, in_channels=1, out_channels=1, input=(5, 4, 6), filter=(2, 3, 3),
       stride=(2, 1, 2), dilation=(1, 1, 2), pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="dw-w-3d"),
    _p(op="grad_weight", groups=5, in_channels=1, out_channels=1, layout="NGCHW", weight_layout="GKCYX",
       name="dw-w-ngchw"),
]


def test_interpreted_kernels_match_the_reference():
    _check(NAMED, _interpret(NAMED))


# the 64-bit offset form of every kernel (GEMM and direct; grad_weight's partials, strided, 3D, channel-first):
# the same numbers as the 32-bit form
WIDE_FORMS = [p for p in NAMED if p.name in ("grad_input-NGCHW-GKCYX", "grad_weight-NHWGC-GKYXC", "1d-s3", "3d",
                                             "depthwise-3d", "dw-w", "dw-w-3d", "dw-w-ngchw")]
WIDE_FORMS += [_p(op="forward", dims=3, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
                  pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="fwd-3d-wide"),
               _p(op="forward", groups=6, in_channels=1, out_channels=1, stride=(2, 2), name="fwd-dw-wide")]


# the one-tap loop of grad_input_phases (1x1 filters, and stride phases of one tap): reductions that fill whole
# BLOCK_K steps (unmasked channel loads) and ones that do not, padding, strided rows, zero phases
ONE_TAP = [
    _p(op="forward", in_channels=32, out_channels=24, filter=(1, 1), stride=(1, 1), dilation=(1, 1), pad_lo=(0, 0),
       pad_hi=(0, 0), name="fwd-1x1-even"),
    _p(op="forward", in_channels=20, out_channels=24, filter=(1, 1), stride=(2, 2), dilation=(1, 1), pad_lo=(1, 0),
       pad_hi=(0, 1), name="fwd-1x1-odd-strided"),
    _p(in_channels=8, out_channels=32, filter=(1, 1), stride=(2, 2), dilation=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0),
       name="dgrad-1x1-s2"),
    _p(in_channels=8, out_channels=16, filter=(3, 3), stride=(3, 3), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1),
       input=(9, 9), name="dgrad-3x3-s3"),
]


def test_interpreted_one_tap_loop_matches_the_reference():
    for p in ONE_TAP:
        _, (launch,), _ = plan_launches(p, parse_tiles(SMALL_TILES), HOPPER)
        taps = [math.prod(launch_j) for launch_j in zip(*dict(launch.constants)["J"])]
        assert dict(launch.constants)["ONE_TAP"] and 1 in taps, p.name  # some phase runs the one-tap loop
    _check(ONE_TAP, _interpret(ONE_TAP))


# forward with fewer input channels than a reduction step (an RGB stem): the (taps, C) reduction flattened;
# strided, padded, dilated, 1D/2D/3D, channel-first and GKCYX weights, steps that end past the last tap
FLAT = [
    _p(op="forward", groups=1, in_channels=3, out_channels=20, input=(11, 10), filter=(3, 3), stride=(2, 2),
       dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 0), name="fwd-stem"),
    _p(op="forward", groups=2, in_channels=1, out_channels=5, dims=1, input=(13,), filter=(5,), stride=(3,),
       dilation=(2,), pad_lo=(2,), pad_hi=(1,), layout="GNHWC", weight_layout="GKCYX", name="fwd-flat-1d"),
    _p(op="forward", groups=1, in_channels=2, out_channels=6, dims=3, input=(5, 4, 6), filter=(2, 3, 3),
       stride=(2, 1, 2), dilation=(1, 1, 2), pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), layout="NGCHW", name="fwd-flat-3d"),
]


def test_interpreted_flat_reduction_matches_the_reference():
    for p in FLAT:
        _, (launch,), _ = plan_launches(p, parse_tiles(SMALL_TILES), HOPPER)
        assert dict(launch.constants)["FLAT"], p.name
    _check(FLAT, _interpret(FLAT))


def test_interpreted_wide_offsets_match_the_reference():
    assert len(WIDE_FORMS) == 10
    _check(WIDE_FORMS, _interpret(WIDE_FORMS, wide=True))


def _big(**kw) -> ConvProblem:
    base = dict(op="grad_input", dims=3, groups=1, batch=32, in_channels=64, out_channels=64, input=(72, 128, 128),
                filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(1, 1, 1),
                dtype="f16", name="big")
    base.update(kw)
    return ConvProblem(**base)


def test_wide_offsets_exactly_where_a_tensor_reaches_2_to_the_30_elements():
    # dX of N x 64 x 2^14 positions: 2^20 elements per image, so batch 1024 is the first of 2^30 elements
    at = _big(batch=1024, input=(1, 128, 128))
    under = at.with_(batch=1023)
    for p, wide in ((at, True), (under, False)):
        for op in ("grad_input", "grad_weight", "forward"):
            _, launches, _ = plan_launches(p.with_(op=op), None, HOPPER)
            assert all(dict(la.constants)["WIDE"] is wide for la in launches), (op, p.batch)
    # the case: grad_weight's f32 partials (split_k 112 x 1024 x 1024 x 25 = 2.9e9 elements) are wide
    # although X, dY and W are small
    w = ConvProblem(op="grad_weight", dims=2, groups=1, batch=64, in_channels=1024, out_channels=1024,
                    input=(28, 28), filter=(5, 5), stride=(1, 1), dilation=(1, 1), pad_lo=(2, 2), pad_hi=(2, 2),
                    dtype="f16", split_k=112, name="w")
    assert max(math.prod(w.x_shape), math.prod(w.y_shape), math.prod(w.w_shape)) < 2**30
    _, (launch,), partials = plan_launches(w, None, HOPPER)
    assert math.prod(partials) >= 2**31 and dict(launch.constants)["WIDE"] is True
    _, (launch,), partials = plan_launches(w.with_(split_k=32), None, HOPPER)
    assert math.prod(partials) < 2**30 and dict(launch.constants)["WIDE"] is False


def test_tensors_past_2_to_the_31_elements_take_the_kernels():
    p = _big()  # dX 2.4e9 elements (4.8 GB in f16)
    assert math.prod(p.x_shape) > 2**31 and unsupported_reason(p, HOPPER) is None
    _, (launch,), _ = plan_launches(p, None, HOPPER)
    assert dict(launch.constants)["WIDE"] is True and launch.grid[0] < 2**31 - 1


def test_grids_stay_within_cudas_limits():
    # split-K chunks and depthwise row chunks a knob asks beyond 65535 are cut to it; a split_k asked for so is
    # refused (never silently changed), and the kernel keeps the linalg form, which cuts the batch
    w = _big(op="grad_weight", input=(64, 128, 128), in_channels=8, out_channels=8)
    _, (launch,), _ = plan_launches(w, parse_tiles("t16x16x16w4s2k100000"), HOPPER)
    assert 60000 < launch.grid[2] <= 65535
    with pytest.raises(ValueError, match="kernel big: split_k = 100000 cannot be honoured by the grad_weight GEMM kernel"):
        plan_launches(w.with_(split_k=100000), None, HOPPER)
    assert "split_k = 100000" in unsupported_reason(w.with_(split_k=100000), HOPPER)
    dw = _big(op="grad_weight", groups=64, in_channels=1, out_channels=1, filter=(3, 3, 3))
    _, (launch,), _ = plan_launches(dw, parse_tiles("t8x32x1w1s1k100000"), HOPPER)
    assert launch.grid[1] <= 65535
    # more packed groups than a grid's y can hold: the linalg form, with the reason
    many = _p(groups=140000, in_channels=16, out_channels=16, input=(4, 4), stride=(1, 1), dilation=(1, 1))
    assert "65535" in unsupported_reason(many, HOPPER)


# forward on grad_input's GEMM kernel (one phase, read stride s, weight's k and c strides swapped): every layout
# and weight layout (strided (2, 1), dilated (1, 2), asymmetric padding), 1D stride 3, 3D, a scale epilogue,
# channels past one tile (column tiles and reduction steps), and 16-bit storage (f16: exact products, the
# store's cast; bf16 only as f32 values: the interpreter's bf16 dot is wrong)
FORWARD = [
    *(_p(op="forward", layout=layout, weight_layout=wl, name=f"fwd-{layout}-{wl}")
      for layout in ("NHWGC", "GNHWC", "NGCHW") for wl in ("GKYXC", "GKCYX")),
    _p(op="forward", dims=1, input=(11,), filter=(3,), stride=(3,), dilation=(1,), pad_lo=(2,), pad_hi=(0,),
       name="fwd-1d-s3"),
    _p(op="forward", dims=3, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
       pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="fwd-3d"),
    _p(op="forward", epilogue=Epilogue("scale", 0.5), dtype="bf16", name="fwd-scaled-bf16"),
    _p(op="forward", groups=1, in_channels=33, out_channels=17, stride=(1, 1), name="fwd-wide"),
]
FORWARD_16_BIT = [
    _p(op="forward", dtype="f16", name="fwd-f16"),
    _p(op="forward", dtype="f16", layout="GNHWC", weight_layout="GKCYX", dims=1, input=(11,), filter=(3,),
       stride=(2,), dilation=(2,), pad_lo=(0,), pad_hi=(2,), epilogue=Epilogue("scale", 2.0), name="fwd-f16-1d"),
]


def test_interpreted_forward_gemm_matches_the_reference():
    for p in FORWARD + FORWARD_16_BIT:
        _, (launch,), _ = plan_launches(p, parse_tiles(SMALL_TILES), HOPPER)
        c = dict(launch.constants)
        assert launch.kernel == "grad_input_phases" and c["PHASES"] == 1 and c["RS"][3 - p.dims:] == p.stride
        assert c["PRECISION"] == ("ieee" if p.dtype != "f32" else "tf32x3"), p.name
    _check(FORWARD, _interpret(FORWARD))
    _check(FORWARD_16_BIT, _interpret(FORWARD_16_BIT, native=True))


# the depthwise window kernels with small chunks (t4: rows cut into uneven chunks, a masked tail; dgrad's chunks
# rounded up to the stride), filters past TAPS_PER_THREAD_MOST (tap rows across threads, padded), 1D and 3D,
# transposed and scaled, and a forced split of a chunk per dY row
def _dw(**kw) -> ConvProblem:
    return _p(**{**dict(groups=20, in_channels=1, out_channels=1, input=(5, 13), filter=(3, 3), stride=(1, 2),
                        dilation=(1, 2), pad_lo=(1, 2), pad_hi=(1, 1)), **kw})


WINDOWS = [
    _dw(op="grad_weight", name="dw-w-chunks"),
    _dw(op="grad_weight", filter=(5, 5), stride=(1, 1), dilation=(1, 1), pad_lo=(2, 2), pad_hi=(2, 2),
        name="dw-w-tap-rows"),
    _dw(op="grad_weight", dims=3, input=(5, 4, 9), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
        pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="dw-w-3d-tap-rows"),
    _dw(op="grad_weight", dims=1, input=(23,), filter=(7,), stride=(2,), dilation=(1,), pad_lo=(3,), pad_hi=(3,),
        layout="NGCHW", weight_layout="GKCYX", name="dw-w-1d"),
    _dw(stride=(2, 3), name="dw-dgrad-chunks"),
    _dw(dims=3, input=(5, 4, 9), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2), pad_lo=(1, 1, 2),
        pad_hi=(0, 1, 1), name="dw-dgrad-3d"),
    _dw(op="transposed", dims=1, input=(23,), filter=(7,), stride=(2,), dilation=(1,), pad_lo=(3,), pad_hi=(3,),
        epilogue=Epilogue("scale", 0.5), name="dw-transposed-1d"),
]
# forward_direct: strided and dilated rows cut into chunks (a masked tail), 3D, 1D stride 3 channel-first with a
# scale epilogue, every activation layout; 16-bit storage (no dot here: bf16 runs natively too)
FORWARD_WINDOWS = [
    _dw(op="forward", name="dw-fwd-chunks"),
    _dw(op="forward", dims=3, input=(4, 3, 9), filter=(2, 2, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
        pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), layout="GNHWC", name="dw-fwd-3d"),
    _dw(op="forward", dims=1, input=(23,), filter=(7,), stride=(3,), dilation=(1,), pad_lo=(3,), pad_hi=(2,),
        layout="NGCHW", weight_layout="GKCYX", epilogue=Epilogue("scale", 0.5), name="dw-fwd-1d"),
]
FORWARD_WINDOWS_16_BIT = [
    _dw(op="forward", dtype="bf16", input=(3, 9), name="dw-fwd-bf16"),
    _dw(op="forward", dtype="f16", input=(3, 9), layout="NGCHW", name="dw-fwd-f16"),
]


def test_interpreted_depthwise_windows_match_the_reference():
    _check(WINDOWS, _interpret(WINDOWS, tiles="t4x16x1w4s1"))
    split = [_dw(op="grad_weight", dims=3, input=(5, 4, 9), filter=(2, 3, 3), stride=(1, 1, 2), dilation=(1, 1, 2),
                 pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="dw-w-split")]
    _, (launch,), partials = plan_launches(split[0], parse_tiles("t4x16x1w1s1k40"), HOPPER)
    assert launch.grid[1] == partials[0] == 40 and dict(launch.constants)["ROWS_PER"] == 1  # a chunk per row
    _check(split, _interpret(split, tiles="t4x16x1w1s1k40"))


def test_interpreted_depthwise_forward_matches_the_reference():
    for p in FORWARD_WINDOWS + FORWARD_WINDOWS_16_BIT:
        _, (launch,), _ = plan_launches(p, parse_tiles("t4x16x1w4s1"), HOPPER)
        assert launch.kernel == "forward_direct" and launch.grid[0] == p.batch * math.prod(p.output[:-1])
    _check(FORWARD_WINDOWS, _interpret(FORWARD_WINDOWS, tiles="t4x16x1w4s1"))
    _check(FORWARD_WINDOWS_16_BIT, _interpret(FORWARD_WINDOWS_16_BIT, tiles="t4x16x1w4s1", native=True))


@pytest.mark.parametrize("stride, filt, dilation, longest", [(1, 3, 1, 32), (2, 3, 1, 31), (3, 7, 2, 18),
                                                              (1, 31, 1, 4), (1, 3, 40, 1)])
def test_forward_chunks_keep_the_x_window_bounded(stride, filt, dilation, longest):
    # a chunk of BLOCK_W positions reads (BLOCK_W - 1) * stride + (filt - 1) * dilation + 1 X positions per tap row
    p = _dw(op="forward", dims=1, input=(200,), filter=(filt,), stride=(stride,), dilation=(dilation,),
            pad_lo=(0,), pad_hi=(0,))
    _, (launch,), _ = plan_launches(p, parse_tiles("t32x16x1w4s1"), HOPPER)
    width = dict(launch.constants)["BLOCK_W"]
    assert width == depthwise_chunk(p.output[0], longest)
    assert width == 1 or (width - 1) * stride + (filt - 1) * dilation + 1 <= FORWARD_WINDOW_MOST


# grad_weight_depthwise_rows: the kernel that slides along dY's rows (stride and dilation 1 along them, every tap
# in each thread), in 2D and 3D (two planes of X rows kept), channel-first, strided and dilated along the other
# dimensions, with segments cut unevenly (a short last one) by an explicit split
SLIDING = [
    _dw(op="grad_weight", name="dw-w-rows"),
    _dw(op="grad_weight", dims=3, input=(5, 7, 9), filter=(2, 2, 3), stride=(2, 1, 2), dilation=(2, 1, 2),
        pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="dw-w-rows-3d"),
    _dw(op="grad_weight", input=(9, 6), filter=(4, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(2, 1),
        pad_hi=(1, 1), layout="NGCHW", weight_layout="GKCYX", name="dw-w-rows-ngchw"),
]


@pytest.mark.parametrize("tiles", ["t4x16x1w1s1", "t4x16x1w1s1k11", "t2x8x1w2s1k40"])
def test_interpreted_depthwise_rows_kernel_matches_the_reference(tiles):
    for p in SLIDING:
        assert slides_along_rows(p), p.name
        _, (launch,), partials = plan_launches(p, parse_tiles(tiles), HOPPER)
        consts = dict(launch.constants)
        assert launch.kernel == "grad_weight_depthwise_rows" and launch.grid[1] == partials[0]
        # the segments cover every dY row of every plane once
        out = (1,) * (3 - p.dims) + p.output
        assert partials[0] == p.batch * out[0] * -(-out[1] // consts["SEG"])
    _check(SLIDING, _interpret(SLIDING, tiles=tiles))
    assert "sliding along the rows" in describe_plan(plan_kernel(SLIDING[0], HOPPER, Knobs(tiles=tiles)))
    # stride 2 along the rows, or too many taps for one thread: the general kernel
    assert not slides_along_rows(_dw(op="grad_weight", stride=(2, 1)))
    assert not slides_along_rows(_dw(op="grad_weight", filter=(5, 5)))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 64))
def test_depthwise_chunks_are_the_fewest_and_as_even_as_they_come(extent, most):
    width = depthwise_chunk(extent, most)
    chunks = -(-extent // width)
    assert width <= most and chunks == -(-extent // most)
    assert (chunks - 1) * width < extent <= chunks * width and chunks * width - extent < chunks


def test_wide_depthwise_filters_compile_to_bounded_code():
    # RepLKNet's 31x31 depthwise: grad_input_direct loops over tap rows and cuts chunks shorter for wide filters
    # (unrolled whole, a 13x13 filter took 5 minutes to compile to 592 KB); grad_weight spreads tap rows across
    # threads; forward_direct loops over tap rows as grad_input_direct does
    for op in ("grad_input", "grad_weight", "forward"):
        p = _dw(op=op, dtype="f16", batch=8, input=(32, 32), filter=(31, 31), stride=(1, 1), dilation=(1, 1),
                pad_lo=(15, 15), pad_hi=(15, 15))
        _, (launch,), _ = plan_launches(p, None, HOPPER)
        assert len(compile_launch(launch, "sm_90").data) < 300_000, op


def test_tap_rows_go_across_threads_for_large_filters():
    dw = _dw(op="grad_weight")
    assert tap_rows(dw) == 1 and tap_rows(dw.with_(filter=(7, 7))) == 8
    assert tap_rows(dw.with_(dims=3, input=(5, 4, 9), filter=(3, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
                             pad_lo=(1, 1, 1), pad_hi=(1, 1, 1))) == 16
    assert tap_rows(dw.with_(dims=1, input=(40,), filter=(31,), stride=(1,), dilation=(1,), pad_lo=(15,),
                             pad_hi=(15,))) == 1  # one row of 31 taps: nothing to spread


def _grouped(**kw) -> ConvProblem:
    return _p(**{**dict(groups=8, in_channels=4, out_channels=4), **kw})


# packed groups: PACK groups per GEMM with a block-diagonal weight (both ops, strided and dilated, channel-first,
# uneven C and K, 1D and 3D, transposed, depthwise packed on request)
PACKED = [
    _grouped(name="packed"),
    _grouped(op="grad_weight", name="packed-w"),
    _grouped(layout="NGCHW", weight_layout="GKCYX", name="packed-ngchw"),
    _grouped(op="grad_weight", layout="NGCHW", weight_layout="GKCYX", name="packed-w-ngchw"),
    _grouped(in_channels=2, out_channels=8, name="packed-2x8"),
    _grouped(op="grad_weight", in_channels=8, out_channels=2, name="packed-w-8x2"),
    _grouped(op="transposed", dims=1, input=(11,), filter=(3,), stride=(3,), dilation=(1,), pad_lo=(2,),
             pad_hi=(0,), name="packed-1d-s3"),
    _grouped(op="grad_weight", dims=3, input=(5, 4, 6), filter=(2, 3, 3), stride=(2, 1, 2), dilation=(1, 1, 2),
             pad_lo=(1, 1, 2), pad_hi=(0, 1, 1), name="packed-w-3d"),
    _grouped(op="forward", name="packed-fwd"),
    _grouped(op="forward", in_channels=8, out_channels=2, layout="NGCHW", weight_layout="GKCYX", name="packed-fwd-8x2"),
    _grouped(in_channels=1, out_channels=1, name="packed-depthwise"),
    _grouped(op="grad_weight", in_channels=1, out_channels=1, name="packed-w-depthwise"),
]


def test_interpreted_packed_groups_match_the_reference():
    _check(PACKED, _interpret(PACKED, tiles="t16x16x16w4s2g2p4"))
    # the default tiles pack by themselves (default_pack): 4 groups of 8 channels, 8 groups of 4
    defaults = [_grouped(groups=4, in_channels=8, out_channels=8, name="default-8"), _grouped(name="default-4"),
                _grouped(op="grad_weight", name="default-4-w")]
    assert [plan_launches(p, None, HOPPER)[0].pack for p in defaults] == [4, 8, 8]
    _check(defaults, _interpret(defaults, tiles=""))


def test_packing_needs_adjacent_group_channels_and_a_dividing_pack():
    assert default_pack(_grouped(layout="GNHWC")) == 1  # groups' channels are not adjacent in GNHWC
    assert default_pack(_grouped(groups=6)) == 2  # as far as the group count divides
    assert default_pack(_grouped(in_channels=32, out_channels=16)) == 2
    assert default_pack(_grouped(in_channels=32, out_channels=32)) == 1
    assert default_pack(_grouped(in_channels=1, out_channels=1)) == 1  # depthwise: its own kernels
    with pytest.raises(ValueError, match="pack 4 for kernel k: 6 groups are not a multiple"):
        plan_launches(_grouped(groups=6), parse_tiles("t16x16x16w4s2p4"), HOPPER)
    with pytest.raises(ValueError, match="layout GNHWC does not keep"):
        plan_launches(_grouped(layout="GNHWC", op="grad_weight"), parse_tiles("t16x16x16w4s2p2"), HOPPER)
    # the rule: packable few-channel groups take the Triton kernels on CUDA, GNHWC keeps the gather form
    rx = _grouped(dtype="f16", stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), filter=(3, 3))
    assert unsupported_reason(rx, HOPPER) is None
    assert "gather form" in unsupported_reason(rx.with_(layout="GNHWC"), HOPPER)


@st.composite
def problems(draw) -> ConvProblem:
    dims = draw(st.integers(1, 3))
    filt = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dil = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    lo = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    hi = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    # the window must fit: I + lo + hi >= d*(R-1) + 1
    inp = tuple(max(draw(st.integers(2, 7)), d * (r - 1) + 1 - a - b) for r, d, a, b in zip(filt, dil, lo, hi))
    return ConvProblem(
        op=draw(st.sampled_from(["grad_input", "grad_weight"])), dims=dims, groups=draw(st.integers(1, 2)),
        batch=draw(st.integers(1, 2)), in_channels=draw(st.integers(2, 9)), out_channels=draw(st.integers(2, 9)),
        input=inp, filter=filt, stride=stride, dilation=dil, pad_lo=lo, pad_hi=hi,
        layout=draw(st.sampled_from(["NHWGC", "GNHWC", "NGCHW"])),
        weight_layout=draw(st.sampled_from(["GKYXC", "GKCYX"])), dtype="f32", name="prop",
    )


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(problems(), min_size=8, max_size=8))
def test_interpreted_kernels_match_the_reference_on_random_shapes(batch):
    _check(batch, _interpret(batch))


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(problems().map(lambda p: p.with_(op="forward")), min_size=6, max_size=6))
def test_interpreted_forward_matches_the_reference_on_random_shapes(batch):
    _check(batch, _interpret(batch))


# --- the index algebra the launches carry ----------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(problems())
def test_the_phases_of_the_launch_write_every_dx_position_once(p):
    # the residues i = r + s*q of the phases partition [0, I) in every dimension; the phases' program ranges
    # [FIRST[p], FIRST[p+1]) tile the grid, each as many programs as its row and column tiles, heaviest first
    if p.op != "grad_input":
        p = p.with_(op="grad_input")
    tiles = parse_tiles(SMALL_TILES)
    c = dict(grad_input_launch(p, tiles, "k", "tf32x3").constants)
    grid_x = grad_input_launch(p, tiles, "k", "tf32x3").grid[0]
    assert c["PHASES"] == len(grad_input_phases(p)) and c["FIRST"][0] == 0 and c["FIRST"][-1] == grid_x
    seen = []
    for ph in range(c["PHASES"]):
        q = [c["Q"][i][ph] for i in range(3)]
        per_dim = [[c["R"][i][ph] + c["S"][i] * j for j in range(q[i])] for i in range(3)]
        seen.extend((a, b, d) for a in per_dim[0] for b in per_dim[1] for d in per_dim[2])
        rows = p.batch * math.prod(q)
        assert c["FIRST"][ph + 1] - c["FIRST"][ph] == -(-rows // tiles.block_m) * -(-c["C"] // tiles.block_n)
    taps = [math.prod(c["J"][i][ph] for i in range(3)) for ph in range(c["PHASES"])]
    assert taps == sorted(taps, reverse=True)
    padded = (1,) * (3 - p.dims) + p.input
    assert sorted(seen) == sorted((a, b, d) for a in range(padded[0]) for b in range(padded[1])
                                  for d in range(padded[2]))


@settings(max_examples=60, deadline=None)
@given(problems(), st.integers(0, 9))
def test_split_k_chunks_cover_the_reduction_once(p, forced):
    tiles = TileConfig(16, 16, 16, 4, 2, split=forced)
    parts, chunk = grad_weight_split(p, tiles, HOPPER)
    length = p.batch * math.prod(p.output)
    assert chunk % tiles.block_k == 0 and parts >= 1
    assert (parts - 1) * chunk < length <= parts * chunk  # every chunk non-empty, the last one may be short


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 1500), st.integers(1, 256))
def test_the_automatic_split_is_the_fewest_chunks_that_fill_the_slots_as_well_as_any(tiles_out, slots, most):
    parts = fullest_split(tiles_out, slots, most)
    fills = [last_wave_fill(tiles_out * s, slots) for s in range(1, most + 1)]
    assert 1 <= parts <= most
    assert fills[parts - 1] >= max(fills) - 0.02  # as busy as the best, within the margin
    assert all(f < max(fills) - 0.02 for f in fills[: parts - 1])  # and no fewer chunks are


@settings(max_examples=60, deadline=None)
@given(problems())
def test_grad_weight_split_uses_the_fullest_split_of_the_tiles_resident_slots(p):
    p = p.with_(op="grad_weight", dtype="f16")
    tiles = TileConfig(16, 16, 16, 4, 2)
    steps = -(-p.batch * math.prod(p.output) // 16)
    tiles_out = p.groups * -(-p.out_channels // 16) * -(-(p.in_channels * math.prod(p.filter)) // 16)
    chosen = fullest_split(tiles_out, HOPPER.gpu.sm_count * resident_programs(tiles, 2, HOPPER), max(1, min(256, steps // 8)))
    parts, _ = grad_weight_split(p, tiles, HOPPER)
    assert parts <= min(chosen, steps)  # recomputed so that no chunk is empty: never more chunks
    assert resident_programs(TileConfig(128, 128, 64, 8, 4), 2, HOPPER) == 1  # 128 KiB of shared memory: one per SM
    assert resident_programs(TileConfig(64, 64, 64, 4, 4), 2, HOPPER) == 3  # 64 KiB: three (ncu: 18.75% occupancy)


def test_the_split_follows_the_targets_sm_count():
    # an A100 (sm_80) has 108 SMs, not Hopper's 132: the automatic split aims at its own waves
    ampere = Target("cuda", "sm_80")
    assert (ampere.gpu.sm_count, HOPPER.gpu.sm_count, Target("cuda", "sm_87").gpu.sm_count) == (108, 132, 108)
    p = ConvProblem(op="grad_weight", dims=2, groups=1, batch=32, in_channels=64, out_channels=64, input=(28, 28),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16", name="k")
    tiles = parse_tiles("t64x64x32w4s3")
    parts = {}
    for target in (ampere, HOPPER):
        steps = -(-p.batch * math.prod(p.output) // tiles.block_k)
        tiles_out = p.groups * -(-p.out_channels // 64) * -(-(p.in_channels * math.prod(p.filter)) // 64)
        slots = target.gpu.sm_count * resident_programs(tiles, 2, target)
        parts[target.arch] = grad_weight_parts(p, tiles, target)
        assert parts[target.arch] == fullest_split(tiles_out, slots, max(1, min(256, steps // 8)))
    assert parts["sm_80"] != parts["sm_90"]


def test_last_wave_fill_counts_the_idle_slots_of_the_last_wave():
    assert last_wave_fill(264, 264) == 1.0 and last_wave_fill(528, 264) == 1.0
    assert last_wave_fill(280, 264) == pytest.approx(280 / 528)  # CK's NGCHW wgrad before: a wave of 16
    assert last_wave_fill(130 * 3, 396) == pytest.approx(390 / 396)


def test_strides_address_every_element_once():
    for layout in ("NHWGC", "GNHWC", "NGCHW"):
        p = _p(layout=layout, dims=3, input=(3, 4, 5), filter=(1, 2, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
               pad_lo=(0, 0, 0), pad_hi=(0, 0, 0))
        n, g, c, s0, s1, s2 = activation_strides(p, p.input, p.in_channels)
        offsets = {a * n + b * g + d * c + i * s0 + j * s1 + k * s2
                   for a in range(p.batch) for b in range(p.groups) for d in range(p.in_channels)
                   for i in range(3) for j in range(4) for k in range(5)}
        assert offsets == set(range(math.prod(p.x_shape)))
    for wl in ("GKYXC", "GKCYX"):
        p = _p(weight_layout=wl, dims=3, input=(3, 4, 5), filter=(1, 2, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
               pad_lo=(0, 0, 0), pad_hi=(0, 0, 0))
        g, k, c, y0, y1, y2 = weight_strides(p)
        offsets = {a * g + b * k + d * c + i * y0 + j * y1 + m * y2
                   for a in range(p.groups) for b in range(p.out_channels) for d in range(p.in_channels)
                   for i in range(1) for j in range(2) for m in range(3)}
        assert offsets == set(range(math.prod(p.w_shape)))


# NGCHW grad_weight with only X copied channels-last: dY read in place, tile by tile within one image (DY_IMAGE);
# each case's dY has a multiple of 16 (SMALL_TILES' reduction step) positions per image
IN_PLACE_DY = [
    _p(op="grad_weight", layout="NGCHW", weight_layout=wl, input=(4, 8), stride=(1, 1), dilation=(1, 1),
       pad_lo=(1, 1), pad_hi=(1, 0), name=f"dy-in-place-{wl}") for wl in ("GKYXC", "GKCYX")
] + [
    _p(op="grad_weight", layout="NGCHW", input=(8, 8), stride=(2, 2), dilation=(1, 2), pad_lo=(1, 1),
       pad_hi=(0, 0), name="dy-in-place-strided"),
    _p(op="grad_weight", layout="NGCHW", dims=3, input=(2, 4, 4), filter=(2, 3, 3), stride=(1, 1, 1),
       dilation=(1, 1, 1), pad_lo=(1, 1, 1), pad_hi=(0, 1, 1), name="dy-in-place-3d"),
    _grouped(op="grad_weight", layout="NGCHW", input=(4, 8), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1),
             pad_hi=(1, 0), name="dy-in-place-packed"),
]


def test_interpreted_ngchw_grad_weight_reads_dy_in_place():
    for p in IN_PLACE_DY:
        tiles = parse_tiles(SMALL_TILES)
        assert dy_read_in_place(p, tiles), p.name
        _, (launch,), _ = plan_launches(p, tiles, HOPPER, x_layout="NHWGC")
        c = dict(launch.constants)
        assert c["DY_IMAGE"] and not c["DY_FLAT"], p.name
        assert c["X"] == activation_strides(p.with_(layout="NHWGC"), p.input, p.in_channels), p.name
    _check(IN_PLACE_DY, _interpret(IN_PLACE_DY, x_layout="NHWGC"))
    packed = IN_PLACE_DY[-1]
    _check([packed], _interpret([packed], tiles="t16x16x16w4s2g2p4", x_layout="NHWGC"))
    # where a reduction tile would straddle two images (5 x 5 positions), dY is copied as X is
    odd = IN_PLACE_DY[0].with_(input=(5, 5), pad_hi=(1, 1))
    assert not dy_read_in_place(odd, parse_tiles(SMALL_TILES))
    assert plan_kernel(odd, HOPPER, Knobs(tiles=SMALL_TILES)).channels_last is not None
    with pytest.raises(ValueError, match="x_layout"):
        plan_launches(_p(), None, HOPPER, x_layout="NHWGC")  # grad_input reads no copy of X


def test_ngchw_grad_weight_copies_only_x():
    p = IN_PLACE_DY[0].with_(in_channels=64, out_channels=64)
    plan = plan_kernel(p, HOPPER, Knobs(tiles=SMALL_TILES))
    assert plan.channels_last is None and plan.extern.copied_channels_last == ("x",)
    assert "x copied to NHWGC" in describe_plan(plan)
    mlir = lower_to_mlir([p], HOPPER, knobs={p.name: Knobs(tiles=SMALL_TILES)})
    generics = [ln for ln in mlir.splitlines() if "linalg.generic" in ln]
    copies = [ln for ln in generics if "reduction" not in ln]  # the partials' sum has a reduction iterator
    functions = len(re.findall(r"(?:func\.func|util\.func public) @", mlir))  # @k, its $into and $into$async twins
    assert functions == 3 and len(copies) == functions and len(generics) == 2 * functions, generics  # X copy, sum
    assert len(compile_mlir(mlir, HOPPER)) > 0


def test_flat_positions_holds_exactly_where_positions_lie_evenly_apart():
    for layout in ("NHWGC", "GNHWC", "NGCHW"):
        p = _p(layout=layout, dims=3, input=(3, 4, 5), filter=(1, 2, 3), stride=(1, 1, 1), dilation=(1, 1, 1),
               pad_lo=(0, 0, 0), pad_hi=(0, 1, 2))
        strides = activation_strides(p, p.input, p.in_channels)
        n, _, _, s0, s1, s2 = strides
        offsets = [a * n + i * s0 + j * s1 + k * s2 for a in range(p.batch) for i in range(3) for j in range(4)
                   for k in range(5)]
        evenly = offsets == [r * s2 for r in range(len(offsets))]
        assert flat_positions(strides, (3, 4, 5)) == evenly
        assert evenly == (layout != "NGCHW")  # channel-first: a position's channels lie between positions
    # the kernels read X through dY's flat offsets only where stride 1 keeps X's positions at dY's
    for stride, flat in (((1, 1), True), ((2, 1), False)):
        same = _p(op="grad_weight", stride=stride, dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 0))
        _, (launch,), _ = plan_launches(same, parse_tiles(SMALL_TILES), HOPPER)
        assert (same.input == same.output) is flat and dict(launch.constants)["X_FLAT"] is flat
        assert dict(launch.constants)["DY_FLAT"] is True


# --- when the external kernels apply ---------------------------------------------------------

def test_rule_and_overrides():
    p = _p(in_channels=64, out_channels=64)
    assert plan_kernel(p, HOPPER).form == "extern"
    assert plan_kernel(p, CPU).form == "im2col"  # the CPU's linalg form (policy.cpu_im2col)
    linalg = plan_kernel(p, HOPPER, Knobs(extern=False))
    assert linalg.form == "implicit-gemm" and "extern = false" in describe_plan(linalg)
    for other, why in (
        (p.with_(dynamic_batch=True), "batch = ?"),
        (p.with_(epilogue=Epilogue("bilinear", 1.0, 0.5)), "bilinear"),
        (p.with_(op="grad_weight", groups=8, in_channels=4, out_channels=4, layout="GNHWC"), "few channels"),
    ):
        assert why in unsupported_reason(other, HOPPER)
        assert plan_kernel(other, HOPPER).form != "extern"
        with pytest.raises(ValueError, match="cannot use the external kernels"):
            plan_kernel(other, HOPPER, Knobs(extern=True))
    assert "sm_80" in unsupported_reason(p, Target("cuda", "sm_75"))
    ngchw = p.with_(layout="NGCHW")
    assert plan_kernel(ngchw, HOPPER).channels_last.problem.layout == "NHWGC"  # the rule: NHWGC copies
    assert plan_kernel(ngchw, HOPPER, Knobs(relayout=False)).channels_last is None
    assert "copied to NHWGC" in describe_plan(plan_kernel(ngchw, HOPPER))
    assert parse_label("cl-t64x32x16w4s3") == Knobs(relayout=True, tiles="t64x32x16w4s3")
    packed = plan_kernel(p.with_(groups=8, in_channels=4, out_channels=4), HOPPER)
    assert packed.extern.tiles.pack == 8 and "8 groups per GEMM" in describe_plan(packed)
    assert "gather form" in unsupported_reason(p.with_(groups=8, in_channels=4, out_channels=4, layout="GNHWC"),
                                               HOPPER)
    depthwise = plan_kernel(p.with_(groups=8, in_channels=1, out_channels=1), HOPPER)
    assert [la.kernel for la in depthwise.extern.launches] == ["grad_input_direct"]
    assert "direct sums" in describe_plan(depthwise) and "f32 FMA" in describe_plan(depthwise)
    depthwise_forward = plan_kernel(p.with_(op="forward", groups=8, in_channels=1, out_channels=1), HOPPER)
    assert [la.kernel for la in depthwise_forward.extern.launches] == ["forward_direct"]
    assert "taps per Y element" in describe_plan(depthwise_forward)
    forward = plan_kernel(p.with_(op="forward"), HOPPER)
    assert [la.kernel for la in forward.extern.launches] == ["grad_input_phases"]
    assert "forward as one implicit GEMM" in describe_plan(forward)
    # packed on request, depthwise forward runs as packed GEMMs like the other ops
    packed_dw = plan_kernel(p.with_(op="forward", groups=8, in_channels=1, out_channels=1), HOPPER,
                            Knobs(tiles="t16x16x16w4s2p8"))
    assert [la.kernel for la in packed_dw.extern.launches] == ["grad_input_phases"]
    tiled = plan_kernel(p, HOPPER, Knobs(tiles="t64x32x16w4s3"))
    assert tiled.extern.tiles == TileConfig(64, 32, 16, 4, 3)
    assert dict(tiled.extern.launches[0].constants)["BLOCK_N"] == 32


def test_tile_labels_round_trip_and_reject_bad_tiles():
    for tiles in (TileConfig(128, 64, 32, 4, 4), TileConfig(64, 128, 64, 8, 3, group_m=4, split=7)):
        assert parse_tiles(tiles.label()) == tiles
        knobs = Knobs(tiles=tiles.label(), extern=False)
        assert parse_label(knobs.label()) == knobs and knobs.config_default
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(48, 64, 32, 4, 4)
    with pytest.raises(ValueError, match="at least 16"):
        plan_launches(_p(in_channels=32, out_channels=32), TileConfig(8, 64, 32, 4, 4), HOPPER)
    with pytest.raises(ValueError, match="expected t<M>"):
        parse_tiles("t64x64")


# --- IR and compilation ----------------------------------------------------------------------

@pytest.mark.parametrize("target", [HOPPER, AMPERE], ids=str)
def test_modules_embed_the_kernels_and_compile_for_cuda(target):
    dgrad = _p(in_channels=32, out_channels=48, name="dgrad")  # stride (2, 1): two phases, one launch
    wgrad = _p(op="grad_weight", in_channels=32, out_channels=48, compute=("bf8", "fp8"), dtype="f16", name="wgrad")
    mlir = lower_to_mlir([dgrad, wgrad], target)
    kind = "cubin" if target.arch == "sm_90" else "ptx"
    assert mlir.count("hal.executable.source") == 2 and mlir.count(f'.{kind}"') == 2
    # each launch once per function (plain, $into and $into$async): one dispatch writes all of dX
    assert mlir.count("flow.dispatch @dgrad_phases") == 3
    assert mlir.count("flow.dispatch @wgrad_partials") == 3
    assert "linalg.generic" in mlir  # the split-K sum and the fp8 rounding around the kernels
    vmfb = compile_mlir(mlir, target)
    assert len(vmfb) > 10_000


@pytest.mark.parametrize("target", [HOPPER, AMPERE], ids=str)
def test_forward_modules_embed_the_kernels_and_compile_for_cuda(target):
    gemm = _p(op="forward", in_channels=32, out_channels=48, layout="NGCHW", name="fwd")  # through NHWGC copies
    depthwise = _dw(op="forward", dtype="f16", name="dwfwd")
    fp8 = _p(op="forward", in_channels=32, out_channels=48, compute=("fp8", "fp8"), dtype="f16", name="fwd8")
    for p, kernel in ((gemm, "grad_input_phases"), (depthwise, "forward_direct"), (fp8, "grad_input_phases")):
        plan = plan_kernel(p, target)
        assert plan.form == "extern", p.name
        inner = plan.channels_last.extern if plan.channels_last is not None else plan.extern
        assert [la.kernel for la in inner.launches] == [kernel], p.name
    mlir = lower_to_mlir([gemm, depthwise, fp8], target)
    kind = "cubin" if target.arch == "sm_90" else "ptx"
    assert mlir.count("hal.executable.source") == 3 and mlir.count(f'.{kind}"') == 3
    # one dispatch writes all of Y, once per function (plain, $into and $into$async)
    for name in ("fwd_forward", "dwfwd_direct", "fwd8_forward"):
        assert mlir.count(f"flow.dispatch @{name}") == 3, name
    vmfb = compile_mlir(mlir, target)
    assert len(vmfb) > 10_000


def test_a_triton_failure_names_the_kernel_and_the_way_around(monkeypatch):
    import convdsl.passes.pipeline as pipeline
    from convdsl.passes.pipeline import LoweringError

    def refuse(launch, arch):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(pipeline, "compile_launch", refuse)
    with pytest.raises(LoweringError, match=r"kernel k: Triton could not compile launch k_phases .*shared memory.*linalg"):
        lower_to_mlir([_p(in_channels=32, out_channels=32)], HOPPER)


def test_the_command_line_reports_a_triton_failure_without_a_traceback(monkeypatch, capsys):
    import convdsl.passes.pipeline as pipeline
    from convdsl.cli import main

    monkeypatch.setattr(pipeline, "compile_launch", lambda launch, arch: (_ for _ in ()).throw(RuntimeError("boom")))
    example = Path(__file__).resolve().parent.parent / "examples" / "ck17_conv2d_bwd_data.conv"
    assert main(["explain", str(example), "--target", "cuda", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert "convdsl: error: kernel" in err and "boom" in err and "Traceback" not in err


def test_a_triton_that_miscompiles_is_refused_before_it_compiles(monkeypatch):
    # Triton 3.8 built a grad_weight kernel that reads out of bounds (docs/decisions.md#grad-weight-fit): refused
    # with the way around, never compiled into a wrong number; the pinned 3.9 and PyTorch 2.11's 3.6 compile
    from convdsl import policy
    from convdsl.kernels import compile as kernels_compile

    _, launches, _ = policy.plan_launches(_p(in_channels=32, out_channels=32), None, HOPPER)
    monkeypatch.setattr(kernels_compile, "triton_version", lambda: "3.8.0")
    with pytest.raises(kernels_compile.TritonVersionError, match=r"Triton 3\.8\.0 miscompiles.*Triton 3\.9.*bundle"):
        kernels_compile.compile_launch.__wrapped__(launches[0], "sm_90")
    for fine in ("3.6.0", "3.9.0", None):
        monkeypatch.setattr(kernels_compile, "triton_version", lambda v=fine: v)
        kernels_compile.check_triton_version()


def test_f32_tiles_stay_at_most_128_columns_wide():
    # a 128 x 256 f32 tile with 4 warps spills its accumulator (docs/decisions.md#f32-tiles); 16-bit keeps
    # columns up to 256
    from convdsl import policy
    from convdsl.problem import ConvProblem

    p = ConvProblem(op="grad_input", dims=2, groups=1, batch=64, in_channels=256, out_channels=256, input=(14, 14),
                    filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), layout="NHWGC",
                    weight_layout="GKYXC", dtype="f32", compute="tf32", name="k")
    for q in (p, p.with_(compute=None), p.with_(op="forward", in_channels=1024, out_channels=256)):
        tiles = (policy.default_grad_input_tiles(q, HOPPER) if q.op == "grad_input"
                 else policy.default_forward_tiles(q, HOPPER))
        assert tiles.block_n <= 128 and tiles.block_k == 32, (q.describe(), tiles)
    wide = policy.default_grad_input_tiles(p.with_(dtype="bf16", compute=None, in_channels=512, groups=1), HOPPER)
    assert wide.block_n >= 128
