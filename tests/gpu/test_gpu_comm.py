"""Device-buffer collectives on a real GPU over every usable transport (NCCL, CUDA-aware MPI,
pinned host staging), against the host collectives as oracle. Meaningful under mpiexec -n 2."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import device
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
