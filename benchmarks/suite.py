"""The benchmark suite (benchmarks/suite.toml) as ConvProblems, with FLOPs and the minimal bytes.

Field conventions follow the header of suite.toml: channel counts are per group; spatial lists are
outermost first; `stride`, `dilation` are one number or one per spatial dim; `padding` is one number,
one per dim, or [low per dim] and [high per dim] (a list of two lists); weight_layout defaults to GKYXC;
`compute` names the operand compute types [A, B] (fp8 = e4m3, bf8 = e5m2).  Values are normalised by
convdsl.options, as the .conv parser's and the Python API's are.

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

from convdsl import options
from convdsl.problem import ConvProblem, ProblemError

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


def case_to_problem(case: dict) -> ConvProblem:
    unknown = set(case) - _KNOWN_KEYS
    if unknown:
        raise ProblemError(f"case {case.get('name')!r}: unknown field(s) {', '.join(sorted(unknown))}")
    dims = options.dims(case["dims"])
    filter = options.expand(case["filter"], dims, "filter")
    stride = options.expand(case.get("stride", 1), dims, "stride")
    dilation = options.expand(case.get("dilation", 1), dims, "dilation")
    # padding: the suite writes [[low per dim], [high per dim]] where the language writes [lo, hi] per dim
    lo, hi = options.padding(case.get("padding", 0), dims, form="sides", filter=filter, dilation=dilation,
                             stride=stride)
    out_dtype = case.get("out_dtype")
    return ConvProblem(
        op=case["op"],
        dims=dims,
        groups=case.get("groups", 1),
        batch=case["batch"],
        in_channels=case["in_channels"],
        out_channels=case["out_channels"],
        input=options.expand(case["input"], dims, "input"),
        filter=filter,
        stride=stride,
        dilation=dilation,
        pad_lo=lo,
        pad_hi=hi,
        layout=options.layout(case.get("layout", "NHWGC"), dims=dims)[0],
        weight_layout=options.weight_layout(case.get("weight_layout", "GKYXC"), dims=dims)[0],
        dtype=options.dtype(case.get("dtype", "f32")),
        out_dtype=options.dtype(out_dtype, "out_dtype") if out_dtype is not None else None,
        compute=options.compute(case.get("compute")),  # "bf16x3", "tf32" or [A, B]
        split_k=options.split_k(case.get("split_k")),
        name=case["name"],
    )


def forward_of(p: ConvProblem) -> ConvProblem:
    """The forward convolution of p's shape, named `<name>_fwd` (the gradients of one layer share it)."""
    return p.with_(op="forward", name=f"{p.name}_fwd", split_k=None, out_dtype=None)


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
