"""tests/gpu: the CUDA backends on a real device (marker ``gpu``; ``make test-gpu``).

Every test skips cleanly, with the reason, when CuPy or a CUDA device is missing; under
NUMBA_ENABLE_CUDASIM=1 the Numba flavour is skipped here too (tests/cudasim covers the simulator).
``make test-gpu`` also runs this folder under ``mpiexec -n 2``: both ranks then share GPU 0
(local_rank % device_count), and the collective tests run across them.
"""
import pytest

from tests.support.gpu_backend import load_backend

FLAVOURS = ("cupy", "numba")


@pytest.fixture(params=FLAVOURS)
def gpu(request):
    return load_backend(request.param)


@pytest.fixture(scope="session")
def cpu():
    from mpitrain.kernels import cpu
    return cpu
