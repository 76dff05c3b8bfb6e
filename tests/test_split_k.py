"""A split_k asked for is honoured by the form the kernel takes (the partials number what was asked) or refused
with the kernel's name and the reason; never ignored.  CPU kernels run against the float64 reference; the CUDA
depthwise grad_weight is planned for sm_90 without a GPU and run in Triton's interpreter."""
from __future__ import annotations

import pytest

from convdsl import policy, stream
from convdsl.passes.plan import plan_kernel
from convdsl.problem import ConvProblem
from convdsl.targets import Target
from convdsl.tuning.knobs import Knobs

from test_cpu_forms import check, conv

CPU = Target("cpu", "host")
HOPPER = Target("cuda", "sm_90")


def _cpu_partials(p: ConvProblem) -> int:
    """The f32 partials the CPU plan sums (1: none, one GEMM over every position)."""
    plan = plan_kernel(p, CPU)
    if plan.form == "im2col":
        return p.batch * plan.row_chunks if plan.row_chunks > 1 else 1
    return plan.split.parts


def test_cpu_im2col_grad_weight_honours_split_k():
    p = conv("grad_weight", batch=3, input=(12, 9))
    assert plan_kernel(p, CPU).form == "im2col" and _cpu_partials(p) == 1  # the rule: no split for this shape
    # N x H chunks of whole output rows: the im2col form cuts them itself
    rows = p.with_(split_k=6)
    plan = plan_kernel(rows, CPU)
    assert plan.form == "im2col" and plan.row_chunks == 2 and _cpu_partials(rows) == 6
    # one chunk: one GEMM over every position
    assert plan_kernel(p.with_(split_k=1), CPU).form == "im2col" and _cpu_partials(p.with_(split_k=1)) == 1
    # 3 chunks of 3 images cannot be whole rows of each image: the implicit-GEMM form cuts the batch instead
    three = p.with_(split_k=3)
    assert policy.cpu_im2col_split_reason(three) is not None and "kernel k: split_k = 3" in \
        policy.cpu_im2col_split_reason(three)
    plan = plan_kernel(three, CPU)
    assert plan.form == "implicit-gemm" and _cpu_partials(three) == 3
    for q in (rows, three):
        check(q)


def test_cpu_few_channel_and_depthwise_grad_weight_honour_split_k():
    # the gather and depthwise-named forms have no split-K chunks: a split_k takes a form that cuts them
    grouped = conv("grad_weight", groups=4, in_channels=2, out_channels=2, batch=3, layout="GNHWC")
    dw = conv("grad_weight", groups=8, in_channels=1, out_channels=1, batch=3)
    assert plan_kernel(grouped, CPU).form == "gather" and plan_kernel(dw, CPU).form == "depthwise-named"
    for p in (grouped.with_(split_k=3), dw.with_(split_k=3)):
        plan = plan_kernel(p, CPU)
        assert plan.form in ("implicit-gemm", "depthwise") and plan.split.parts == 3, plan.form
        check(p)


def _depthwise_wgrad(**changes) -> ConvProblem:
    fields = dict(op="grad_weight", dims=2, groups=64, batch=2, in_channels=1, out_channels=1, input=(14, 14),
                  filter=(3, 3), stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dtype="f16",
                  name="wgrad")
    fields.update(changes)
    return ConvProblem(**fields)


def test_cuda_depthwise_grad_weight_honours_split_k():
    p = _depthwise_wgrad()
    auto = plan_kernel(p, HOPPER)
    assert auto.form == "extern" and auto.extern.partials_shape[0] == 28  # the rule: a segment per dY row
    # 3 chunks: runs of whole dY rows (the sliding kernel cuts each image's rows into as many segments: 4 at best)
    three = plan_kernel(p.with_(split_k=3), HOPPER)
    (launch,) = three.extern.launches
    assert three.form == "extern" and three.extern.partials_shape[0] == 3 and launch.grid[1] == 3
    assert launch.kernel == "grad_weight_depthwise" and dict(launch.constants)["ROWS_PER"] == 10  # 2 x 14 rows
    # as many segments in each image: the sliding kernel's, 7 segments of 2 rows per image
    (slid,) = plan_kernel(p.with_(split_k=14), HOPPER).extern.launches
    assert slid.kernel == "grad_weight_depthwise_rows" and slid.grid[1] == 14 and dict(slid.constants)["SEG"] == 2
    # the stream path plans the same launches
    kernel = stream.planned_stream_kernel(p.with_(split_k=3), HOPPER, Knobs())
    assert kernel.partials_shape[0] == 3 and kernel.launches[0].launch == launch


def test_cuda_depthwise_grad_weight_split_k_matches_the_reference():
    from test_extern import _check, _interpret

    # 3 runs of the 2 x 6 rows; 6 segments, three in each image's plane (the sliding kernel)
    problems = [_depthwise_wgrad(groups=8, input=(6, 5), split_k=s, name=f"s{s}") for s in (3, 6)]
    launches = [plan_kernel(p, HOPPER).extern.launches[0] for p in problems]
    assert [(la.kernel, la.grid[1]) for la in launches] == [("grad_weight_depthwise", 3),
                                                            ("grad_weight_depthwise_rows", 6)]
    _check(problems, _interpret(problems, tiles=""))


def test_a_split_k_no_chunks_can_give_is_refused_with_the_reason():
    # 4 rows of dY cannot be cut into 3 equal runs: the Triton kernel refuses, naming the kernel and why
    p = _depthwise_wgrad(batch=4, input=(3, 3), pad_lo=(0, 0), pad_hi=(0, 0), split_k=3)
    with pytest.raises(ValueError, match=r"kernel wgrad: split_k = 3 cannot be honoured by the depthwise "
                                         r"grad_weight kernel \(its split cuts the 4 rows of dY"):
        policy.plan_launches(p, None, HOPPER)
    # the module keeps the linalg form, which cuts the batch into the 3 chunks asked for, and says why
    plan = plan_kernel(p, HOPPER)
    assert plan.form == "depthwise" and plan.split.parts == 3 and "split_k = 3" in plan.linalg_reason
    # the stream path has no kernel for it, and says so
    assert "split_k = 3 cannot be honoured" in stream.unsupported_reason(p, HOPPER)
    with pytest.raises(ValueError, match="kernel wgrad: no stream kernel on cuda:sm_90: kernel wgrad: split_k = 3"):
        stream.stream_kernel(p, HOPPER)


def test_the_users_split_k_wins_over_the_tiles_split():
    p = conv("grad_weight", batch=4, in_channels=32, out_channels=32, input=(16, 16), dtype="f16", split_k=3)
    ext = policy.extern_launches(p, HOPPER, Knobs(tiles="t64x64x64w4s4k4"))
    assert ext.partials_shape[0] == 3
    assert policy.extern_launches(p.with_(split_k=None), HOPPER, Knobs(tiles="t64x64x64w4s4k4")).partials_shape[0] == 4
