"""Passes that turn convolution kernels into linalg implicit-GEMM IR: see pipeline.PIPELINE for the order."""
from .pipeline import PIPELINE, STAGE_NAMES, LoweringError, Stage, lower_to_mlir, run_pipeline

__all__ = ["PIPELINE", "STAGE_NAMES", "LoweringError", "Stage", "lower_to_mlir", "run_pipeline"]
