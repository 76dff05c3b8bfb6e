"""A kernel's knobs, looked up once for every path that builds it: the compile driver (compiler.tuned_knobs) and
the stream path (stream.stream_plan) ask `lookup`, so the IREE module and the stream kernel of a problem are
planned with the same knobs."""
from __future__ import annotations

from .. import policy
from ..backends.iree import iree_version
from ..problem import ConvProblem
from ..targets import Target
from . import db
from .knobs import Knobs

ON_CPU = "none on the CPU (IREE's own configuration)"
BY_RULES = "rules (convdsl/policy): no tuning database entry for this problem and target"


def lookup(p: ConvProblem, target: Target) -> tuple[Knobs, str]:
    """`p`'s knobs on `target` and where they come from (`convdsl explain` prints it): the tuning database's
    entry (db.lookup: this IREE's, else the newest other version's), else policy's rules; none on the CPU."""
    if target.backend == "cpu":
        return Knobs(), ON_CPU
    version = iree_version()  # "not installed" (a machine that only runs kernels): the newest entry serves
    tuned = db.lookup(p, target, version)
    if tuned is None and p.op == "grad_weight" and p.out_dtype is not None:
        # grad_weight's result dtype is the sum's store only: the GEMM tuned for the arguments' dtype serves
        tuned = db.lookup(p.with_(out_dtype=None), target, version)
    if tuned is not None:
        return tuned.knobs, tuned.source
    return policy.knobs_for(p, target, None), BY_RULES
