"""The CuPy flavour's own convolution (column-major columns, one GEMM per batch, a move to NCHW)
against the CPU's, its CUDA C run on the CPU (tests/support/fake_cupy.py)."""
import numpy as np
import pytest

from tests.support.conv_cases import SHAPES, check_conv


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_conv_matches_cpu(cpu, emulated, shape, dtype):
    check_conv(cpu, emulated, shape, dtype)


def test_bad_shapes_are_one_line(emulated):
    x = np.zeros((2, 3, 5, 5), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        emulated.conv2d_forward(x, np.zeros((4, 2, 3, 3), np.float32), None,
                                np.zeros((2, 4, 3, 3), np.float32), 1, 0, False)
    with pytest.raises(ValueError, match="y"):
        emulated.conv2d_forward(x, np.zeros((4, 3, 3, 3), np.float32), None,
                                np.zeros((2, 4, 5, 5), np.float32), 1, 0, False)
