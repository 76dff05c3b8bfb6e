"""ROCm targets, compile-only: gfx942 (MI300X), gfx90a (MI250X) and gfx1100 (RX 7900 XTX) each planned with their own
figures, which agree with IREE's target descriptions; IREE's configurations sized to each one's LDS before
iree-compile sees them (no setting rejected on the shapes that were); an executable IREE still rejects loses its
own settings only; IREE's substitution notes kept off stderr."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from convdsl.backends import iree as _iree
from convdsl.backends import iree_config
from convdsl.backends.iree_config import apply_knobs, compile_with_knobs_reported, workgroup_memory_bytes
from convdsl.cli import main
from convdsl.compiler import knobs_by_kernel, load_problems
from convdsl.passes import lower_to_mlir
from convdsl.problem import ConvProblem
from convdsl.targets import CDNA2, CDNA3, RDNA3, Target
from convdsl.tuning import Knobs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ARCHS = ("gfx942", "gfx90a", "gfx1100")
# (chip, compute units, LDS per workgroup, native wave, matrix instructions): AMD's GPU specifications table
FIGURES = {"gfx942": ("MI300X", 304, 65536, 64, "MFMA"), "gfx90a": ("MI250X GCD", 110, 65536, 64, "MFMA"),
           "gfx1100": ("RX 7900 XTX", 96, 65536, 32, "WMMA")}
LINALG = Knobs(extern=False)


def _kernel(example: str, name: str) -> ConvProblem:
    return next(p for p in load_problems(str(EXAMPLES / example)) if p.name == name)


# the kernels whose settings iree-compile rejected for 106,496 bytes of LDS (64 output channels, a 128-column
# tile), and a 1x1 grad_input whose n4-m2 is four times gfx942's LDS
C1_FWD = _kernel("unet3d_level.conv", "c1_fwd")
BACKPROP_INPUT = _kernel("ascend_conv3d_backprop_input.conv", "backprop_input")
REDUCE_DGRAD = _kernel("resnet_bottleneck.conv", "reduce_dgrad")


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_has_its_own_figures(arch):
    gpu = Target("rocm", arch).gpu
    assert (gpu.chip, gpu.sm_count, gpu.workgroup_memory, gpu.subgroup_size, gpu.matrix_unit) == FIGURES[arch]
    assert gpu.subgroup_sizes[0] == gpu.subgroup_size


@pytest.mark.parametrize("arch, facts", [("gfx950", CDNA3), ("gfx908", CDNA2),
                                         ("gfx1101", RDNA3), ("gfx1030", RDNA3), ("gfx1201", RDNA3)])
def test_an_arch_without_figures_takes_its_familys(arch, facts):
    # an RDNA chip is never planned with a CDNA chip's wave64 and compute units, nor the other way round
    assert Target("rocm", arch).gpu is facts


def _configs(problems: list[ConvProblem], target: Target, folder: Path) -> dict[str, str]:
    """IREE's own configurations of the module's contraction dispatches on matrix instructions, by file name."""
    _iree.compile_mlir(lower_to_mlir(problems, target, {p.name: LINALG for p in problems}), target,
                       ["--compile-to=executable-configurations",
                        f"--iree-hal-dump-executable-configurations-to={folder}"])
    return {p.name: p.read_text() for p in sorted(folder.glob("*.mlir")) if "mma_kind" in p.read_text()}


@pytest.mark.parametrize("arch", ARCHS)
def test_figures_agree_with_irees_target_description(arch, tmp_path):
    target = Target("rocm", arch)
    gpu = target.gpu
    (config,) = _configs([C1_FWD], target, tmp_path).values()
    # IREE rejects a kernel over max_workgroup_memory_bytes: the facts must be the same limit
    assert f"max_workgroup_memory_bytes = {gpu.workgroup_memory}," in config
    assert f"subgroup_size_choices = [{', '.join(map(str, gpu.subgroup_sizes))}]" in config
    assert re.search(rf"subgroup_size = {gpu.subgroup_size}\b", config)  # the wave IREE compiles the kernel for
    assert re.search(rf"mma = \[<{gpu.matrix_unit}\w*_", config)
    assert re.search(rf"mma_layout<{gpu.matrix_unit}\w*_", config)


def _iree_count(message: str, executable: str) -> int:
    return int(re.search(rf"'{executable}_\w+' uses (\d+) bytes of shared memory", message).group(1))


@pytest.mark.parametrize("arch", ARCHS)
def test_memory_model_counts_what_iree_counts(arch, tmp_path):
    # n2-m2 on 64 output channels: a 128-column tile over a 64-channel loop, so IREE clamps the weight tile and
    # stages the f32 accumulator through LDS; the model must count it exactly as iree-compile does
    target = Target("rocm", arch)
    (name, config), = _configs([C1_FWD], target, tmp_path / "dumped").items()
    edited = tmp_path / "edited"
    edited.mkdir()
    knobs = Knobs(n_scale=2, m_scale=2)
    (edited / name.removeprefix("configured_")).write_text(apply_knobs(config, knobs))
    mlir = lower_to_mlir([C1_FWD], target, {C1_FWD.name: LINALG})
    with pytest.raises(_iree.CompileError) as err:
        _iree.compile_mlir(mlir, target, [f"--iree-hal-substitute-executable-configurations-from={edited}"])
    executable = re.search(r"hal\.executable public @(\w+)", config).group(1)
    counted = _iree_count(str(err.value), executable)
    assert workgroup_memory_bytes(config, knobs) == counted > target.gpu.workgroup_memory


# backprop_input's four stride phases take 15 s to compile for gfx1100 (2 s for gfx942): there its
# configurations are checked against the model instead (test_settings_fit_before_iree_compile_sees_them)
COMPILED = {"gfx942": [C1_FWD, BACKPROP_INPUT, REDUCE_DGRAD], "gfx90a": [C1_FWD, BACKPROP_INPUT, REDUCE_DGRAD],
            "gfx1100": [C1_FWD, REDUCE_DGRAD]}


@pytest.mark.parametrize("arch", ARCHS)
def test_representative_kernels_compile_with_no_setting_rejected(arch):
    # the rules' own knobs, as `convdsl compile` asks them; strict: a setting iree-compile rejects raises
    target = Target("rocm", arch)
    problems = COMPILED[arch]
    knobs = knobs_by_kernel(problems, target)
    assert all(not knobs[p.name].config_default for p in problems)
    vmfb, results = compile_with_knobs_reported(lower_to_mlir(problems, target, knobs), target, knobs, strict=True)
    assert vmfb and set(results) == {p.name for p in problems}
    for result in results.values():
        assert result.default_kept is None and result.dispatches
        for dispatch in result.dispatches:
            assert dispatch.rejected is None and dispatch.memory_bytes <= target.gpu.workgroup_memory
        # the shapes that were rejected are scaled down to fit, not left as asked
        assert result.fitted


@pytest.mark.parametrize("arch", ARCHS)
def test_settings_fit_before_iree_compile_sees_them(arch, tmp_path):
    target = Target("rocm", arch)
    knobs = knobs_by_kernel([BACKPROP_INPUT], target)[BACKPROP_INPUT.name]
    configs = _configs([BACKPROP_INPUT], target, tmp_path).values()
    assert len(configs) == 4  # one GEMM per stride phase
    asked = [workgroup_memory_bytes(c, knobs) for c in configs]
    fitted = [workgroup_memory_bytes(c, iree_config.fit_knobs(c, knobs, target.gpu.workgroup_memory)) for c in configs]
    assert max(asked) > target.gpu.workgroup_memory >= max(fitted)


@pytest.mark.parametrize("arch", ARCHS)
def test_explain_shows_each_archs_own_figures(arch, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    source = str(EXAMPLES / "resnet_bottleneck.conv")
    assert main(["explain", source, "--target", "rocm", "--arch", arch, "--kernel", "reduce_dgrad",
                 "--stage", "plan"]) == 0
    out = capsys.readouterr().out
    chip, units, lds, wave, matrix = FIGURES[arch]
    assert (f"target: rocm:{arch} ({chip}: {units} compute units, {lds // 1024} KB of LDS per workgroup, wave{wave}"
            in out)
    assert f"{matrix} matrix instructions" in out
    for other in ARCHS:
        if FIGURES[other][:2] != FIGURES[arch][:2]:
            assert f"{FIGURES[other][1]} compute units" not in out


# --- which executable loses its settings ---------------------------------------------------------------

def test_an_executable_is_told_from_one_whose_kernel_name_ends_the_same():
    kernels = ["fwd", "c1_fwd", "c1_fwd_dispatch"]
    assert iree_config._kernel_of("c1_fwd_dispatch_1", kernels) == "c1_fwd"
    assert iree_config._kernel_of("fwd_dispatch_12", kernels) == "fwd"
    assert iree_config._kernel_of("c1_fwd_dispatch_dispatch_0", kernels) == "c1_fwd_dispatch"
    line = "error: function 'c1_fwd_dispatch_1_conv_2x32x32x32x64_bf16xbf16xf32' uses 106496 bytes"
    assert iree_config._names(line, "c1_fwd_dispatch_1")
    assert not iree_config._names(line, "fwd_dispatch_1") and not iree_config._names(line, "c1_fwd_dispatch_10")
    assert not iree_config._names("error: function 'c1_fwd_dispatch_10_conv' uses", "c1_fwd_dispatch_1")


def test_only_the_rejected_executable_keeps_irees_configuration(monkeypatch, caplog):
    target = Target("rocm", "gfx942")
    fwd = REDUCE_DGRAD.with_(op="forward", name="fwd")
    problems = [REDUCE_DGRAD, fwd]
    knobs = {p.name: Knobs(n_scale=2) for p in problems}
    mlir = lower_to_mlir(problems, target, {p.name: LINALG for p in problems})
    real = _iree.compile_mlir
    substituted: list[list[str]] = []

    def compile_mlir(mlir, target, flags=()):
        folder = next((f.split("=", 1)[1] for f in flags
                       if f.startswith("--iree-hal-substitute-executable-configurations-from=")), None)
        if folder is None:
            return real(mlir, target, flags)
        substituted.append(sorted(p.name for p in Path(folder).iterdir()))
        if len(substituted) == 1:  # IREE's error names reduce_dgrad's dispatch alone
            raise _iree.CompileError("  <stdin>:29:10: error: function 'reduce_dgrad_dispatch_0_matmul_100352x256x128_"
                                     "f16xf16xf32' uses 999999 bytes of shared memory; exceeded the limit of 65536 "
                                     "bytes\nThe input was saved to /tmp/x.mlir")
        return real(mlir, target, flags)

    monkeypatch.setattr(_iree, "compile_mlir", compile_mlir)
    with caplog.at_level(logging.WARNING, logger="convdsl.iree_config"):
        vmfb, results = compile_with_knobs_reported(mlir, target, knobs)
    assert vmfb and len(substituted) == 2
    assert substituted[1] == [name for name in substituted[0] if "reduce_dgrad" not in name] != []
    (rejected,) = results["reduce_dgrad"].dispatches
    assert "999999 bytes" in rejected.rejected and "999999 bytes" in results["reduce_dgrad"].default_kept
    assert results["fwd"].default_kept is None and all(d.rejected is None for d in results["fwd"].dispatches)
    assert "reduce_dgrad" in caplog.text and "fwd on" not in caplog.text


def test_irees_own_rejection_drops_the_offending_executables_settings_only(monkeypatch):
    # unfitted, c1_fwd's n2-m2 takes 106,496 bytes of LDS and iree-compile rejects it, naming the function
    # c1_fwd_dispatch_1_conv_...; reduce_dgrad's m2 fits and must keep its settings
    target = Target("rocm", "gfx942")
    monkeypatch.setattr(iree_config, "fit_knobs", lambda config, knobs, memory: knobs)
    knobs = {C1_FWD.name: Knobs(n_scale=2, m_scale=2), REDUCE_DGRAD.name: Knobs(m_scale=2)}
    problems = [C1_FWD, REDUCE_DGRAD]
    vmfb, results = compile_with_knobs_reported(lower_to_mlir(problems, target, {p.name: LINALG for p in problems}),
                                                target, knobs)
    assert vmfb and "uses 106496 bytes of shared memory" in results[C1_FWD.name].default_kept
    (kept,) = results[REDUCE_DGRAD.name].dispatches
    assert results[REDUCE_DGRAD.name].default_kept is None and kept.rejected is None
    assert kept.applied == Knobs(m_scale=2) and kept.memory_bytes <= target.gpu.workgroup_memory


def test_a_rejected_configuration_can_be_reproduced(monkeypatch, tmp_path):
    # strict (tuning) raises; the command it prints must find the edited configurations after the compile
    monkeypatch.setenv("CONVDSL_FAILURE_DIR", str(tmp_path / "failures"))
    monkeypatch.setattr(iree_config, "fit_knobs", lambda config, knobs, memory: knobs)
    target = Target("rocm", "gfx942")
    mlir = lower_to_mlir([C1_FWD], target, {C1_FWD.name: LINALG})
    with pytest.raises(_iree.CompileError) as err:
        compile_with_knobs_reported(mlir, target, {C1_FWD.name: Knobs(n_scale=2, m_scale=2)}, strict=True)
    folder = Path(re.search(r"--iree-hal-substitute-executable-configurations-from=(\S+)", str(err.value)).group(1))
    assert folder.parent == tmp_path / "failures" and "106496 bytes" in str(err.value)
    (saved,) = folder.iterdir()
    assert saved.name.endswith("c1_fwd_dispatch_1.mlir") and "workgroup = [2, 1, 4, 32, 128, 0]" in saved.read_text()


def test_substitution_notes_stay_off_stderr(capfd, caplog):
    target = Target("rocm", "gfx942")
    mlir = lower_to_mlir([REDUCE_DGRAD], target, {REDUCE_DGRAD.name: LINALG})
    with caplog.at_level(logging.DEBUG, logger="convdsl.iree_config"):
        vmfb, results = compile_with_knobs_reported(mlir, target, {REDUCE_DGRAD.name: Knobs(n_scale=2)}, strict=True)
    assert vmfb and results[REDUCE_DGRAD.name].dispatches
    assert "substituted with MLIR source" not in capfd.readouterr().err
    assert "reduce_dgrad_dispatch_0` substituted with MLIR source" in caplog.text  # at DEBUG level
