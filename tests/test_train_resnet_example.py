"""examples/train_resnet.py refuses what cannot work before it builds a model or compiles anything: one line on
stderr and exit status 2 (argparse's), never a traceback after minutes of work."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

PATH = Path(__file__).resolve().parents[1] / "examples" / "train_resnet.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_resnet_example_cli", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(example, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        example.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("flag, what", [("--check-gradients", "compares convdsl's gradients with cuDNN's"),
                                        ("--profile", "lists the GPU kernels")])
def test_gpu_only_modes_without_cuda_are_refused(flag, what, example, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(example, "check_gradients", lambda args: pytest.fail("refused before running"))
    monkeypatch.setattr(example, "train", lambda args: pytest.fail("refused before running"))
    last = _refused(example, [flag], capsys)
    assert last.endswith(f"error: {flag}: needs a CUDA GPU (it {what}), but no CUDA device is available here")


def test_check_gradients_with_cpu_flag_is_refused(example, monkeypatch, capsys):
    monkeypatch.setattr(example, "check_gradients", lambda args: pytest.fail("refused before running"))
    last = _refused(example, ["--check-gradients", "--cpu"], capsys)
    assert last.endswith("but --cpu was given")


def test_bundle_out_folder_is_made_before_compiling(example, tmp_path, monkeypatch):
    target = tmp_path / "build" / "deeper" / "x.convk"
    seen = []
    # build_bundle compiles for minutes: the folder must exist by the time it starts
    monkeypatch.setattr(example, "build_bundle", lambda args: seen.append(args.bundle_out.parent.is_dir()) or 0)
    assert example.main(["--bundle-out", str(target)]) == 0
    assert seen == [True]


def test_bundle_out_that_cannot_be_written_is_refused_before_compiling(example, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(example, "build_bundle", lambda args: pytest.fail("refused before compiling"))
    assert _refused(example, ["--bundle-out", str(tmp_path)], capsys).endswith("is a directory, expected a bundle "
                                                                               "file (e.g. resnet50.convk)")
    blocker = tmp_path / "file"
    blocker.write_text("")
    last = _refused(example, ["--bundle-out", str(blocker / "x.convk")], capsys)
    assert f"cannot create its folder {blocker}" in last
