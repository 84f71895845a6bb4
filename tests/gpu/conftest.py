"""tests/gpu: the CUDA backends on a real device (marker ``gpu``; ``make test-gpu``).

Every test skips cleanly, with the reason, when CuPy or a CUDA device is missing; under
NUMBA_ENABLE_CUDASIM=1 the Numba flavour is skipped here too (tests/cudasim covers the simulator).
``make test-gpu`` also runs this folder under ``mpiexec -n 2``: both ranks then share GPU 0
(local_rank % device_count), and the collective tests run across them.
"""
import os

import pytest

FLAVOURS = ("cupy", "numba")


def load_backend(flavour):
    """The real-GPU kernel module of ``flavour``, or pytest.skip with the reason."""
    if flavour == "numba" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: tests/gpu need a real device")
    try:
        from mpitrain.comm import device
        device.select_device()
        from mpitrain import kernels
        return kernels.get("cuda", flavour)
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"cuda/{flavour} unavailable: {' '.join(str(exc).split())}")


@pytest.fixture(params=FLAVOURS)
def gpu(request):
    return load_backend(request.param)


@pytest.fixture(scope="session")
def cpu():
    from mpitrain.kernels import cpu
    return cpu
