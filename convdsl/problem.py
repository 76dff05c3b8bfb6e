"""The one description of a convolution kernel that everything downstream derives from.

A `ConvProblem` is frozen and hashable: the parser builds it, the passes read it, the reference
computes from it and the cache keys hash it.  Index algebra (per spatial dimension, see
docs/algebra.md): input size I, output size O, filter R, stride s, dilation d,
padding lo/hi;  forward reads input i = o*s + y*d - lo, so O = (I + lo + hi - d*(R-1) - 1) // s + 1.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

OPS = ("forward", "grad_input", "grad_weight", "transposed")
LAYOUTS = ("NHWGC", "GNHWC", "NGCHW")
WEIGHT_LAYOUTS = ("GKYXC", "GKCYX")
DTYPES = ("f32", "f16", "bf16")
COMPUTE_TYPES = ("fp8", "bf8")  # fp8 = e4m3, bf8 = e5m2, as in CK
# compute = "bf16x3": f32 operands each split into two bf16 (hi + lo), three bf16 products per f32 product
# on the matrix units (see convdsl/passes/bf16x3.py).  Stored as the pair (BF16X3, BF16X3), so that
# `compute` stays a 2-tuple of names everywhere (spec, cache key, describe).
BF16X3 = "bf16x3"
BF16X3_COMPUTE = (BF16X3, BF16X3)
# compute = "tf32": f32 operands may be rounded to TF32 (10-bit mantissa) for one-pass matrix products, as
# cuDNN and PyTorch allow by default for convolutions (torch.backends.cudnn.allow_tf32).  A permission, like
# PyTorch's: the CUDA kernels take it (Triton's tf32 dot); forms with no TF32 path compute in f32.
TF32 = "tf32"
TF32_COMPUTE = (TF32, TF32)
# the compute modes of f32 kernels, each stored as the pair (mode, mode), and what they do to the operands
F32_COMPUTES = {BF16X3: "splits f32 operands into bf16 pairs", TF32: "rounds f32 operands to TF32"}
EPILOGUES = ("none", "scale", "bilinear")
# Fused steps an epilogue may chain after its scale/bilinear head, applied in order in f32 (forward and transposed
# kernels: the ops whose result is an activation).  bias: + bias[g, k]; affine: * scale[g, k] + shift[g, k]
# (BatchNorm's inference apply); residual: + a tensor of the result's shape and layout; the rest activations, as
# torch.nn computes them (gelu: the exact erf form, gelu_tanh: approximate='tanh').
ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh", "hardswish")
EPILOGUE_STEPS = ("bias", "affine", "residual", *ACTIVATIONS)
# the tensors each step reads, in argument order
STEP_TENSORS = {"bias": ("bias",), "affine": ("scale", "shift"), "residual": ("residual",)}
STEP_OPS = ("forward", "transposed")
# A prologue applies an activation's backward to dY as grad_input / grad_weight read it: dY * act'(saved), saved
# being what torch saves for that backward (relu: its output, the others: their input), in dY's shape and layout.
PROLOGUES = ("none", *(f"{a}_backward" for a in ACTIVATIONS))
PROLOGUE_OPS = ("grad_input", "grad_weight")

DYNAMIC_BATCH_NOMINAL = 2  # the batch `convdsl run` draws inputs at for `batch = ?` (--batch N compiles for N)

_SPATIAL_LETTERS = {1: "W", 2: "HW", 3: "DHW"}
_TAP_LETTERS = {1: "X", 2: "YX", 3: "ZYX"}


# Limits (checked by `convdsl check` too): every size, stride, dilation and padding fits a signed 32-bit
# integer, and every tensor has at most 2^48 elements, so that any offset into it fits a signed 64-bit index
MAX_SIZE = 2**31 - 1
MAX_TENSOR_ELEMENTS = 2**48

# Kernel names become function names of the compiled module; IREE's VM reserves names starting with this
# (__init, __deinit): a module holding one compiles but does not load.
RESERVED_NAME_PREFIX = "__"


class ProblemError(ValueError):
    """A convolution description that is inconsistent; the message names the field."""


def output_size(i: int, r: int, s: int, d: int, lo: int, hi: int) -> int:
    """O = (I + lo + hi - d*(R-1) - 1) // s + 1: the window positions o with o*s + (R-1)*d <= I + lo + hi - 1
    along one dimension (the one formula: ConvProblem.output, algebra and the PyTorch wrappers use it)."""
    return (i + lo + hi - d * (r - 1) - 1) // s + 1


def output_sizes(size: Sequence[int], filt: Sequence[int], stride: Sequence[int], pad_lo: Sequence[int],
                 pad_hi: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
    """output_size per spatial dimension."""
    return tuple(output_size(i, r, s, d, lo, hi)
                 for i, r, s, lo, hi, d in zip(size, filt, stride, pad_lo, pad_hi, dilation))


def step_text(step: str) -> str:
    """A fused step as the language writes it (gelu_tanh is gelu(tanh))."""
    return "gelu(tanh)" if step == "gelu_tanh" else step


@dataclass(frozen=True)
class Epilogue:
    """out = alpha * conv (+ beta * D for bilinear), then each of `steps` in order, in f32 before the output
    cast."""

    kind: str = "none"
    alpha: float = 1.0
    beta: float = 0.0
    steps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in EPILOGUES:
            raise ProblemError(f"epilogue: expected one of {', '.join(EPILOGUES)}, got {self.kind!r}")
        if isinstance(self.steps, list):
            object.__setattr__(self, "steps", tuple(self.steps))  # from a spec's JSON list: one hashable form
        if not isinstance(self.steps, tuple) or any(s not in EPILOGUE_STEPS for s in self.steps):
            raise ProblemError(f"epilogue: expected steps from {', '.join(EPILOGUE_STEPS)}, got {self.steps!r}")
        if len(set(self.steps)) != len(self.steps):
            raise ProblemError(f"epilogue: expected each step once, got {list(self.steps)}")

    @property
    def has_tensor(self) -> bool:
        """Whether the bilinear head's D is an argument."""
        return self.kind == "bilinear"

    @property
    def tensors(self) -> tuple[str, ...]:
        """The argument names of every tensor the epilogue reads, in argument order (d first)."""
        return (("d",) if self.has_tensor else ()) + tuple(t for s in self.steps for t in STEP_TENSORS.get(s, ()))

    @property
    def fused(self) -> bool:
        """Whether steps follow the head (the kernels' own scale epilogue cannot apply them)."""
        return bool(self.steps)

    def __str__(self) -> str:
        if self.kind == "none":
            head = []
        elif self.kind == "scale":
            head = [f"scale({self.alpha:g})"]
        else:
            head = [f"bilinear({self.alpha:g}, {self.beta:g})"]
        return ", ".join(head + [step_text(s) for s in self.steps]) or "none"


@dataclass(frozen=True)
class Prologue:
    """dY * act'(saved), applied to dY as a grad_input or grad_weight kernel reads it; computed in f32 and rounded
    to dY's dtype, as torch's activation backward returns it before the convolution's backward reads it."""

    kind: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in PROLOGUES:
            raise ProblemError(f"prologue: expected one of {', '.join(PROLOGUES)}, got {self.kind!r}")

    @property
    def activation(self) -> Optional[str]:
        return None if self.kind == "none" else self.kind.removesuffix("_backward")

    @property
    def saves_output(self) -> bool:
        """relu's backward masks by its output (as torch's threshold_backward); the others read their input."""
        return self.kind == "relu_backward"

    def __str__(self) -> str:
        return "gelu_backward(tanh)" if self.kind == "gelu_tanh_backward" else self.kind


@dataclass(frozen=True)
class ConvProblem:
    """One kernel: which op of which convolution, with every option that changes its output."""

    op: str
    dims: int
    groups: int
    batch: int
    in_channels: int  # C, per group
    out_channels: int  # K, per group
    input: tuple[int, ...]  # spatial sizes of X, outermost first
    filter: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pad_lo: tuple[int, ...]
    pad_hi: tuple[int, ...]
    layout: str = "NHWGC"
    weight_layout: str = "GKYXC"
    dtype: str = "f32"
    out_dtype: Optional[str] = None  # None: same as dtype
    # (A, B) operand compute types, e.g. ("bf8", "fp8"); or BF16X3_COMPUTE (the string "bf16x3" is accepted
    # and stored as that pair)
    compute: Optional[tuple[str, str]] = None
    split_k: Optional[int] = None  # grad_weight only; None = auto
    epilogue: Epilogue = field(default_factory=Epilogue)
    name: str = "kernel"
    # One module for any batch size (`batch = ?`); `batch` is then the nominal size used for
    # FLOP counts and for the inputs `convdsl run` draws.
    dynamic_batch: bool = False
    prologue: Prologue = field(default_factory=Prologue)

    def __post_init__(self) -> None:
        d = self.dims
        if self.op not in OPS:
            raise ProblemError(f"op: expected one of {', '.join(OPS)}, got {self.op!r}")
        if d not in (1, 2, 3):
            raise ProblemError(f"dims: expected 1, 2 or 3, got {d}")
        for key in ("input", "filter", "stride", "dilation", "pad_lo", "pad_hi"):
            value = getattr(self, key)
            if not isinstance(value, tuple) or len(value) != d:
                raise ProblemError(f"{key}: expected {d} value(s) for dims = {d}, got {value!r}")
            if any((not isinstance(v, int)) or isinstance(v, bool) for v in value):
                raise ProblemError(f"{key}: expected integers, got {value!r}")
        for key in ("groups", "batch", "in_channels", "out_channels"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ProblemError(f"{key}: expected a positive integer, got {v!r}")
        for key in ("input", "filter", "stride", "dilation"):
            if any(v < 1 for v in getattr(self, key)):
                raise ProblemError(f"{key}: expected positive values, got {getattr(self, key)}")
        if any(v < 0 for v in self.pad_lo + self.pad_hi):
            raise ProblemError(f"padding: expected non-negative values, got {self.pad_lo} / {self.pad_hi}")
        for key in ("groups", "batch", "in_channels", "out_channels", "input", "filter", "stride", "dilation",
                    "pad_lo", "pad_hi"):
            value = getattr(self, key)
            if max(value if isinstance(value, tuple) else (value,)) > MAX_SIZE:
                raise ProblemError(f"{key}: expected at most {MAX_SIZE} (2^31 - 1), got {value}")
        if self.layout not in LAYOUTS:
            raise ProblemError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ProblemError(
                f"weight_layout: expected one of {', '.join(WEIGHT_LAYOUTS)}, got {self.weight_layout!r}"
            )
        if self.dtype not in DTYPES:
            raise ProblemError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.out_dtype is not None and self.out_dtype not in DTYPES:
            raise ProblemError(f"out_dtype: expected one of {', '.join(DTYPES)}, got {self.out_dtype!r}")
        if self.compute is not None:
            self._check_compute()
        if self.split_k is not None:
            if self.op != "grad_weight":
                raise ProblemError(f"split_k: only grad_weight kernels split the reduction, not {self.op}")
            if not isinstance(self.split_k, int) or isinstance(self.split_k, bool) or self.split_k < 1:
                raise ProblemError(f"split_k: expected a positive integer or auto, got {self.split_k!r}")
            if self.split_k > MAX_SIZE:
                raise ProblemError(f"split_k: expected at most {MAX_SIZE} (2^31 - 1), got {self.split_k}")
        if self.epilogue.steps and self.op not in STEP_OPS:
            raise ProblemError(f"epilogue: {', '.join(map(step_text, self.epilogue.steps))} apply to the result of "
                               f"{' and '.join(STEP_OPS)} kernels, not of {self.op}")
        if self.prologue.kind != "none" and self.op not in PROLOGUE_OPS:
            raise ProblemError(f"prologue: {self.prologue} applies to dY as {' and '.join(PROLOGUE_OPS)} kernels read "
                               f"it, not to a {self.op} kernel")
        if not isinstance(self.name, str):
            raise ProblemError(f"name: expected a string, got {self.name!r}")
        if self.name.startswith(RESERVED_NAME_PREFIX):
            raise ProblemError(f"name: expected a kernel name that does not start with '{RESERVED_NAME_PREFIX}' "
                               f"(the compiled module reserves such names, e.g. __init), got {self.name!r}")
        for i, o in enumerate(self.output):
            if o < 1:
                raise ProblemError(
                    f"output size {self.output} is empty in spatial dim {i}: input {self.input[i]} + padding "
                    f"{self.pad_lo[i]}+{self.pad_hi[i]} is smaller than the dilated filter "
                    f"{self.dilation[i] * (self.filter[i] - 1) + 1}"
                )
        g, n = self.groups, self.batch
        for name, elements in (("input", n * g * self.in_channels * math.prod(self.input)),
                               ("output gradient", n * g * self.out_channels * math.prod(self.output)),
                               ("weight", g * self.out_channels * self.in_channels * math.prod(self.filter))):
            if elements > MAX_TENSOR_ELEMENTS:
                raise ProblemError(f"the {name} tensor would have {elements} elements; expected at most "
                                   f"{MAX_TENSOR_ELEMENTS} (2^48)")

    def _check_compute(self) -> None:
        compute = self.compute
        if (isinstance(compute, str) and compute in F32_COMPUTES) or (
                isinstance(compute, list) and len(compute) == 2 and compute[0] == compute[1]
                and compute[0] in F32_COMPUTES):
            compute = (compute, compute) if isinstance(compute, str) else tuple(compute)
            object.__setattr__(self, "compute", compute)  # one canonical value: equal problems hash alike
        elif isinstance(compute, list):
            compute = tuple(compute)
            object.__setattr__(self, "compute", compute)
        modes = [c for c in compute if c in F32_COMPUTES] if isinstance(compute, tuple) else []
        if modes:
            if len(compute) != 2 or compute[0] != compute[1]:
                raise ProblemError(
                    f"compute: expected \"{modes[0]}\" for both operands (it treats A and B alike), not mixed with "
                    f"{', '.join(c for c in (*COMPUTE_TYPES, *F32_COMPUTES) if c != modes[0])}, got {list(compute)}"
                )
            if self.dtype != "f32":
                raise ProblemError(
                    f"compute: {modes[0]} {F32_COMPUTES[modes[0]]}: expected dtype f32, got dtype {self.dtype}"
                )
            return
        if not isinstance(compute, tuple) or len(compute) != 2 or any(c not in COMPUTE_TYPES for c in compute):
            raise ProblemError(
                f"compute: expected [A, B] from {', '.join(COMPUTE_TYPES)}, \"{BF16X3}\" or \"{TF32}\", "
                f"got {compute!r}"
            )

    @property
    def fp8_compute(self) -> bool:
        """Operands rounded to 8-bit compute types (compute = [A, B] of fp8/bf8)."""
        return self.compute is not None and self.compute[0] in COMPUTE_TYPES

    @property
    def bf16x3(self) -> bool:
        """f32 computed as three bf16 products per product (compute = "bf16x3")."""
        return self.compute == BF16X3_COMPUTE

    @property
    def tf32(self) -> bool:
        """f32 products allowed in one-pass TF32 (compute = "tf32")."""
        return self.compute == TF32_COMPUTE

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def output(self) -> tuple[int, ...]:
        return output_sizes(self.input, self.filter, self.stride, self.pad_lo, self.pad_hi, self.dilation)

    @property
    def result_dtype(self) -> str:
        return self.out_dtype or self.dtype

    @property
    def depthwise(self) -> bool:
        return self.in_channels == 1 and self.out_channels == 1 and self.groups > 1

    @property
    def flops(self) -> int:
        # 2 * G * N * prod(O) * K * C * prod(R), the same for every op
        return (
            2 * self.groups * self.batch * math.prod(self.output) * self.out_channels * self.in_channels
            * math.prod(self.filter)
        )

    # --- tensor shapes in their layouts ------------------------------------------------------
    def _activation_shape(self, spatial: tuple[int, ...], channels: int) -> tuple[int, ...]:
        n, g = self.batch, self.groups
        if self.layout == "NHWGC":
            return (n, *spatial, g, channels)
        if self.layout == "GNHWC":
            return (g, n, *spatial, channels)
        return (n, g, channels, *spatial)  # NGCHW

    @property
    def x_shape(self) -> tuple[int, ...]:
        return self._activation_shape(self.input, self.in_channels)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return self._activation_shape(self.output, self.out_channels)

    @property
    def w_shape(self) -> tuple[int, ...]:
        g, k, c = self.groups, self.out_channels, self.in_channels
        if self.weight_layout == "GKYXC":
            return (g, k, *self.filter, c)
        return (g, k, c, *self.filter)

    def layout_name(self, tensor: str) -> str:
        """The axis letters of 'x', 'y' or 'w' for this rank, e.g. NDHWGC or GKZYXC."""
        sp, taps = _SPATIAL_LETTERS[self.dims], _TAP_LETTERS[self.dims]
        if tensor == "w":
            return "GK" + taps + "C" if self.weight_layout == "GKYXC" else "GKC" + taps
        ch = "C" if tensor == "x" else "K"
        return {"NHWGC": "N" + sp + "G" + ch, "GNHWC": "GN" + sp + ch, "NGCHW": "NG" + ch + sp}[self.layout]

    # --- kernel signature --------------------------------------------------------------------
    @property
    def arg_names(self) -> tuple[str, ...]:
        names = {
            "forward": ("x", "w"),
            "grad_input": ("dy", "w"),
            "grad_weight": ("x", "dy"),
            "transposed": ("x", "w"),
        }[self.op]
        return names + (("saved",) if self.prologue.kind != "none" else ()) + self.epilogue.tensors

    @property
    def result_name(self) -> str:
        return {"forward": "y", "grad_input": "dx", "grad_weight": "dw", "transposed": "y"}[self.op]

    @property
    def result_shape(self) -> tuple[int, ...]:
        return {"forward": self.y_shape, "grad_input": self.x_shape, "grad_weight": self.w_shape,
                "transposed": self.x_shape}[self.op]

    @property
    def arg_shapes(self) -> tuple[tuple[int, ...], ...]:
        shapes = {
            "forward": (self.x_shape, self.w_shape),
            "grad_input": (self.y_shape, self.w_shape),
            "grad_weight": (self.x_shape, self.y_shape),
            "transposed": (self.y_shape, self.w_shape),
        }[self.op]
        return shapes + tuple(self._extra_arg(n)[0] for n in self.arg_names[2:])

    @property
    def arg_dtypes(self) -> tuple[str, ...]:
        return (self.dtype, self.dtype) + tuple(self._extra_arg(n)[1] for n in self.arg_names[2:])

    @property
    def arg_batched(self) -> tuple[bool, ...]:
        """Per argument, whether it has the batch axis (activations do; the weight and per-channel vectors not)."""
        return tuple(n not in ("w", "bias", "scale", "shift") for n in self.arg_names)

    @property
    def result_channels(self) -> int:
        """Channels per group of the result (K for forward, C for transposed): a per-channel vector's length."""
        return self.in_channels if self.op in ("grad_input", "transposed") else self.out_channels

    def _extra_arg(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of an argument after the two operands: D and the residual in the result's shape and
        dtype, the per-channel vectors (G, channels) in f32 (as the epilogue computes), saved in dY's."""
        if name == "saved":
            return self.y_shape, self.dtype
        if name in ("bias", "scale", "shift"):
            return (self.groups, self.result_channels), "f32"
        return self.result_shape, self.result_dtype

    def batch_axis(self, tensor: str) -> Optional[int]:
        """Position of N in 'x', 'y' or 'w' (None: the weight has no batch)."""
        if tensor == "w":
            return None
        return 1 if self.layout == "GNHWC" else 0

    def with_(self, **changes) -> "ConvProblem":
        return replace(self, **changes)

    def without_fused(self) -> "ConvProblem":
        """The same convolution without fused epilogue steps or prologue: the GEMM its kernels share."""
        ep = self.epilogue
        return replace(self, epilogue=Epilogue(ep.kind, ep.alpha, ep.beta), prologue=Prologue())

    def record(self) -> dict:
        """Every field, recursively (the epilogue too): canonical for equal problems, different for any
        changed field (cache keys hash it)."""
        return asdict(self)

    def describe(self) -> str:
        sp = "x".join(map(str, self.input))
        fl = "x".join(map(str, self.filter))
        return (
            f"{self.op} {self.dims}D G={self.groups} N={self.batch} C={self.in_channels} K={self.out_channels} "
            f"in={sp} filter={fl} stride={list(self.stride)} dil={list(self.dilation)} "
            f"pad={list(self.pad_lo)}/{list(self.pad_hi)} {self.layout}/{self.weight_layout} {self.dtype}"
            + (f"->{self.out_dtype}" if self.out_dtype else "")
            + (f" compute={self.compute[0]}" if self.compute and self.compute[0] in F32_COMPUTES
               else f" compute={list(self.compute)}" if self.compute else "")
            + (f" split_k={self.split_k}" if self.split_k else "")
            + (f" epilogue={self.epilogue}" if self.epilogue.kind != "none" or self.epilogue.steps else "")
            + (f" prologue={self.prologue}" if self.prologue.kind != "none" else "")
            + (" batch=?" if self.dynamic_batch else "")
        )


def problem_to_spec(p: ConvProblem) -> dict:
    """A JSON-ready dict of every field (the manifest's `spec`); `problem_from_spec` inverts it."""
    epilogue = {"kind": p.epilogue.kind, "alpha": p.epilogue.alpha, "beta": p.epilogue.beta}
    spec = {
        "name": p.name, "op": p.op, "dims": p.dims, "groups": p.groups, "batch": p.batch,
        "in_channels": p.in_channels, "out_channels": p.out_channels, "input": list(p.input),
        "filter": list(p.filter), "stride": list(p.stride), "dilation": list(p.dilation),
        "pad_lo": list(p.pad_lo), "pad_hi": list(p.pad_hi), "layout": p.layout, "weight_layout": p.weight_layout,
        "dtype": p.dtype, "out_dtype": p.out_dtype, "compute": list(p.compute) if p.compute else None,
        "split_k": p.split_k, "epilogue": epilogue, "dynamic_batch": p.dynamic_batch,
    }
    # the fused forms only where present: a spec without them (the tuning database's keys) stays as it was
    if p.epilogue.steps:
        epilogue["steps"] = list(p.epilogue.steps)
    if p.prologue.kind != "none":
        spec["prologue"] = p.prologue.kind
    return spec


def problem_from_spec(spec: dict) -> ConvProblem:
    fields = dict(spec)
    for key in ("input", "filter", "stride", "dilation", "pad_lo", "pad_hi"):
        fields[key] = tuple(fields[key])
    fields["compute"] = tuple(fields["compute"]) if fields.get("compute") else None
    fields["epilogue"] = Epilogue(**fields["epilogue"])
    fields["prologue"] = Prologue(fields.get("prologue", "none"))
    return ConvProblem(**fields)


# fp8 compute types: (mantissa bits, smallest normal exponent) of e4m3 (fp8) and e5m2 (bf8)
FP8_FORMATS = {"fp8": (3, -6), "bf8": (2, -14)}


def activation_axes(p: ConvProblem, channel: str) -> list[str]:
    """Logical axes of X (channel 'ch' = C) or dY (channel 'ch' = K) in the problem's layout order."""
    sp = [f"sp{i}" for i in range(p.dims)]
    if p.layout == "NHWGC":
        return ["n", *sp, "g", channel]
    if p.layout == "GNHWC":
        return ["g", "n", *sp, channel]
    return ["n", "g", channel, *sp]  # NGCHW


def weight_axes(p: ConvProblem) -> list[str]:
    taps = [f"t{i}" for i in range(p.dims)]
    return ["g", "k", *taps, "c"] if p.weight_layout == "GKYXC" else ["g", "k", "c", *taps]


def weight_axes_name(p: ConvProblem, axes: Sequence[str]) -> str:
    """The letters of a weight axis order, as layouts are named (["g", "t0", "t1", "c", "k"] in 2D: GYXCK)."""
    letters = {"g": "G", "k": "K", "c": "C", **{f"t{i}": t for i, t in enumerate(_TAP_LETTERS[p.dims])}}
    return "".join(letters[a] for a in axes)
