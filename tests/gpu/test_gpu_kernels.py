"""Every CUDA kernel (CuPy and Numba flavours) against the CPU kernel, on a real GPU."""
import numpy as np
import pytest

from tests.support import transformer_cases
from tests.support.kernel_cases import CASES, KERNEL_NAMES, run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, build, tol", CASES)
def test_kernel_matches_cpu(cpu, gpu, name, build, tol):
    run_case(cpu, gpu, name, build, tol)


@pytest.mark.parametrize("name, build, tol", transformer_cases.CASES)
def test_transformer_kernel_matches_cpu(cpu, gpu, name, build, tol):
    transformer_cases.run_case(cpu, gpu, name, build, tol)


@pytest.mark.parametrize("seed", [1, 2])
def test_larger_shapes_match_cpu(cpu, gpu, seed):
    """Shapes of a real layer: many blocks and tiles, grid-stride loops wrapping."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((300, 257)).astype(np.float32)              # (B, in)
    w = rng.standard_normal((129, 257)).astype(np.float32)              # (out, in)
    want = np.empty((300, 129), np.float32)
    cpu.gemm(a, w, want, trans_b=True)
    out = gpu.empty((300, 129), np.float32)
    gpu.gemm(gpu.to_device(a), gpu.to_device(w), out, trans_b=True)
    np.testing.assert_allclose(gpu.to_host(out), want, rtol=1e-4, atol=1e-4)
    x = rng.standard_normal(1_000_003).astype(np.float32)
    assert abs(gpu.total(gpu.to_device(x)) - cpu.total(x)) < 1e-6 * np.abs(x).sum()


def test_contract_names(gpu):
    missing = [n for n in KERNEL_NAMES + ["empty", "zeros", "to_device", "to_host",
                                          "synchronize"] if not hasattr(gpu, n)]
    assert not missing, f"{gpu.name} lacks {missing}"


def test_host_arrays_are_refused(gpu):
    with pytest.raises(TypeError, match="to_device"):
        gpu.fill(np.zeros(3, np.float32), 1.0)
