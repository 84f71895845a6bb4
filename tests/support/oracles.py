"""Oracles for the collective tests: per-rank inputs every rank can rebuild, and the expected
result computed with NumPy (tests/mpi/test_allreduce.py, test_properties.py)."""
import numpy as np
from mpi4py import MPI

import mpitrain as mt

N = MPI.COMM_WORLD.Get_size()
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
OPS = [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product]
NP_OPS = {mt.Sum: np.add, mt.Average: np.add, mt.Min: np.minimum, mt.Max: np.maximum,
          mt.Product: np.multiply}


def rank_input(rank, n, dtype, op, seed=0):
    rng = np.random.default_rng([seed, rank, n])
    dt = np.dtype(dtype)
    if dt.kind == "f":
        low, high = (0.5, 1.5) if op is mt.Product else (-4, 4)
        return rng.uniform(low, high, n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


def numpy_oracle(inputs, op, pre=1.0, post=1.0, size=None):
    """The expected allreduce of ``inputs`` (one per rank) on ``size`` ranks (default: all)."""
    size = N if size is None else size
    if op is mt.Average and inputs[0].dtype.kind != "f":   # NumPy's mean: a float64
        inputs = [x.astype(np.float64) for x in inputs]
    dt = inputs[0].dtype
    scaled = [scale_copy(x, pre) for x in inputs]
    acc = scaled[0].copy()
    for x in scaled[1:]:
        NP_OPS[op](acc, x, out=acc)
    return scale_copy(acc, post / size if op is mt.Average else post).astype(dt)


def scale_copy(x, factor):
    y = x.copy()
    if factor != 1.0:
        np.multiply(y, factor, out=y, casting="unsafe")
    return y


def assert_matches(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":
        tol = 2e-2 if got.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def assert_same_on_all_ranks(x):
    """The result must be bitwise identical on every rank (replicas must not drift)."""
    ref = MPI.COMM_WORLD.bcast(x.tobytes(), root=0)
    assert x.tobytes() == ref


def adasum_oracle(rows):
    """Adasum of ``rows`` (one array per rank) in float64, as Horovod defines it: pairs (0, 1),
    (2, 3), ... combined as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, then pairs of those."""
    level = [np.asarray(r, np.float64) for r in rows]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            d = a @ b
            ca = 1 - d / (2 * (a @ a)) if a @ a > 0 else 1.0      # a zero array: orthogonal
            cb = 1 - d / (2 * (b @ b)) if b @ b > 0 else 1.0
            nxt.append(ca * a + cb * b)
        level = nxt
    return level[0]
