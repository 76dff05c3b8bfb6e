"""Tuned lowering configurations: knobs over IREE's own GPU configuration, a database, and a heuristic."""
from .knobs import Knobs, apply_knobs, compile_with_knobs

__all__ = ["Knobs", "apply_knobs", "compile_with_knobs"]
