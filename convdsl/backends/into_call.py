"""Calls of a kernel's destination-passing twin (convdsl/abi.py) with a result buffer and a workspace that
are allocated once and reused, through iree.runtime only (no compiler: this runs on GPU machines too)."""
from __future__ import annotations

import math
import time
from typing import Sequence

from ..abi import ASYNC_SUFFIX, INTO_SUFFIX, TRANSIENTS_SIZE_CONSTANT, TRANSIENTS_SIZE_FUNCTION

MIN_WORKSPACE_BYTES = 256  # a kernel without transients still takes a (tiny) buffer
# How long a call polls its fence's semaphore before it blocks on the fence.  Blocking wakes the caller
# through IREE's completion thread, microseconds after the work is done (docs/decisions.md#poll-the-fence);
# polling costs a CPU core meanwhile.  Longer calls block: the wake-up is small beside them.
SPIN_SECONDS = 0.002
# IREE's drivers whose work runs on the host's own cores (the local-task device's workers): their calls block, for
# a polling caller would take a core from the kernel (docs/decisions.md#kept-workspace)
HOST_DRIVERS = ("local-task", "local-sync")


def default_wait(driver: str) -> str:
    """How a call on `driver` waits for its work: "block" where the host's cores run it, else "poll"."""
    return "block" if driver in HOST_DRIVERS else "poll"


def allocate_result(device, shape: Sequence[int], element_type, bytes_per_element: int):
    """A device-local buffer view of the result's shape, for IntoCall to write into."""
    import iree.runtime as rt

    size = max(1, math.prod(shape)) * bytes_per_element
    return rt.HalBufferView(_allocate(device.allocator, size), list(shape), element_type)


def _allocate(allocator, size: int):
    import iree.runtime as rt

    return allocator.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                     allowed_usage=rt.BufferUsage.DEFAULT, allocation_size=size)


class IntoCall:
    """`call(pack(args))` runs `<name>$into(args..., out, workspace)`; `out` holds the result afterwards.

    context: the iree.runtime SystemContext the module was added to; vm_module: that module (an
    rt.VmModule); args: the argument buffer views, whose shapes fix the result's; out: a buffer view of the
    result's shape to write into (allocate_result, or a framework tensor imported through DLPack).  The
    workspace is allocated here, once.  wait: "poll" calls the `$into$async` twin and polls its signal
    fence (SPIN_SECONDS, then blocks), "block" the synchronous `$into`, which blocks (so do modules built
    before convdsl exported the twin).
    """

    def __init__(self, context, vm_module, name: str, args: Sequence, out, wait: str = "poll") -> None:
        import iree.runtime as rt

        if wait not in ("poll", "block"):
            raise ValueError(f"wait: expected 'poll' or 'block', got {wait!r}")
        self._rt = rt
        self.context = context
        self.vm_module = vm_module
        self.name = name + INTO_SUFFIX
        self.function = vm_module.lookup_function(self.name)
        if self.function is None:
            raise LookupError(f"the module has no function {self.name!r} (compiled before convdsl had it)")
        self.async_function = vm_module.lookup_function(self.name + ASYNC_SUFFIX) if wait == "poll" else None
        if self.async_function is not None:
            # one timeline per call site: call i waits for value i - 1 (reached: calls return when done)
            # and signals value i
            self.semaphore = context.config.device.create_semaphore(0)
            self.calls = 0
        self.out = out
        allocator = context.config.device.allocator
        self.workspace = _allocate(allocator, MIN_WORKSPACE_BYTES)  # a placeholder while the size is asked
        self.workspace_bytes = self._workspace_size(list(args))
        if self.workspace_bytes > MIN_WORKSPACE_BYTES:
            self.workspace = _allocate(allocator, self.workspace_bytes)

    def _workspace_size(self, args: list) -> int:
        reflection = self.function.reflection
        if TRANSIENTS_SIZE_CONSTANT in reflection:
            return int(reflection[TRANSIENTS_SIZE_CONSTANT])
        size_function = self.vm_module.lookup_function(reflection[TRANSIENTS_SIZE_FUNCTION])
        results = self._rt.VmVariantList(1)
        self.context.vm_context.invoke(size_function, self._list([*args, self.out, self.workspace]), results)
        return int(results.get_variant(0))

    def _list(self, refs: Sequence):
        packed = self._rt.VmVariantList(len(refs) + 2)
        for ref in refs:
            packed.push_ref(ref)
        return packed

    def pack(self, args: Sequence, out=None):
        """The arguments of one call (pack once, call many times); `out`: another result view of the same
        shape to write into instead of self.out."""
        refs = [*args, self.out if out is None else out, self.workspace]
        return refs if self.async_function is not None else self._list(refs)

    def submit(self, packed):
        """Queue one call of the fenced twin after this call site's previous one, without waiting for it;
        returns its signal fence (`fence.wait()` blocks until `out` is written; so does polling until
        `self.semaphore.query() >= self.calls`).  Needs the twin: wait="poll" and a module that has it."""
        if self.async_function is None:
            raise ValueError(f"submit: {self.name!r} is called through the synchronous twin (wait='block', "
                             "or a module without the fenced one)")
        fence = self._rt.HalFence.create_at
        arguments = self._list(packed)
        arguments.push_ref(fence(self.semaphore, self.calls))
        signal = fence(self.semaphore, self.calls + 1)
        arguments.push_ref(signal)
        self.context.vm_context.invoke(self.async_function, arguments, self._rt.VmVariantList(1))
        self.calls += 1
        return signal

    def call(self, packed) -> None:
        """One call: returns after the device has written `out`."""
        if self.async_function is None:
            self.context.vm_context.invoke(self.function, packed, self._rt.VmVariantList(1))
            return
        signal = self.submit(packed)
        done = self.calls
        deadline = time.perf_counter() + SPIN_SECONDS
        while self.semaphore.query() < done:  # raises if the work failed
            if time.perf_counter() > deadline:
                signal.wait()
                break
