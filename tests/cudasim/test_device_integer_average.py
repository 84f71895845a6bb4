"""The Average of integer device arrays: a float64 mean, as on the host, grouped or not; refused
in place. Numba (simulated) arrays through mt.*, and the CuPy family with its kernels' CUDA C run
on the CPU (tests/support/fake_cupy.py). One process; device_comm_job.py checks two ranks."""
import sys

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import device, world
from tests.support import fake_cupy


def _inputs():
    return [np.arange(-3, 4, dtype=np.int32).reshape(7), np.full((2, 3), 5, np.int64),
            np.linspace(-1, 1, 5).astype(np.float32), np.arange(4, dtype=np.uint8)]


def _check_means(outs, host_outs):
    for got, want in zip(outs, host_outs):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert [o.dtype for o in host_outs] == [np.float64, np.float64, np.float32, np.float64]


def test_numba_integer_average_matches_the_host(dev):
    xs = _inputs()
    host_outs = mt.grouped_allreduce(xs, postscale_factor=3.0)
    outs = mt.grouped_allreduce([dev.to_device(x) for x in xs], postscale_factor=3.0)
    _check_means([dev.to_host(o) for o in outs], host_outs)
    single = mt.allreduce(dev.to_device(xs[0]))
    assert dev.to_host(single).tobytes() == mt.allreduce(xs[0]).tobytes()
    ds = [dev.to_device(x) for x in xs]
    for call in (lambda: mt.grouped_allreduce_(ds), lambda: mt.allreduce_(ds[1]),
                 lambda: mt.grouped_allreduce_(xs), lambda: mt.allreduce_(xs[1])):
        with pytest.raises(ValueError, match="Average of int.* arrays is not an integer"):
            call()
    for d, x in zip(ds, xs):                                          # untouched
        np.testing.assert_array_equal(dev.to_host(d), x)


@pytest.fixture
def cupy_family(emulated, monkeypatch):
    """NumPy arrays taken for CuPy arrays: the CuPy family over the emulated cuda_cupy kernels."""
    fake = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    fam = device._CupyFamily.__new__(device._CupyFamily)
    device._Family.__init__(fam, emulated, lambda n, dtype: np.empty(n, dtype))
    fam.cupy = fake
    monkeypatch.setitem(device._families, "cupy", fam)
    monkeypatch.setattr(device, "on_device", lambda x: True)
    return fam


def test_cupy_integer_average_matches_the_host(cupy_family):
    state = world.current()
    xs = _inputs()
    host_outs = mt.grouped_allreduce(xs, postscale_factor=3.0)
    outs = device.grouped_allreduce(state, xs, postscale_factor=3.0, fusion_threshold_bytes=64)
    _check_means(outs, host_outs)
    assert state.device["fusion"].family is cupy_family
    single = device.allreduce(state, xs[1])
    assert single.tobytes() == mt.allreduce(xs[1]).tobytes()
    with pytest.raises(ValueError, match="Average of int32 arrays is not an integer"):
        device.grouped_allreduce_(state, xs)
    np.testing.assert_array_equal(xs[0], np.arange(-3, 4))            # untouched
    sums = device.grouped_allreduce_(state, xs, op=mt.Sum, prescale_factor=2.0)
    assert [id(s) for s in sums] == [id(x) for x in xs]
    np.testing.assert_array_equal(xs[1], np.full((2, 3), 10))
