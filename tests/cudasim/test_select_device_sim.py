"""GPU selection under NUMBA_ENABLE_CUDASIM=1: the Numba flavour needs no CuPy."""
import sys

import pytest

from mpitrain.comm import device, world


@pytest.fixture
def unselected(monkeypatch):
    """No GPU chosen yet in this process, and CuPy unimportable (sys.modules entry None)."""
    monkeypatch.setattr(world.current(), "device", {})
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_numba_flavour_selects_a_gpu_without_cupy(dev, unselected):
    assert device.select_device(flavour="numba") == 0
    assert world.current().device["device"] == 0
    assert device.select_device(flavour="numba") == 0              # idempotent


def test_cupy_flavour_still_needs_cupy(dev, unselected):
    with pytest.raises(ImportError):
        device.select_device(0)
    with pytest.raises(ImportError):
        device.select_device(0, flavour="cupy")
    assert world.current().device == {}                          # nothing half-selected
