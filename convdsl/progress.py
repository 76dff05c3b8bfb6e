"""Compile progress: the steps the compile driver reports while it works, for its caller to show (the command
line draws them as one line on a terminal).  Nothing here prints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class CompileStep:
    """One step of compiling a module of `total` kernels.

    kind "kernel": kernel `name`, number `index` (from 1) of `total`, is lowered to IR (on a GPU target with its
    Triton GEMM cores compiled, the slow part there).  kind "backend": `name` (iree-compile) compiles all
    `total` kernels as one module (the slow part on the CPU); `index` is `total`.  A module found in the cache
    reports no steps.
    """

    kind: str
    index: int
    total: int
    name: str


ProgressFn = Callable[[CompileStep], None]
