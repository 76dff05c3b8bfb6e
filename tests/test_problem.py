"""ConvProblem refuses what no compiled module can hold, however it is built (not only from .conv text)."""
from __future__ import annotations

import pytest

import convdsl
from convdsl.problem import MAX_SIZE, ConvProblem, ProblemError


def make(op: str = "forward", **fields) -> ConvProblem:
    base = dict(dims=2, groups=1, batch=1, in_channels=2, out_channels=2, input=(4, 4), filter=(3, 3),
                stride=(1, 1), dilation=(1, 1), pad_lo=(1, 1), pad_hi=(1, 1))
    base.update(fields)
    return ConvProblem(op=op, **base)


@pytest.mark.parametrize("name", ["__init", "__deinit", "__x"])
def test_a_name_the_module_reserves_is_refused(name: str) -> None:
    with pytest.raises(ProblemError, match=rf"^name: expected a kernel name that does not start with '__' "
                                           rf"\(the compiled module reserves such names, e\.g\. __init\), "
                                           rf"got '{name}'$"):
        make(name=name)


def test_compile_refuses_a_reserved_name_given_as_a_problem() -> None:
    # a ConvProblem list skips the parser: the refusal must come from ConvProblem itself
    with pytest.raises(ProblemError, match="^name: "):
        convdsl.compile([make(name="__init")], target="cpu")


def test_names_outside_the_reserved_prefix_are_kept() -> None:
    assert make(name="_init").name == "_init"
    assert make(name="init__").name == "init__"
    assert make(name="").name == ""  # record keys blank the name


def test_a_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ProblemError, match=r"^name: expected a string, got 3$"):
        make(name=3)


def test_split_k_above_2_31_minus_1_is_refused() -> None:
    assert make("grad_weight", split_k=MAX_SIZE).split_k == 2**31 - 1
    with pytest.raises(ProblemError, match=r"^split_k: expected at most 2147483647 \(2\^31 - 1\), got 2147483648$"):
        make("grad_weight", split_k=2**31)


def test_split_k_true_is_not_an_integer() -> None:
    with pytest.raises(ProblemError, match=r"^split_k: expected a positive integer or auto, got True$"):
        make("grad_weight", split_k=True)
