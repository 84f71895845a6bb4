"""allgather, broadcast, reducescatter, alltoall, objects, barrier, local/cross ranks (N = 1..4)."""
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_uneven_first_dims(dtype):
    rows = [(r * 2 + 1) % 5 for r in range(N)]                         # 1, 3, 0, 2 rows
    parts = [np.full((rows[r], 3), r + 1, dtype) for r in range(N)]   # (rows_r, 3)
    got = mt.allgather(parts[R])
    np.testing.assert_array_equal(got, np.concatenate(parts))
    assert got.dtype == np.dtype(dtype)


def test_allgather_empty_and_non_contiguous():
    got = mt.allgather(np.zeros((0, 2), np.float32) if R % 2 else np.ones((1, 2), np.float32))
    assert got.shape == (sum(1 - r % 2 for r in range(N)), 2)
    x = np.arange(12.0).reshape(3, 4) + R                              # (3, 4)
    got = mt.allgather(x[:, ::2])
    np.testing.assert_array_equal(got, np.concatenate([(np.arange(12.0).reshape(3, 4) + r)[:, ::2]
                                                       for r in range(N)]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_every_root(dtype):
    for root in range(N):
        x = np.full((2, 3), R + 1, dtype)
        y = mt.broadcast(x, root)
        np.testing.assert_array_equal(y, np.full((2, 3), root + 1, dtype))
        np.testing.assert_array_equal(x, np.full((2, 3), R + 1, dtype))  # out of place
        assert mt.broadcast_(x, root_rank=root) is x
        np.testing.assert_array_equal(x, np.full((2, 3), root + 1, dtype))


def test_broadcast_in_place_non_contiguous_and_empty():
    x = np.zeros((4, 4), np.float32) + R
    mt.broadcast_(x[:, 1], N - 1)
    np.testing.assert_array_equal(x[:, 1], np.full(4, N - 1))
    np.testing.assert_array_equal(x[:, 0], np.full(4, R))
    assert mt.broadcast(np.zeros(0), 0).shape == (0,)


@pytest.mark.parametrize("rows", sorted({0, 1, max(N - 1, 1), N, N + 1, 7}))
@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_uneven(rows, dtype):
    inputs = [np.arange(rows * 2).reshape(rows, 2).astype(dtype) * (r + 1) for r in range(N)]
    total = sum(x.astype(np.float64) for x in inputs)
    wrapped = np.sum(np.stack(inputs), axis=0, dtype=dtype).astype(np.float64)  # ints wrap
    base, extra = divmod(rows, N)
    counts = [base + (r < extra) for r in range(N)]
    start = sum(counts[:R])
    got = mt.reducescatter(inputs[R], op=mt.Sum)
    assert got.shape == (counts[R], 2) and got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), wrapped[start:start + counts[R]],
                               rtol=1e-2)
    avg = mt.reducescatter(inputs[R].astype(np.float64), op=mt.Average, postscale_factor=2.0)
    np.testing.assert_allclose(avg, 2 * total[start:start + counts[R]] / N)


def test_alltoall_even_and_with_splits():
    x = np.repeat(np.arange(N) + 10 * R, 2).astype(np.float32)        # (2N,) block j -> rank j
    got = mt.alltoall(x)
    np.testing.assert_array_equal(got, np.repeat(R + 10 * np.arange(N), 2))
    # Rank r sends (j + r) % 3 rows (0, 1 or 2) of value 100*r + j to rank j.
    splits = [(j + R) % 3 for j in range(N)]
    rows = np.concatenate([np.full((s, 2), 100 * R + j) for j, s in enumerate(splits)])
    out, received = mt.alltoall(rows.astype(np.int64), splits=splits)
    want_counts = [(R + r) % 3 for r in range(N)]
    np.testing.assert_array_equal(received, want_counts)
    want = np.concatenate([np.full((c, 2), 100 * r + R) for r, c in enumerate(want_counts)])
    np.testing.assert_array_equal(out, want.reshape(-1, 2))


def test_objects_and_barrier():
    assert mt.broadcast_object({"from": R, "list": [1, 2]}, root_rank=N - 1) == \
        {"from": N - 1, "list": [1, 2]}
    assert mt.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    mt.barrier()


def test_local_and_cross_ranks_with_fake_hosts(monkeypatch):
    """MPITRAIN_LOCAL_SIZE fakes hosts of k consecutive ranks; re-init picks it up."""
    k = 2 if N % 2 == 0 else 1
    mt.shutdown()
    monkeypatch.setenv("MPITRAIN_LOCAL_SIZE", str(k))
    try:
        mt.init()
        assert (mt.local_rank(), mt.local_size()) == (R % k, k)
        assert (mt.cross_rank(), mt.cross_size()) == (R // k, N // k)
        # The local communicator really groups those ranks.
        assert world.local_comm().allgather(R) == [R - R % k + i for i in range(k)]
    finally:
        mt.shutdown()
        monkeypatch.delenv("MPITRAIN_LOCAL_SIZE")
        mt.init()
    assert mt.local_size() * mt.cross_size() == N


def test_bad_local_size_is_one_clear_error(monkeypatch):
    mt.shutdown()
    monkeypatch.setenv("MPITRAIN_LOCAL_SIZE", str(N + 1) if N > 1 else "zero")
    try:
        with pytest.raises(ValueError, match="MPITRAIN_LOCAL_SIZE"):
            mt.init()
    finally:
        monkeypatch.delenv("MPITRAIN_LOCAL_SIZE")
        mt.init()


def test_init_is_idempotent_and_rejects_other_comm():
    mt.init()
    mt.init(MPI.COMM_WORLD)
    with pytest.raises(RuntimeError, match="another communicator"):
        mt.init(MPI.COMM_SELF)


def test_broadcast_parameters_dict_and_named():
    params = {"b": np.full(3, R, np.float32), "a": np.full((2, 2), -R, np.float64)}
    mt.broadcast_parameters(params, root_rank=N - 1)
    np.testing.assert_array_equal(params["b"], np.full(3, N - 1))
    np.testing.assert_array_equal(params["a"], np.full((2, 2), -(N - 1)))

    class P:
        def __init__(self, a):
            self.data = a
    named = [("w", P(np.full(4, R + 0.5))), ("bias", P(np.full(1, R, np.int64)))]
    mt.broadcast_parameters(named)
    assert named[0][1].data.tolist() == [0.5] * 4 and named[1][1].data.tolist() == [0]


def test_env_is_clean():
    assert "MPITRAIN_LOCAL_SIZE" not in os.environ
