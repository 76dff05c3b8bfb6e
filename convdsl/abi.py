"""The calling conventions of a compiled module, shared by the emitter (passes/lower.py) and the runtimes.

Every kernel is exported twice:
  @<name>(args...) -> result
      allocates its result and its transient buffers on every call (what IREE's own tools call);
  @"<name>$into"(args..., out, workspace) -> result
      destination passing: the result is written into the caller's `out` (IREE's `iree.abi.output`) and
      every transient buffer (split-K partials, zero borders, stride phases) is carved from the caller's
      `workspace` (`iree.abi.transients`), so a call allocates nothing, as cuDNN takes dX/dW and a
      workspace from its caller.  The workspace size is the function's reflection attribute
      `iree.abi.transients.size.constant` when static, else what `<name>$into_transients_size(args..., out,
      workspace)` returns.
"""
from __future__ import annotations

INTO_SUFFIX = "$into"
TRANSIENTS_SIZE_CONSTANT = "iree.abi.transients.size.constant"
TRANSIENTS_SIZE_FUNCTION = "iree.abi.transients.size"
