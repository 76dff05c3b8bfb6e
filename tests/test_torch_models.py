"""convdsl.torch as a user's model meets it, on the CPU: outputs that in-place ops may modify, double backward
(gradient penalties), convert() on subclasses and on a bare convolution, torch.nn's memory-format rule, the
fallback to PyTorch's convolution (and strict mode), and one training step of models built from the patterns
torchvision's models use, gradients against torch.nn in float64."""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import convdsl.torch as ct  # noqa: E402
from convdsl.torch import fallback, runtime  # noqa: E402

CL = {4: torch.channels_last, 5: torch.channels_last_3d}
F32 = 1e-5  # convdsl's f32 kernels against torch.nn in float64, norm-wise


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm()
                 .clamp_min(1e-300))


MODULES = [
    (ct.Conv1d, nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1), (2, 4, 9)),
    (ct.Conv2d, nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=2), (2, 4, 6, 5)),
    (ct.Conv3d, nn.Conv3d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1), (1, 4, 4, 5, 3)),
    (ct.ConvTranspose2d, nn.ConvTranspose2d, dict(in_channels=4, out_channels=4, kernel_size=2, stride=2),
     (2, 4, 3, 4)),
]


@pytest.mark.parametrize("cls, ref_cls, kwargs, shape, channels_last",
                         [(*m, cl) for m in MODULES for cl in (False, True) if not cl or len(m[3]) in CL])
def test_in_place_ops_on_outputs_match_torch_nn(cls, ref_cls, kwargs, shape, channels_last):
    """torch.nn's outputs are never views: `y += r`, `y.relu_()` and their gradients work on convdsl's too
    (Conv1d has no channels-last memory format)."""
    torch.manual_seed(0)
    mod, ref = cls(**kwargs), ref_cls(**kwargs).double()
    ref.load_state_dict({k: v.double() for k, v in mod.state_dict().items()})
    fmt = CL[len(shape)] if channels_last else torch.contiguous_format
    x = torch.randn(shape).to(memory_format=fmt).requires_grad_()
    xr = x.detach().double().requires_grad_()
    y, yr = mod(x), ref(xr)
    assert y._base is None and y.is_contiguous(memory_format=fmt)
    r = torch.randn(y.shape, dtype=torch.float64)
    y += r.float()
    yr += r
    y.relu_(), yr.relu_()
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g.float()), yr.backward(g)
    assert _rel(y, yr) <= F32 and _rel(x.grad, xr.grad) <= F32
    assert _rel(mod.weight.grad, ref.weight.grad) <= F32


@pytest.mark.parametrize("transposed", [False, True])
def test_double_backward_gradient_penalty_matches_torch_nn(transposed):
    """A gradient penalty (WGAN-GP, R1): ||d out / d x||^2 differentiated again, to the input and the weight."""
    torch.manual_seed(1)
    kwargs = dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, groups=2)
    cls, ref_cls = (ct.ConvTranspose2d, nn.ConvTranspose2d) if transposed else (ct.Conv2d, nn.Conv2d)
    mod, ref = cls(**kwargs), ref_cls(**kwargs).double()
    ref.load_state_dict({k: v.double() for k, v in mod.state_dict().items()})
    x = torch.randn(2, 4, 7, 6, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    results = []
    for m, inp in ((mod, x), (ref, xr)):
        out = m(inp)
        (grad,) = torch.autograd.grad(out.square().sum(), inp, create_graph=True)
        assert grad.grad_fn is not None
        penalty = grad.square().sum()
        penalty.backward()
        results.append((grad, inp.grad, m.weight.grad))
    for got, want in zip(*results):
        assert _rel(got, want) <= 1e-4


def test_double_backward_of_the_operators_passes_gradcheck_shapes():
    """The gradient operators' own formulas against torch.nn's second derivatives, channels-last, strided."""
    torch.manual_seed(2)
    x = torch.randn(2, 4, 7, 6).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(6, 2, 3, 3).to(memory_format=torch.channels_last).requires_grad_()
    conv = [2, 1], [1, 1], [1, 1], [1, 1], 2
    y = torch.ops.convdsl.convolution(x, w, None, *conv)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = torch.nn.functional.conv2d(xr, wr, None, [2, 1], [1, 1], [1, 1], 2)
    v = torch.randn(y.shape, dtype=torch.float64)
    gx, gw = torch.autograd.grad((y * v.float()).sum(), (x, w), create_graph=True)
    gxr, gwr = torch.autograd.grad((yr * v).sum(), (xr, wr), create_graph=True)
    u, t = torch.randn(gx.shape, dtype=torch.float64), torch.randn(gw.shape, dtype=torch.float64)
    hx, hw = torch.autograd.grad((gx * u.float()).sum() + (gw * t.float()).sum(), (x, w))
    hxr, hwr = torch.autograd.grad((gxr * u).sum() + (gwr * t).sum(), (xr, wr))
    assert _rel(hx, hxr) <= F32 and _rel(hw, hwr) <= F32


class _Standardized(nn.Conv2d):
    """A subclass that transforms the weight and calls torch.nn's _conv_forward (weight standardisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class _Conv3DSimple(nn.Conv3d):
    """torchvision's video models' pattern: a subclass with its own constructor and static methods."""

    def __init__(self, in_planes: int, out_planes: int, stride: int = 1) -> None:
        super().__init__(in_planes, out_planes, kernel_size=(3, 3, 3), stride=stride, padding=(1, 1, 1),
                         bias=False)

    @staticmethod
    def get_downsample_stride(stride: int) -> tuple[int, int, int]:
        return stride, stride, stride


def test_convert_takes_subclasses_and_a_bare_convolution():
    torch.manual_seed(3)
    model = nn.Sequential(_Standardized(3, 4, 3, padding=1), nn.ReLU())
    ref = copy.deepcopy(model).double()
    ct.convert(model)
    assert isinstance(model[0], _Standardized) and type(model[0]) is not _Standardized
    x = torch.randn(2, 3, 6, 6)
    calls = []
    original = runtime.run
    try:
        runtime.run = lambda op, *a, **k: calls.append(op) or original(op, *a, **k)
        y = model(x)
    finally:
        runtime.run = original
    assert calls == ["forward"]  # the transformed weight ran on convdsl's kernel
    assert _rel(y, ref(x.double())) <= F32

    video = _Conv3DSimple(2, 4, stride=2)
    video_ref = copy.deepcopy(video).double()
    converted = ct.convert(video)  # a bare convolution as the model
    assert converted is video and type(video) is not _Conv3DSimple and isinstance(video, _Conv3DSimple)
    assert video.get_downsample_stride(2) == (2, 2, 2)
    xv = torch.randn(1, 2, 4, 5, 6)
    assert _rel(video(xv), video_ref(xv.double())) <= F32
    # converting again changes nothing; a pickled copy is still converted
    assert type(ct.convert(video)) is type(video)
    clone = pickle.loads(pickle.dumps(video))
    assert type(clone) is type(video) and _rel(clone(xv), video_ref(xv.double())) <= F32


def test_results_take_the_memory_format_torch_nn_gives():
    """A contiguous input with a channels-last weight: channels-last, as torch.nn (a following Dropout then
    draws the same mask)."""
    mod = ct.Conv2d(4, 6, 3, padding=1).to(memory_format=torch.channels_last)
    ref = nn.Conv2d(4, 6, 3, padding=1).to(memory_format=torch.channels_last)
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(2, 4, 5, 5)
    y, yr = mod(x), ref(x)
    assert y.stride() == yr.stride() and y.is_contiguous(memory_format=torch.channels_last)
    assert _rel(y, yr) <= F32


def test_calls_without_a_kernel_run_pytorchs_convolution_or_raise_in_strict_mode(monkeypatch):
    torch.manual_seed(4)
    mod = ct.Conv2d(4, 6, 3, padding=1).double()
    ref = nn.Conv2d(4, 6, 3, padding=1).double()
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    with pytest.warns(fallback.KernelFallbackWarning, match="float64"):
        y = mod(x)
    assert y.dtype == torch.float64 and _rel(y, ref(x)) <= 1e-12  # PyTorch computed it in float64
    # an empty batch needs no kernel: torch.nn's empty result, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        empty = mod(torch.randn(0, 4, 5, 5, dtype=torch.float64))
    assert empty.shape == (0, 6, 5, 5)
    # a kernel that fails to compile (here: any failure of the compiler) announces itself once and falls back,
    # forward and both gradients, asymmetric padding too
    monkeypatch.setattr(runtime, "_calls", {})

    def broken(p, device):
        raise RuntimeError(f"iree-compile failed for {p.op}\nsecond line of the log")

    monkeypatch.setattr(runtime, "_iree_kernel", broken)
    pad = ct.Conv2d(4, 6, (2, 4), padding="same")  # pad (0, 1) / (1, 2): asymmetric
    pad_ref = nn.Conv2d(4, 6, (2, 4), padding="same").double()
    pad_ref.load_state_dict({k: v.double() for k, v in pad.state_dict().items()})
    xf = torch.randn(2, 4, 7, 9, requires_grad=True)
    xr = xf.detach().double().requires_grad_()
    with pytest.warns(fallback.KernelFallbackWarning, match=r"iree-compile failed for forward\); it runs PyTorch"):
        yf = pad(xf)
    yr = pad_ref(xr)
    g = torch.randn(yr.shape, dtype=torch.float64)
    with pytest.warns(fallback.KernelFallbackWarning):
        yf.backward(g.float())
    yr.backward(g)
    assert _rel(yf, yr) <= F32 and _rel(xf.grad, xr.grad) <= F32 and _rel(pad.weight.grad, pad_ref.weight.grad) <= F32
    # strict mode: the error, not PyTorch's convolution
    monkeypatch.setattr(runtime, "_calls", {})
    fallback.set_strict(True)
    try:
        with pytest.raises(fallback.KernelUnavailableError, match="iree-compile failed for forward"):
            pad(xf)
        with pytest.raises(fallback.KernelUnavailableError, match="float64"):
            mod(x)
    finally:
        fallback.set_strict(False)


# --- models built from the patterns torchvision's models use -------------------------------------------------

class _SqueezeExcite(nn.Module):
    """MobileNetV3/EfficientNet: 1x1 convolutions on a 1x1 spatial tensor, a gate multiplied in."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.fc2(nn.functional.relu(self.fc1(s), inplace=True)))


class _InvertedResidual(nn.Module):
    """MBConv: expand, depthwise, squeeze-excite, project; stochastic depth and an in-place residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        hidden = channels * 4
        self.block = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.SiLU(inplace=True), _SqueezeExcite(hidden), nn.Conv2d(hidden, channels, 1, bias=False),
            nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        keep = (torch.arange(x.shape[0], dtype=x.dtype) % 2).view(-1, 1, 1, 1)  # stochastic depth, fixed mask
        result = result * keep
        result += x
        return result


class _ShuffleUnit(nn.Module):
    """ShuffleNet: split, grouped convolution on one half, concatenation, channel shuffle."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        half = channels // 2
        self.branch = nn.Sequential(nn.Conv2d(half, half, 1), nn.ReLU(inplace=True),
                                    nn.Conv2d(half, half, 3, padding=1, groups=2), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        out = torch.cat((a, self.branch(b)), dim=1)
        n, c, h, w = out.shape
        return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


class _PatternNet(nn.Module):
    """Stem, MBConv, ShuffleNet unit, DenseNet-style concatenation, a ConvTranspose decoder (segmentation)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.mb = _InvertedResidual(8)
        self.shuffle = _ShuffleUnit(8)
        self.dense = nn.Conv2d(16, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        m = self.mb(s)
        d = self.dense(torch.cat((self.shuffle(m), s), dim=1)).relu_()
        return self.head(self.up(d))


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_training_step_of_torchvision_patterns_matches_torch_nn(channels_last):
    torch.manual_seed(5)
    ref = _PatternNet().double()
    model = ct.convert(copy.deepcopy(ref).float())
    assert not any(type(m) in (nn.Conv2d, nn.ConvTranspose2d) for m in model.modules())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model, ref = model.to(memory_format=fmt), ref.to(memory_format=fmt)
    x = torch.randn(4, 3, 12, 12).to(memory_format=fmt)
    out, out_ref = model(x), ref(x.double())
    target = torch.randn(out_ref.shape, dtype=torch.float64)
    nn.functional.mse_loss(out, target.float()).backward()
    nn.functional.mse_loss(out_ref, target).backward()
    assert _rel(out, out_ref) <= 1e-4
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, pr.grad) <= 1e-4, name


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_step_traced_on_fake_tensors_lists_every_kernel_the_run_asks_for(channels_last, monkeypatch):
    """A bundle is compiled from the problems a step traced on fake tensors records; the real step (here the
    eager path that CUDA takes, its kernels a float64 reference on the CPU) must ask for none besides them,
    under bf16 autocast, in either memory format."""
    from test_torch import _ReferenceRunner
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(6)
    model = ct.convert(_PatternNet())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    with runtime.recording(as_cuda=False) as traced, FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 3, 12, 12).to(memory_format=fmt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
    asked = []

    def new_call(p, device, a, b):
        asked.append(p)
        return runtime._new_call_with(p, _ReferenceRunner(p), a, b)

    monkeypatch.setattr(runtime, "on_stream_device", lambda t: True)
    monkeypatch.setattr(runtime, "_new_call", new_call)
    monkeypatch.setattr(runtime, "_calls", {})
    x = torch.randn(4, 3, 12, 12).to(memory_format=fmt)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
    assert asked and {p.op for p in asked} == {"forward", "grad_input", "grad_weight"}
    missing = [p.describe() for p in asked if p not in traced]
    assert not missing, missing


def test_a_triton_failure_names_the_installed_triton_and_the_one_the_kernels_need(monkeypatch):
    import sys
    import types

    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    with pytest.warns(fallback.KernelFallbackWarning, match=r"at 39:8; the installed Triton is 3\.6\.0, convdsl's "
                      r"kernels need 3\.9"):
        fallback.unavailable("grad_weight of a depthwise layer", CompilationError("at 39:8:\n  more"))
    with pytest.warns(fallback.KernelFallbackWarning) as caught:
        fallback.unavailable("another layer", RuntimeError("out of memory"))
    assert "Triton" not in str(caught[0].message)
