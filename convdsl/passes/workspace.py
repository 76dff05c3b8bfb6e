"""A module's plain functions with their transient storage kept in the module (docs/decisions.md#module-workspace).

A kernel's plain function (`@<name>`, convdsl/abi.py) allocates its result and its transient buffers (split-K
partials, zero borders, stride phases) on every call.  Here its transients come instead from one buffer the module
allocates once, when it is loaded:

    util.global private @"<name>$workspace" : !hal.buffer
    util.initializer {                                   // at load: `bytes` of device memory
      %raw = tensor.empty() : tensor<bytes x i8>
      %buffer = hal.tensor.export %raw : tensor<bytes x i8> -> !hal.buffer
      util.global.store %buffer, @"<name>$workspace"
    }
    func.func @<name>(...) {
      ...
      %storage = util.global.load immutable @"<name>$workspace" : !hal.buffer
      %kept = hal.tensor.transients %result : tensor<...> from %storage : !hal.buffer
      return %kept
    }

`hal.tensor.transients` is the op the `$into` twin's `iree.abi.transients` argument becomes: iree-compile packs
the function's transient allocations into the given storage.  `bytes` is what that twin asks its caller for
(backends/iree.transient_sizes): the two functions compute the same thing.  Like a cuDNN handle's workspace, the
buffer serves one call at a time: IREE's contexts are externally synchronised unless made concurrent.
"""
from __future__ import annotations

from typing import Mapping

from iree.compiler import ir
from iree.compiler.dialects import func, hal, tensor, util

WORKSPACE_SUFFIX = "$workspace"


def keep_workspaces(module: ir.Module, workspace_bytes: Mapping[str, int]) -> None:
    """Give each plain function named in `workspace_bytes` a module-held transient buffer of that many bytes."""
    with module.context, ir.Location.unknown():
        buffer_type = ir.Type.parse("!hal.buffer")
        functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                     if isinstance(op.opview, func.FuncOp)}
        for name, size in workspace_bytes.items():
            symbol = name + WORKSPACE_SUFFIX
            with ir.InsertionPoint(functions[name]):
                util.GlobalOp(symbol, ir.TypeAttr.get(buffer_type), sym_visibility="private")
                initializer = util.InitializerOp(ir.TypeAttr.get(ir.FunctionType.get([], [])))
                with ir.InsertionPoint(initializer.body.blocks.append()):
                    raw = tensor.EmptyOp([size], ir.IntegerType.get_signless(8)).result
                    exported = hal.TensorExportOp(buffer_type, raw, ir.TypeAttr.get(raw.type), []).result
                    util.GlobalStoreOp(exported, symbol)
                    util.ReturnOp([])
            entry = functions[name].regions[0].blocks[0]
            returned = list(entry.operations)[-1]
            with ir.InsertionPoint(returned):
                storage = util.GlobalLoadOp(buffer_type, symbol, is_immutable=True).result
                kept = hal.TensorTransientsOp(returned.operands[0], [], storage).result
            returned.operands[0] = kept
