"""Device-buffer collectives on a real GPU over every usable transport (NCCL, CUDA-aware MPI,
pinned host staging), against the host collectives as oracle. Meaningful under mpiexec -n 2."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import device, handles
from mpitrain.comm.build_info import device_count
from tests.support.comm import comm_settings

pytestmark = pytest.mark.gpu


@pytest.fixture(params=device.TRANSPORTS)
def transport(request):
    with comm_settings(device_comm=request.param, fusion_threshold_bytes=256):
        try:
            chosen = device.transport()          # collective: every rank skips or none does
        except ValueError as exc:
            pytest.skip(str(exc))
        yield chosen


def test_collectives_match_host(gpu, transport):
    rng = np.random.default_rng(7 + mt.rank())
    for dtype in (np.float32, np.float64, np.int32, np.float16):
        for n in (1, 5, 1000, 100_003):
            x = (rng.standard_normal(n) * 3).astype(dtype)
            for op in (mt.Average, mt.Sum, mt.Max):
                got = gpu.to_host(mt.allreduce(gpu.to_device(x), op=op))
                want = mt.allreduce(x, op=op)
                np.testing.assert_allclose(got, want, rtol=1e-3 if dtype == np.float16 else 1e-6,
                                           err_msg=f"{transport} {np.dtype(dtype)} {n} {op}")
    xs = [rng.standard_normal(s).astype(np.float32) for s in (3, 70, 1, 300, 2)]
    ds = [gpu.to_device(a) for a in xs]
    mt.grouped_allreduce_(ds)
    for d, want in zip(ds, mt.grouped_allreduce(xs)):
        np.testing.assert_allclose(gpu.to_host(d), want, rtol=1e-6)
    d = gpu.to_device(xs[1])
    mt.broadcast_(d, root_rank=0)
    np.testing.assert_array_equal(gpu.to_host(d), mt.broadcast(xs[1], 0))


def _current_gpu(gpu):
    """The GPU current on the calling thread for the flavour of ``gpu``."""
    if "cupy" in gpu.__name__:
        import cupy
        return cupy.cuda.Device().id
    from numba import cuda
    return cuda.get_current_device().id


def test_comm_thread_collectives_stay_on_the_rank_gpu(gpu):
    """Ranks on GPUs 0 and 1 (mpiexec -n 2): a device collective the comm thread runs reduces
    on the rank's GPU, and the ranks do not count as sharing one."""
    if device_count() < 2 or mt.local_size() < 2:
        pytest.skip("needs 2 GPUs and 2 ranks on them (mpiexec -n 2)")
    dev = device.select_device()
    x = np.arange(6, dtype=np.float32) + mt.rank()
    out = handles.synchronize(handles.submit(mt.allreduce, gpu.to_device(x), mt.Sum))
    np.testing.assert_allclose(gpu.to_host(out), mt.allreduce(x, op=mt.Sum))
    assert handles.synchronize(handles.submit(_current_gpu, gpu)) == dev
    ids = mt.allgather_object(device._gpu_identity(dev))
    assert len(set(ids)) == len(ids), ids
