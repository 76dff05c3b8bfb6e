"""Fused Conv -> BatchNorm -> activation (convdsl/torch/fused.py): the kernels (in Triton's interpreter, a
subprocess: tests/batchnorm_interpreter.py) against torch.nn in float64 for every activation, rank and layout;
fuse() on the patterns torchvision's models use, a training step against torch.nn in float64."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import convdsl.torch as ct  # noqa: E402
from convdsl.torch.fused import ACTIVATION_FUNCTIONS  # noqa: E402

HERE = Path(__file__).resolve().parent
# relative error against float64 per storage dtype: f32 sums of a few thousand terms; f16 rounds y, out, dout, dy
TOLERANCE = {"f32": 2e-6, "f16": 2e-3}


def _jobs() -> list[dict]:
    jobs = []
    for act in [None, *ACTIVATION_FUNCTIONS]:
        for channels_last in (True, False):
            # 2x8x33x33: several row blocks per program and several programs per channel (partials merged)
            jobs.append({"shape": [2, 8, 33, 33], "channels_last": channels_last, "activation": act,
                         "dtype": "f32", "momentum": 0.1})
    jobs += [
        {"shape": [3, 6, 17, 17], "channels_last": False, "activation": "silu", "dtype": "f16", "momentum": None},
        {"shape": [2, 80, 9, 7], "channels_last": True, "activation": "relu", "dtype": "f16", "momentum": 0.1},
        {"shape": [2, 6, 3, 5, 7], "channels_last": True, "activation": "hardswish", "dtype": "f32",
         "momentum": 0.3},
        {"shape": [2, 6, 3, 5, 7], "channels_last": False, "activation": "relu6", "dtype": "f32", "momentum": 0.1},
        {"shape": [2, 70, 300], "channels_last": False, "activation": None, "dtype": "f32", "momentum": None},
        {"shape": [4, 5, 31], "channels_last": True, "activation": "relu", "dtype": "f32", "momentum": 0.1},
        {"shape": [2, 8, 9, 11], "channels_last": True, "activation": "silu", "dtype": "f32", "momentum": 0.1,
         "affine": False},
        # ResNet's block end: act(BatchNorm(y) + residual), the mask from the output
        {"shape": [2, 8, 33, 33], "channels_last": True, "activation": "relu", "dtype": "f32", "momentum": 0.1,
         "residual": True},
        {"shape": [3, 6, 17, 17], "channels_last": False, "activation": "relu6", "dtype": "f16", "momentum": 0.1,
         "residual": True},
        {"shape": [2, 6, 3, 5, 7], "channels_last": True, "activation": None, "dtype": "f32", "momentum": None,
         "residual": True},
        {"shape": [2, 8, 9, 11], "channels_last": False, "activation": "relu", "dtype": "f32", "momentum": 0.1,
         "strided": True},
    ]
    return jobs


def test_the_fused_kernels_match_torch_nn_batch_norm_and_activation_in_float64():
    jobs = _jobs()
    done = subprocess.run([sys.executable, str(HERE / "batchnorm_interpreter.py")], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == len(jobs)
    for r in results:
        case = r["case"]
        assert r["layout_kept"], case
        assert r["errors"]["batches"] == 0.0, case
        for name, error in r["errors"].items():
            assert error <= TOLERANCE[case["dtype"]], (case, name, error)


# --- fuse() -----------------------------------------------------------------------------------------------------

class _Bottleneck(nn.Module):
    """ResNet's block: one ReLU module shared by three uses (one after the residual add), attributes not a
    Sequential; a functional activation; a BatchNorm without an activation."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv3, self.bn3 = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = nn.functional.silu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x
        return self.relu(out)


class _FuseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.Hardswish(inplace=True))
        self.block = _Bottleneck(8)
        # DenseNet's pre-activation after a concatenation: BatchNorm -> ReLU -> convolution (a FusedBatchNorm2d)
        self.pre_bn, self.pre_conv = nn.BatchNorm2d(16), nn.Conv2d(16, 8, 1, bias=False)
        # a convolution whose output is used twice: not fused (the BatchNorm would see only one use)
        self.side, self.side_bn = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.up_bn, self.up_act = nn.BatchNorm2d(4, momentum=None), nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.block(self.stem(x))
        s = self.pre_conv(torch.relu(self.pre_bn(torch.cat((s, s * 0.5), 1))))
        side = self.side(s)
        s = self.side_bn(side) + side
        return self.up_act(self.up_bn(self.up(s)))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("channels_last", [False, True])
def test_fuse_forms_conv_bn_activation_modules_and_trains_as_torch_nn(channels_last):
    torch.manual_seed(3)
    ref = _FuseNet().double()
    source = copy.deepcopy(ref).float()
    model = ct.fuse(source)
    fused = {name: m.activation for name, m in model.named_modules() if isinstance(m, ct.ConvBNAct)}
    assert fused == {"stem.0": "hardswish", "block.conv1": "relu", "block.conv2": "silu", "block.conv3": "relu",
                     "up": "relu6"}
    # the pre-activation BatchNorm: fused with its ReLU at its own path (its names kept), the model's own untouched
    assert type(model.get_submodule("pre_bn")) is ct.FusedBatchNorm2d
    assert model.get_submodule("pre_bn").activation == "relu"
    assert type(source.pre_bn) is nn.BatchNorm2d and model.get_submodule("pre_bn").weight is source.pre_bn.weight
    # the block's end, bn3 + x and the shared ReLU, is one call with the residual (computed before it here)
    calls = {n.target: n.args for n in model.graph.nodes if n.op == "call_module"}
    assert len(calls["block.conv3"]) == 2 and len(calls["block.conv1"]) == 1
    assert not any(type(m) in (nn.Conv2d, nn.ConvTranspose2d) for m in model.modules())
    assert "block.conv1.bn.running_mean" in model.state_dict() and "side_bn.running_mean" in model.state_dict()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model, ref = model.to(memory_format=fmt), ref.to(memory_format=fmt)
    for step in range(2):  # two steps: the running averages, momentum None's cumulative one included
        x = torch.randn(4, 3, 12, 12).to(memory_format=fmt)
        out, out_ref = model(x), ref(x.double())
        target = torch.randn(out_ref.shape, dtype=torch.float64)
        nn.functional.mse_loss(out, target.float()).backward()
        nn.functional.mse_loss(out_ref, target).backward()
        assert _rel(out, out_ref) <= 1e-4
    fused_state, ref_state = model.state_dict(), ref.state_dict()
    renamed = {"stem.0.": "stem.0.conv.", "stem.1.": "stem.0.bn.", "up.": "up.conv.", "up_bn.": "up.bn."}
    for i in (1, 2, 3):
        renamed[f"block.conv{i}."] = f"block.conv{i}.conv."
        renamed[f"block.bn{i}."] = f"block.conv{i}.bn."
    expected = {next((new + name[len(old):] for old, new in renamed.items() if name.startswith(old)), name): name
                for name in ref_state}
    assert ct.original_names(model) == expected
    for name, value in ref_state.items():
        new = next((new + name[len(old):] for old, new in renamed.items() if name.startswith(old)), name)
        if value.is_floating_point():
            assert _rel(fused_state[new], value) <= 1e-4, name
        else:
            assert torch.equal(fused_state[new], value), name
    grads = dict(model.named_parameters())
    # a convolution's bias before a BatchNorm has a gradient of ~0: errors relative to the step's largest gradient
    floor = 1e-3 * max(p.grad.norm() for p in ref.parameters())
    for name, p in ref.named_parameters():
        new = next((new + name[len(old):] for old, new in renamed.items() if name.startswith(old)), name)
        error = (grads[new].grad.double() - p.grad).norm() / max(p.grad.norm(), floor)
        assert error <= 1e-4, name
    model.eval(), ref.eval()
    x = torch.randn(2, 3, 12, 12)
    assert _rel(model(x), ref(x.double())) <= 1e-4
    # a checkpoint of the unfused model loads into the fused one
    fresh = ct.fuse(_FuseNet())
    ct.load_unfused_state_dict(fresh, {k: v.float() if v.is_floating_point() else v for k, v in ref_state.items()})
    fresh.eval()
    assert _rel(fresh(x), ref(x.double())) <= 1e-4
    with pytest.raises(KeyError, match="no place for"):
        ct.load_unfused_state_dict(fresh, {**ref_state, "extra.weight": torch.zeros(1)})


def test_conv_bn_act_rejects_what_torch_nn_would_not_compute():
    with pytest.raises(TypeError, match="BatchNorm2d"):
        ct.ConvBNAct(nn.Conv2d(3, 4, 1), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="bn has 5 features, the convolution 4 output channels"):
        ct.ConvBNAct(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(5))
    with pytest.raises(ValueError, match="activation 'gelu' is not one of"):
        ct.ConvBNAct(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), "gelu")
    with pytest.raises(TypeError, match="conv must be a torch.nn convolution"):
        ct.ConvBNAct(nn.Linear(3, 4), nn.BatchNorm2d(4))
    module = ct.ConvBNAct(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        module(torch.randn(1, 3, 1, 1))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if x.sum() > 0 else x


def test_fuse_names_the_model_torch_fx_cannot_trace():
    with pytest.raises(ValueError, match=r"fuse\(\): torch.fx cannot trace _DataDependent"):
        ct.fuse(_DataDependent())


@pytest.mark.parametrize("channels_last", [True, False])
def test_every_fused_launch_compiles_for_hopper_with_pointers_only(channels_last):
    """The launches pass only pointers (every size a constant): compile_launch checks the binary's parameter count
    against the launch's pointers, for both layouts, with momentum None (num_batches_tracked read on the GPU)."""
    pytest.importorskip("triton")
    from convdsl.kernels.batchnorm_launches import batch_norm_launches
    from convdsl.kernels.compile import compile_launch
    launches = batch_norm_launches((8, 96, 14, 14), channels_last, "bfloat16", "float32", "float32", "hardswish",
                                   True, None, 1e-5, 132)
    for launch in (launches.stats, launches.apply, launches.apply_running, launches.grad_stats,
                   launches.grad_apply):
        binary = compile_launch(launch, "sm_90")
        assert binary.params == len(launch.pointer_types) + 2, launch.kernel
        assert launch.grid[0] * launch.grid[1] >= 1
    # the statistics' programs: about four per SM over the channel blocks, every row block taken once
    blocks = dict(launches.stats.constants)["BLOCKS"]
    per, programs = dict(launches.stats.constants)["PER"], launches.programs
    assert (programs - 1) * per < blocks <= programs * per


class _DropPath(nn.Module):
    """torchvision's StochasticDepth: a branch on self.training, no BatchNorm (a leaf for fuse())."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if self.training else x


class _DropPathNet(nn.Module):
    def __init__(self, branch_here: bool = False) -> None:
        super().__init__()
        self.conv, self.bn, self.drop = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), _DropPath()
        self.branch_here = branch_here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        if self.branch_here and self.training:  # a branch fx would freeze, beside a fusable pattern
            y = y * 2
        return y


@pytest.mark.filterwarnings("ignore::convdsl.torch.KernelFallbackWarning")  # float64: torch.nn's convolution
def test_fuse_keeps_train_and_eval_branches_and_refuses_a_model_whose_trace_depends_on_the_mode():
    torch.manual_seed(4)
    ref = _DropPathNet().double()
    model = ct.fuse(copy.deepcopy(ref))
    assert [m.activation for m in model.modules() if isinstance(m, ct.ConvBNAct)] == ["relu"]
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for mode in (True, False, True):
        model.train(mode), ref.train(mode)
        assert _rel(model(x), ref(x)) <= 1e-12, mode
    with pytest.raises(ValueError, match="traces differently in train and eval mode"):
        ct.fuse(_DropPathNet(branch_here=True))


def test_a_fused_kernel_that_cannot_be_had_runs_torch_nn_with_one_warning_or_raises_in_strict_mode(monkeypatch):
    from convdsl.torch import fallback, fused

    def broken(launch, device):
        raise RuntimeError(f"ptxas failed for {launch.kernel}")
    monkeypatch.setattr(fused, "launcher_for", broken)
    monkeypatch.setattr(fused.ConvBNAct, "_fusable", staticmethod(lambda y: True))
    monkeypatch.setattr(fused, "_PLANNED", {})
    torch.manual_seed(8)
    module, ref = ct.ConvBNAct(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), "silu"), nn.BatchNorm2d(4)
    y = torch.randn(2, 4, 5, 5)
    with pytest.warns(ct.KernelFallbackWarning, match=r"fused BatchNorm \+ silu of \(2, 4, 5, 5\).*ptxas failed"
                                                      r".*torch.nn's BatchNorm and activation"):
        out = module.batch_norm_activation(y)
    assert torch.allclose(out, nn.functional.silu(ref(y)))
    assert torch.equal(module.bn.running_mean, ref.running_mean)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # announced once per signature: the next call is quiet
        module.batch_norm_activation(y)
    fallback.set_strict(True)
    try:
        monkeypatch.setattr(fused, "_PLANNED", {})
        with pytest.raises(ct.KernelUnavailableError, match="ptxas failed"):
            module.batch_norm_activation(y)
    finally:
        fallback.set_strict(False)


def test_record_step_traces_a_fused_model_as_its_converted_twin():
    """record_step on fuse()'s model (with a momentum-None BatchNorm, whose average reads the batch count on the
    host) records the same convolutions as on the converted model, and leaves the model's BatchNorms as they were."""
    torch.manual_seed(9)
    base = _FuseNet()
    fused, converted = ct.fuse(copy.deepcopy(base)), ct.convert(copy.deepcopy(base))
    x = torch.randn(4, 3, 12, 12)
    steps = [ct.record_step(m, lambda m: m(x).float().square().mean(), autocast=torch.bfloat16)
             for m in (fused, converted)]
    assert steps[0].problems and steps[0].problems == steps[1].problems and steps[0].calls == steps[1].calls
    assert fused.get_submodule("up.bn").momentum is None
    assert int(fused.get_submodule("up.bn").num_batches_tracked) == 0


def test_the_native_plan_carries_each_training_launch_with_its_buffers_in_the_python_order(monkeypatch):
    """Where the native launcher is built, a fused BatchNorm's four training launches go to it as data: which
    launch, its function, grid and block, and per parameter a buffer of the call (in BatchNormActivation's order,
    the count it passes) or a zero (a parameter the kernel never reads)."""
    from types import SimpleNamespace

    from convdsl.kernels.batchnorm_launches import batch_norm_launches
    from convdsl.torch import fused

    made = []

    class FakePlan:
        def __init__(self, work_elements, channels, residual):
            self.args, self.sets = (work_elements, channels, residual), {}
            made.append(self)

        def set(self, which, function, grid, threads, shared_bytes, name, params):
            self.sets[which] = (function, grid, threads, shared_bytes, name, params)

    monkeypatch.setattr(fused.native, "extension", lambda: SimpleNamespace(BatchNormPlan=FakePlan))
    monkeypatch.setattr(fused, "launcher_for", fused._driver_launcher)
    launches = batch_norm_launches((8, 24, 9, 9), True, "bfloat16", "float32", "float32", "relu", True, 0.1, 1e-5, 132,
                                   True)
    planned = fused._Planned(launches, torch.device("cuda"), residual=True)
    passed = {"stats": 6, "apply": 6, "grad_stats": 9, "grad_apply": 9}  # BatchNormActivation's calls
    for i, name in enumerate(passed):
        function = SimpleNamespace(handle=SimpleNamespace(value=1000 + i), threads=128, shared_bytes=64 * i,
                                   name=f"k_{name}", params=passed[name] + 2)
        run = lambda stream, *tensors: None  # noqa: E731
        run.function, run.grid = function, getattr(launches, name).grid
        setattr(planned, name, run)
    assert planned.native is made[0] and len(made) == 1
    assert made[0].args == (launches.work_elements, 24, True)
    for which, name in enumerate(passed):
        function, grid, threads, shared, kernel, params = made[0].sets[which]
        assert (function, kernel, threads, shared) == (1000 + which, f"k_{name}", 128, 64 * which)
        assert grid == tuple(getattr(launches, name).grid)
        assert params == [(0, i) for i in range(passed[name])] + [(2, 0), (2, 0)]
    assert planned.native is made[0] and len(made) == 1  # planned once
    cpu = fused._Planned(launches, torch.device("cpu"))
    assert cpu.native is None and len(made) == 1
