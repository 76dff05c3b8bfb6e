"""The stream path (convdsl/stream.py, convdsl/torch/stream.py): the launches a framework queues on its own
stream compute what the IREE module computes.  Numerics run in Triton's interpreter on the CPU (a subprocess,
tests/stream_interpreter.py): the GEMM core, the fp8 roundings and the split-K sum with its epilogue, around the
runner's layout copies; the launches are the ones policy plans for the module (same tiles, same split)."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from convdsl import policy, stream
from convdsl.kernels.tiles import parse_tiles
from convdsl.problem import ConvProblem, Epilogue, Prologue, problem_to_spec
from convdsl.reference import tolerance
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs
from convdsl.passes.explain import describe_plan
from convdsl.passes.plan import plan_kernel

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

HOPPER = Target("cuda", "sm_90")
HERE = Path(__file__).resolve().parent
BASE = ConvProblem(op="grad_weight", dims=2, groups=2, batch=2, in_channels=5, out_channels=6, input=(7, 6),
                   filter=(3, 2), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 0), pad_hi=(1, 1), dtype="f16",
                   name="k")
SMALL = "t16x16x16w4s2"

CASES = [
    # grad_weight: split-K partials summed by sum_partials, both weight layouts, the scale epilogue, f32 result
    (BASE.with_(weight_layout="GKCYX", out_dtype="f32", epilogue=Epilogue("scale", 0.5)), SMALL + "k3"),
    (BASE.with_(dtype="bf16", stride=(2, 1)), SMALL + "k2"),
    # NGCHW grad_weight: X copied to NHWGC by the runner, dY read in place
    (BASE.with_(layout="NGCHW", input=(8, 8), filter=(3, 3), pad_hi=(1, 1), pad_lo=(1, 1)), "t16x16x16w4s2k2"),
    # fp8 compute: both operands rounded by round_fp8 first
    (BASE.with_(compute=("bf8", "fp8"), out_dtype="f32"), SMALL + "k2"),
    # grad_input: NGCHW copies both ways, strided (several phases), f32 three-pass TF32
    (BASE.with_(op="grad_input", layout="NGCHW", stride=(2, 1), dtype="f32"), SMALL),
    (BASE.with_(op="transposed", stride=(2, 2), epilogue=Epilogue("scale", 2.0)), SMALL),
    # depthwise: the direct grad_input kernel and the rows grad_weight kernel with its many chunks
    (BASE.with_(op="grad_input", groups=8, in_channels=1, out_channels=1, filter=(3, 3), pad_lo=(1, 1),
                pad_hi=(1, 1)), None),
    (BASE.with_(groups=8, in_channels=1, out_channels=1, filter=(3, 3), pad_lo=(1, 1), pad_hi=(1, 1)), None),
    # forward on grad_input's kernel (one phase, read stride): strided and dilated, asymmetric padding, f32
    # (three-pass TF32) and bf16, NGCHW through copies, packed few-channel groups, 1D and 3D
    (BASE.with_(op="forward", stride=(2, 1), dilation=(1, 2), dtype="f32"), SMALL),
    (BASE.with_(op="forward", dtype="bf16", layout="NGCHW", epilogue=Epilogue("scale", 0.5)), SMALL),
    (BASE.with_(op="forward", groups=8, in_channels=4, out_channels=4, filter=(3, 3), pad_lo=(1, 1),
                pad_hi=(1, 1)), None),
    (BASE.with_(op="forward", dims=1, input=(13,), filter=(3,), stride=(2,), dilation=(1,), pad_lo=(1,),
                pad_hi=(0,), layout="GNHWC"), SMALL),
    (BASE.with_(op="forward", dims=3, input=(4, 5, 6), filter=(2, 3, 2), stride=(1, 2, 1), dilation=(1, 1, 2),
                pad_lo=(0, 1, 1), pad_hi=(1, 1, 0), weight_layout="GKCYX"), SMALL),
    # GKCYX weights read through a GKYXC copy (policy.weight_copied): grad_input strided, transposed
    (BASE.with_(op="grad_input", weight_layout="GKCYX", stride=(2, 1)), SMALL),
    (BASE.with_(op="transposed", weight_layout="GKCYX", stride=(2, 2), layout="NGCHW"), SMALL),
    # depthwise forward: the direct kernel, strided, NGCHW through copies
    (BASE.with_(op="forward", groups=8, in_channels=1, out_channels=1, filter=(3, 3), stride=(2, 2), pad_lo=(1, 1),
                pad_hi=(1, 1), layout="NGCHW"), None),
    # one-pass TF32: grad_input and transposed read a K-innermost copy of the weight (from GKYXC and from GKCYX);
    # grad_weight's operands, both position-strided, rounded in registers (kernels' ROUND_A / ROUND_B); forward
    # reads both operands reduction-major as they lie
    (BASE.with_(op="grad_input", dtype="f32", compute="tf32", stride=(2, 1)), SMALL),
    (BASE.with_(op="transposed", dtype="f32", compute="tf32", weight_layout="GKCYX", layout="NGCHW"), SMALL),
    (BASE.with_(dtype="f32", compute="tf32", stride=(2, 1)), SMALL + "k2"),
    (BASE.with_(op="forward", dtype="f32", compute="tf32", stride=(1, 2)), SMALL),
    # a few-channel strided forward (an RGB stem) over X and W regrouped space-to-depth: 2D with a 7x7 filter
    # (taps past it zero), the weight read from GKCYX; 3D with unequal strides and asymmetric padding
    (BASE.with_(op="forward", in_channels=3, out_channels=8, input=(13, 12), filter=(7, 7), stride=(2, 2),
                pad_lo=(3, 3), pad_hi=(3, 2), weight_layout="GKCYX", groups=1), SMALL),
    (BASE.with_(op="forward", dims=3, in_channels=2, out_channels=5, input=(5, 6, 7), filter=(3, 2, 3),
                stride=(2, 1, 2), dilation=(1, 1, 1), pad_lo=(1, 0, 1), pad_hi=(0, 1, 1), groups=1), SMALL),
    # forward and grad_input split-K on the stream path (policy.output_split; here the tiles' k asks for it): f32
    # partials of the result summed in order with the scale epilogue; the general loop (3D, several taps, a
    # reduction of 37 channels: a ragged last step), the one-tap loop (1x1, 37 channels), the flat reduction (3
    # channels), grad_input of one stride phase, the transposed convolution at stride 1
    (BASE.with_(op="forward", dims=3, in_channels=37, out_channels=20, input=(3, 4, 5), filter=(3, 1, 2),
                stride=(1, 1, 1), dilation=(1, 1, 1), pad_lo=(1, 0, 1), pad_hi=(1, 0, 0), groups=1,
                dtype="bf16", epilogue=Epilogue("scale", 0.5)), SMALL + "k3"),
    (BASE.with_(op="forward", in_channels=37, out_channels=18, filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0),
                groups=1), SMALL + "k4"),
    (BASE.with_(op="forward", in_channels=3, out_channels=8, groups=1, stride=(1, 1)), SMALL + "k2"),
    (BASE.with_(op="grad_input", in_channels=20, out_channels=37, groups=1, dtype="bf16"), SMALL + "k5"),
    (BASE.with_(op="transposed", in_channels=24, out_channels=40, groups=1, epilogue=Epilogue("scale", 2.0)),
     SMALL + "k3"),
]
# the output split-K cases (stream-only launches: the module keeps one pass)
OUTPUT_SPLIT = tuple(range(len(CASES) - 5, len(CASES)))
# the space-to-depth cases: their stream kernels regroup the operands, the IREE module's kernel does not
SPACE_TO_DEPTH = (OUTPUT_SPLIT[0] - 2, OUTPUT_SPLIT[0] - 1)


# in the 64-bit offset form too: split-K partials and their sum, the fp8 roundings, strided grad_input's copies,
# a forward's split-K partials
WIDE_CASES = (0, 3, 4, OUTPUT_SPLIT[0])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    jobs = [{"spec": problem_to_spec(p.with_(name=f"c{i}")), "tiles": t} for i, (p, t) in enumerate(CASES)]
    jobs += [{"spec": problem_to_spec(CASES[i][0].with_(name=f"wide{i}")), "tiles": CASES[i][1], "wide": True}
             for i in WIDE_CASES]
    done = subprocess.run([sys.executable, str(HERE / "stream_interpreter.py")], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in json.loads(done.stdout)}


@pytest.mark.parametrize("index", range(len(CASES)))
def test_stream_kernel_matches_the_reference(interpreted, index):
    p, _ = CASES[index]
    r = interpreted[f"c{index}"]
    assert r["shape_ok"] and r["unwritten"] == 0, r
    assert r["error"] <= tolerance(p), f"{p.describe()}: relative error {r['error']:.2e}"
    assert r["repeat_equal"], "two calls on the same inputs differ: the split-K sum must be reproducible"


@pytest.mark.parametrize("index", WIDE_CASES)
def test_wide_stream_kernel_matches_the_reference(interpreted, index):
    p, _ = CASES[index]
    r = interpreted[f"wide{index}"]
    assert r["shape_ok"] and r["unwritten"] == 0, r
    assert r["error"] <= tolerance(p), f"{p.describe()}: relative error {r['error']:.2e}"


def test_gkcyx_weights_are_copied_where_a_gemm_kernel_reads_them():
    copied = {p.name: stream.planned_stream_kernel(p, HOPPER, Knobs()).weight_axes
              for p in (BASE.with_(op=op, weight_layout=wl, name=f"{op}-{wl}")
                        for op in ("forward", "grad_input", "transposed", "grad_weight") for wl in ("GKCYX", "GKYXC"))}
    gkyxc = ("g", "k", "t0", "t1", "c")
    assert copied == {"forward-GKCYX": gkyxc, "grad_input-GKCYX": gkyxc, "transposed-GKCYX": gkyxc,
                      "grad_weight-GKCYX": (), "forward-GKYXC": (), "grad_input-GKYXC": (),
                      "transposed-GKYXC": (), "grad_weight-GKYXC": ()}
    # where the layouts coincide: one tap, or one channel per group (depthwise)
    one_tap = BASE.with_(op="forward", weight_layout="GKCYX", filter=(1, 1), pad_lo=(0, 0), pad_hi=(0, 0))
    depthwise = BASE.with_(op="forward", weight_layout="GKCYX", groups=8, in_channels=1, out_channels=1)
    assert not any(stream.planned_stream_kernel(p, HOPPER, Knobs()).weight_axes for p in (one_tap, depthwise))
    # explain says so, for the module's kernel too
    assert "w copied to GKYXC" in describe_plan(plan_kernel(BASE.with_(op="forward", weight_layout="GKCYX"), HOPPER))


def test_one_pass_tf32_reads_k_innermost_weights_and_rounds_strided_operands():
    tf32 = BASE.with_(dtype="f32", compute="tf32")
    axes = {(op, wl): stream.planned_stream_kernel(tf32.with_(op=op, weight_layout=wl), HOPPER, Knobs()).weight_axes
            for op in ("forward", "grad_input", "transposed", "grad_weight") for wl in ("GKCYX", "GKYXC")}
    # grad_input and transposed reduce over K: K innermost, whatever the layout; forward reduces over C (GKYXC)
    assert axes == {("grad_input", "GKYXC"): ("g", "t0", "t1", "c", "k"), ("grad_input", "GKCYX"): ("g", "c", "t0", "t1", "k"),
                    ("transposed", "GKYXC"): ("g", "t0", "t1", "c", "k"), ("transposed", "GKCYX"): ("g", "c", "t0", "t1", "k"),
                    ("forward", "GKCYX"): ("g", "k", "t0", "t1", "c"), ("forward", "GKYXC"): (),
                    ("grad_weight", "GKCYX"): (), ("grad_weight", "GKYXC"): ()}
    rounds = {op: tuple(dict(stream.planned_stream_kernel(tf32.with_(op=op), HOPPER, Knobs()).launches[0].launch.constants)[
        key] for key in ("ROUND_A", "ROUND_B")) for op in ("forward", "grad_input", "grad_weight")}
    # grad_weight reduces over positions, strided by the channels in NHWGC: both rounded; the others read
    # reduction-major operands (grad_input's weight through its copy)
    assert rounds == {"forward": (False, False), "grad_input": (False, False), "grad_weight": (True, True)}
    # three passes need neither: Triton splits the operands in registers itself
    three = stream.planned_stream_kernel(BASE.with_(op="grad_input", dtype="f32"), HOPPER, Knobs())
    assert three.weight_axes == () and dict(three.launches[0].launch.constants)["ROUND_B"] is False
    assert "w copied to GYXCK" in describe_plan(plan_kernel(tf32.with_(op="grad_input"), HOPPER))


def test_ngchw_copies_are_transpose_launches():
    dgrad = stream.planned_stream_kernel(BASE.with_(op="grad_input", layout="NGCHW"), HOPPER, Knobs())
    assert dgrad.copied == ("dy",) and [sl.launch.kernel for sl in dgrad.copy_in] == ["transpose_planes"]
    assert dgrad.copy_out is not None and dict(dgrad.copy_out.launch.constants)["ROWS"] == 7 * 6
    wgrad = stream.planned_stream_kernel(BASE.with_(layout="NGCHW", input=(8, 8), filter=(3, 3), pad_hi=(1, 1),
                                                 pad_lo=(1, 1)), HOPPER, Knobs(tiles="t16x16x16w4s2k2"))
    assert wgrad.copied == ("x",) and len(wgrad.copy_in) == 1 and wgrad.copy_out is None  # dY read in place


def test_stream_launches_are_the_modules_launches():
    # the stream kernel's GEMM core is the launch the IREE module embeds: same plan, same tiles, same split
    from convdsl.passes.plan import plan_kernel

    for i, (p, tiles) in enumerate(CASES):
        knobs = Knobs(tiles=tiles) if tiles else Knobs()
        kernel = stream.planned_stream_kernel(p, HOPPER, knobs)
        plan = plan_kernel(p, HOPPER, knobs)
        if i in SPACE_TO_DEPTH:  # the module's kernel is the regrouped problem's, planned alike
            plan = plan_kernel(policy.space_to_depth_forward(p), HOPPER, knobs)
            assert [sl.launch.kernel for sl in kernel.staging] == ["space_to_depth"] * 2
        assert len(kernel.rounds) == (2 if p.fp8_compute else 0)
        if i in OUTPUT_SPLIT:  # the module's launch in one pass, the stream's split-K: the same GEMM otherwise
            (split,), (whole,) = (sl.launch for sl in kernel.launches), plan.extern.launches
            splits = dict(split.constants)["SPLIT"]
            assert splits == parse_tiles(tiles).split and kernel.partials_shape == (splits, math.prod(p.result_shape))
            assert split.grid == (*whole.grid[:2], splits) and split.pointer_types[2] == "fp32"
            assert ({k: v for k, v in split.constants if k not in ("SPLIT", "PART")}
                    == {k: v for k, v in whole.constants if k not in ("SPLIT", "PART")})
            assert kernel.sum is not None and dict(whole.constants)["SPLIT"] == 1
            continue
        assert tuple(sl.launch for sl in kernel.launches) == plan.extern.launches
        assert (kernel.sum is not None) == (p.op == "grad_weight")


def test_forward_takes_the_triton_kernel_and_compiles_for_cuda():
    from convdsl.backends.iree import compile_mlir
    from convdsl.passes import lower_to_mlir
    from convdsl.passes.explain import describe_plan
    from convdsl.passes.plan import plan_kernel

    p = BASE.with_(op="forward")
    plan = plan_kernel(p, HOPPER)
    assert plan.form == "extern" and "forward as one implicit GEMM" in describe_plan(plan)
    depthwise = p.with_(groups=8, in_channels=1, out_channels=1)
    assert stream.unsupported_reason(depthwise, HOPPER) is None
    assert [sl.launch.kernel for sl in stream.planned_stream_kernel(depthwise, HOPPER, Knobs()).launches] == [
        "forward_direct"]
    assert len(compile_mlir(lower_to_mlir([p], Target("cuda", "sm_80")), Target("cuda", "sm_80"))) > 0


def test_unsupported_problems_say_why():
    assert "CUDA" in stream.unsupported_reason(BASE, Target("cpu", "host"))
    assert "batch" in stream.unsupported_reason(BASE.with_(dynamic_batch=True), HOPPER)
    assert stream.unsupported_reason(BASE, HOPPER) is None


def test_bundle_round_trip_and_damage(tmp_path):
    p = BASE.with_(weight_layout="GKCYX")
    kernel = stream.planned_stream_kernel(p, HOPPER, stream.Knobs(tiles=SMALL + "k2"), compile=True)
    path = stream.save_bundle([kernel], tmp_path / "k.convk")
    (back,) = stream.load_bundle(path)
    assert back.problem == p and back.copied == kernel.copied and back.partials_shape == kernel.partials_shape
    assert [sl.binary for sl in back.launches] == [sl.binary for sl in kernel.launches]
    assert back.sum.binary == kernel.sum.binary and back.sum.launch.grid == kernel.sum.launch.grid
    stream.register_bundle([back])
    assert stream.stream_kernel(p, HOPPER) is back  # a registered bundle serves before the cache or Triton
    text = path.read_text()
    path.write_text(text.replace('"grid": [', '"grid": [1, ', 1))
    with pytest.raises(ValueError, match="checksum"):
        stream.load_bundle(path)


def test_sum_launch_spreads_small_weights_over_the_gpu():
    from convdsl.kernels.elementwise_launches import sum_partials_launch

    dw = BASE.with_(groups=144, in_channels=1, out_channels=1, filter=(3, 3))
    launch = sum_partials_launch(dw, (3584, 144, 1, 1, 3, 3, 1), "k", HOPPER.sum_programs)
    assert launch.grid[0] >= 40  # 1296 weights in blocks of 16 to 32: not one program per 1024 weights
    c = dict(launch.constants)
    assert c["BLOCK_S"] * c["BLOCK_E"] <= 4096 and c["S"] == 3584
    assert parse_tiles(SMALL).block_m == 16


def test_few_output_tiles_over_a_long_reduction_split_on_the_stream_path_only():
    # r2plus1d_18's 3x1x1 forward over 921 channels at 1x7x7, batch 8: 392 rows x 512 columns, 16 programs of
    # 128 x 128 on 132 SMs over 3 x 15 reduction steps: split-K into f32 partials and their sum (policy.output_split)
    r2plus1d = ConvProblem(op="forward", dims=3, groups=1, batch=8, in_channels=921, out_channels=512,
                           input=(1, 7, 7), filter=(3, 1, 1), stride=(1, 1, 1), dilation=(1, 1, 1),
                           pad_lo=(1, 0, 0), pad_hi=(1, 0, 0), dtype="bf16", name="r2p1d")
    kernel = stream.planned_stream_kernel(r2plus1d, HOPPER, Knobs())
    (launch,) = (sl.launch for sl in kernel.launches)
    splits = launch.grid[2]
    assert 2 <= splits <= policy.OUTPUT_SPLIT_MOST and kernel.partials_shape == (splits, 8 * 7 * 7 * 512)
    assert kernel.sum is not None and dict(kernel.sum.launch.constants)["S"] == splits
    assert "split-K" in kernel.describe()
    # the module keeps one pass (its lowering sums grad_weight's partials only)
    (whole,) = plan_kernel(r2plus1d, HOPPER, Knobs()).extern.launches
    assert whole.grid[2] == 1 and dict(whole.constants)["SPLIT"] == 1
    # grad_input of the same layer (one stride phase) splits too; enough output tiles, a short reduction, or
    # several stride phases do not
    dgrad = r2plus1d.with_(op="grad_input", in_channels=512, out_channels=921, filter=(1, 3, 3), pad_lo=(0, 1, 1),
                           pad_hi=(0, 1, 1))
    assert stream.planned_stream_kernel(dgrad, HOPPER, Knobs()).partials_shape
    for whole_pass in (r2plus1d.with_(batch=64, input=(4, 14, 14)), r2plus1d.with_(in_channels=64),
                       dgrad.with_(stride=(1, 2, 2), input=(1, 14, 14))):
        kernel = stream.planned_stream_kernel(whole_pass, HOPPER, Knobs())
        assert not kernel.partials_shape and kernel.sum is None, whole_pass.describe()


def test_plain_triton_kernels_unroll_over_constexprs_only():
    # Triton 3.6 (the one PyTorch 2.11 pins) takes tl.static_range only over constexprs, and an element of a
    # constexpr tuple (F[2]) or a product of them is a plain int there: the depthwise kernels failed to compile
    # (3.9 accepts both).  The cp.async and elementwise kernels must compile with both; the Gluon kernels need 3.9.
    import ast

    from convdsl.kernels import elementwise, igemm

    for module in (igemm, elementwise):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "static_range":
                for arg in node.args:
                    wrapped = (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                               and arg.func.attr == "constexpr")
                    assert isinstance(arg, (ast.Name, ast.Constant)) or wrapped, (
                        f"{module.__name__}:{node.lineno}: static_range({ast.unparse(arg)}): wrap it in tl.constexpr")


@pytest.mark.parametrize("fused", [dict(epilogue=Epilogue(steps=("bias", "relu"))),
                                   dict(op="grad_input", prologue=Prologue("relu_backward"))],
                         ids=["epilogue", "prologue"])
def test_fused_forms_have_no_stream_kernel(fused):
    """The stream kernels apply a scale at most: a problem with fused steps is refused with that reason (never
    planned without them), so convdsl.torch and explain take the IREE path that applies them."""
    p = dataclasses.replace(BASE, **{"op": "forward", "dtype": "f16", **fused})
    target = Target("cuda", "sm_90")
    assert stream.unsupported_reason(dataclasses.replace(p, epilogue=Epilogue(), prologue=Prologue()),
                                     target) is None
    assert "fused" in stream.unsupported_reason(p, target)


def test_a_forward_on_the_phases_kernel_is_described_as_the_forward():
    """explain's stream line for an RGB stem (space-to-depth, then the stride-1 forward on grad_input's kernel)
    says it is the forward, not a grad_input."""
    p = ConvProblem(op="forward", dims=2, groups=1, batch=4, in_channels=3, out_channels=64, input=(64, 64),
                    filter=(7, 7), stride=(2, 2), dilation=(1, 1), pad_lo=(3, 3), pad_hi=(3, 3), layout="NHWGC",
                    weight_layout="GKYXC", dtype="bf16", name="stem")
    text = stream.plan(p, Target("cuda", "sm_90")).stream.describe()
    assert "the forward as one implicit GEMM" in text and "space-to-depth" in text


def test_a_machine_without_iree_compiler_plans_and_loads_stream_kernels(tmp_path):
    # a machine that only runs bundles (convdsl.torch on a GPU host) has PyTorch and iree's runtime at most: the
    # one planner and the bundle loader must import without IREE's compiler
    p = BASE.with_(op="grad_weight", name="no_compiler")
    path = tmp_path / "k.convk"
    stream.save_bundle([stream.planned_stream_kernel(p, HOPPER, Knobs())], path)
    script = f"""
import json
import sys
sys.modules["iree.compiler"] = None  # as if not installed
import convdsl.torch
from convdsl import stream
from convdsl.problem import problem_from_spec
from convdsl.targets import Target
p = problem_from_spec(json.loads({json.dumps(problem_to_spec(p))!r}))
plan = stream.plan(p, Target("cuda", "sm_90"))
(kernel,) = stream.load_bundle({str(path)!r})
assert plan.stream is not None and kernel.problem == p, plan.stream_reason
assert "iree.compiler" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
