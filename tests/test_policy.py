"""The planning rules as examples: given a problem on a target, the plan takes this form, these tiles and this
split.  Planning needs no GPU (policy reads the chip's facts off the Target)."""
from __future__ import annotations

import pytest

from convdsl.targets import CUDA_MAX_GRID, Target, TargetError

HOPPER = Target("cuda", "sm_90")
AMPERE = Target("cuda", "sm_80")
CPU = Target("cpu", "host")


# --- the target's facts ------------------------------------------------------------------------------------

def test_cuda_facts_live_on_the_target():
    assert (HOPPER.arch_number, AMPERE.arch_number, Target("cuda", "sm_90a").arch_number) == (90, 80, 90)
    # Hopper's kernels ship as sm_90a cubins; older chips' as PTX 8.0 for the driver to JIT
    assert HOPPER.ptx_version is None and AMPERE.ptx_version == 80 == Target("cuda", "sm_89").ptx_version
    assert HOPPER.has_tma and HOPPER.has_wgmma and not AMPERE.has_tma and not AMPERE.has_wgmma
    assert AMPERE.has_cp_async and not Target("cuda", "sm_75").has_cp_async
    # a newer chip has TMA but not Hopper's wgmma
    assert Target("cuda", "sm_100").has_tma and not Target("cuda", "sm_100").has_wgmma
    assert HOPPER.max_grid == AMPERE.max_grid == CUDA_MAX_GRID == (2**31 - 1, 65535, 65535)
    assert HOPPER.registers == (65536, 255)
    assert not (CPU.has_tma or CPU.has_wgmma or CPU.has_cp_async)
    with pytest.raises(TargetError, match="max_grid is a CUDA target's fact; target is cpu:host"):
        CPU.max_grid
