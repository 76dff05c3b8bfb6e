"""Passes that turn convolution kernels into linalg implicit-GEMM IR (see pipeline.PIPELINE for the order); the
plan of each kernel (plan.py) gathers convdsl/policy's decisions, and explain.py renders it."""
from .pipeline import PIPELINE, STAGE_NAMES, LoweringError, Stage, lower_to_mlir, run_pipeline

__all__ = ["PIPELINE", "STAGE_NAMES", "LoweringError", "Stage", "lower_to_mlir", "run_pipeline"]
