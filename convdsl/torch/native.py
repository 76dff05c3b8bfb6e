"""The native launcher: a planned eager convolution's launches and its autograd node in C++
(convdsl/torch/csrc/native.cpp), so that a training step spends no Python per convolution call in forward beyond
finding its plan, and none in backward.

It is built at first use with PyTorch's C++ extension loader (a C++ compiler, ninja and the CUDA toolkit's
headers; nothing to link but PyTorch), as Triton builds its launchers, and cached under convdsl's cache
directory by its source and the PyTorch and Python it was built for.  Where it cannot be built, one warning says
why and the calls launch through Python (convdsl/torch/stream.py), which does the same work with more host time.
`CONVDSL_TORCH_NATIVE=0` skips it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch.utils import cpp_extension

from .. import cache

ENV = "CONVDSL_TORCH_NATIVE"
SOURCE = Path(__file__).resolve().parent / "csrc" / "native.cpp"


class NativeUnavailableWarning(UserWarning):
    """The native launcher could not be built: eager calls launch through Python."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.lru_cache(maxsize=None)
def extension() -> Optional[ModuleType]:
    """The built extension module, or None (disabled, or it could not be built: warned once)."""
    if not enabled():
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + f"{torch.__version__} {sys.version}".encode()).hexdigest()[:16]
    name = f"convdsl_native_{tag}"
    build = cache.cache_dir() / "torch-native" / name
    try:
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build), with_cuda=True,
                                  extra_cflags=["-O2"], verbose=False)
    except Exception as err:  # noqa: BLE001 - no compiler, no CUDA headers, a failed build: all mean the same
        reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        warnings.warn(f"convdsl.torch: the native launcher could not be built ({reason}); eager convolutions "
                      f"launch through Python, with more host time per call (build log under {build}; "
                      f"{ENV}=0 skips it)", NativeUnavailableWarning, stacklevel=2)
        return None
