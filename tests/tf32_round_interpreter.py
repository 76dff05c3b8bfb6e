"""Run kernels/igemm.tf32_round in Triton's interpreter over the f32 values on stdin (raw little-endian bytes) and
write the rounded values to stdout (tests/test_tf32.py: TRITON_INTERPRET must be set before triton is imported)."""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from convdsl.kernels.igemm import tf32_round  # noqa: E402


@triton.jit
def _round_all(src, dst, N: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tf32_round(tl.load(src + i, mask=i < N)), mask=i < N)


values = torch.from_numpy(np.frombuffer(sys.stdin.buffer.read(), dtype=np.float32).copy())
out = torch.empty_like(values)
_round_all[(triton.cdiv(values.numel(), 1024),)](values, out, N=values.numel(), BLOCK=1024)
sys.stdout.buffer.write(out.numpy().tobytes())
