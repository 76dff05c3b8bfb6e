"""compiler.load_problems: a path names what is wrong with it."""
from __future__ import annotations

import os

import pytest

from convdsl.compiler import load_problems
from convdsl.frontend import ConvSyntaxError


def test_a_pipe_is_not_a_regular_file(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would wait forever for a writer
    with pytest.raises(ConvSyntaxError) as err:
        load_problems(str(fifo))
    assert str(err.value).splitlines()[0] == \
        f"{fifo}:1:1: error: expected a regular .conv file, got a device, pipe or socket"


def test_a_device_is_not_a_regular_file() -> None:
    with pytest.raises(ConvSyntaxError, match="^/dev/null:1:1: error: expected a regular .conv file, got a device"):
        load_problems("/dev/null")


def test_a_missing_path_is_still_no_such_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="No such file"):
        load_problems(str(tmp_path / "missing"))
