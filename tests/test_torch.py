"""convdsl.torch on the CPU: every op (forward, grad_input and grad_weight through autograd, transposed), ranks
1D/2D/3D, groups (one, several, depthwise), stride, dilation, padding ('same' with an even kernel: asymmetric),
both memory formats, with and without bias, against torch.nn's convolutions in float64; torch.compile of a
model built from the modules; DistributedDataParallel over gloo; torch.nn's errors for bad calls."""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import convdsl.torch as ct  # noqa: E402
from convdsl.torch import native  # noqa: E402
from convdsl.problem import problem_from_spec  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CL = {2: torch.channels_last, 3: torch.channels_last_3d}

# (module class name, constructor arguments, input shape, memory format or None, dtype)
CASES = [
    ("Conv1d", dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, groups=2), (2, 4, 11), None),
    ("Conv2d", dict(in_channels=8, out_channels=12, kernel_size=3, stride=2, padding=1, groups=4), (2, 8, 9, 10),
     None),
    ("Conv2d", dict(in_channels=8, out_channels=12, kernel_size=3, stride=2, padding=1, groups=4), (2, 8, 9, 10),
     "cl"),
    ("Conv2d", dict(in_channels=6, out_channels=6, kernel_size=3, padding="same", dilation=2, groups=6,
                    bias=False), (2, 6, 8, 7), "cl"),  # depthwise, dilated
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=(2, 4), padding="same"), (1, 4, 6, 9), None),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=3, padding="valid", stride=(1, 2)), (2, 4, 7, 9),
     None),
    ("Conv3d", dict(in_channels=4, out_channels=4, kernel_size=3, stride=2, padding=1, groups=2), (1, 4, 5, 6, 7),
     None),
    ("Conv3d", dict(in_channels=4, out_channels=4, kernel_size=3, stride=2, padding=1, groups=2), (1, 4, 5, 6, 7),
     "cl"),
    ("ConvTranspose1d", dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1),
     (2, 4, 7), None),
    ("ConvTranspose2d", dict(in_channels=6, out_channels=4, kernel_size=3, stride=2, padding=1, output_padding=1,
                             groups=2), (2, 6, 5, 7), "cl"),
    ("ConvTranspose3d", dict(in_channels=4, out_channels=4, kernel_size=2, stride=2, bias=False), (1, 4, 3, 4, 3),
     None),
]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach()).norm() / want.detach().norm().clamp_min(1e-300))


def _pair(name: str, kwargs: dict, dtype: torch.dtype):
    ref = getattr(nn, name)(**kwargs).double()
    mod = getattr(ct, name)(**kwargs).to(dtype)
    mod.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.double() for k, v in mod.state_dict().items()})  # the same (rounded) weights
    return mod, ref


@pytest.mark.parametrize("name, kwargs, shape, fmt", CASES)
@pytest.mark.parametrize("dtype", [torch.float32])
def test_module_matches_torch_nn(name, kwargs, shape, fmt, dtype):
    mod, ref = _pair(name, kwargs, dtype)
    memory = CL[len(shape) - 2] if fmt else torch.contiguous_format
    mod = mod.to(memory_format=memory)
    x = torch.randn(shape).to(dtype).to(memory_format=memory).requires_grad_()
    xr = x.detach().double().requires_grad_()
    y, yr = mod(x), ref(xr)
    assert y.shape == yr.shape and y.dtype == dtype
    assert y.is_contiguous(memory_format=memory)  # the result keeps the input's memory format
    g = torch.randn(y.shape)
    y.backward(g.to(dtype))
    yr.backward(g.double())
    tol = TOLERANCE[dtype]
    assert _rel(y, yr) <= tol
    assert _rel(x.grad, xr.grad) <= tol
    assert _rel(mod.weight.grad, ref.weight.grad) <= tol
    if kwargs.get("bias", True):
        assert _rel(mod.bias.grad, ref.bias.grad) <= tol


class _ReferenceRunner:
    """A stand-in for a stream runner on the CPU: computes its problem with convdsl's float64 reference and
    counts how it was called (run_into: the arguments as they lie; __call__: through convdsl's layout views)."""

    direct = True

    def __init__(self, problem) -> None:
        self.problem = problem
        self.calls = {"run_into": 0, "views": 0}

    def _result(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from convdsl.reference import reference

        r = reference(self.problem, a.detach().float().numpy(), b.detach().float().numpy())  # bf16: exact in f32
        return torch.from_numpy(r).to(runtime_dtypes()[self.problem.result_dtype])

    def run_into(self, a, b, out):
        from convdsl.torch import runtime

        self.calls["run_into"] += 1
        p = self.problem
        av = runtime.activation_view(a, p.groups, p.layout)
        bv = (runtime.activation_view(b, p.groups, p.layout) if p.op == "grad_weight"
              else runtime.weight_view(b, p.groups, p.weight_layout))
        assert av.data_ptr() == a.data_ptr() and av.is_contiguous() and bv.is_contiguous()  # read as they lie
        r = self._result(av, bv)
        ov = (runtime.weight_view(out, p.groups, p.weight_layout) if p.op == "grad_weight"
              else runtime.activation_view(out, p.groups, p.layout))
        ov.copy_(r)
        return out

    def __call__(self, av, bv, out=None):
        self.calls["views"] += 1
        r = self._result(av.contiguous(), bv.contiguous())
        if out is None:
            return r
        out.copy_(r)
        return out


def runtime_dtypes() -> dict:
    from convdsl.torch import runtime

    return {v: k for k, v in runtime.DTYPES.items()}


@pytest.fixture
def planned_on_the_cpu(monkeypatch):
    """The eager plans (convdsl/torch/ops.py) on CPU tensors, each problem's kernels a _ReferenceRunner."""
    from convdsl.torch import runtime

    runners = {}

    def new_call(p, device, a, b):
        runner = runners.setdefault(p, _ReferenceRunner(p))
        return runtime._new_call_with(p, runner, a, b)

    monkeypatch.setattr(runtime, "on_stream_device", lambda t: True)
    monkeypatch.setattr(runtime, "_new_call", new_call)
    monkeypatch.setattr(runtime, "_calls", {})
    return runners


def test_eager_plans_are_made_once_and_match_torch_nn(planned_on_the_cpu):
    import copy
    import pickle

    mod, ref = _pair("Conv2d", dict(in_channels=8, out_channels=12, kernel_size=3, stride=2, padding=1, groups=4),
                     torch.float32)
    mod, ref = mod.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
    for step in range(2):
        x = torch.randn(2, 8, 9, 10).to(memory_format=torch.channels_last).requires_grad_()
        xr = x.detach().double().requires_grad_()
        y, yr = mod(x), ref(xr)
        g = torch.randn(y.shape).to(memory_format=torch.channels_last)
        y.backward(g)
        yr.backward(g.double())
        assert _rel(y, yr) <= 1e-5 and _rel(x.grad, xr.grad) <= 1e-5
        assert _rel(mod.weight.grad, ref.weight.grad) <= 1e-5 and _rel(mod.bias.grad, ref.bias.grad) <= 1e-5
        mod.zero_grad(), ref.zero_grad()
    plans = mod.__dict__["_convdsl_eager_plans"]
    assert len(plans) == 1 and next(iter(plans.values())) is not None
    # forward, grad_input and grad_weight each ran twice, every time on the tensors as they lie
    assert sorted(r.problem.op for r in planned_on_the_cpu.values()) == ["forward", "grad_input", "grad_weight"]
    assert all(r.calls == {"run_into": 2, "views": 0} for r in planned_on_the_cpu.values())
    # a changed module attribute is a new signature, not a stale plan
    mod.stride, ref.stride = (1, 1), (1, 1)
    x = torch.randn(2, 8, 9, 10).to(memory_format=torch.channels_last)
    assert _rel(mod(x), ref(x.double())) <= 1e-5 and len(plans) == 2
    # copies start without plans (they hold loaded kernels)
    assert len(copy.deepcopy(mod).__dict__["_convdsl_eager_plans"]) == 0
    assert len(pickle.loads(pickle.dumps(mod)).__dict__["_convdsl_eager_plans"]) == 0


def test_eager_plans_under_autocast_cast_the_weight_inside_the_convolution(planned_on_the_cpu):
    mod, ref = _pair("Conv2d", dict(in_channels=8, out_channels=8, kernel_size=3, padding=1, bias=False),
                     torch.float32)
    mod, ref = mod.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
    for _ in range(2):  # the plan's first call, then a hit
        x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(x)
        assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ == "PlannedConvolutionBackward"
        # the weight parameter feeds the convolution's node directly (no cast node of its own), the input
        # through autocast's cast
        (x_fn, _), (w_fn, _) = y.grad_fn.next_functions[:2]
        assert type(x_fn).__name__ == "ToCopyBackward0" and w_fn.variable is mod.weight
        g = torch.randn(y.shape).to(memory_format=torch.channels_last)
        y.backward(g.to(torch.bfloat16))
        xr = x.detach().double().requires_grad_()
        ref(xr).backward(g.double())
        assert x.grad.dtype == torch.float32 and mod.weight.grad.dtype == torch.float32
        assert _rel(x.grad, xr.grad) <= TOLERANCE[torch.bfloat16]
        assert _rel(mod.weight.grad, ref.weight.grad) <= TOLERANCE[torch.bfloat16]
        mod.zero_grad(), ref.zero_grad()
    assert all(r.calls["views"] == 0 and r.calls["run_into"] == 2 for r in planned_on_the_cpu.values())
    # grad_weight summed straight into the f32 parameter's dtype (no bf16 result and cast)
    (grad_weight,) = [r.problem for r in planned_on_the_cpu.values() if r.problem.op == "grad_weight"]
    assert grad_weight.dtype == "bf16" and grad_weight.out_dtype == "f32"


def test_eager_plans_fall_back_for_tensors_not_as_planned(planned_on_the_cpu):
    mod, ref = _pair("Conv2d", dict(in_channels=4, out_channels=4, kernel_size=3, padding=1), torch.float32)
    mod, ref = mod.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    mod(x)  # the plan, made on an aligned input
    # the same shape and strides at an address the kernels cannot bind: the general path copies it
    storage = torch.randn(x.numel() + 1)
    shifted = storage[1:].view(2, 6, 6, 4).permute(0, 3, 1, 2).requires_grad_()
    assert shifted.stride() == x.stride() and shifted.data_ptr() % 16 != 0
    y = mod(shifted)
    assert _rel(y, ref(shifted.detach().double())) <= 1e-5
    # dY in the other memory format than planned: the gradients take the general path, and are right
    xr = shifted.detach().double().requires_grad_()
    g = torch.randn(y.shape)  # contiguous, where y is channels-last
    y.backward(g)
    ref(xr).backward(g.double())
    assert _rel(shifted.grad, xr.grad) <= 1e-5 and _rel(mod.weight.grad, ref.weight.grad) <= 1e-5
    views = {r.problem.op: r.calls["views"] for r in planned_on_the_cpu.values() if r.calls["views"]}
    assert sorted(views) == ["forward", "grad_input", "grad_weight"]  # each went the general way


def test_bf16_module():
    mod, ref = _pair("Conv2d", dict(in_channels=8, out_channels=8, kernel_size=3, padding=1), torch.bfloat16)
    x = torch.randn(2, 8, 6, 6).to(torch.bfloat16).requires_grad_()
    xr = x.detach().double().requires_grad_()
    y, yr = mod(x), ref(xr)
    g = torch.randn(y.shape)
    y.backward(g.to(torch.bfloat16))
    yr.backward(g.double())
    for got, want in ((y, yr), (x.grad, xr.grad), (mod.weight.grad, ref.weight.grad)):
        assert got.dtype == torch.bfloat16 and _rel(got, want) <= TOLERANCE[torch.bfloat16]


def test_unbatched_input_and_output_size():
    mod, ref = _pair("ConvTranspose2d", dict(in_channels=4, out_channels=2, kernel_size=3, stride=2), torch.float32)
    x = torch.randn(4, 5, 5)
    assert _rel(mod(x), ref(x.double())) <= 1e-5  # (C, H, W) as torch.nn takes it
    assert mod(x.unsqueeze(0), output_size=[12, 12]).shape == ref(x.unsqueeze(0).double(), output_size=[12, 12]).shape


def _model(conv_cls=nn.Conv2d) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(conv_cls(3, 8, 3, padding=1), nn.ReLU(), conv_cls(8, 8, 3, stride=2, padding=1, groups=4),
                         nn.ReLU(), conv_cls(8, 4, 1), nn.Flatten(), nn.Linear(64, 3))  # for 8x8 inputs


def test_convert_swaps_convolutions_and_keeps_outputs():
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    want = model(x)
    converted = ct.convert(model)
    kinds = [type(m) for m in converted.modules() if isinstance(m, nn.Conv2d)]
    assert kinds == [ct.Conv2d] * 3
    assert _rel(converted(x), want.detach().double()) <= 1e-5
    reflect = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
    assert type(ct.convert(nn.Sequential(reflect))[0]) is nn.Conv2d  # only zero padding is swapped


def test_torch_compile_fullgraph():
    model = ct.convert(_model())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    assert _rel(y, model(x).detach().double()) <= 1e-6 and _rel(grad, x.grad.double()) <= 1e-6


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile's default backend (Inductor) needs a C++ compiler on the CPU")
def test_torch_compile_with_inductor_on_the_cpu():
    # the default backend: Inductor generates C++ around convdsl's operators, which stay opaque calls
    model = ct.convert(_model())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    want = model(x)
    want.sum().backward()
    assert _rel(y, want.detach().double()) <= 1e-5 and _rel(grad, x.grad.double()) <= 1e-5


def _assert_step_as_float64(y: torch.Tensor, xg: torch.Tensor, model: nn.Module, want: torch.Tensor,
                            xd: torch.Tensor, want_model: nn.Module) -> None:
    """A compiled step's output, input gradient and parameter gradients against the float64 model's."""
    assert _rel(y, want.detach()) <= 1e-5
    assert _rel(xg.grad, xd.grad) <= 1e-4
    for mine, exact in zip(model.parameters(), want_model.parameters()):
        assert _rel(mine.grad, exact.grad) <= 1e-4


def _float64_step(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The reference for _assert_step_as_float64: a float64 copy of model, x as float64 and its output after the
    step's backward."""
    want_model = copy.deepcopy(model).double()
    xd = x.double().requires_grad_()
    want = want_model(xd)
    want.square().sum().backward()
    return want_model, xd, want


def _compiled_step(model: nn.Module, x: torch.Tensor, before_profiled: Callable[[], object] = lambda: None
                   ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """One training step of torch.compile(model, backend="convdsl") after two that compile its graphs (again once
    the CPU kernels' first call has set PyTorch's threads): its output, input and the convdsl operators called."""
    compiled = torch.compile(model, backend="convdsl")
    for _ in range(2):
        compiled(x.clone().requires_grad_()).square().sum().backward()
    model.zero_grad(set_to_none=True)
    before_profiled()
    xg = x.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = compiled(xg)
        y.square().sum().backward()
    return y, xg, sorted(e.name for e in prof.events() if e.name.startswith("convdsl::"))


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile's default backend (Inductor) needs a C++ compiler on the CPU")
def test_torch_compile_backend_runs_an_unconverted_models_convolutions(monkeypatch):
    """torch.compile(model, backend="convdsl"): the model is not converted, yet every convolution of the compiled
    step, forward and both gradients (a transposed one too), is convdsl's; outputs and gradients as torch.nn's."""
    from convdsl.torch import runtime

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=4), nn.ReLU(),
                          nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Flatten(), nn.Linear(256, 3))
    x = torch.randn(2, 3, 8, 8)
    want_model, xd, want = _float64_step(model, x)
    ops_run = []
    real_run = runtime.run
    monkeypatch.setattr(runtime, "run", lambda op, *a, **k: ops_run.append(op) or real_run(op, *a, **k))
    y, xg, called = _compiled_step(model, x, ops_run.clear)
    assert all(type(m) in (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.ReLU, nn.Flatten, nn.Linear)
               for m in model)  # nothing converted
    # the graphs call the operators' twins, which have no (Python) autograd or autocast kernel to pass through
    # two forwards and the transposed one's dX; the transposed forward; two grad_inputs; three grad_weights
    assert called == sorted(["convdsl::graph_convolution"] * 3 + ["convdsl::graph_conv_transpose"]
                            + ["convdsl::graph_convolution_grad_input"] * 2
                            + ["convdsl::graph_convolution_grad_weight"] * 3), called
    # kernels: forward for 2 forwards and the transposed one's dX, grad_input for 2 and the transposed forward
    assert sorted(ops_run) == sorted(["forward"] * 3 + ["grad_input"] * 3 + ["grad_weight"] * 3), ops_run
    _assert_step_as_float64(y, xg, model, want, xd, want_model)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile's default backend (Inductor) needs a C++ compiler on the CPU")
def test_torch_compile_backend_calls_a_converted_models_operators_as_their_graph_twins():
    """A convert()ed model under backend="convdsl": its operator calls (forward, both gradients, a transposed
    convolution) become the graph twins in Inductor's graphs; outputs and gradients as torch.nn's in float64."""
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2),
                        nn.Flatten(), nn.Linear(256, 3))
    x = torch.randn(2, 3, 4, 4)
    want_model, xd, want = _float64_step(ref, x)
    model = ct.convert(ref)
    y, xg, called = _compiled_step(model, x)
    # the transposed convolution's backward: dX as a forward, dW as grad_weight
    assert called == sorted(["convdsl::graph_convolution"] * 2 + ["convdsl::graph_conv_transpose"]
                            + ["convdsl::graph_convolution_grad_input"]
                            + ["convdsl::graph_convolution_grad_weight"] * 2), called
    _assert_step_as_float64(y, xg, model, want, xd, want_model)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile's default backend (Inductor) needs a C++ compiler on the CPU")
def test_torch_compile_backend_keeps_inductors_layout_optimisation(monkeypatch):
    """backend="convdsl" lowers aten's convolutions inside Inductor, so its layout optimisation still plans the
    graph: a contiguous model's convolutions get channels-last activations (the kernels' layout, no transpose
    around each call), in forward and both gradients, with torch.nn's results.  (Inductor optimises the layout
    where it judges it pays: on the CPU wherever oneDNN is available, as here.)"""
    import torch._inductor.config as inductor_config
    from convdsl.torch import runtime

    if not inductor_config.layout_optimization or not torch.backends.mkldnn.is_available():
        pytest.skip("Inductor's layout optimisation is off on this CPU build of PyTorch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=True), nn.ReLU(),
                          nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Flatten(), nn.Linear(256, 3))
    x = torch.randn(2, 3, 8, 8)
    want_model, xd, want = _float64_step(model, x)
    seen = []
    real_run = runtime.run

    def spy(op, a, b, **kwargs):
        seen.append((op, a.is_contiguous(), b.is_contiguous() if b.dim() == 4 and op == "grad_weight" else False))
        return real_run(op, a, b, **kwargs)
    monkeypatch.setattr(runtime, "run", spy)
    compiled = torch.compile(model, backend="convdsl")
    xg = x.clone().requires_grad_()
    y = compiled(xg)
    y.square().sum().backward()
    assert sorted(op for op, *_ in seen) == sorted(["forward"] * 3 + ["grad_input"] * 3 + ["grad_weight"] * 3)
    assert not any(a or b for _, a, b in seen), seen  # every activation channels-last, grad_weight's dY too
    _assert_step_as_float64(y, xg, model, want, xd, want_model)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="torch.compile's default backend (Inductor) needs a C++ compiler on the CPU")
def test_torch_compile_backend_keeps_a_channels_last_3d_models_layout(monkeypatch):
    """A channels-last-3d model (a video network, whose convolutions Inductor's layout optimisation leaves alone):
    every convolution, forward and both gradients, gets its activations (and grad_weight its dY) channels-last,
    so that no kernel transposes them on its calls; results as torch.nn's in float64."""
    from convdsl.torch import runtime

    torch.manual_seed(2)
    cl3d = torch.channels_last_3d
    model = nn.Sequential(nn.Conv3d(3, 8, (1, 3, 3), padding=(0, 1, 1), bias=False), nn.BatchNorm3d(8), nn.ReLU(),
                          nn.Conv3d(8, 8, (3, 1, 1), stride=(2, 1, 1), padding=(1, 0, 0)), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 2 * 4 * 4, 3)).to(memory_format=cl3d)
    x = torch.randn(2, 3, 4, 4, 4).contiguous(memory_format=cl3d)
    want_model, xd, want = _float64_step(model, x)
    seen = []
    real_run = runtime.run

    def spy(op, a, b, **kwargs):
        dy_too = op != "grad_weight" or b.is_contiguous(memory_format=cl3d)
        seen.append((op, a.is_contiguous(memory_format=cl3d) and dy_too))
        return real_run(op, a, b, **kwargs)
    monkeypatch.setattr(runtime, "run", spy)
    y, xg, _ = _compiled_step(model, x, seen.clear)
    # dX of both convolutions (the step's input asks for its gradient too)
    assert sorted(op for op, _ in seen) == sorted(["forward", "grad_input", "grad_weight"] * 2), seen
    assert all(ok for _, ok in seen), seen
    _assert_step_as_float64(y, xg, model, want, xd, want_model)


def test_operator_registrations_pass_opcheck():
    """torch.library's own check of each operator: schema, fake kernel against the real one, autograd
    registration, and AOT dispatch (what torch.compile runs)."""
    x = torch.randn(2, 4, 7, 6).to(memory_format=torch.channels_last)
    w = torch.randn(6, 2, 3, 3).to(memory_format=torch.channels_last)
    conv = [2, 1], [1, 1], [1, 0], [1, 1], 2
    y = torch.ops.convdsl.convolution(x, w, None, *conv)
    assert y.shape == (2, 6, 4, 5)
    x.requires_grad_(), w.requires_grad_()
    torch.library.opcheck(torch.ops.convdsl.convolution.default, (x, w, torch.randn(6), *conv))
    dy = torch.randn(y.shape).to(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.convdsl.convolution_grad_input.default, (dy, w.detach(), list(x.shape), *conv))
    torch.library.opcheck(torch.ops.convdsl.convolution_grad_weight.default, (x.detach(), dy, list(w.shape), *conv))
    xt = torch.randn(2, 6, 4, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.convdsl.conv_transpose.default,
                          (xt, w, None, [2, 1], [1, 1], [1, 1], [1, 0], [1, 1], 2))


def test_recording_on_fake_tensors_lists_every_kernel_of_a_step():
    """A training step on fake tensors inside runtime.recording() computes nothing and records each
    convolution's forward, grad_input and grad_weight once (how bundles are built for another machine)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl.torch import runtime

    model = ct.convert(_model()).to(memory_format=torch.channels_last)
    with runtime.recording(as_cuda=True) as problems, FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
        model(x).sum().backward()
    convs = [m for m in model.modules() if isinstance(m, ct.Conv2d)]
    ops = sorted(p.op for p in problems)
    assert ops == sorted(["forward", "grad_input", "grad_weight"] * len(convs))
    assert all(p.dtype == "f32" and p.tf32 for p in problems)  # as_cuda: TF32 as cuDNN allows
    assert all(p.layout == "NHWGC" for p in problems if p.op == "forward")


def test_recording_counts_the_calls_of_each_problem():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl.torch import runtime

    same = ct.Conv2d(4, 4, 3, padding=1)
    model = nn.Sequential(ct.Conv2d(3, 4, 3, padding=1), same, same, same)  # one layer called three times
    calls: dict = {}
    with runtime.recording(as_cuda=True, calls=calls) as problems, FakeTensorMode(allow_non_fake_inputs=True):
        model(torch.randn(2, 3, 8, 8).requires_grad_()).sum().backward()
    assert set(calls) == set(problems) and sum(calls.values()) == 4 + 4 + 4
    repeated = [n for p, n in calls.items() if p.in_channels == 4]
    assert sorted(repeated) == [3, 3, 3]  # forward, grad_input, grad_weight of the repeated layer


def test_recording_under_autocast_adds_the_eager_grad_weight_into_the_parameter_dtype():
    """Eager plans under autocast sum grad_weight's f32 partials straight into the f32 parameter's gradient (a
    problem with out_dtype f32); the operators' path keeps the 16-bit result.  A bundle traced once holds both,
    and the step's call counts are the operators' only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl.torch import runtime

    model = nn.Sequential(ct.Conv2d(3, 8, 3, padding=1), ct.Conv2d(8, 8, 3, stride=2, groups=2))
    model = model.to(memory_format=torch.channels_last)
    calls: dict = {}
    with runtime.recording(as_cuda=True, calls=calls) as problems, FakeTensorMode(allow_non_fake_inputs=True), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
        model(x).float().sum().backward()
    weights = [p for p in problems if p.op == "grad_weight"]
    assert sorted(str(p.out_dtype) for p in weights) == ["None", "None", "f32", "f32"]
    assert all(p.dtype == "bf16" for p in problems)
    for eager in (p for p in weights if p.out_dtype == "f32"):
        assert eager.with_(out_dtype=None) in weights  # the same convolution as the operators' one
        assert eager not in calls
    assert sum(calls.values()) == 3 * 2


def test_record_step_lists_what_the_step_calls_and_leaves_the_model_alone(tmp_path):
    """ct.record_step: one training step of a convert()ed model traced on fake tensors lists every kernel the step
    calls and how often (as the step traced by hand does), the model keeps its gradients and buffers, autocast
    gives 16-bit problems, and write_bundle compiles them for sm_90."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from convdsl import stream
    from convdsl.torch import runtime

    model = ct.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                     nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.Flatten(),
                                     nn.Linear(128, 3))).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = ct.record_step(model, lambda m: nn.functional.cross_entropy(m(x), y))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # num_batches_tracked too
    calls: dict = {}
    twin = copy.deepcopy(model)
    with runtime.recording(as_cuda=True, calls=calls) as traced, FakeTensorMode(allow_non_fake_inputs=True):
        nn.functional.cross_entropy(twin(x), y).backward()  # by hand, as the tests above trace
    assert list(traced) == list(step.problems) and calls == dict(step.calls)
    assert sum(step.calls.values()) == 2 + 1 + 2  # forwards, one grad_input (the first has no dX), grad_weights
    assert sorted(p.op for p in step.calls) == ["forward", "forward", "grad_input", "grad_weight", "grad_weight"]
    assert all(p.layout == "NHWGC" and p.dtype == "f32" and p.tf32 for p in step.problems)  # as CUDA with TF32
    halves = ct.record_step(model, lambda m: nn.functional.cross_entropy(m(x), y), autocast=torch.bfloat16)
    assert {p.dtype for p in halves.problems} == {"bf16"}
    with pytest.raises(ValueError, match="convert"):  # torch.nn's own convolutions: nothing to compile
        ct.record_step(nn.Conv2d(3, 4, 3), lambda m: m(torch.randn(1, 3, 5, 5)).sum())
    without = step.write_bundle(tmp_path / "step.convk", arch="sm_90")
    kernels = stream.load_bundle(tmp_path / "step.convk")
    assert {k.problem for k in kernels} | {p for p, _ in without} == set(step.problems) and kernels


def test_problem_for_keeps_out_dtype_only_where_it_differs():
    from convdsl.torch import runtime

    x = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16)
    dy = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16)
    conv = dict(spatial=(6, 6), filt=(3, 3), stride=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1), dilation=(1, 1), groups=1)
    assert runtime.problem_for("grad_weight", x, dy, **conv, out_dtype=torch.float32).out_dtype == "f32"
    assert runtime.problem_for("grad_weight", x, dy, **conv, out_dtype=torch.bfloat16).out_dtype is None
    assert runtime.problem_for("grad_weight", x, dy, **conv).result_dtype == "bf16"


def test_a_grad_weight_into_f32_takes_the_tuned_knobs_of_its_16_bit_problem():
    """The result dtype is only the split-K sum's store: the tuning database's entry for the 16-bit problem
    serves the GEMM of the one summed into f32."""
    from convdsl import stream
    from convdsl.targets import Target
    from convdsl.tuning import db

    target = Target("cuda", "sm_90")
    tuned = [s for s in db.load_db().get(f"{target}|3.13.0", {}) if '"op":"grad_weight"' in s]
    assert tuned, "the database has tuned grad_weight entries for sm_90"
    p = problem_from_spec(dict(json.loads(tuned[0]), name="k"))
    planned, widened = stream.plan(p, target), stream.plan(p.with_(out_dtype="f32"), target)
    assert widened.knobs == planned.knobs and "tuning database" in widened.knobs_source


def test_bad_calls_raise_torch_nn_errors():
    conv = ct.Conv2d(4, 6, 3)
    with pytest.raises(RuntimeError, match="Expected 3D .unbatched. or 4D"):
        conv(torch.randn(1, 1, 4, 8, 8))
    with pytest.raises(RuntimeError, match="should be the same"):
        conv(torch.randn(1, 4, 8, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="expected input.* to have 4 channels, but got 5"):
        conv(torch.randn(1, 5, 8, 8))
    with pytest.raises(ValueError, match="divisible by groups"):
        ct.Conv2d(4, 6, 3, groups=3)
    with pytest.raises(RuntimeError, match=r"Input type \(float\) and bias type \(double\) should be the same"):
        ct.Conv2d(4, 6, 3)._conv_forward(torch.randn(1, 4, 8, 8), conv.weight, conv.bias.double())
    with pytest.raises(RuntimeError, match="non-positive groups"):
        torch.ops.convdsl.convolution(torch.randn(1, 4, 8, 8), conv.weight, None, [1, 1], [0, 0], [0, 0], [1, 1], 0)
    with pytest.raises(RuntimeError, match="expected weight to be divisible by 4"):
        torch.ops.convdsl.convolution(torch.randn(1, 8, 8, 8), torch.randn(6, 2, 3, 3), None, [1, 1], [0, 0],
                                      [0, 0], [1, 1], 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, batch: torch.Tensor, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nn.parallel.DistributedDataParallel(ct.convert(_model()))
        shard = batch.chunk(world)[rank]
        model(shard).square().mean().backward()
        out[rank] = [p.grad.clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def test_distributed_data_parallel_over_gloo():
    torch.manual_seed(1)
    batch = torch.randn(4, 3, 8, 8)
    single = ct.convert(_model())
    single(batch).square().mean().backward()
    want = [p.grad for p in single.parameters()]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ddp_worker, args=(2, _free_port(), batch, out), nprocs=2, join=True)
        got = out[0]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _rel(g, w.double()) <= 1e-5  # DDP's averaged gradients equal the whole batch's


@pytest.mark.parametrize("fuse", [False, True], ids=["convert", "fuse"])
def test_train_example_interleaves_both_backends_in_one_process(tmp_path, monkeypatch, fuse):
    """examples/train_resnet.py --backend both: the two models from the same weights on the same batches, in
    alternating blocks, one result file per backend (a tiny model stands in for ResNet-50 on the CPU); --fuse:
    convdsl's model through ct.fuse()."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_resnet.py"
    spec = importlib.util.spec_from_file_location("train_resnet_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def tiny(groups: int, width_per_group: int, classes: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(4, classes))

    monkeypatch.setattr(example, "ResNet", tiny)
    out = tmp_path / "run.json"
    assert example.main(["--backend", "both", "--cpu", "--steps", "4", "--batch", "2", "--image-size", "8",
                         "--classes", "3", "--log-every", "2", "--out", str(out)] + (["--fuse"] if fuse else [])) == 0
    runs = {b: json.loads((tmp_path / f"run-{b}.json").read_text()) for b in ("convdsl", "cudnn")}
    assert all(r["interleaved"] and len(r["losses"]) == 4 and r["images_per_s"] > 0 for r in runs.values())
    # the same weights and batches: the same losses up to f32 rounding of the convolutions
    for a, b in zip(runs["convdsl"]["losses"], runs["cudnn"]["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert not out.exists()


def test_native_launcher_that_cannot_be_built_warns_once_and_leaves_the_python_path(monkeypatch, tmp_path):
    """Where the C++ extension cannot be built (no compiler, no CUDA headers), one warning names why and where
    the log is, and extension() is None (the calls launch through Python); it is not retried per call."""
    attempts = []

    def failing_load(**kwargs):
        attempts.append(kwargs["name"])
        raise RuntimeError("Error building extension: c++: command not found\nmore lines")

    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native.cpp_extension, "load", failing_load)
    native.extension.cache_clear()
    try:
        with pytest.warns(native.NativeUnavailableWarning, match="c\\+\\+: command not found") as caught:
            assert native.extension() is None
        assert native.extension() is None
        assert len(attempts) == 1 and len(caught) == 1 and str(tmp_path) in str(caught[0].message)
    finally:
        native.extension.cache_clear()


def test_native_launcher_is_skipped_when_disabled(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(native.cpp_extension, "load", lambda **kwargs: pytest.fail("built though disabled"))
    native.extension.cache_clear()
    try:
        assert native.extension() is None
    finally:
        native.extension.cache_clear()


def test_native_launcher_source_is_installed_with_the_package():
    """The extension is built from the installed package's source at first use: it must ship with it."""
    assert native.SOURCE.is_file() and "PYBIND11_MODULE" in native.SOURCE.read_text()


@pytest.mark.parametrize("setting, cores, want", [(None, 2, 1), (None, 64, 3), ("0", 2, 3), ("2", 64, 2)])
def test_first_cpu_kernel_call_caps_torchs_intra_op_threads(monkeypatch, setting, cores, want):
    """PyTorch's OpenMP threads spin after each op on the cores IREE's CPU workers run the next kernel on
    (docs/decisions.md#cpu-torch-threads): the first CPU kernel call caps them (CONVDSL_TORCH_CPU_THREADS; by
    default 1 on machines of at most 4 cores, no cap on more; 0 leaves them), once, so a later
    torch.set_num_threads stands."""
    from convdsl import interop

    before = torch.get_num_threads()
    monkeypatch.setattr(interop, "_torch_threads_capped", False)
    monkeypatch.setattr(interop.os, "cpu_count", lambda: cores)
    if setting is None:
        monkeypatch.delenv(interop.TORCH_CPU_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(interop.TORCH_CPU_THREADS_ENV, setting)
    try:
        torch.set_num_threads(3)
        mod, ref = _pair("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=3, padding=1), torch.float32)
        x = torch.randn(2, 4, 6, 6)
        assert _rel(mod(x), ref(x.double())) <= 1e-5
        assert torch.get_num_threads() == want
        torch.set_num_threads(3)
        mod(x)
        assert torch.get_num_threads() == 3  # capped once: the caller's later setting stands
    finally:
        torch.set_num_threads(before)


def test_operators_hand_their_cuda_kernels_to_the_native_extension(monkeypatch):
    """Once a planned call has a native program, the three convolutions' Python CUDA kernels are removed and the
    extension registers its own (given the Python ones for signatures it has no program for); where registering
    fails, the Python kernels come back: the operators never lack a CUDA kernel."""
    from convdsl.torch import ops

    def has_cuda_kernel(name: str) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"convdsl::{name}", "CUDA")

    taken = []

    class Extension:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def take_operators(self, namespace, *kernels):
            if self.fails:
                raise RuntimeError("no registration")
            taken.append((namespace, kernels))

    names = ("convolution", "convolution_grad_input", "convolution_grad_weight")
    assert all(map(has_cuda_kernel, names)) and not ops._native_operators
    try:
        monkeypatch.setattr(native, "extension", lambda: Extension(fails=False))
        ops._take_native_operators()
        assert taken == [("convdsl", (ops._forward, ops._grad_input, ops._grad_weight))]
        assert not any(map(has_cuda_kernel, names)) and has_cuda_kernel("conv_transpose")  # the extension's now
        ops._cuda_library = ops._python_cuda_kernels()
        monkeypatch.setattr(native, "extension", lambda: Extension(fails=True))
        with pytest.warns(native.NativeUnavailableWarning, match="no registration"):
            ops._take_native_operators()
        assert all(map(has_cuda_kernel, names))
    finally:
        if not all(map(has_cuda_kernel, names)):
            ops._cuda_library = ops._python_cuda_kernels()
        ops._native_operators = False  # as before the test (the extension's were never registered)
