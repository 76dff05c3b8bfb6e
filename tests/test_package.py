"""What `import convdsl` offers at package level."""
from __future__ import annotations

import numpy as np
import pytest

import convdsl


def test_empty_is_the_interop_one() -> None:
    assert convdsl.empty is convdsl.interop.empty
    assert "empty" in convdsl.__all__


@pytest.mark.parametrize("shape, dtype", [((3, 5, 7), np.float32), ((2, 9), np.float16), ((1,), "float32")])
def test_empty_is_64_byte_aligned_with_the_shape_and_dtype_asked(shape, dtype) -> None:
    for _ in range(8):  # one aligned array could be luck
        a = convdsl.empty(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype)
        assert a.ctypes.data % 64 == 0
