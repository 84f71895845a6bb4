"""mpitrain.comm.device on simulated Numba device arrays: one process here, 2 ranks via mpiexec.

Under the simulator only the pinned-host staging transport exists (no NCCL, no CUDA-aware MPI),
so these tests cover dispatch, validation, the device fusion buffer and the staging path; NCCL
and CUDA-aware MPI need a GPU (tests/gpu).
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import device, ops
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
