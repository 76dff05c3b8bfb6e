"""The calling conventions of a compiled module, shared by the emitter (passes/lower.py) and the runtimes.

Every kernel is exported three times:
  @<name>(args...) -> result
      allocates its result and its transient buffers on every call (what IREE's own tools call);
  @"<name>$into"(args..., out, workspace) -> result
      destination passing: the result is written into the caller's `out` (IREE's `iree.abi.output`) and
      every transient buffer (split-K partials, zero borders, stride phases) is carved from the caller's
      `workspace` (`iree.abi.transients`), so a call allocates nothing, as cuDNN takes dX/dW and a
      workspace from its caller.  The workspace size is the function's reflection attribute
      `iree.abi.transients.size.constant` when static, else what `<name>$into_transients_size(args..., out,
      workspace)` returns.
  @"<name>$into$async"(args..., out, workspace, wait_fence, signal_fence) -> result
      the same with IREE's "coarse-fences" invocation model: it returns once the work is queued after
      wait_fence and signals signal_fence when it is done, so that the caller chooses how to wait.
      convdsl's runtime (backends/into_call.py) polls the fence's semaphore for a short while before it
      blocks: a blocking wait wakes the caller through IREE's completion thread, later
      (docs/decisions.md#poll-the-fence).
"""
from __future__ import annotations

INTO_SUFFIX = "$into"
ASYNC_SUFFIX = "$async"
TRANSIENTS_SIZE_CONSTANT = "iree.abi.transients.size.constant"
TRANSIENTS_SIZE_FUNCTION = "iree.abi.transients.size"

# The function name inside every module the functional API and the PyTorch operators compile: one fixed name
# lets every call with the same problem share one cache entry.
KERNEL_NAME = "kernel"
