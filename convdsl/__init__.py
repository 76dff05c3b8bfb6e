"""convdsl: a compiler for convolution gradients (backward data, backward weight, transposed, forward)."""
__version__ = "0.1.0"

from .problem import ConvProblem, Epilogue, ProblemError  # noqa: E402
from .compiler import CompiledModule, compile  # noqa: E402

__all__ = ["ConvProblem", "Epilogue", "ProblemError", "CompiledModule", "compile", "__version__"]
