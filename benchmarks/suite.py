"""The benchmark suite (benchmarks/suite.toml) as ConvProblems, with FLOPs and the minimal bytes.

Field conventions follow the header of suite.toml: channel counts are per group; spatial lists are
outermost first; `stride`, `dilation` are one number or one per spatial dim; `padding` is one number,
or [low per dim] and [high per dim] (a list of two lists); weight_layout defaults to GKYXC; `compute`
names the operand compute types [A, B] (fp8 = e4m3, bf8 = e5m2).

FLOPs = 2 * G * N * prod(O) * K * C * prod(R) (ConvProblem.flops).  Minimal bytes: each input read
once and the output written once, in their storage dtypes.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from convdsl.problem import ConvProblem, ProblemError, expand

SUITE_PATH = Path(__file__).resolve().parent / "suite.toml"
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_KNOWN_KEYS = {
    "name", "source", "op", "dims", "groups", "batch", "in_channels", "out_channels", "input", "filter",
    "stride", "dilation", "padding", "layout", "weight_layout", "dtype", "out_dtype", "compute", "split_k",
}


@dataclass(frozen=True)
class Case:
    """One suite case: the kernel it describes plus where it comes from."""

    problem: ConvProblem
    source: str

    @property
    def name(self) -> str:
        return self.problem.name

    @property
    def flops(self) -> int:
        return self.problem.flops

    @property
    def bytes(self) -> int:
        return minimal_bytes(self.problem)


def suite_padding(value, dims: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """padding: one number (every side) or [[low per dim], [high per dim]] (the suite's convention)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims, (value,) * dims
    value = list(value)
    if len(value) == 2 and all(isinstance(v, (list, tuple)) for v in value):
        lo, hi = expand(list(value[0]), dims, "padding low"), expand(list(value[1]), dims, "padding high")
        return tuple(lo), tuple(hi)
    if len(value) == dims and all(isinstance(v, int) for v in value):  # one number per dim, both sides
        return tuple(value), tuple(value)
    raise ProblemError(f"padding: expected a number or [[low...], [high...]], got {value!r}")


def case_to_problem(case: dict) -> ConvProblem:
    unknown = set(case) - _KNOWN_KEYS
    if unknown:
        raise ProblemError(f"case {case.get('name')!r}: unknown field(s) {', '.join(sorted(unknown))}")
    dims = case["dims"]
    lo, hi = suite_padding(case.get("padding", 0), dims)
    compute = case.get("compute")
    return ConvProblem(
        op=case["op"],
        dims=dims,
        groups=case.get("groups", 1),
        batch=case["batch"],
        in_channels=case["in_channels"],
        out_channels=case["out_channels"],
        input=expand(case["input"], dims, "input"),
        filter=expand(case["filter"], dims, "filter"),
        stride=expand(case.get("stride", 1), dims, "stride"),
        dilation=expand(case.get("dilation", 1), dims, "dilation"),
        pad_lo=lo,
        pad_hi=hi,
        layout=case.get("layout", "NHWGC"),
        weight_layout=case.get("weight_layout", "GKYXC"),
        dtype=case.get("dtype", "f32"),
        out_dtype=case.get("out_dtype"),
        compute=(compute if isinstance(compute, str) else tuple(compute)) if compute else None,  # "bf16x3" or [A, B]
        split_k=case.get("split_k"),
        name=case["name"],
    )


def minimal_bytes(p: ConvProblem) -> int:
    """Each input read once, the output written once, in their storage dtypes."""
    moved = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(p.arg_shapes, p.arg_dtypes))
    return moved + math.prod(p.result_shape) * DTYPE_BYTES[p.result_dtype]


def load_suite(path: Path | str = SUITE_PATH, names: Optional[Sequence[str]] = None) -> list[Case]:
    data = tomllib.loads(Path(path).read_text())
    cases = [Case(case_to_problem(c), c.get("source", "")) for c in data["case"]]
    seen: set[str] = set()
    for c in cases:
        if c.name in seen:
            raise ProblemError(f"case name {c.name!r} appears twice")
        seen.add(c.name)
    if names:
        by_name = {c.name: c for c in cases}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise KeyError(f"no case named {', '.join(missing)}; cases: {', '.join(by_name)}")
        cases = [by_name[n] for n in names]
    return cases


if __name__ == "__main__":
    for c in load_suite():
        p = c.problem
        print(f"{c.name:24s} {p.op:11s} {p.dtype:4s} {c.flops / 1e9:9.2f} GFLOP {c.bytes / 1e6:9.1f} MB  {p.describe()}")
