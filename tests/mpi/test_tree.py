"""comm/tree.py: the fixed reduction tree gives the same bits for every power-of-two N.

The global leaves (M = 8 micro-shard "gradients") are drawn from one seed on every rank, with a
wide dynamic range so that summation order shows in the last bits (checked: a sequential sum
differs from the tree's). Rank r adds its contiguous M/N leaves pairwise, then tree_allreduce
combines the ranks; the result must be byte-identical to one process adding all M leaves.
"""
import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm.tree import PairwiseSum, is_power_of_two, tree_allreduce
from mpitrain.kernels.cpu import reduce_into

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
M = 8


def leaves(n, dtype, seed=3):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-6, 6, size=(M, n))                  # (M, n) orders of magnitude
    return (rng.standard_normal((M, n)) * scale).astype(dtype)         # (M, n)


def pairwise(rows):
    acc = PairwiseSum(lambda: np.empty_like(rows[0]), np.copyto,
                      lambda d, s: reduce_into(d, s, "sum"))
    for row in rows:
        acc.add(row)
    return acc.result().copy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1001])
def test_same_bits_as_one_process(n, dtype):
    if not is_power_of_two(SIZE):
        pytest.skip("power-of-two N only (N=3 is refused: test_refuses_other_sizes)")
    g = leaves(n, dtype)
    want = pairwise(g)
    if n >= 64:   # the data is such that the order of additions matters
        sequential = g[0].copy()
        for row in g[1:]:
            sequential += row
        assert sequential.tobytes() != want.tobytes()
    per = M // SIZE
    buf = pairwise(g[RANK * per:(RANK + 1) * per])
    tree_allreduce(COMM, buf, lambda d, s: reduce_into(d, s, "sum"),
                   np.empty(max(1, (n + 1) // 2), dtype))
    assert buf.tobytes() == want.tobytes()
    gathered = COMM.allgather(buf.tobytes())
    assert all(b == gathered[0] for b in gathered)


def test_refuses_other_sizes():
    buf = np.ones(4, np.float32)
    if is_power_of_two(SIZE):
        tree_allreduce(COMM, buf, lambda d, s: reduce_into(d, s, "sum"), np.empty(2, np.float32))
        assert np.all(buf == SIZE)
    else:
        with pytest.raises(ValueError, match="power-of-two number of ranks, got 3"):
            tree_allreduce(COMM, buf, lambda d, s: reduce_into(d, s, "sum"),
                           np.empty(2, np.float32))


def test_pairwise_sum_is_the_tree():
    rows = leaves(5, np.float32)
    got = pairwise(rows)
    r = rows.astype(np.float32)
    want = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    assert got.tobytes() == want.tobytes()
    acc = PairwiseSum(lambda: np.empty(5, np.float32), np.copyto,
                      lambda d, s: np.add(d, s, out=d))
    for row in rows[:3]:
        acc.add(row)
    with pytest.raises(ValueError, match="power-of-two number of leaves, got 3"):
        acc.result()
