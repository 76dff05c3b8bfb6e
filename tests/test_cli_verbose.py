"""`convdsl -v`: the convdsl loggers' DEBUG lines on stderr, only when asked."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

import convdsl.cli as cli
from convdsl.cli import main

EXAMPLE = Path(__file__).parent.parent / "examples" / "resnext.conv"
NOTE = "NOTE: hal.executable k substituted with MLIR source at /tmp/x.mlir"


@pytest.fixture
def noting(monkeypatch) -> None:
    """`check` logs a DEBUG line on convdsl.iree_config (where the substitution notes go) as it reads the file."""
    real = cli.parse_file

    def parse_file(path, *args, **kwargs):
        logging.getLogger("convdsl.iree_config").debug("%s", NOTE)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cli, "parse_file", parse_file)


@pytest.mark.parametrize("flag", ["-v", "--verbose"])
def test_verbose_shows_debug_lines(flag, noting, capsys) -> None:
    assert main([flag, "check", str(EXAMPLE)]) == 0
    err = capsys.readouterr().err
    assert f"convdsl.iree_config: DEBUG: {NOTE}" in err.splitlines()


def test_without_verbose_debug_lines_stay_hidden(noting, capsys) -> None:
    assert main(["check", str(EXAMPLE)]) == 0
    assert NOTE not in capsys.readouterr().err


def test_verbose_leaves_the_logger_as_it_found_it(noting, capsys) -> None:
    logger = logging.getLogger("convdsl")
    level, handlers = logger.level, list(logger.handlers)
    assert main(["-v", "check", str(EXAMPLE)]) == 0
    assert (logger.level, logger.handlers) == (level, handlers)
