"""A CUDA module's few-channel strided forward (ResNet's stem) runs as the stride-1 forward over X and W regrouped
space-to-depth by the stream kernel's two copies (docs/decisions.md#stem-space-to-depth; the copies' numbers:
tests/test_space_to_depth.py).  Compile-only: the plan, and the three external dispatches in the module."""
from __future__ import annotations

from convdsl import policy
from convdsl.backends.iree import compile_mlir
from convdsl.compiler import plan
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.targets import Target

HOPPER = Target("cuda", "sm_90")
STEM = ConvProblem(op="forward", dims=2, groups=1, batch=8, in_channels=3, out_channels=64, input=(224, 224),
                   filter=(7, 7), stride=(2, 2), dilation=(1, 1), pad_lo=(3, 3), pad_hi=(3, 3), dtype="bf16",
                   name="stem")


def test_a_cuda_module_runs_the_stem_regrouped():
    planned = plan(STEM, HOPPER)
    q = policy.space_to_depth_forward(STEM)
    assert planned.space_to_depth is not None and planned.space_to_depth.problem == q
    copies, gemm = planned.extern.launches[:2], planned.extern.launches[2:]
    assert [c.kernel for c in copies] == ["space_to_depth"] * 2
    assert gemm == planned.space_to_depth.extern.launches  # the regrouped forward's own kernel
    mlir = lower_to_mlir([STEM], HOPPER, plans=[planned])
    stem = mlir[mlir.index("func.func @stem("):]
    stem = stem[:stem.index("\n  }")]
    # X and W copied into q's shapes, then the GEMM core reads them
    assert stem.count("flow.dispatch") == 3
    assert "x".join(map(str, q.x_shape)) in stem and "x".join(map(str, q.w_shape)) in stem
    assert compile_mlir(mlir, HOPPER)[:8]


def test_other_forwards_are_not_regrouped():
    assert plan(STEM.with_(in_channels=64), HOPPER).space_to_depth is None  # too many channels
    assert plan(STEM.with_(stride=(1, 1)), HOPPER).space_to_depth is None
