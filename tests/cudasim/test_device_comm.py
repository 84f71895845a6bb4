"""mpitrain.comm.device on simulated Numba device arrays: one process here, 2 ranks via mpiexec.

Under the simulator only the pinned-host staging transport exists (no NCCL, no CUDA-aware MPI),
so these tests cover dispatch, validation, the device fusion buffer and the staging path; NCCL
and CUDA-aware MPI need a GPU (tests/gpu).
"""
import os
import pathlib
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import device, handles, ops, watchdog, world
from tests.support.comm import settings_stack

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.fixture
def with_settings():
    """``with_settings(device_comm="host")``: a fresh World (no transport chosen yet)."""
    with settings_stack() as use:
        yield use


def test_single_rank_collectives_on_device_arrays(dev):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)                  # (2, 3)
    d = dev.to_device(x)
    out = mt.allreduce(d, op=mt.Average, postscale_factor=3.0)
    assert out is not d and getattr(out, "__cuda_ndarray__", False)
    np.testing.assert_allclose(dev.to_host(out), x * 3.0)
    np.testing.assert_array_equal(dev.to_host(d), x)                  # input untouched
    ds = [dev.to_device(x), dev.to_device(np.ones(4))]
    assert mt.grouped_allreduce_(ds, op=mt.Sum, prescale_factor=2.0) is not None
    np.testing.assert_allclose(dev.to_host(ds[0]), x * 2.0)
    np.testing.assert_allclose(dev.to_host(ds[1]), np.full(4, 2.0))
    assert ops.on_device(d) and not ops.on_device(x)             # what sends d to device.py


def test_bad_device_arguments_raise(dev):
    with pytest.raises(ValueError, match="bool"):
        mt.allreduce(dev.to_device(np.zeros(3, np.bool_)))
    with pytest.raises(ValueError, match="mixed"):
        mt.grouped_allreduce([dev.to_device(np.zeros(3)), np.zeros(3)])


def test_transport_is_host_under_the_simulator_and_can_be_forced(dev, with_settings):
    with_settings(device_comm="auto")
    assert device.transport() == "host"
    with_settings(device_comm="nccl")
    with pytest.raises(ValueError, match="MPITRAIN_DEVICE_COMM=nccl"):
        device.transport()
    with pytest.raises(ValueError, match="carrier-pigeon"):
        mt.CommSettings.from_env({"MPITRAIN_DEVICE_COMM": "carrier-pigeon"})
    with_settings(device_comm="host")
    assert device.transport() == "host"


@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_two_ranks_match_the_host_collectives(dev, algo):
    mpiexec = os.environ.get("MPIEXEC", str(ROOT / ".venv" / "bin" / "mpiexec"))
    if not os.path.exists(mpiexec) and "/" in mpiexec:
        pytest.skip(f"no mpiexec at {mpiexec}")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MPITRAIN_FUSION_THRESHOLD="64",
               MPITRAIN_ALLREDUCE=algo, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("MPITRAIN_DEVICE_COMM", None)
    cmd = ["timeout", "-k", "5", "240", mpiexec, "-n", "2", sys.executable,
           str(HERE / "device_comm_job.py")]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=260)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "device comm OK" in res.stdout
    assert "device allreduce via host" in res.stderr


def _open_once_queued(gate, in_flight=2):
    """Open ``gate`` once the collective it holds has another one queued behind it."""
    deadline = time.monotonic() + 60
    while handles._submitted - handles._finished < in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()


def test_a_collective_queued_on_the_comm_thread_runs_on_the_process_gpu(dev, monkeypatch):
    """A device collective called while another collective is in flight runs on the comm
    thread; CuPy and Numba start every thread on GPU 0, so it binds the process's GPU (here 1)
    there, once, before it touches the array."""
    from numba import cuda
    events = []                                      # (what, on the comm thread?, GPU)

    def record(what, i=None):
        events.append((what, handles.on_comm_thread(), i))

    def device_of(i):
        return types.SimpleNamespace(use=lambda: record("cupy", i))

    fake_cupy = types.SimpleNamespace(ndarray=type("ndarray", (), {}),
                                      cuda=types.SimpleNamespace(Device=device_of))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cuda, "select_device", lambda i: record("numba", i))
    family = device._family
    monkeypatch.setattr(device, "_family", lambda x: record("array") or family(x))
    monkeypatch.setitem(world.current().device, "device", 1)     # select_device() chose GPU 1
    x = np.arange(5, dtype=np.float32)
    for _ in range(2):
        gate = threading.Event()
        first = handles.submit(gate.wait)                         # a collective in flight
        opener = threading.Thread(target=_open_once_queued, args=(gate,))
        opener.start()
        record("call")
        out = mt.allreduce(dev.to_device(x))                     # queued behind it
        opener.join()
        handles.synchronize(first)
        np.testing.assert_array_equal(dev.to_host(out), x)
    assert events == [("call", False, None), ("cupy", True, 1), ("numba", True, 1),
                      ("array", True, None), ("call", False, None), ("array", True, None)], events


class _ProducerStream:
    """A producer's CUDA stream: the copies queued on it happen at ``synchronize()``."""

    def __init__(self):
        self.queued = []

    def synchronize(self):
        while self.queued:
            self.queued.pop(0)()


class _ProducerArray:
    """A Numba device array wrapped from a producer that exports its stream
    (``__cuda_array_interface__["stream"]``): Numba copies on that stream, asynchronously."""

    __cuda_ndarray__ = True

    def __init__(self, values, stream):
        self.values, self.stream = values, stream
        self.shape, self.dtype, self.size, self.ndim = (values.shape, values.dtype, values.size,
                                                        values.ndim)

    def copy_to_host(self, ary, stream=0):
        self.stream.queued.append(lambda: np.copyto(ary, self.values))

    def copy_to_device(self, ary, stream=0):
        self.stream.queued.append(lambda: np.copyto(self.values, ary))


def test_staging_copies_finish_before_the_host_buffer_is_read_or_reused(dev, monkeypatch):
    """The host transport reads the pinned buffer right after the copy down and reuses it for
    the next allreduce right after the copy up: both copies must be done by then."""
    read = []

    def host_sum(state, host, op, pre, post):               # a second rank with equal values
        read.append(host.copy())
        host *= 2

    monkeypatch.setattr(device, "host_allreduce_flat", host_sum)
    state = types.SimpleNamespace(comm=types.SimpleNamespace(Get_size=lambda: 2),
                                  device={"transport": "host"}, record=watchdog.Record())
    stream = _ProducerStream()
    a = _ProducerArray(np.arange(1.0, 5.0), stream)                           # (4,)
    b = _ProducerArray(np.full(4, 7.0), stream)                               # (4,)
    fam = device._family(a)
    fam.pinned(4, np.float64)[:] = np.nan                    # whatever the last call left there
    for x in (a, b):                                         # b reuses a's pinned buffer
        device._allreduce_flat(state, fam, x, mt.Sum, 1.0, 1.0)
    stream.synchronize()
    np.testing.assert_array_equal(read[0], np.arange(1.0, 5.0))
    np.testing.assert_array_equal(read[1], np.full(4, 7.0))
    np.testing.assert_array_equal(a.values, 2 * np.arange(1.0, 5.0))
    np.testing.assert_array_equal(b.values, np.full(4, 14.0))


def test_cupy_copy_up_finishes_before_the_pinned_buffer_is_reused():
    """CuPy's ``set`` from pinned memory is asynchronous on the current stream."""
    stream = _ProducerStream()
    fam = device._CupyFamily.__new__(device._CupyFamily)
    fam.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream))
    flat = types.SimpleNamespace(values=np.zeros(3))
    flat.set = lambda host: stream.queued.append(lambda: np.copyto(flat.values, host))
    host = np.arange(3.0)                                                     # (3,) pinned
    fam.to_dev(host, flat)
    host[:] = -1.0                                           # the next collective's copy down
    stream.synchronize()
    np.testing.assert_array_equal(flat.values, np.arange(3.0))
