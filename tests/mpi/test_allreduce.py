"""allreduce / allreduce_ under mpiexec -n 1..4 against NumPy and MPI_Allreduce as oracles.

Every rank builds every rank's input from a seed, so each can compute the exact expected result
locally (NumPy) and also ask MPI_Allreduce for it. Integers must match exactly (overflow wraps in
all three); floats to a tolerance, since the ring sums in a different order than MPI.
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import engine, world
from mpitrain.comm.ops import SATURATED_BY_MPI
from tests.support.oracles import (DTYPES, OPS, assert_matches, assert_same_on_all_ranks,
                                   numpy_oracle, rank_input, scale_copy)

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()
LENGTHS = sorted({0, 1, max(N - 1, 1), N, N + 1, 2, 3, 7, 13, 31, 1009})
MPI_OPS = {mt.Sum: MPI.SUM, mt.Average: MPI.SUM, mt.Min: MPI.MIN, mt.Max: MPI.MAX,
           mt.Product: MPI.PROD}


@pytest.mark.parametrize("path", ["ring", "mpi", "auto"])   # auto: <= 4 KiB inline in the check
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_dtype_length(dtype, op, path, use_settings):
    use_settings(algorithm=path)
    for n in LENGTHS:
        inputs = [rank_input(r, n, dtype, op) for r in range(N)]
        got = mt.allreduce(inputs[R], op=op)
        assert_matches(got, numpy_oracle(inputs, op))
        if path != "mpi":
            assert_same_on_all_ranks(got)
        # MPI itself as the oracle, where it reduces the type right (not float16; not the
        # small integers Open MPI saturates: comm/ops.py)
        if dtype != "float16" and np.dtype(dtype) not in SATURATED_BY_MPI:
            want = inputs[R].astype(got.dtype)        # float64 for an integer Average
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, want, op=MPI_OPS[op])
            if op is mt.Average:
                want = scale_copy(want, 1.0 / N)
            assert_matches(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_allreduce_in_place_returns_same_array(dtype):
    inputs = [rank_input(r, 257, dtype, mt.Sum) for r in range(N)]
    x = inputs[R].copy()
    out = mt.allreduce_(x, op=mt.Sum)
    assert out is x
    assert_matches(x, numpy_oracle(inputs, mt.Sum))


def test_allreduce_out_of_place_leaves_input():
    x = np.arange(10, dtype=np.float32) + R
    before = x.copy()
    y = mt.allreduce(x, op=mt.Sum)
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(y, N * np.arange(10) + N * (N - 1) / 2)


@pytest.mark.parametrize("path", ["ring", "mpi"])
def test_prescale_postscale(path, use_settings):
    use_settings(algorithm=path)
    inputs = [rank_input(r, 50, "float64", mt.Sum) for r in range(N)]
    for op in (mt.Sum, mt.Average):
        got = mt.allreduce(inputs[R], op=op, prescale_factor=0.5, postscale_factor=3.0)
        assert_matches(got, numpy_oracle(inputs, op, 0.5, 3.0))
    ints = [np.arange(20, dtype=np.int32) * (r + 1) for r in range(N)]
    got = mt.allreduce(ints[R], op=mt.Sum, prescale_factor=2, postscale_factor=3)
    np.testing.assert_array_equal(got, numpy_oracle(ints, mt.Sum, 2, 3))


@pytest.mark.parametrize("path", ["ring", "mpi", "auto"])
@pytest.mark.parametrize("dtype", ["uint8", "int32", "int64"])
def test_integer_average_is_a_float64_mean_never_truncated(dtype, path, use_settings):
    use_settings(algorithm=path)
    x = np.full(5, R + 1, dtype)                      # ranks hold 1, 2, ..., N
    got = mt.allreduce(x, op=mt.Average)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.full(5, (N + 1) / 2))   # [1, 2] -> 1.5, not 1
    np.testing.assert_array_equal(x, np.full(5, R + 1, dtype))
    got = mt.allreduce([R + 1, 2 * (R + 1)], op="average")         # lists too
    np.testing.assert_array_equal(got, [(N + 1) / 2, N + 1])
    outs = mt.grouped_allreduce([x, np.ones(2, np.float32)], op=mt.Average)
    assert outs[0].dtype == np.float64 and outs[1].dtype == np.float32
    np.testing.assert_array_equal(outs[0], np.full(5, (N + 1) / 2))
    rows = mt.reducescatter(np.full((N, 2), R + 1, dtype), op=mt.Average)
    np.testing.assert_array_equal(rows, np.full((1, 2), (N + 1) / 2))


def test_integer_average_in_place_raises_on_every_rank():
    x = np.full(3, R, np.int32)
    with pytest.raises(ValueError, match="Average of int32 arrays is not an integer"):
        mt.allreduce_(x, op=mt.Average)
    with pytest.raises(ValueError, match="Average of int64 arrays"):
        mt.grouped_allreduce_([np.zeros(2), np.zeros(2, np.int64)], op=mt.Average)
    np.testing.assert_array_equal(x, np.full(3, R, np.int32))      # untouched
    assert mt.allreduce_(x, op=mt.Sum) is x                          # Sum stays integer


@pytest.mark.parametrize("path", ["ring", "mpi"])
def test_non_contiguous_inputs(path, use_settings):
    use_settings(algorithm=path)
    base = np.arange(60, dtype=np.float32).reshape(6, 10) * (R + 1)  # (6, 10)
    want = np.arange(60, dtype=np.float32).reshape(6, 10) * (N * (N + 1) / 2)
    np.testing.assert_array_equal(mt.allreduce(base[:, ::3], op=mt.Sum), want[:, ::3])
    np.testing.assert_array_equal(mt.allreduce(base.T, op=mt.Sum), want.T)
    x = base.copy()
    view = x[::2, 1::2]                                                # (3, 5), strided
    assert mt.allreduce_(view, op=mt.Sum) is view
    np.testing.assert_array_equal(x[::2, 1::2], want[::2, 1::2])
    np.testing.assert_array_equal(x[1::2], base[1::2])                 # untouched rows


def test_shapes_and_scalars():
    assert mt.allreduce(np.float64(R), op=mt.Sum).shape == ()
    assert mt.allreduce(np.float64(R), op=mt.Sum) == N * (N - 1) / 2
    y = mt.allreduce(np.ones((2, 0, 3), np.float32))
    assert y.shape == (2, 0, 3)
    z = mt.allreduce([1.0, 2.0], op=mt.Sum)                            # list input
    np.testing.assert_array_equal(z, [N, 2 * N])


def test_auto_path_around_the_threshold(use_settings):
    use_settings(ring_threshold_bytes=64 * 1024)                         # keep the test small
    for n in (1023, 1025, 16383, 16385):                                 # inline, MPI, ring
        inputs = [rank_input(r, n, "float32", mt.Max) for r in range(N)]
        assert_matches(mt.allreduce(inputs[R], op=mt.Max), numpy_oracle(inputs, mt.Max))


@pytest.mark.skipif(N != 2, reason="the two-rank path rule")
@pytest.mark.parametrize("op", [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_two_ranks_take_the_ring_from_1_mib_with_mpis_bits(dtype, op, monkeypatch):
    rings = []
    ring = engine.ring_allreduce
    monkeypatch.setattr(engine, "ring_allreduce", lambda *a: rings.append(1) or ring(*a))
    rng = np.random.default_rng(7 + R)
    for nbytes in (1 << 20, (1 << 20) - 64):                           # the ring, MPI
        n = nbytes // np.dtype(dtype).itemsize
        x = (rng.standard_normal(n) * 100).astype(dtype)                  # (n,)
        del rings[:]
        got = mt.allreduce(x, op=op)
        assert len(rings) == (got.nbytes >= 1 << 20)  # an integer Average reduces float64
        want = x.astype(got.dtype)                    # float64 for an integer Average
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, want, op=MPI_OPS[op])
        if op is mt.Average:
            want = scale_copy(want, 0.5)
        np.testing.assert_array_equal(got, want)                          # the same bits


def test_large_ring_over_a_million(use_settings):
    use_settings(algorithm="ring")
    n = 1_000_003
    x = ((np.arange(n) % 5) * (R + 1)).astype(np.float32)             # (n,)
    got = mt.allreduce(x, op=mt.Sum)
    want = ((np.arange(n) % 5) * (N * (N + 1) / 2)).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert_same_on_all_ranks(got)


def test_ops_accept_strings_and_ranks_are_consistent():
    assert mt.allreduce(np.array([R]), op="max")[0] == N - 1
    assert 0 <= mt.rank() < mt.size() == N
    assert mt.local_size() * mt.cross_size() == N
    assert mt.local_rank() < mt.local_size() and mt.cross_rank() < mt.cross_size()
    assert mt.is_initialized()


def test_ring_steady_state_allocates_no_buffer(use_settings):
    """After the first call (scratch, JIT) a 4 MB ring allreduce allocates no array at all."""
    import tracemalloc
    use_settings(algorithm="ring")
    x = np.full(1 << 20, R, np.float32)                                 # (1M,) 4 MB
    mt.allreduce_(x, op=mt.Max)
    tracemalloc.start()
    try:
        mt.allreduce_(x, op=mt.Max)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"ring allocated {peak} bytes in steady state"
    assert x[0] == N - 1


@pytest.mark.parametrize("dtype", ["int16", "float16", "float64"])
def test_ring_with_many_small_subchunks(dtype, use_settings):
    """Tiny sub-chunks: many pipelined messages per step, double-buffered scratch reuse."""
    use_settings(algorithm="ring", ring_subchunk_bytes=24)
    for n in (5, 97, 1000):
        for op in (mt.Sum, mt.Max):
            inputs = [rank_input(r, n, dtype, op) for r in range(N)]
            got = mt.allreduce(inputs[R], op=op)
            assert_matches(got, numpy_oracle(inputs, op))
            assert_same_on_all_ranks(got)


# --- steady state: repeated calls reuse a validated plan (host._Plan) ---------------------------

@pytest.mark.parametrize("path", ["auto", "mpi", "ring"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_calls_match_the_first(dtype, path, use_settings):
    """The second identical call takes the cached plan: same bits as the general path, in place
    and out of place, for every op, small (inline) and larger (MPI/ring) sizes."""
    use_settings(algorithm=path)                        # a new World: no plans yet
    plans = world.current().plans
    for n, shape in ((0, (0,)), (1, ()), (7, (7,)), (12, (3, 4)), (1024, (1024,)),
                     (3000, (3000,))):
        for op in OPS:
            first = [rank_input(r, n, dtype, op, seed=0).reshape(shape) for r in range(N)]
            inputs = [rank_input(r, n, dtype, op, seed=1).reshape(shape) for r in range(N)]
            mt.allreduce(first[R], op=op, postscale_factor=0.5)           # leaves a plan
            planned = mt.allreduce(inputs[R], op=op, postscale_factor=0.5)
            x = inputs[R].copy()
            if op is mt.Average and x.dtype.kind != "f":  # a float64 mean: none in place
                x = planned.copy()
            else:
                assert mt.allreduce_(x, op=op, postscale_factor=0.5) is x
            plans.clear()
            general = mt.allreduce(inputs[R], op=op, postscale_factor=0.5)
            assert planned.shape == x.shape == general.shape == shape
            assert planned.tobytes() == x.tobytes() == general.tobytes(), (n, op)
            assert inputs[R].tobytes() == rank_input(R, n, dtype, op, 1).tobytes()  # untouched
            assert_matches(planned, numpy_oracle(inputs, op, 1.0, 0.5))
    assert bool(plans) == (N > 1), "plans exist exactly when there is a check"


@pytest.mark.skipif(N == 1, reason="a mismatch needs two ranks")
def test_cached_plan_still_detects_a_mismatch():
    """Rank 0 repeats a cached call while the others change shape: CollectiveError everywhere."""
    x = np.ones(8, np.float32)
    mt.allreduce(x)
    mt.allreduce(x)                                                   # plan cached everywhere
    y = x if R == 0 else np.ones(9, np.float32)
    with pytest.raises(mt.CollectiveError, match="shape differs"):
        mt.allreduce(y)
    np.testing.assert_array_equal(mt.allreduce(x, op=mt.Sum), np.full(8, N))


def test_plan_never_accepts_what_the_general_path_rejects():
    x = np.ones(4)
    mt.allreduce(x, prescale_factor=1.0)
    mt.allreduce(x, prescale_factor=1.0)
    with pytest.raises(ValueError, match="prescale_factor=True is not a number"):
        mt.allreduce(x, prescale_factor=True)                          # True == 1.0 as a key
    read_only = np.ones(4)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        mt.allreduce_(read_only)
    mt.allreduce(x, name=["unhashable"])                               # no plan, still works


def test_no_plans_and_no_exchange_when_the_check_is_off(use_settings, monkeypatch):
    """With the agreement off (MPITRAIN_CHECK=0) no call exchanges anything, a repeated one
    included: plans are only made where there is a check."""
    use_settings(check=False)
    state = world.current()
    sent = []
    monkeypatch.setattr(state.agreement, "exchange", lambda *args: sent.append(args))
    x = np.full(16, R + 1.0, np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(mt.allreduce(x, op=mt.Sum), np.full(16, N * (N + 1) / 2))
    assert sent == [] and state.plans == {}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_ring_scales_each_chunk_once_where_it_is_reduced(dtype, use_settings):
    """The ring applies Average's 1/N (and postscale) to the chunk each rank completes, before
    the allgather: bitwise the same as scaling the whole summed buffer afterwards."""
    use_settings(algorithm="ring", ring_subchunk_bytes=40)             # several pieces a chunk
    for n in (1, N + 1, 257):
        x = rank_input(R, n, dtype, mt.Sum)
        if x.dtype.kind == "i":
            x %= 1000                                   # x 3.0 must stay within int32
        total = mt.allreduce(x, op=mt.Sum)
        for op, post in ((mt.Average, 1.0), (mt.Average, 3.0), (mt.Sum, 0.25)):
            mean = op is mt.Average and x.dtype.kind == "i"      # an integer mean: float64
            want = total.astype(np.float64) if mean else total.copy()
            factor = post / N if op is mt.Average else post
            engine.scale(want, factor)
            got = mt.allreduce(x, op=op, postscale_factor=post)
            assert got.tobytes() == want.tobytes(), (n, op, post)
            assert_same_on_all_ranks(got)
