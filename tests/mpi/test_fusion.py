"""grouped_allreduce through the fusion buffer: round trip, bucket splitting, fixed plan."""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()


def model_like(rank):
    """A gradient-like list: mixed shapes and dtypes, a non-contiguous view, an empty array."""
    rng = np.random.default_rng([7, rank])
    big = rng.standard_normal((8, 6)).astype(np.float32)
    return [rng.standard_normal((5, 3)).astype(np.float32),
            rng.standard_normal(7),                                     # float64
            big[:, ::2],                                                # non-contiguous (8, 3)
            np.zeros(0, np.float32),
            rng.integers(-50, 50, 11).astype(np.int32),
            rng.standard_normal((2, 2, 2)).astype(np.float32)]


def expected(op=mt.Average):
    parts = [model_like(r) for r in range(N)]
    out = []
    for i in range(len(parts[0])):
        total = sum(p[i].astype(np.float64) for p in parts)
        if op is mt.Average:
            total = total / N
        out.append(total)
    return out


@pytest.mark.parametrize("threshold", [None, "0", "64", "100000"])
def test_grouped_round_trip_any_threshold(threshold, use_settings):
    if threshold is not None:
        use_settings(fusion_threshold_bytes=int(threshold))
    xs = model_like(R)
    for op in (mt.Sum, mt.Average):
        outs = mt.grouped_allreduce(xs, op=op)
        for got, x, want in zip(outs, xs, expected(op)):
            mean = op is mt.Average and x.dtype.kind == "i"          # a float64 mean
            assert got.shape == x.shape and got.dtype == (np.float64 if mean else x.dtype)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_in_place_and_deterministic():
    xs = model_like(R)
    first = mt.grouped_allreduce([x.copy() for x in xs], op=mt.Sum)
    ys = [x.copy() for x in xs]
    outs = mt.grouped_allreduce_(ys, op=mt.Sum)
    assert all(o is y for o, y in zip(outs, ys))
    for a, b in zip(first, ys):
        assert a.tobytes() == b.tobytes()                               # bitwise rerun
    assert mt.grouped_allreduce([]) == []


def test_buckets_split_when_over_threshold(use_settings):
    use_settings(fusion_threshold_bytes=40 * 4)                         # 40 float32 elements
    xs = [np.full(n, R + 1.0, np.float32) for n in (10, 20, 15, 50, 5)]
    outs = mt.grouped_allreduce(xs, op=mt.Sum)
    for x, o in zip(xs, outs):
        np.testing.assert_array_equal(o, np.full(x.shape, N * (N + 1) / 2))
    fusion = world.current().fusion
    plan = fusion.plan(xs)
    assert [[e[0] for e in b.entries] for b in plan] == [[0, 1], [2], [3], [4]]
    # The shared buffer never exceeds the threshold: the 50-element array went direct.
    assert fusion.buffer_sizes()[np.dtype(np.float32)] <= 40
