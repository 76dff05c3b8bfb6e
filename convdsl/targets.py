"""Compilation targets: which IREE backend, which chip, and what the chip computes natively."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

BACKENDS = ("cpu", "cuda", "rocm")
DEFAULT_ARCH = {"cpu": "host", "cuda": "sm_80", "rocm": "gfx942"}


# IREE 3.13 knows CUDA chips by name only up to sm_89 (`--iree-cuda-target=sm_90` fails with "missing GPU
# target").  Hopper is described in the input IR instead, as `hal.device.targets` on the module: sm_89's
# matrix instructions (mma.sync; IREE has no wgmma), PTX ISA 8.4, and the 227 KB of shared memory a block may
# use on H100/H200 (sm_80 and sm_89 allow 163 KB and 99 KB), which IREE's tile and prefetch choices read.
_SM90_TARGET_INFO = (
    '#iree_gpu.target<arch = "sm_90", features = "+ptx84", wgp = <'
    "compute = fp64|fp32|fp16|int64|int32|int16|int8, storage = b64|b32|b16|b8, subgroup = shuffle|arithmetic, "
    "dot = dp4xi8toi32, mma = [<NV_MMA_SYNC_F32_16x8x16_F16>, <NV_MMA_SYNC_F16_16x8x16_F16>, "
    "<NV_MMA_SYNC_F32_16x8x16_BF16>, <NV_MMA_SYNC_F32_16x8x32_F8E4M3FN>, <NV_MMA_SYNC_F32_16x8x32_F8E5M2>, "
    "<NV_WMMA_F32_16x16x16_F16>, <NV_WMMA_F16_16x16x16_F16>], subgroup_size_choices = [32], "
    "max_workgroup_sizes = [1024, 1024, 1024], max_thread_count_per_workgroup = 1024, "
    "max_workgroup_memory_bytes = 232448, max_workgroup_counts = [2147483647, 65535, 65535]>>"
)
IR_DESCRIBED_ARCHS = {"sm_90": _SM90_TARGET_INFO}

# Every module is compiled without IREE's compile-time evaluation of constant globals: convdsl's modules take
# their operands as arguments, so the pass only JIT-compiles and runs a few index computations, for 0.4-0.6 s of
# each compile (docs/decisions.md#no-const-eval).
NO_CONST_EVAL = "--iree-opt-const-eval=false"


class TargetError(ValueError):
    pass


# the oldest CUDA architecture IREE's CUDA backend compiles for (Volta)
MIN_CUDA_ARCH = 70


def _arch_number(arch: str) -> int:
    return int(re.sub(r"\D", "", arch) or 0)


# CUDA's limits on every arch convdsl compiles for: the programs of a grid along x, y and z, and the 32-bit
# registers of an SM and the most one thread may hold
CUDA_MAX_GRID = (2**31 - 1, 65535, 65535)
CUDA_REGISTERS = (65536, 255)
# the PTX ISA of the PTX handed to the driver to JIT: 8.0 (CUDA 12.0), which any driver of the last years accepts
# (Triton's default follows its own ptxas and can be newer than the driver on the machine)
CUDA_PTX_VERSION = 80
# TMA's im2col copies (cuTensorMapEncodeIm2col): the pixel box's corners per spatial dimension, by the tensor's
# rank, and the most traversal (element) stride
CUDA_TMA_IM2COL_CORNERS = {3: (-32768, 32767), 4: (-128, 127), 5: (-16, 15)}
CUDA_TMA_MOST_STRIDE = 8
# the programs a sum over a weight-sized tensor aims for (the stream runner's split-K sum): two per SM of an
# H100/H200 (132 SMs), the GPUs the kernels are measured on.  One number for every CUDA arch, so that a kernel's
# constants do not depend on the arch it is planned for (sized by each arch's SMs, sm_80's would be 216 and sm_89's
# 284: kernels no measurement asked to change)
CUDA_SUM_PROGRAMS = 264


@dataclass(frozen=True)
class GpuFacts:
    """What the planning policy (convdsl/policy/) reads off a GPU to size its grids: streaming
    multiprocessors (compute units), the shared memory of one and what each resident block reserves of it,
    and the warps (waves) one can hold; and what bounds one workgroup's configuration (backends/iree_config.py):
    the shared memory (LDS) one workgroup may use and the threads of a subgroup (warp or wavefront)."""

    sm_count: int
    shared_per_sm: int
    shared_reserved_per_block: int
    warps_per_sm: int
    workgroup_memory: int
    subgroup_size: int
    # dense 16-bit matrix products with f32 accumulation (FLOP/s) and memory bandwidth (bytes/s), the
    # datasheets' peaks: what a cost model weighs a split-K partial's memory traffic against its products with
    matrix_flops: float = 0.0
    memory_bandwidth: float = 0.0
    # what `convdsl explain` names: the chip planned for, its matrix instructions, and every subgroup size the
    # chip runs (the first its native one, IREE's default)
    chip: str = ""
    matrix_unit: str = ""
    subgroup_sizes: tuple[int, ...] = ()


# The chip each arch is planned for (where one arch spans several chips, its data-centre part): the split-K
# and depthwise grids aim at whole waves of its SMs.  From the vendors' datasheets: H100 SXM, A100, L40S, MI300X.
# workgroup_memory is what one block may use (CUDA's opt-in maximum: 227, 163 and 99 KB; CDNA3's 64 KB of LDS),
# the same limits as IREE's target descriptions (max_workgroup_memory_bytes), which reject a kernel over them.
# matrix_flops: dense bf16 with f32 accumulation (989, 312, 362 and 1307 TFLOP/s); memory_bandwidth: 3.35, 2.04,
# 0.864 and 5.3 TB/s.
HOPPER = GpuFacts(sm_count=132, shared_per_sm=228 * 1024, shared_reserved_per_block=1024, warps_per_sm=64,
                  workgroup_memory=227 * 1024, subgroup_size=32, matrix_flops=989e12, memory_bandwidth=3.35e12)
AMPERE = GpuFacts(sm_count=108, shared_per_sm=164 * 1024, shared_reserved_per_block=1024, warps_per_sm=64,
                  workgroup_memory=163 * 1024, subgroup_size=32, matrix_flops=312e12, memory_bandwidth=2.04e12)
ADA = GpuFacts(sm_count=142, shared_per_sm=100 * 1024, shared_reserved_per_block=1024, warps_per_sm=48,
               workgroup_memory=99 * 1024, subgroup_size=32, matrix_flops=362e12, memory_bandwidth=0.864e12)

# ROCm: compute units, wavefront size and LDS from AMD's GPU specifications table (ROCm docs,
# reference/gpu-arch-specs.rst): MI300X (gfx942) 304 CUs, wave64, 64 KiB of LDS per CU; MI250X (gfx90a) 110 CUs per
# GCD, which ROCm shows as one device (MI210: 104), wave64, 64 KiB; RX 7900 XTX (gfx1100) 96 CUs (48 WGPs), wave32,
# 128 KiB of LDS per WGP.  A workgroup may use 64 KiB on all three, IREE's max_workgroup_memory_bytes.  CDNA
# multiplies matrices with MFMA, RDNA3 with WMMA (IREE: mma = [<MFMA_...>] / [<WMMAR3_...>]); gfx1100 also runs
# wave64 (IREE: subgroup_size_choices = [32, 64]).  Peaks (datasheets): MI250X 383 TFLOP/s bf16 and 3.2 TB/s over its
# two GCDs; RX 7900 XTX 122.8 TFLOP/s f16 and 960 GB/s.
CDNA3 = GpuFacts(sm_count=304, shared_per_sm=64 * 1024, shared_reserved_per_block=0, warps_per_sm=32,
                 workgroup_memory=64 * 1024, subgroup_size=64, matrix_flops=1307e12, memory_bandwidth=5.3e12,
                 chip="MI300X", matrix_unit="MFMA", subgroup_sizes=(64,))
CDNA2 = GpuFacts(sm_count=110, shared_per_sm=64 * 1024, shared_reserved_per_block=0, warps_per_sm=32,
                 workgroup_memory=64 * 1024, subgroup_size=64, matrix_flops=191.5e12, memory_bandwidth=1.6e12,
                 chip="MI250X GCD", matrix_unit="MFMA", subgroup_sizes=(64,))
# LDS: 128 KiB per WGP of two CUs, 64 KiB per CU on average (what shared_per_sm counts)
RDNA3 = GpuFacts(sm_count=96, shared_per_sm=64 * 1024, shared_reserved_per_block=0, warps_per_sm=32,
                 workgroup_memory=64 * 1024, subgroup_size=32, matrix_flops=122.8e12, memory_bandwidth=0.96e12,
                 chip="RX 7900 XTX", matrix_unit="WMMA", subgroup_sizes=(32, 64))
GPU_FACTS = {"sm_80": AMPERE, "sm_86": AMPERE, "sm_89": ADA, "sm_90": HOPPER,
             "gfx90a": CDNA2, "gfx942": CDNA3, "gfx1100": RDNA3}


def _gfx_version(arch: str) -> tuple[int, int]:
    """A gfx arch's major version and its minor version and stepping, for ordering: the last two digits (hex) are
    minor and stepping (gfx90a -> (9, 0x0a), gfx942 -> (9, 0x42), gfx1100 -> (0x11, 0x00))."""
    digits = arch[3:]
    return int(digits[:-2], 16), int(digits[-2:], 16)


def _rocm_family(arch: str) -> str:
    """GCN and CDNA chips have a one-digit major version (gfx9xx), RDNA chips two (gfx10xx and newer): wave64 MFMA
    chips against wave32 WMMA ones."""
    return "cdna" if len(arch) == 6 else "rdna"


def rocm_facts(arch: str) -> GpuFacts:
    """The facts of a gfx arch: its own, else those of the newest arch of its family (CDNA or RDNA) below it, else
    the oldest of its family, so an RDNA chip is never planned with a CDNA chip's wavefronts and CUs."""
    if arch in GPU_FACTS:
        return GPU_FACTS[arch]
    family = sorted((a for a in GPU_FACTS if a.startswith("gfx") and _rocm_family(a) == _rocm_family(arch)),
                    key=_gfx_version)
    below = [a for a in family if _gfx_version(a) <= _gfx_version(arch)]
    return GPU_FACTS[below[-1] if below else family[0]]


def native_cuda_arch(device: int = 0) -> Optional[str]:
    """The arch to compile for the CUDA device present (None: no driver or no device), from its compute
    capability: 9.x (H100, H200) -> sm_90 (wgmma cubins), 8.9 -> sm_89, other 8.x -> sm_80.  Others get None,
    so the portable default applies: sm_80 PTX, which the driver JIT-compiles (also for chips newer than
    Hopper, which cannot run sm_90a cubins).  Read from libcuda itself: no runtime library is needed."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        handle, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), device) != 0:
            return None
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, handle) != 0 or \
                cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return arch_for_capability(major.value, minor.value)


def arch_for_capability(major: int, minor: int) -> Optional[str]:
    if major == 9:
        return "sm_90"
    if major == 8:
        return "sm_89" if minor >= 9 else "sm_80"
    return None


# The CPU target's arch: "host" (the CPU that compiles, features and all) or a CPU name LLVM knows, as
# `clang -march` takes it (sapphirerapids, emeraldrapids, znver4, x86-64-v4, neoverse-v2, ...): IREE derives the
# vector units from the name, so a module can be compiled on one machine for another's CPU.  iree-compile
# rejects a name LLVM does not know and lists the ones it does.
_CPU_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_GPU_NAME = re.compile(r"(sm|compute)_\d+a?|gfx[0-9a-f]{3,4}")


def cpu_arch(arch: str) -> bool:
    """Whether `arch` can name a CPU for the CPU target: "host" or an LLVM CPU name (lowercase letters, digits,
    '-', '_', '.'), never a GPU's sm_XY or gfxNNN."""
    return bool(_CPU_NAME.fullmatch(arch)) and not _GPU_NAME.fullmatch(arch)


@dataclass(frozen=True)
class Target:
    backend: str = "cpu"
    arch: str = "host"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise TargetError(f"--target: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "cuda" and not (re.fullmatch(r"sm_\d{2,3}a?", self.arch)
                                           and _arch_number(self.arch) >= MIN_CUDA_ARCH):
            raise TargetError(f"--arch: a CUDA target names an sm_XY architecture, sm_{MIN_CUDA_ARCH} or newer "
                              f"(e.g. sm_80, sm_90), got {self.arch!r}")
        if self.backend == "cpu" and not cpu_arch(self.arch):
            raise TargetError(f"--arch: the CPU target takes an LLVM CPU name (e.g. sapphirerapids, znver4, x86-64-v4; "
                              f"default host, the CPU that compiles; sm_XY and gfxNNN name GPUs: use --target cuda or "
                              f"rocm with them), got {self.arch!r}")
        if self.backend == "rocm" and not re.fullmatch(r"gfx[0-9a-f]{3,4}", self.arch):
            raise TargetError(f"--arch: a ROCm target names a gfxNNN architecture (e.g. gfx942), got {self.arch!r}")

    @staticmethod
    def parse(backend: str, arch: str | None = None) -> "Target":
        if backend not in BACKENDS:
            raise TargetError(f"--target: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        return Target(backend, arch or DEFAULT_ARCH[backend])

    @property
    def fp8_native(self) -> bool:
        """Whether fp8 operands are kept as fp8 tensors for the chip's fp8 matrix instructions.

        ROCm gfx942/gfx950: yes.  CUDA sm_89+ has fp8 mma.sync, but IREE 3.13's CUDA backend cannot
        lower `arith.truncf` to f8 ("missing LLVMTranslationDialectInterface"), so CUDA, like the CPU,
        gets the emulated form: operands rounded to the fp8 grid, stored in f16 (every e4m3 and e5m2
        value is exact in f16) and multiplied on f16 units with f32 accumulation: the same products.
        """
        return self.backend == "rocm" and self.arch in ("gfx942", "gfx950")

    def fp8_type(self, kind: str) -> str:
        """CK's fp8 is e4m3 and bf8 is e5m2; gfx942 implements the FNUZ variants of both."""
        if self.backend == "rocm" and self.arch == "gfx942":
            return {"fp8": "f8E4M3FNUZ", "bf8": "f8E5M2FNUZ"}[kind]
        return {"fp8": "f8E4M3FN", "bf8": "f8E5M2"}[kind]

    def compile_flags(self, data_tiling: bool = True) -> list[str]:
        """iree-compile's flags for this target.  `data_tiling` (CPU only; policy.cpu_data_tiling decides it per
        module) adds data tiling (packed matmul operands) and the matmul microkernels: IREE's fast path for the
        named matmuls of the im2col form (docs/decisions.md#cpu-im2col)."""
        if self.backend == "cpu":
            device = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                      f"--iree-llvmcpu-target-cpu={self.arch}", NO_CONST_EVAL]
            return [*device, "--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all"] if data_tiling \
                else device
        # IREE's own split reduction for the reductions convdsl leaves whole (docs/decisions.md#iree-split-reduction)
        gpu = ["--iree-dispatch-creation-enable-split-reduction", NO_CONST_EVAL]
        if self.device_targets_attr() is not None:
            return gpu  # the device comes from the module's hal.device.targets
        if self.backend == "cuda":
            return ["--iree-hal-target-device=cuda", f"--iree-cuda-target={self.arch}", *gpu]
        return ["--iree-hal-target-device=hip", f"--iree-rocm-target={self.arch}", *gpu]

    def device_targets_attr(self) -> Optional[str]:
        """The `#hal.device.target` to put on the module for chips IREE's flags cannot name, else None."""
        info = IR_DESCRIBED_ARCHS.get(self.arch) if self.backend == "cuda" else None
        if info is None:
            return None
        return (f'#hal.device.target<"cuda", [#hal.executable.target<"cuda", "cuda-nvptx-fb", '
                f"{{iree_codegen.target_info = {info}}}>]> : !hal.device")

    @property
    def gpu(self) -> GpuFacts:
        """The GPU facts of this target's arch; an arch not in the table takes those of the newest one below it
        (sm_87 plans as sm_86), and one below them all those of the oldest; ROCm archs by family (rocm_facts)."""
        if self.backend == "rocm":
            return rocm_facts(self.arch)
        same_kind = sorted((a for a in GPU_FACTS if a[:3] == self.arch[:3]), key=_arch_number)
        below = [a for a in same_kind if _arch_number(a) <= _arch_number(self.arch)]
        return GPU_FACTS[below[-1] if below else same_kind[0]]

    @property
    def driver(self) -> str:
        return {"cpu": "local-task", "cuda": "cuda", "rocm": "hip"}[self.backend]

    # --- CUDA's facts (kernels/compile.py compiles with them, policy/ plans with them) -----------------------

    def _cuda(self, fact: str) -> None:
        if self.backend != "cuda":
            raise TargetError(f"{fact} is a CUDA target's fact; target is {self}")

    @property
    def arch_number(self) -> int:
        """XY of sm_XY (sm_90a: 90)."""
        self._cuda("arch_number")
        return _arch_number(self.arch)

    @property
    def max_grid(self) -> tuple[int, int, int]:
        """The most programs of a grid along x, y and z."""
        self._cuda("max_grid")
        return CUDA_MAX_GRID

    @property
    def registers(self) -> tuple[int, int]:
        """32-bit registers of an SM, and the most one thread may hold."""
        self._cuda("registers")
        return CUDA_REGISTERS

    @property
    def ptx_version(self) -> Optional[int]:
        """The PTX ISA of the kernels' PTX, which the driver JIT-compiles for the chip it runs on; None where they
        ship as cubins instead: sm_90, whose wgmma needs the arch-specific sm_90a (H100/H200 only)."""
        self._cuda("ptx_version")
        return None if self.arch_number >= 90 else CUDA_PTX_VERSION

    def tma_im2col_corners(self, rank: int) -> tuple[int, int]:
        """The least and the most corner of a TMA im2col copy's pixel box along a spatial dimension of a tensor of
        `rank` dimensions."""
        self._cuda("tma_im2col_corners")
        return CUDA_TMA_IM2COL_CORNERS[rank]

    @property
    def tma_most_stride(self) -> int:
        """The longest traversal (element) stride of a TMA copy."""
        self._cuda("tma_most_stride")
        return CUDA_TMA_MOST_STRIDE

    @property
    def sum_programs(self) -> int:
        """The programs a sum over a weight-sized tensor (the split-K sum) aims for."""
        self._cuda("sum_programs")
        return CUDA_SUM_PROGRAMS

    @property
    def has_cp_async(self) -> bool:
        """cp.async copies and bf16 mma (sm_80 and newer): what the Triton GEMM cores need."""
        return self.backend == "cuda" and self.arch_number >= 80

    @property
    def has_tma(self) -> bool:
        """TMA copies (sm_90 and newer)."""
        return self.backend == "cuda" and self.arch_number >= 90

    @property
    def has_wgmma(self) -> bool:
        """Hopper's wgmma (sm_90 only: newer chips have other matrix instructions)."""
        return self.backend == "cuda" and self.arch_number == 90

    def __str__(self) -> str:
        return f"{self.backend}:{self.arch}"
