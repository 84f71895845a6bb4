"""The collectives on communicators other than COMM_WORLD (mpi4py's practice: World, a Dup, a
Split half): mt.init(comm) builds a World for that communicator, and every collective, its
agreement, plans and fusion buffers live there. Oracles are MPI's own calls on the same comm.
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world
from tests.support.oracles import DTYPES, OPS, assert_matches, numpy_oracle, rank_input

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()


@pytest.fixture(params=["world", "dup", "split-half"])
def comm(request):
    """mpitrain initialised on that communicator for the test; COMM_WORLD again afterwards."""
    made = {"world": lambda: WORLD, "dup": WORLD.Dup,
            "split-half": lambda: WORLD.Split(int(R >= N // 2), R)}[request.param]()
    settings = world.current().settings
    mt.shutdown()
    mt.init(made, threads=None, settings=settings)
    try:
        yield made
    finally:
        mt.shutdown()
        if made is not WORLD:
            made.Free()
        mt.init(WORLD, threads=None, settings=settings)


def _inputs(comm, n, dtype, op, seed):
    """Every rank of ``comm``'s input, built from seeds (each rank can rebuild all of them)."""
    return [rank_input(r, n, dtype, op, seed) for r in range(comm.Get_size())]


def test_rank_and_size_are_the_communicators(comm):
    assert (mt.rank(), mt.size()) == (comm.Get_rank(), comm.Get_size())
    assert world.comm() is comm


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_against_the_oracle(comm, dtype):
    me = comm.Get_rank()
    for n in (0, 1, 7, 1031, 3000):
        for op in OPS:
            inputs = _inputs(comm, n, dtype, op, seed=n)
            want = numpy_oracle(inputs, op, size=comm.Get_size())
            assert_matches(mt.allreduce(inputs[me], op=op), want)
            assert_matches(mt.allreduce(inputs[me], op=op), want)        # the cached plan
            x = inputs[me].copy()
            if op is mt.Average and x.dtype.kind != "f":
                continue                                                 # refused in place
            mt.allreduce_(x, op=op)
            assert_matches(x, want)


def test_grouped_allgather_broadcast_reducescatter_alltoall(comm):
    size, me = comm.Get_size(), comm.Get_rank()
    xs = [np.full(5, me + 1.0, np.float32), np.arange(3.0) * (me + 1), np.zeros(0)]
    outs = mt.grouped_allreduce(xs, op=mt.Sum, fusion_threshold_bytes=16)
    total = size * (size + 1) / 2
    for got, want in zip(outs, [np.full(5, total), np.arange(3.0) * total, np.zeros(0)]):
        np.testing.assert_array_equal(got, want)
    rows = mt.allgather(np.full((me + 1, 2), me, np.int32))
    np.testing.assert_array_equal(rows[:, 0], np.repeat(np.arange(size), np.arange(1, size + 1)))
    np.testing.assert_array_equal(mt.broadcast(np.full(3, float(me)), size - 1),
                                  np.full(3, float(size - 1)))
    x = np.arange(2 * size + 1, dtype=np.float64).reshape(-1, 1) * (me + 1)
    mine = mt.reducescatter(x, op=mt.Sum)
    want = np.empty_like(mine)
    counts = [(2 * size + 1) // size + (r < (2 * size + 1) % size) for r in range(size)]
    comm.Reduce_scatter(np.ascontiguousarray(x).reshape(-1), want.reshape(-1), counts,
                        op=MPI.SUM)
    np.testing.assert_array_equal(mine, want)
    out = mt.alltoall(np.full((size, 2), me, np.int64))
    np.testing.assert_array_equal(out[:, 0], np.arange(size))
    assert mt.allgather_object(me) == list(range(size))
    assert mt.broadcast_object({"me": me}, root_rank=0) == {"me": 0}


def test_a_mismatch_is_a_collective_error_on_the_sub_communicator(comm):
    if comm.Get_size() == 1:
        pytest.skip("a mismatch needs two ranks in the communicator")
    with pytest.raises(mt.CollectiveError, match="shape differs"):
        mt.allreduce(np.zeros(comm.Get_rank() + 1))
    np.testing.assert_array_equal(mt.allreduce(np.ones(2), op=mt.Sum),
                                  np.full(2, comm.Get_size()))


def test_collective_numbers_agree_again_after_a_split_half():
    """A half of one rank makes no agreements, a half of two does: back on COMM_WORLD the stall
    watchdog's numbers ("collective #k") must name the same collective on every rank again."""
    settings = world.current().settings
    half = WORLD.Split(int(R >= N // 2), R)
    mt.shutdown()
    mt.init(half, threads=None, settings=settings)
    for _ in range(3 + int(R >= N // 2)):       # the halves: different counts
        mt.allreduce(np.ones(2), name="half")
    mt.shutdown()
    half.Free()
    mt.init(WORLD, threads=None, settings=settings)
    from mpitrain.comm import watchdog
    assert len(set(mt.allgather_object(watchdog.record().seq))) == 1
