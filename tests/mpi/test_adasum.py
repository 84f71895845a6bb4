"""op=mt.Adasum (comm/adasum.py): Horovod's pairwise combination over a power-of-two number
of ranks, on mt.allreduce-style calls and in mt.DistributedOptimizer.

Oracles, as Horovod's test/parallel/test_adasum_pytorch.py: columns of an orthogonal matrix
(one per rank) combine to their sum; multiples of one vector to their mean; tiny and huge
magnitudes (near float32's smallest normal and the square root of its largest) stay accurate.
Beyond those, a float64 evaluation of the formula in numpy on every rank's array (gathered
here) in the recursive halving-doubling order. At N = 3 every call is one ValueError on every
rank.
"""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer
from tests.support.oracles import adasum_oracle

mt.init()
N, R = mt.size(), mt.rank()
POW2 = N & (N - 1) == 0
needs_pow2 = pytest.mark.skipif(not POW2, reason="Adasum needs a power-of-two number of ranks")


def close(dtype, expected, got):
    """Horovod's criterion: |expected - got| / |expected| / 100 < eps."""
    diff = np.linalg.norm(expected - np.asarray(got, np.float64))
    return diff / np.linalg.norm(expected) / 100.0 < np.finfo(dtype).eps


@needs_pow2
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_orthogonal_arrays_give_their_sum(dtype):
    rng = np.random.default_rng(2)
    for n in (N * 20 - 17, N * 2 + 1, N + 2, 2 ** 15):
        q, _ = np.linalg.qr(rng.normal(0, 1, (n, N)))
        q = q.astype(dtype)
        got = mt.allreduce(q[:, R], op=mt.Adasum)
        assert got.dtype == dtype
        assert close(dtype, q.astype(np.float64).sum(axis=1), got)


@needs_pow2
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_parallel_arrays_give_their_mean(dtype):
    rng = np.random.default_rng(3)
    for n in (N * 20 - 13, N * 2 + 1, N + 2, 2 ** 15):
        q = (rng.normal(0, 1, (n, 1)) @ rng.normal(0, 1, (N, 1)).T).astype(dtype)
        x = q[:, R].copy()
        mt.allreduce_(x, op=mt.Adasum)
        assert close(dtype, q.astype(np.float64).mean(axis=1), x)


@needs_pow2
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_stability_at_extreme_magnitudes(dtype):
    rng = np.random.default_rng(4)
    tiny, top = float(np.finfo(dtype).tiny), float(np.sqrt(np.finfo(dtype).max))
    a = rng.normal(0, 1, (1024, 1))
    for r in (rng.normal(0, tiny, (N, 1)),
              np.array([[top ** ((i + 1) / N) * tiny ** ((N - i - 1) / N)] for i in range(N)])):
        q = (a @ r.T).astype(dtype).astype(np.float64)
        x = q[:, R].astype(dtype)
        mt.allreduce_(x, op=mt.Adasum)
        assert close(dtype, q.mean(axis=1), x)


@needs_pow2
def test_general_arrays_match_the_numpy_tree_and_agree_bitwise():
    rng = np.random.default_rng(10 + R)
    x = rng.normal(0, 1, 1000) + (R + 1) * np.linspace(0, 1, 1000)
    rows = mt.allgather(x[None])
    got = mt.allreduce(x, op=mt.Adasum)
    np.testing.assert_allclose(got, adasum_oracle(rows), rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(got, g) for g in mt.allgather(got[None]))
    # a zero array is orthogonal to everything: the others' combination is kept
    z = mt.allreduce(np.zeros(5) if R == 0 else np.ones(5) * R, op="adasum")
    assert np.allclose(z, adasum_oracle([np.zeros(5)] + [np.ones(5) * r for r in range(1, N)]))


@needs_pow2
def test_grouped_and_async_combine_each_array_separately():
    rng = np.random.default_rng(20 + R)
    xs = [rng.normal(0, 1, (3, 4)).astype(np.float32), rng.normal(0, 1, 7)]
    outs = mt.grouped_allreduce(xs, op=mt.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    for x, out in zip(xs, outs):
        rows = mt.allgather(x.reshape(1, -1))
        assert out.shape == x.shape and out.dtype == x.dtype
        np.testing.assert_allclose(out.reshape(-1), adasum_oracle(rows), rtol=1e-5, atol=1e-6)
    h = mt.allreduce_async(xs[1], op=mt.Adasum)
    np.testing.assert_array_equal(mt.synchronize(h), outs[1])


def test_errors_raise_on_every_rank():
    if not POW2:
        with pytest.raises(ValueError, match="power-of-two"):
            mt.allreduce(np.ones(3), op=mt.Adasum)
        with pytest.raises(ValueError, match="power-of-two"):
            p = mt.nn.Parameter(np.zeros(3, np.float32))
            DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)], op=mt.Adasum)
        return
    with pytest.raises(ValueError, match="floating-point"):
        mt.allreduce(np.ones(3, np.int32), op=mt.Adasum)
    if N > 1:      # only rank 0 has a bad factor: every rank raises
        with pytest.raises((ValueError, mt.CollectiveError)):
            mt.allreduce(np.ones(3), op=mt.Adasum,
                         prescale_factor=float("nan") if R == 0 else 1.0)
        with pytest.raises(mt.CollectiveError):
            mt.allreduce(np.ones(3 + (R == 0)), op=mt.Adasum)
    p = mt.nn.Parameter(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="Adasum"):
        DistributedOptimizer(mt.optim.SGD([p], lr=0.1), [("p", p)], op=mt.Adasum,
                             average="weights")


@needs_pow2
@pytest.mark.parametrize("overlap", [True, False])
def test_distributed_optimizer_combines_each_gradient(overlap):
    p = mt.nn.Parameter(np.zeros(300, np.float32))
    q = mt.nn.Parameter(np.zeros((20, 10), np.float32))
    opt = DistributedOptimizer(mt.optim.SGD([p, q], lr=1.0), [("p", p), ("q", q)],
                               op=mt.Adasum, overlap=overlap, fusion_threshold_bytes=512)
    for t in range(3):
        rng = np.random.default_rng(100 * t + R)
        g = rng.normal(0, 1, 300).astype(np.float32)
        h = rng.normal(0, 1, (20, 10)).astype(np.float32) + R
        before_p, before_q = p.data.copy(), q.data.copy()
        p.grad[...] = g
        q.grad[...] = h
        opt.step()
        for mine, old, new in ((g, before_p, p.data), (h, before_q, q.data)):
            expected = adasum_oracle(mt.allgather(mine.reshape(1, -1))).reshape(mine.shape)
            np.testing.assert_allclose(old - new, expected, rtol=1e-4, atol=1e-5)
