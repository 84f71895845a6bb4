"""The real-GPU kernel module of a flavour for tests/gpu, or a clean skip with the reason."""
import os

import pytest


def load_backend(flavour):
    """The real-GPU kernel module of ``flavour``, or pytest.skip with the reason."""
    if flavour == "numba" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: tests/gpu need a real device")
    try:
        from mpitrain.comm import device
        device.select_device(flavour=flavour)
        from mpitrain import kernels
        return kernels.get("cuda", flavour)
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"cuda/{flavour} unavailable: {' '.join(str(exc).split())}")
