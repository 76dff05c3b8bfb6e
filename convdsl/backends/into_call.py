"""Calls of a kernel's destination-passing twin (convdsl/abi.py) with a result buffer and a workspace that
are allocated once and reused, through iree.runtime only (no compiler: this runs on GPU machines too)."""
from __future__ import annotations

import math
from typing import Sequence

from ..abi import INTO_SUFFIX, TRANSIENTS_SIZE_CONSTANT, TRANSIENTS_SIZE_FUNCTION

MIN_WORKSPACE_BYTES = 256  # a kernel without transients still takes a (tiny) buffer


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
    workspace is allocated here, once.
    """

    def __init__(self, context, vm_module, name: str, args: Sequence, out) -> None:
        import iree.runtime as rt

        self._rt = rt
        self.context = context
        self.vm_module = vm_module
        self.name = name + INTO_SUFFIX
        self.function = vm_module.lookup_function(self.name)
        if self.function is None:
            raise LookupError(f"the module has no function {self.name!r} (compiled before convdsl had it)")
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
        self.context.vm_context.invoke(size_function, self.pack(args), results)
        return int(results.get_variant(0))

    def pack(self, args: Sequence, out=None):
        """The argument list of one call (pack once, call many times); `out`: another result view of the
        same shape to write into instead of self.out."""
        packed = self._rt.VmVariantList(len(args) + 2)
        for view in args:
            packed.push_ref(view)
        packed.push_ref(self.out if out is None else out)
        packed.push_ref(self.workspace)
        return packed

    def call(self, packed) -> None:
        """One synchronous call: returns after the device has written `out`."""
        self.context.vm_context.invoke(self.function, packed, self._rt.VmVariantList(1))
