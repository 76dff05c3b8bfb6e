"""The command line as a user runs it: every example passes --check on the CPU, plus explain/check/compile."""
from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from convdsl.cli import main
from convdsl.passes import STAGE_NAMES

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.conv"))


def test_there_is_an_example_per_seed_and_network():
    names = {p.stem for p in EXAMPLES}
    assert {"ck15_conv3d_bwd_data", "ck17_conv2d_bwd_data", "ck11_grouped_bwd_weight", "ck20_grouped_bwd_weight",
            "ascend_conv3d_backprop_input", "resnet_bottleneck", "resnext", "mobilenetv2_block", "unet3d_level",
            "audio_encoder"} <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_check_on_cpu(example, capsys):
    code = main(["run", str(example), "--target", "cpu", "--check", "--batch", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    kernels = [ln for ln in out if "rel.err" in ln]
    assert code == 0, "\n".join(out)
    assert kernels and all(ln.endswith("PASS") for ln in kernels)
    assert out[-1] == f"{len(kernels)} passed, 0 failed"


def test_run_reports_a_wrong_result_and_exits_nonzero(monkeypatch, capsys):
    import convdsl.reference as ref

    real = ref.reference
    monkeypatch.setattr(ref, "reference", lambda p, *a: real(p, *a) * 1.5)
    code = main(["run", str(EXAMPLES[0].parent / "resnext.conv"), "--target", "cpu", "--check", "--batch", "1",
                 "--kernel", "y"])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and out.strip().endswith("0 passed, 1 failed")


def test_explain_prints_every_stage(capsys):
    assert main(["explain", str(EXAMPLES[0].parent / "ck17_conv2d_bwd_data.conv"), "--kernel", "dgrad"]) == 0
    out = capsys.readouterr().out
    for stage in STAGE_NAMES:  # every stage that applies to the CPU: it has no Triton GEMM cores
        assert (f"after pass '{stage}'" in out) == (stage != "gemm-cores")
    assert "stride phases: 4" in out and "linalg.generic" in out and "iree-compile" in out
    # CK 17's grad_input (128 columns) compiles unpacked: no packed matmul to set workgroup tiles for
    assert "data tiling and matmul microkernels: off" in out and "packed matmuls" not in out


def test_explain_shows_the_gather_form_of_small_groups(capsys):
    # ResNeXt's 32 groups of 4 channels: a gather per output, not a GEMM
    assert main(["explain", str(EXAMPLES[0].parent / "resnext.conv"), "--kernel", "dgrad"]) == 0
    out = capsys.readouterr().out
    assert "form: gather" in out and "tensor.extract" in out and "stride phases" not in out
    assert "data tiling and matmul microkernels: on" in out
    assert "packed matmuls with a long reduction" in out and "policy.cpu_packed_matmul_distribution" in out


def test_explain_one_stage(capsys):
    assert main(["explain", str(EXAMPLES[0].parent / "ck17_conv2d_bwd_data.conv"), "--stage", "plan"]) == 0
    out = capsys.readouterr().out
    # stride 2 in 2D: four phases, each reading 4, 2, 2 or 1 taps of the 3x3 filter
    assert "stride phases: 4 (4 computed, 0 all-zero)" in out and "linalg.generic" not in out


def test_check_reports_location_and_caret(tmp_path, capsys):
    bad = tmp_path / "bad.conv"
    bad.write_text("conv a {\n  dims = 2\n  strid = 2\n}\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:3: error:" in err and "did you mean 'stride'" in err and "^~~~~" in err


def test_check_accepts_every_example(capsys):
    for example in EXAMPLES:
        assert main(["check", str(example)]) == 0
    assert "no errors" in capsys.readouterr().out


def test_compile_writes_module_and_manifest(tmp_path, capsys):
    out = tmp_path / "rx.vmfb"
    assert main(["compile", str(EXAMPLES[0].parent / "resnext.conv"), "--target", "cpu", "--batch", "2",
                 "-o", str(out)]) == 0
    info = json.loads(out.with_suffix(".json").read_text())
    assert out.stat().st_size > 0
    assert info["target"] == "cpu" and info["convdsl_version"] and info["iree_version"].startswith("3.13")
    dgrad = next(k for k in info["kernels"] if k["function"] == "dgrad")
    assert dgrad["args"][0] == {"name": "dy", "shape": [2, 56, 56, 32, 4], "dtype": "f16", "layout": "NHWGK"}
    assert dgrad["result"]["layout"] == "NHWGC" and dgrad["flops"] == 2 * 32 * 2 * 56 * 56 * 4 * 4 * 9


@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_compile_for_gpus_writes_manifest(tmp_path, target, arch, capsys):
    out = tmp_path / f"rx-{target}.vmfb"
    assert main(["compile", str(EXAMPLES[0].parent / "resnext.conv"), "--target", target, "--arch", arch,
                 "-o", str(out)]) == 0
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["target"] == target and info["arch"] == arch and len(info["kernels"]) == 4


def test_unknown_kernel_is_a_clear_error(capsys):
    assert main(["run", str(EXAMPLES[0].parent / "resnext.conv"), "--target", "cpu", "--kernel", "nope"]) == 2
    assert "no kernel named nope" in capsys.readouterr().err


@pytest.fixture
def small_peak(tmp_path, monkeypatch):
    """A cache of its own (the peak is measured afresh) and a 128^3 matmul for the peak: fast enough for a test."""
    from convdsl import peak

    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "MATMUL_SIZE", 128)
    monkeypatch.setattr(peak, "REPEAT", 3)
    return tmp_path / "cache"


def test_run_bench_times_every_kernel(small_peak, capsys):
    code = main(["run", str(EXAMPLES[0].parent / "resnext.conv"), "--target", "cpu", "--bench", "--repeat", "2",
                 "--batch", "1"])
    out = capsys.readouterr().out
    assert code == 0
    timed = [line for line in out.splitlines() if " ms " in line and "GFLOP/s" in line]
    assert len(timed) == 4 and all(float(line.split(" ms ")[0].split()[-1]) > 0 for line in timed)


BENCH_LINE = re.compile(r" ([0-9.]+) ms +([0-9.]+) GFLOP/s +([0-9.]+) GB/s +([0-9.]+)% of matmul peak "
                        r"\(([0-9.]+) GFLOP/s\)")


# large enough for rates of several GFLOP/s, whose printed digits the share can be checked against
MEDIUM = ("conv c { dims = 2; batch = 1; in_channels = 32; out_channels = 32; input = [24, 24]; filter = [3, 3]; "
          "padding = 1 }\nkernel dx = grad_input(c)\nkernel dw = grad_weight(c)\n")


def test_cpu_bench_reports_gflops_and_the_share_of_the_matmul_peak(small_peak, tmp_path, capsys):
    from convdsl import peak
    from convdsl.targets import Target

    source = tmp_path / "medium.conv"
    source.write_text(MEDIUM)
    assert main(["run", str(source), "--target", "cpu", "--bench", "--repeat", "3", "--check"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if " ms " in ln]
    assert len(lines) == 2 and "TFLOP/s" not in out, out
    measured = peak.cached(Target("cpu", "host"))
    assert measured is not None and measured > 0
    for line in lines:
        match = BENCH_LINE.search(line)
        assert match, line
        ms, gflops, _, share, of = map(float, match.groups())
        assert ms > 0 and gflops > 0 and share > 0
        assert of == pytest.approx(measured, rel=0.005)  # the peak printed is the one measured and cached
        assert share == pytest.approx(100 * gflops / of, rel=0.03)  # to the digits printed
        assert line.endswith("PASS")  # --check's verdict still ends the line


def test_the_matmul_peak_is_measured_once_then_read_from_the_cache(small_peak, tmp_path, monkeypatch, capsys):
    from convdsl import cache, peak
    from convdsl.targets import Target

    source = tmp_path / "three.conv"
    source.write_text(THREE)
    entry = cache.entry_path(peak.peak_key(Target("cpu", "host")), peak.SUFFIX)
    assert not entry.exists()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["run", str(source), "--target", "cpu", "--bench", "--repeat", "1", "--kernel", "first"]) == 0
    assert "measuring the matmul peak of cpu:host (f32 linalg.matmul 128x128x128" in terminal.getvalue()
    assert entry.is_file()
    first = capsys.readouterr().out

    # the second run finds the peak (and the kernel) in the cache: nothing is compiled or measured again
    def no_measure(*args, **kwargs):
        raise AssertionError("the matmul peak was measured again")

    monkeypatch.setattr(peak, "measure", no_measure)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cache.stats.reset()
    assert main(["run", str(source), "--target", "cpu", "--bench", "--repeat", "1", "--kernel", "first"]) == 0
    second = capsys.readouterr().out
    assert cache.stats.compiles == 0 and cache.stats.hits == 2  # the kernel's module and the peak
    assert "measuring" not in terminal.getvalue()
    peak_of = lambda out: BENCH_LINE.search(out).group(5)  # noqa: E731
    assert peak_of(second) == peak_of(first)

    with monkeypatch.context() as m:
        m.setattr(peak, "MATMUL_SIZE", 64)
        assert peak.cached(Target("cpu", "host")) is None  # another size: another key
    # a damaged entry is a miss (deleted, to be measured again), not an error
    entry.write_bytes(entry.read_bytes()[:-3])
    assert peak.cached(Target("cpu", "host")) is None and not entry.exists()


def test_the_matmul_peak_key_changes_with_what_changes_the_peak(small_peak, monkeypatch):
    from convdsl import compiler, peak
    from convdsl.targets import Target

    cpu = Target("cpu", "host")
    key = peak.peak_key(cpu)
    assert key == peak.peak_key(Target("cpu", "host")) and len(key) == 64
    assert peak.peak_key(cpu, ["--iree-llvmcpu-enable-ukernels=none"]) != key
    assert peak.peak_key(cpu, size=256) != key
    flags = cpu.compile_flags()
    # the CPU kernels' own flags: without data tiling they would compile (and the matmul run) differently
    with monkeypatch.context() as m:
        m.setattr(Target, "compile_flags", lambda self: [f for f in flags if f != "--iree-opt-data-tiling"])
        assert peak.peak_key(cpu) != key
    assert peak.peak_key(cpu) == key
    for name, value in [("threads", lambda: 64), ("cpu_model", lambda: {"name": "another CPU"})]:
        with monkeypatch.context() as m:
            m.setattr(peak, name, value)
            assert peak.peak_key(cpu) != key, name
    with monkeypatch.context() as m:
        m.setattr(compiler, "iree_version", lambda: "99.0")
        assert peak.peak_key(cpu) != key
    # measured under one set of flags, the peak is not found under another
    monkeypatch.setattr(peak, "MATMUL_SIZE", 64)
    gflops = peak.measure(cpu)
    assert gflops > 0 and peak.cached(cpu) == gflops
    assert peak.cached(cpu, ["--iree-llvmcpu-enable-ukernels=none"]) is None


def test_the_peak_matmul_computes_a_matmul_with_the_cpu_flags():
    import numpy as np

    from convdsl import peak
    from convdsl.backends.iree import LoadedModule, compile_mlir
    from convdsl.targets import Target

    cpu = Target("cpu", "host")
    text = peak.matmul_mlir(48)
    assert "linalg.matmul" in text and "tensor<48x48xf32>" in text
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((48, 48), dtype=np.float32) for _ in range(2))
    got = LoadedModule(compile_mlir(text, cpu), cpu).call(peak.FUNCTION, a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="CPU target only"):
        peak.cached(Target("cuda", "sm_80"))


def test_conventions_version_repeat_and_os_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out.startswith("convdsl ")
    with pytest.raises(SystemExit) as repeat:
        main(["run", str(EXAMPLES[0]), "--bench", "--repeat", "0"])
    assert repeat.value.code == 2 and "expected at least 1" in capsys.readouterr().err
    assert main(["check", str(tmp_path)]) == 2  # a folder: one located line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("convdsl: error: ") and "directory" in err and "Traceback" not in err


def test_compile_names_a_missing_file_and_every_kernel_is_reachable(tmp_path):
    import convdsl

    with pytest.raises(FileNotFoundError):
        convdsl.compile("myconvs")
    with pytest.raises(IsADirectoryError):
        convdsl.compile(str(tmp_path))
    source = EXAMPLES[0].read_text()
    first = convdsl.compiler.load_problems(source, batch=1)[0]
    mod = convdsl.compile(source.replace(f"kernel {first.name} ", "kernel save ", 1), target="cpu", batch=1)
    assert "save" in mod.kernels and mod["save"].problem.name == "save"  # not the module's save()


@pytest.mark.parametrize("command", [["check"], ["explain", "--target", "cpu"],
                                     ["compile", "--target", "cpu", "-o", "OUT"]])
def test_a_file_without_kernels_is_a_located_error(command, tmp_path, capsys):
    source = tmp_path / "empty.conv"
    source.write_text("# only a comment\n")
    argv = [a.replace("OUT", str(tmp_path / "x.vmfb")) for a in command]
    assert main([argv[0], str(source), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert f"{source}:1:1: error: no kernels" in err and "Traceback" not in err


@pytest.mark.parametrize("arch", ["sm_1", "sm_9x", "volta"])
def test_an_unknown_cuda_arch_is_named(arch, capsys):
    example = EXAMPLES[0]
    assert main(["explain", str(example), "--target", "cuda", "--arch", arch, "--stage", "plan"]) == 2
    err = capsys.readouterr().err
    assert f"--arch: a CUDA target names an sm_XY architecture" in err and repr(arch) in err


def test_run_without_check_reports_no_pass(tmp_path, capsys):
    source = tmp_path / "long.conv"
    source.write_text("conv c { dims = 1; batch = 1; in_channels = 2; out_channels = 2; input = [5]; filter = [3] }\n"
                      "kernel a_rather_long_kernel_name_here = grad_input(c)\nkernel b = grad_weight(c)\n")
    assert main(["run", str(source), "--target", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "2 kernels ran (unchecked: add --check)" and "passed" not in "\n".join(out)
    rows = [ln for ln in out if "TFLOP/s" in ln]
    assert len(rows) == 2 and rows[0].index(" grad_input") == rows[1].index(" grad_weight")  # aligned columns


def test_every_flag_has_help():
    from convdsl.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


@pytest.mark.parametrize("command", [["compile", "-o", "OUT"], ["run"], ["explain"]])
def test_a_gpu_arch_with_the_cpu_target_is_refused(command, tmp_path, capsys):
    argv = [a.replace("OUT", str(tmp_path / "x.vmfb")) for a in command]
    assert main([argv[0], str(EXAMPLES[0]), "--target", "cpu", "--arch", "sm_80", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convdsl: error: --arch: ") and "'sm_80'" in err
    assert "CPU" in err and not (tmp_path / "x.vmfb").exists()


def test_auto_falling_back_to_the_cpu_drops_a_gpu_arch(monkeypatch):
    import convdsl.module as module

    monkeypatch.setattr(module, "cuda_available", lambda: False)
    assert str(module.resolve_target("auto", "sm_90")) == "cpu:host"
    assert str(module.resolve_target("cpu", "host")) == "cpu:host"  # the CPU's own name is accepted
    assert str(module.resolve_target("auto", "sapphirerapids")) == "cpu:host"  # unchanged: auto's CPU is the host


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "compute_80", "gfx942", "gfx90a", "SapphireRapids", "", "-x",
                                  "a b", "znver4;rm"])
def test_the_cpu_target_refuses_a_gpu_arch_or_what_cannot_name_a_cpu(arch):
    from convdsl.targets import Target, TargetError

    with pytest.raises(TargetError, match="the CPU target takes an LLVM CPU name"):
        Target("cpu", arch)


def test_the_cpu_target_passes_its_llvm_cpu_name_to_iree_and_keys_the_caches_on_it():
    from convdsl import compiler, peak
    from convdsl.module import manifest, resolve_target
    from convdsl.problem import ConvProblem
    from convdsl.targets import Target

    host, spr = Target("cpu", "host"), Target("cpu", "sapphirerapids")
    assert resolve_target("cpu") == host and resolve_target("cpu", "sapphirerapids") == spr
    for target in (host, spr, Target("cpu", "x86-64-v4"), Target("cpu", "znver4"), Target("cpu", "neoverse-v2")):
        flags = target.compile_flags()
        cpu_flags = [f for f in flags if f.startswith("--iree-llvmcpu-target-cpu")]
        assert cpu_flags == [f"--iree-llvmcpu-target-cpu={target.arch}"], flags
        assert "--iree-opt-data-tiling" in flags and "--iree-llvmcpu-enable-ukernels=all" in flags
    # modules and matmul peaks for different CPUs never share a cache entry; the manifest names the CPU
    p = ConvProblem(op="grad_input", dims=1, groups=1, batch=1, in_channels=2, out_channels=3, input=(9,),
                    filter=(3,), stride=(1,), dilation=(1,), pad_lo=(0,), pad_hi=(0,), name="k")
    assert compiler.cache_key([p], host) != compiler.cache_key([p], spr)
    assert peak.peak_key(host) != peak.peak_key(spr)
    assert manifest([p], spr)["arch"] == "sapphirerapids"


def test_compile_for_a_named_cpu_reaches_iree_compile(tmp_path, capsys):
    source = tmp_path / "three.conv"
    source.write_text(THREE)
    out = tmp_path / "three.vmfb"
    assert main(["compile", str(source), "--target", "cpu", "--arch", "x86-64-v3", "-o", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["arch"] == "x86-64-v3" and out.stat().st_size > 0
    capsys.readouterr()
    # a name LLVM does not know is iree-compile's error: the name got there
    assert main(["compile", str(source), "--target", "cpu", "--arch", "notacpu", "-o", str(tmp_path / "x.vmfb")]) == 2
    err = capsys.readouterr().err
    assert "cpu:notacpu" in err and "'notacpu' is not a recognized processor" in err
    assert not (tmp_path / "x.vmfb").exists()


@pytest.mark.parametrize("phase", ["candidates", "collect"])
@pytest.mark.parametrize("target", ["cpu", "tpu"])
def test_tune_refuses_a_target_that_is_not_a_gpu(phase, target, tmp_path, capsys):
    out = tmp_path / "tune-build"
    assert main(["tune", phase, str(EXAMPLES[0]), "--target", target, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # no instructions for a GPU machine, nothing compiled
    assert captured.err.count("\n") == 1 and captured.err.startswith("convdsl: error: --target: tuning applies to "
                                                                     f"GPU targets (cuda, rocm), got '{target}'")


def test_explain_omits_a_stage_that_does_not_apply_to_the_target(capsys):
    example = str(EXAMPLES[0].parent / "ck17_conv2d_bwd_data.conv")
    assert main(["explain", example, "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out.splitlines() and "gemm-cores" not in out and "after pass 'linalg'" in out
    assert main(["explain", example, "--target", "cpu", "--stage", "gemm-cores"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("// pass 'gemm-cores' does not apply here: no kernel for "
                                                       "cpu:host has Triton GEMM cores")


def test_explain_lists_the_gemm_cores_a_gpu_target_compiles(monkeypatch, capsys):
    import convdsl.passes.pipeline as pipeline
    from convdsl.kernels.launch import Binary

    # Triton's compile stands in: the stage's text, not the binary, is under test
    monkeypatch.setattr(pipeline, "compile_launch", lambda launch, arch: Binary(launch.name, b"\0" * 64, "cubin",
                                                                                128, 4096, 9))
    example = str(EXAMPLES[0].parent / "ck17_conv2d_bwd_data.conv")
    assert main(["explain", example, "--target", "cuda", "--arch", "sm_90", "--kernel", "dgrad",
                 "--stage", "gemm-cores"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "// ----- after pass 'gemm-cores' -----" and "None" not in out
    assert any(line.startswith("dgrad") and "cubin, 64 bytes, 128 threads" in line for line in out[1:])


DYNAMIC = ("conv c { dims = 1; batch = ?; in_channels = 2; out_channels = 3; input = [8]; filter = [3] }\n"
           "kernel gw = grad_weight(c)\nkernel gi = grad_input(c)\n")


def test_batch_overrides_a_dynamic_batch(tmp_path, capsys):
    import convdsl

    source = tmp_path / "dyn.conv"
    source.write_text(DYNAMIC)
    mod = convdsl.compile(str(source), target="cpu", batch=3)
    assert all(p.batch == 3 and not p.dynamic_batch for p in mod.problems.values())
    out = tmp_path / "dyn.vmfb"
    assert main(["compile", str(source), "--target", "cpu", "--batch", "3", "-o", str(out)]) == 0
    info = json.loads(out.with_suffix(".json").read_text())
    assert [k["args"][0]["shape"][0] for k in info["kernels"]] == [3, 3]  # static: null would be `?`
    capsys.readouterr()
    assert main(["run", str(source), "--target", "cpu", "--batch", "3", "--check"]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[-1] == "2 passed, 0 failed"
    assert [line.split()[2] for line in out_lines[:-1]] == ["3x8x1x2", "3x6x1x3"]  # x, dy at batch 3


@pytest.mark.parametrize("value", ["0", "-2", "two", "2147483648", "1" + "0" * 5000])
def test_a_bad_batch_names_the_flag(value, capsys):
    with pytest.raises(SystemExit) as bad:
        main(["run", str(EXAMPLES[0]), "--target", "cpu", "--batch", value])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "argument --batch: expected" in err and "Traceback" not in err


THREE = ("conv c { dims = 1; batch = 1; in_channels = 2; out_channels = 3; input = [9]; filter = [3] }\n"
         "kernel first = grad_input(c)\nkernel second = grad_weight(c)\nkernel third = forward(c)\n")


class _Terminal(io.StringIO):
    """stderr as a terminal shows it: the status line is only drawn there."""

    def isatty(self) -> bool:
        return True


def test_compile_reports_each_step_to_a_progress_hook(tmp_path, monkeypatch):
    import convdsl
    from convdsl.progress import CompileStep

    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))  # a compile, not a cache hit
    steps: list[CompileStep] = []
    convdsl.compile(THREE, target="cpu", progress=steps.append)
    assert steps == [CompileStep("kernel", 1, 3, "first"), CompileStep("kernel", 2, 3, "second"),
                     CompileStep("kernel", 3, 3, "third"), CompileStep("backend", 3, 3, "iree-compile")]
    steps.clear()
    convdsl.compile(THREE, target="cpu", kernels=["second"], progress=steps.append)
    assert steps == [CompileStep("kernel", 1, 1, "second"), CompileStep("backend", 1, 1, "iree-compile")]
    steps.clear()
    convdsl.compile(THREE, target="cpu", progress=steps.append)
    assert steps == []  # from the cache: nothing compiled, nothing to report


@pytest.mark.parametrize("command", ["compile", "run", "explain"])
def test_a_terminal_sees_a_status_line_while_kernels_compile(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "three.conv"
    source.write_text(THREE)
    extra = ["-o", str(tmp_path / "three.vmfb")] if command == "compile" else []
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([command, str(source), "--target", "cpu", *extra]) == 0
    err, out = terminal.getvalue(), capsys.readouterr().out
    steps = [f"\rlowering {k} of 3: {name}" for k, name in enumerate(("first", "second", "third"), 1)]
    positions = [err.index(step) for step in steps]
    assert positions == sorted(positions) and "\r" not in out
    last = "iree-compile: 3 kernels in one module ..." if command != "explain" else steps[-1][1:]
    assert f"\r{last}" in err
    # the last status is blanked (spaces over all of it) before anything else is written
    blank = re.search(r"\r( +)\r(compiled 3 kernels |$)", err)
    assert blank and len(blank.group(1)) >= len(last), repr(err)


def test_a_pipe_sees_no_status_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "three.conv"
    source.write_text(THREE)
    assert main(["run", str(source), "--target", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "\r" not in captured.out and "lowering" not in captured.out


def test_an_error_after_the_status_line_starts_on_a_clean_line(tmp_path, monkeypatch):
    import convdsl.backends.iree as iree

    monkeypatch.setenv("CONVDSL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "three.conv"
    source.write_text(THREE)

    def refuse(mlir, target, extra_flags=(), data_tiling=True, **options):
        raise iree.CompileError("iree-compile failed for target cpu:host")

    monkeypatch.setattr(iree, "compile_mlir", refuse)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["compile", str(source), "--target", "cpu", "-o", str(tmp_path / "x.vmfb")]) == 2
    assert re.search(r"\r +\rconvdsl: error: iree-compile failed", terminal.getvalue())


TINY = """conv c { dims = 2; batch = 1; in_channels = 2; out_channels = 2; input = [4, 4]; filter = [3, 3]; padding = 1 }
kernel dgrad = grad_input(c)
"""


def test_an_output_path_that_is_a_directory_is_named(tmp_path, capsys):
    src = tmp_path / "tiny.conv"
    src.write_text(TINY)
    assert main(["compile", str(src), "--target", "cpu", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"convdsl: error: -o {tmp_path}: is a directory, expected OUT.vmfb"


def test_a_batch_too_large_to_allocate_is_one_line(tmp_path, capsys):
    src = tmp_path / "tiny.conv"
    src.write_text(TINY)
    assert main(["run", str(src), "--target", "cpu", "--batch", "2147483647"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("convdsl: error: kernel dgrad: its random inputs need about") and "--batch" in err[-1]


@pytest.mark.parametrize("text, expected", [
    ("{bad", ":1:2: expected JSON, got a syntax error"),
    ('{"x": 1}', ": expected a JSON object with a list 'results'"),
    ('{"results": [{}], "cases": []}', ": results[0]: expected an object with 'name' (a string), got keys []"),
    ('{"results": [7], "cases": []}', ": results[0]: expected an object with 'name' (a string), got int"),
    ('{"results": [{"name": "k", "impls": [1]}], "cases": []}', ": results[0].impls: expected an object, got list"),
    ('{"results": [{"name": "k", "impls": {"convdsl": {"ok": true, "ms": "fast"}}}], "cases": []}',
     ": results[0].impls['convdsl'].ms: expected a non-negative number of milliseconds, got 'fast'"),
    ('{"results": [], "cases": [{"name": "k"}]}', ": cases[0]: expected an object with 'name' (a string), "
     "'spec' (an object), got keys ['name']"),
])
def test_tune_collect_names_a_malformed_file(tmp_path, capsys, text, expected):
    bad = tmp_path / "results.json"
    bad.write_text(text)
    assert main(["tune", "collect", str(bad), "--cases", str(bad), "--target", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"convdsl: error: {bad}") and expected in err[-1]


def test_a_missing_device_is_one_line(capsys):
    from convdsl.backends.iree import runtime_config

    try:
        runtime_config("cuda")
    except ValueError as err:  # TargetError: no CUDA device here
        assert "found no device" in str(err) and "--target cpu" in str(err)
    else:
        pytest.skip("a CUDA device is present: the error cannot occur here")


def test_the_peak_is_two_n_cubed_over_the_timed_median(small_peak, monkeypatch):
    from convdsl import peak
    from convdsl.backends.iree import LoadedModule
    from convdsl.targets import Target

    calls = []

    def timed(self, name, args, repeat=20, warmup=3, **kwargs):
        calls.append((name, [a.shape for a in args], repeat, warmup))
        return 0.004

    monkeypatch.setattr(LoadedModule, "time", timed)
    cpu = Target("cpu", "host")
    assert peak.measure(cpu, size=32) == pytest.approx(2 * 32 ** 3 / 0.004 / 1e9)
    assert calls == [(peak.FUNCTION, [(32, 32), (32, 32)], peak.REPEAT, peak.WARMUP)] and peak.WARMUP >= 1
    assert peak.cached(cpu, size=32) == pytest.approx(2 * 32 ** 3 / 0.004 / 1e9)


def test_explain_says_which_kernels_pytorch_calls_take(tmp_path, monkeypatch, capsys):
    import convdsl.passes.pipeline as pipeline
    from convdsl.kernels.compile import gluon_tma_im2col
    from convdsl.kernels.launch import Binary

    monkeypatch.setattr(pipeline, "compile_launch", lambda launch, arch: Binary(launch.name, b"\0" * 64, "cubin",
                                                                                128, 4096, 9))
    src = tmp_path / "tf32.conv"
    src.write_text("conv c {\n  dims = 2; groups = 1; batch = 4; in_channels = 128; out_channels = 128\n"
                   "  input = [14, 14]; filter = [3, 3]; stride = 1; dilation = 1; padding = 1\n"
                   "  layout = NHWGC; weight_layout = GKYXC; dtype = f32\n}\n"
                   "kernel wgrad = grad_weight(c) { compute = tf32 }\n")
    assert main(["explain", str(src), "--target", "cuda", "--arch", "sm_90", "--stage", "plan"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "from PyTorch (convdsl.torch):" in x)
    assert "stream path" in line
    # the Hopper TF32 grad_weight where Gluon is: three bf16 products on the 16-bit TMA kernel
    assert ("(bf16x3)" in line) == gluon_tma_im2col(), line
    assert main(["explain", str(src), "--target", "cpu", "--stage", "plan"]) == 0
    assert "from PyTorch" not in capsys.readouterr().out  # the CPU has no stream kernels


@pytest.mark.parametrize("value", [0.01234, 0.1136, 1.136, 9.996, 47.25, 1234.56])
def test_a_peak_is_printed_to_within_half_a_percent(value):
    from convdsl.cli import _significant

    printed = _significant(value)
    assert float(printed) == pytest.approx(value, rel=0.005) and "." in printed and "e" not in printed


@pytest.mark.parametrize("output, what", [("tiny.conv", "the module would overwrite the source"),
                                          ("tiny.json", "the module and its manifest would both be written"),
                                          ("sub/../tiny.conv", "the module would overwrite the source")])
def test_compile_refuses_to_overwrite_its_source_or_its_manifest(output, what, tmp_path, monkeypatch, capsys):
    import convdsl.cli as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    src = tmp_path / "tiny.conv"
    src.write_text(TINY)
    monkeypatch.setattr(cli, "compile_module", lambda *a, **k: pytest.fail("refused before compiling"))
    assert main(["compile", "tiny.conv", "--target", "cpu", "-o", output]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"convdsl: error: -o {output}: {what}")
    assert src.read_text() == TINY  # untouched


def test_compile_refuses_a_manifest_over_a_json_source(tmp_path, monkeypatch, capsys):
    # the source named x.json: OUT.json beside x.vmfb would be the source itself
    src = tmp_path / "x.json"
    src.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "x.json", "--target", "cpu", "-o", "x.vmfb"]) == 2
    assert "the manifest would overwrite the source x.json" in capsys.readouterr().err
    assert src.read_text() == TINY and not (tmp_path / "x.vmfb").exists()


def test_a_negative_seed_names_the_flag(capsys):
    with pytest.raises(SystemExit) as bad:
        main(["run", str(EXAMPLES[0]), "--target", "cpu", "--seed", "-1"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "argument --seed: expected a non-negative whole number, got -1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("path", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("command", ["check", "compile", "run", "explain"])
def test_every_command_refuses_a_device_or_a_pipe(command, path, tmp_path, capsys):
    import os

    if path == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)  # reading it would wait forever for a writer
    extra = ["-o", str(tmp_path / "x.vmfb")] if command == "compile" else []
    assert main([command, path, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] in (f"{path}:1:1: error: expected a regular .conv file, got a device, pipe or socket",
                      f"convdsl: error: {path}: expected a regular .conv file, got a device, pipe or socket")


def test_check_refuses_a_file_too_large_to_be_a_source(tmp_path, monkeypatch, capsys):
    import convdsl.frontend.parser as parser

    monkeypatch.setattr(parser, "MAX_SOURCE_BYTES", 1000)
    big = tmp_path / "big.conv"
    big.write_text(TINY + "#" * 1000)
    assert main(["check", str(big)]) == 2
    assert capsys.readouterr().err.startswith(f"{big}:1:1: error: expected a .conv file of at most")


def test_tune_collect_without_cases_names_the_flag(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text('{"results": []}')
    assert main(["tune", "collect", str(results), "--target", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["convdsl: error: tune collect: --cases is required: the cases.json that `convdsl tune candidates` "
                   "wrote (e.g. --cases tune-build/cases.json)"]


DILATED = """conv d {
  dims = 1; batch = 1; in_channels = 1; out_channels = 1
  input = [8]; filter = [3]; dilation = 1000000000; padding = [[1000000000, 1000000000]]
}
kernel f = forward(d)
kernel di = grad_input(d)
"""


def test_check_warns_of_a_padded_operand_of_gigabytes(tmp_path, capsys):
    src = tmp_path / "dilated.conv"
    src.write_text(DILATED)
    assert main(["check", str(src)]) == 0  # valid: warned of, not refused
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("2 kernels, no errors")
    warnings = captured.err.strip().splitlines()
    assert warnings == [
        f"{src}: warning: kernel f: its zero-padded x spans 2000000008 positions per channel (input [8] with padding "
        "[1000000000]/[1000000000], dilation [1000000000]): about 8 GB at batch 1; the compiled kernel may need that "
        "much workspace",
        f"{src}: warning: kernel di: its zero-padded dy spans 3000000008 positions per channel (input [8], padding "
        "[1000000000] and the dilated filter's reach, dilation [1000000000]): about 12 GB at batch 1; the compiled "
        "kernel may need that much workspace"]


def test_check_of_ordinary_padding_warns_of_nothing(tmp_path, capsys):
    src = tmp_path / "tiny.conv"
    # 1.6 GB of padded dy at this batch, but mostly data: a size the user chose, not a padding mistake
    src.write_text(TINY.replace("batch = 1", "batch = 4000000"))
    assert main(["check", str(src)]) == 0
    assert capsys.readouterr().err == ""


def test_a_kernel_that_fails_to_run_is_one_line_naming_the_padded_cost(tmp_path, monkeypatch, capsys):
    from convdsl.module import Kernel

    src = tmp_path / "dilated.conv"
    src.write_text(DILATED)

    def exhausted(self, *args):  # what IREE raises when the workspace cannot be allocated
        raise RuntimeError("Error invoking function: c/runtime/src/iree/hal/allocator.c:1: RESOURCE_EXHAUSTED; "
                           "allocation failed\n  more lines")

    monkeypatch.setattr(Kernel, "__call__", exhausted)
    assert main(["run", str(src), "--target", "cpu", "--kernel", "f", "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("convdsl: error: kernel f: the kernel failed on cpu:")
    assert "RESOURCE_EXHAUSTED; allocation failed; its zero-padded x spans 2000000008 positions" in err[0]
    assert "--batch" not in err[0]  # the batch is 1: the padding is the cost



def test_a_seed_of_thousands_of_digits_is_one_line(capsys):
    with pytest.raises(SystemExit) as bad:
        main(["run", str(EXAMPLES[0]), "--target", "cpu", "--seed", "1" + "0" * 5000])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad.value.code == 2
    assert err[-1] == "convdsl run: error: argument --seed: expected a number of at most 40 digits, got one of 5001 digits"


def test_inputs_too_large_at_batch_one_do_not_blame_the_batch(tmp_path, capsys):
    src = tmp_path / "wide.conv"
    src.write_text("conv c { dims = 1; batch = 1; in_channels = 1048576; out_channels = 1; input = [1048576]; "
                   "filter = [1] }\nkernel f = forward(c)\n")
    assert main(["run", str(src), "--target", "cpu", "--kernel", "f"]) in (2,)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("convdsl: error: kernel f: its random inputs need about") and "--batch" not in err[-1]


def test_compile_writes_a_bundle_of_stream_kernels(tmp_path, monkeypatch, capsys):
    pytest.importorskip("triton")
    from convdsl import stream

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.conv").write_text(TINY + "kernel fused = forward(c) { epilogue = bias }\n")
    assert main(["compile", "tiny.conv", "--target", "cuda", "--arch", "sm_80", "--artifact", "bundle"]) == 0
    out = capsys.readouterr().out
    assert "wrote tiny.convk (1 stream kernels, target cuda:sm_80)" in out and "no stream kernel for fused" in out
    (kernel,) = stream.load_bundle(tmp_path / "tiny.convk")
    assert kernel.problem.name == "dgrad" and kernel.launches[0].binary.data
    assert main(["compile", "tiny.conv", "--artifact", "bundle", "-o", "tiny.conv"]) == 2
    assert "the bundle would overwrite the source" in capsys.readouterr().err


def test_explain_on_the_cpu_says_its_kernels_have_no_knobs(capsys):
    from convdsl.passes.plan import ON_CPU

    assert main(["explain", str(EXAMPLES[0].parent / "ck17_conv2d_bwd_data.conv"), "--target", "cpu",
                 "--stage", "plan"]) == 0
    lines = [x.strip() for x in capsys.readouterr().out.splitlines() if x.strip().startswith("knobs:")]
    assert lines and all(x == f"knobs: {ON_CPU}" for x in lines), lines
