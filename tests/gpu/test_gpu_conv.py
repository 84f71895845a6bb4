"""A flavour's own convolution against the CPU's on a real GPU (cuBLAS, CuPy itself)."""
import numpy as np
import pytest

from tests.support.conv_cases import SHAPES, check_conv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_conv_matches_cpu(cpu, gpu, shape, dtype):
    if not hasattr(gpu, "conv2d_forward"):
        pytest.skip(f"{gpu.name} has no convolution of its own (Conv2D uses im2col + GEMM)")
    check_conv(cpu, gpu, shape, dtype)
