"""Passes that turn convolution kernels into linalg implicit-GEMM IR (see pipeline.PIPELINE for the order); the
plan of each kernel (plan.py) gathers convdsl/policy's decisions, and explain.py renders it.

The pipeline builds IR with IREE's compiler; the planner does not, and a machine that only runs compiled bundles
(convdsl.torch with stream kernels) has no IREE compiler: importing `convdsl.passes.plan` must not load it, so
the pipeline's names load on first use."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PIPELINE", "STAGE_NAMES", "LoweringError", "Stage", "lower_to_mlir", "run_pipeline"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".pipeline", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
