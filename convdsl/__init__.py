"""convdsl: a compiler for convolution gradients (backward data, backward weight, transposed, forward).

The package imports lazily: `convdsl.reference` and `convdsl.problem` need only NumPy, so a GPU
machine with just `iree-runtime` can check artifacts; the compiler is loaded on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from .problem import ConvProblem, Epilogue, ProblemError  # noqa: E402

_LAZY = {
    "compile": "compiler",
    "CompiledModule": "module",
    # the functional JIT API (convdsl/api.py): compile on first use, cached in memory and on disk
    "conv": "api",
    "conv_transpose": "api",
    "grad_input": "api",
    "grad_weight": "api",
    "clear_memory_cache": "api",
    # NumPy arrays aligned for the CPU's zero-copy calls (convdsl.interop.HOST_ALIGNMENT bytes)
    "empty": "interop",
}

__all__ = ["ConvProblem", "Epilogue", "ProblemError", "__version__", *_LAZY]


# submodules loaded on first access: convdsl.interop (DLPack / PyTorch tensors without copies)
_LAZY_MODULES = ("interop",)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        # kept as the package's attribute: later lookups (`convdsl.grad_input(...)` on every call) skip this import
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'convdsl' has no attribute {name!r}")
