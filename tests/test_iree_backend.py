"""backends/iree.compile_mlir's retries, with iree-compile stubbed (nothing is compiled)."""
from __future__ import annotations

import subprocess

import iree.compiler as ireec
import pytest
from iree.compiler.tools import CompilerToolError

from convdsl.backends.iree import (FUSE_PAD_FLAG, SUBSTITUTE_CONFIGURATIONS_FLAG, CompileError, compile_mlir,
                                   retries_unfused)
from convdsl.module import resolve_target

# the text compile_mlir looks for: a zero border to fuse (the stub never parses it)
MLIR = "module {\n  // tensor.pad\n}\n"


@pytest.fixture
def failing(monkeypatch, tmp_path) -> list[list[str]]:
    """Every iree-compile fails; the flags of each call are recorded."""
    monkeypatch.setenv("CONVDSL_FAILURE_DIR", str(tmp_path))
    seen: list[list[str]] = []

    def compile_str(mlir: str, extra_args: list[str]) -> bytes:
        seen.append(list(extra_args))
        raise CompilerToolError(subprocess.CompletedProcess(["iree-compile"], 1, b"", b"error: failed"))

    monkeypatch.setattr(ireec, "compile_str", compile_str)
    return seen


def test_a_failed_compile_is_retried_unfused(failing, caplog) -> None:
    with caplog.at_level("WARNING", logger="convdsl"), pytest.raises(CompileError):
        compile_mlir(MLIR, resolve_target("cpu"))
    assert [FUSE_PAD_FLAG in flags for flags in failing] == [True, False]
    assert "compiled again with them as copies of their own" in caplog.text


def test_a_failed_compile_with_substituted_configurations_is_not_retried_unfused(failing, caplog) -> None:
    substitute = f"{SUBSTITUTE_CONFIGURATIONS_FLAG}=/tmp/edited"
    with caplog.at_level("WARNING", logger="convdsl"), pytest.raises(CompileError) as err:
        compile_mlir(MLIR, resolve_target("cpu"), [substitute])
    assert len(failing) == 1 and FUSE_PAD_FLAG in failing[0] and substitute in failing[0]
    assert "compiled again" not in caplog.text
    assert substitute in str(err.value)  # the reproducing command keeps it


def test_retries_unfused() -> None:
    assert retries_unfused([FUSE_PAD_FLAG])
    assert not retries_unfused([])
    assert not retries_unfused([FUSE_PAD_FLAG, f"{SUBSTITUTE_CONFIGURATIONS_FLAG}=/x"])
