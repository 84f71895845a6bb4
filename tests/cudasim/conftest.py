"""tests/cudasim: the Numba CUDA backend under NUMBA_ENABLE_CUDASIM=1 (or on a real GPU).

Without the simulator flag and without a GPU, kernels/cuda_numba/ refuses to import and every
test here is skipped with that one-line reason.
"""
import pytest


@pytest.fixture(scope="session")
def dev():
    try:
        from mpitrain.kernels import cuda_numba
    except ImportError as exc:
        pytest.skip(f"cuda-numba backend unavailable: {exc}")
    return cuda_numba


@pytest.fixture(scope="session")
def cpu():
    from mpitrain.kernels import cpu
    return cpu


@pytest.fixture(scope="session")
def emulated():
    """kernels/cuda_cupy/ with its CUDA C compiled for the host (tests/support/fake_cupy.py)."""
    from tests.support import fake_cupy
    if not fake_cupy.compiler_available():
        pytest.skip("no host C++ compiler (g++) to run the CuPy kernel sources")
    return fake_cupy.load_cuda_cupy()
