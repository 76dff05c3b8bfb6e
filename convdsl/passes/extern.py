"""Emission of Triton-compiled GEMM cores as IREE external dispatches (CUDA targets).

Each launch becomes a `hal.executable.source` holding the kernel binary (cubin or PTX, embedded as
data) and one `hal.executable.export` that gives IREE what it cannot read from the binary: the
bindings and constants (the kernel's parameters, in order), the grid (static: every size is a
compile-time constant), the block size and the dynamic shared memory.  The kernel function then calls
it with `flow.dispatch`, so IREE still allocates, schedules and exposes the kernel through its ABI,
and fuses convdsl's linalg around it (the deterministic split-K sum, the epilogue, the output cast).

IREE's CUDA HAL passes a kernel its bindings, then its constants, one 64-bit slot each; Triton's
kernels end with two scratch pointers (never read: kernels/compile.compile_launch checks that they have no
scratch), filled here with two zero constants so that the parameter counts match.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, flow, hal

from ..kernels.launch import TRITON_TRAILING_PARAMS, Binary, Launch
from ..problem import ConvProblem
from .ir import PARALLEL, REDUCTION, Space, element_type, generic, tensor_type, weight_axes, zeros

# The generic CUDA executable target: IREE applies an object to every variant whose target it is a
# generic form of (same backend and format), whatever chip the module is compiled for.
_CUDA_GENERIC_TARGET = '#hal.executable.target<"cuda", "cuda-nvptx-fb">'


def executable_symbol(launch: Launch) -> str:
    return f"{launch.name}_triton"


def emit_executable(launch: Launch, binary: Binary) -> None:
    """A `hal.executable.source` at the current insertion point (module level) for one launch."""
    data = np.frombuffer(binary.data, dtype=np.int8)
    blob = ir.DenseElementsAttr.get(data, type=ir.VectorType.get([data.size], ir.IntegerType.get_signless(8)))
    # the object carries its bytes (the module is self-contained); `path` only names it in dumps.
    # #hal.executable.object has no Python builder: its attribute is parsed, with the data printed in
    object_attr = ir.Attribute.parse(
        f'#hal.executable.object<{{path = "{binary.name}.{binary.kind}", data = {blob}}}>')
    objects = ir.Attribute.parse(f"#hal.executable.objects<{{{_CUDA_GENERIC_TARGET} = [{object_attr}]}}>")
    source = hal.ExecutableSourceOp(executable_symbol(launch), sym_visibility="private", objects=objects)
    block = source.body.blocks.append()
    with ir.InsertionPoint(block):
        index = ir.IndexType.get()
        export = hal.ExecutableExportOp(
            binary.name,
            _layout(len(launch.pointer_types)),
            sym_visibility="public",
            ordinal=ir.IntegerAttr.get(index, 0),
            workgroup_size=ir.ArrayAttr.get([ir.IntegerAttr.get(index, v) for v in (binary.threads, 1, 1)]),
            workgroup_local_memory=ir.IntegerAttr.get(index, binary.shared_bytes),
        )
        count = export.regions[0].blocks.append(ir.Type.parse("!hal.device"))
        with ir.InsertionPoint(count):
            # the grid is static: every size of the problem is a compile-time constant
            hal.ReturnOp([arith.ConstantOp(index, v).result for v in launch.grid])
        hal.ExecutableSourceEndOp()


def _layout(pointers: int) -> ir.Attribute:
    read_only = ", ReadOnly"
    bindings = ", ".join(
        f"#hal.pipeline.binding<storage_buffer{read_only if i < pointers - 1 else ''}>" for i in range(pointers)
    )
    return ir.Attribute.parse(f"#hal.pipeline.layout<constants = {TRITON_TRAILING_PARAMS}, bindings = [{bindings}]>")


def dispatch(launch: Launch, binary: Binary, inputs: list[ir.Value], result_type: ir.Type) -> ir.Value:
    """flow.dispatch of one launch: `inputs` are its read-only bindings, the result its last binding.  The
    result is a fresh tensor written whole by the kernel, so IREE can place it in the caller's buffer."""
    i32 = ir.IntegerType.get_signless(32)
    unused = [arith.ConstantOp(i32, 0).result for _ in range(TRITON_TRAILING_PARAMS)]
    entry = ir.SymbolRefAttr.get([executable_symbol(launch), binary.name])
    op = flow.DispatchOp([result_type], [], ir.ArrayAttr.get([entry]), [*inputs, *unused], [], [])
    return op.result


def grad_input(launch: Launch, binary: Binary, p: ConvProblem, dy: ir.Value, w: ir.Value) -> ir.Value:
    """dX: one dispatch whose programs cover every stride phase (kernels/igemm_launches.grad_input_launch)."""
    result_type = tensor_type(list(p.x_shape), element_type(p.result_dtype))
    return dispatch(launch, binary, [dy, w], result_type)


def forward(launch: Launch, binary: Binary, p: ConvProblem, x: ir.Value, w: ir.Value) -> ir.Value:
    """Y: one dispatch that writes all of it: grad_input's GEMM kernel run as a forward convolution
    (kernels/igemm_launches.forward_launch), or the depthwise direct kernel (forward_direct_launch)."""
    result_type = tensor_type(list(p.y_shape), element_type(p.result_dtype))
    return dispatch(launch, binary, [x, w], result_type)


def grad_weight(launch: Launch, binary: Binary, partials_shape: tuple[int, ...], p: ConvProblem,
                x: ir.Value, dy: ir.Value, epilogue) -> ir.Value:
    """dW = epilogue(sum over s of P[s]): the kernel's f32 partials [S, G, K, taps..., C] summed in chunk
    order by one linalg reduction (deterministic), in the weight's layout, then the epilogue's cast."""
    f32 = ir.F32Type.get()
    parts = partials_shape[0]
    stacked_shape = [parts, p.groups, p.out_channels, *p.filter, p.in_channels]  # the same bytes as partials
    stacked = dispatch(launch, binary, [x, dy], tensor_type(stacked_shape, f32))
    w_axes = weight_axes(p)
    space = Space([(a, PARALLEL) for a in w_axes] + [("s", REDUCTION)])
    taps = [f"t{i}" for i in range(p.dims)]
    in_map = space.access(["s", "g", "k", *taps, "c"], {n: space[n] for n in space.names})
    out_map = space.access(w_axes, {n: space[n] for n in w_axes})
    total = generic(space, [stacked], zeros(list(p.w_shape), f32), [in_map, out_map],
                    lambda v, acc: arith.addf(acc, v))
    return epilogue(total)
