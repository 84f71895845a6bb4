"""Hierarchical allreduce (comm/hierarchical.py) against the flat allreduce and MPI, N = 1..4.

Four ranks run as two emulated nodes of two (MPITRAIN_NODE_SIZE=2, the CommSettings field
``local_size``), switched on by re-initialising with other settings (tests/support/comm.py).
Every comparison computes the flat result first (same data, same forced path, hierarchical
off), then the hierarchical one: integers and float Min/Max must be bitwise equal, float sums
within a tolerance (the additions happen in another order); the result must also match MPI's
own Allreduce on COMM_WORLD (the mpi4py oracle; NumPy for float16) and be identical on every
rank. At N < 4 nothing has two levels (a node size must divide N and lie strictly between 1 and
N), so those tests skip, and the settings tests check that hierarchical stays off.
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import overlap, world
from mpitrain.comm.engine import allreduce_flat
from tests.support.comm import comm_settings
from tests.support.oracles import assert_same_on_all_ranks, numpy_oracle, rank_input, scale_copy

COMM = MPI.COMM_WORLD
N, R = COMM.Get_size(), COMM.Get_rank()
TWO_LEVELS = N == 4
needs_two_levels = pytest.mark.skipif(not TWO_LEVELS, reason="2x2 emulated nodes need 4 ranks")

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
OPS = [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product]
MPI_OPS = {mt.Sum: MPI.SUM, mt.Average: MPI.SUM, mt.Min: MPI.MIN, mt.Max: MPI.MAX,
           mt.Product: MPI.PROD}
# 0, 1, primes, lengths not divisible by the node size or N, and beyond the 4 KiB inline limit
LENGTHS = [0, 1, 2, 3, 5, 7, 13, 127, 1021, 4099]
# (algorithm, ring sub-chunk bytes, ring threshold): tiny sub-chunks pipeline each chunk in
# many pieces; the small threshold makes "auto" take the ring above 2 KiB
PATHS = [("mpi", 1 << 20, 32 << 20), ("ring", 24, 32 << 20), ("auto", 40, 2048)]


def _hier(path, **extra):
    algo, sub, threshold = path
    return comm_settings(algorithm=algo, ring_subchunk_bytes=sub, ring_threshold_bytes=threshold,
                         **extra)


def _run(x, op, pre, post, in_place):
    if in_place:
        y = x.copy()
        mt.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
        return y
    return mt.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)


def _mpi_oracle(inputs, op, pre, post):
    """MPI's Allreduce on COMM_WORLD of this rank's prescaled input; NumPy for float16 (MPI has
    no float16 reduction) and for the integer Average (a float64 mean)."""
    mine = inputs[R]
    if mine.dtype == np.float16 or (op is mt.Average and mine.dtype.kind != "f"):
        return numpy_oracle(inputs, op, pre, post)
    send = scale_copy(mine, pre)
    out = np.empty_like(send)
    COMM.Allreduce(send, out, op=MPI_OPS[op])
    return scale_copy(out, post / N if op is mt.Average else post)


def _assert_close(got, want, flat, exact):
    assert got.dtype == want.dtype == flat.dtype and got.shape == want.shape == flat.shape
    if exact:
        np.testing.assert_array_equal(got, flat)
    tol = {np.dtype(np.float16): 2e-2}.get(got.dtype, 1e-5)
    if got.dtype.kind == "f":
        for ref in (want, flat):
            np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64),
                                       rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)
    assert_same_on_all_ranks(got)


def _exact(dtype, op):
    """Which results must be the flat one's bits: no rounding can differ."""
    kind = np.dtype(dtype).kind
    return (kind != "f" and op is not mt.Average) or op in (mt.Min, mt.Max)


# --- settings ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [k for k in range(1, N + 1) if N % k == 0])
def test_hierarchical_runs_only_with_two_levels_of_equal_nodes(k):
    with comm_settings(hierarchical=True, local_size=k):
        state = world.current()
        assert (state.node_comms is not None) == (1 < k < N)
        assert (mt.local_size(), mt.cross_size()) == (k, N // k)
        x = np.arange(10, dtype=np.int64) + R
        np.testing.assert_array_equal(mt.allreduce(x, op=mt.Sum, name="levels"),
                                      N * np.arange(10) + N * (N - 1) // 2)
    assert world.current().node_comms is None          # the previous settings are back


def test_node_size_and_its_alias_are_one_setting(monkeypatch):
    mt.shutdown()
    try:
        k = 2 if N % 2 == 0 else 1
        for env in ({"MPITRAIN_NODE_SIZE": str(k)}, {"MPITRAIN_LOCAL_SIZE": str(k)},
                    {"MPITRAIN_NODE_SIZE": str(k), "MPITRAIN_LOCAL_SIZE": str(k)}):
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            mt.init(threads=None)
            assert world.current().settings.local_size == k and mt.local_size() == k
            mt.shutdown()
            for key in env:
                monkeypatch.delenv(key)
        monkeypatch.setenv("MPITRAIN_NODE_SIZE", "1")
        monkeypatch.setenv("MPITRAIN_LOCAL_SIZE", "2")
        with pytest.raises(ValueError, match="MPITRAIN_NODE_SIZE=1 but its alias "
                                             "MPITRAIN_LOCAL_SIZE=2: set one of the two"):
            mt.init(threads=None)
        monkeypatch.delenv("MPITRAIN_LOCAL_SIZE")
        monkeypatch.delenv("MPITRAIN_NODE_SIZE")
        monkeypatch.setenv("MPITRAIN_HIERARCHICAL_ALLREDUCE", "maybe")
        with pytest.raises(ValueError, match="MPITRAIN_HIERARCHICAL_ALLREDUCE='maybe': expected "
                                             "1/0, true/false"):
            mt.init(threads=None)
        monkeypatch.delenv("MPITRAIN_HIERARCHICAL_ALLREDUCE")
        monkeypatch.setenv("MPITRAIN_NODE_SIZE", str(N + 1))
        with pytest.raises(ValueError, match=r"MPITRAIN_NODE_SIZE \(alias MPITRAIN_LOCAL_SIZE\)"):
            mt.init(threads=None)
    finally:
        for key in ("MPITRAIN_NODE_SIZE", "MPITRAIN_LOCAL_SIZE", "MPITRAIN_HIERARCHICAL_ALLREDUCE"):
            monkeypatch.delenv(key, raising=False)
        mt.shutdown()
        mt.init(threads=None)


@pytest.mark.skipif(N < 2, reason="a difference across ranks needs two ranks")
def test_ranks_asking_differently_raise_at_init_on_every_rank(monkeypatch):
    mt.shutdown()
    try:
        monkeypatch.setenv("MPITRAIN_HIERARCHICAL_ALLREDUCE", "1" if R == 0 else "0")
        with pytest.raises(mt.CollectiveError, match="MPITRAIN_HIERARCHICAL_ALLREDUCE differs"):
            mt.init(threads=None)
    finally:
        monkeypatch.delenv("MPITRAIN_HIERARCHICAL_ALLREDUCE")
        mt.init(threads=None)


# --- results -------------------------------------------------------------------------------------

@needs_two_levels
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_every_dtype_op_and_length_equals_the_flat_allreduce(path):
    cases = [(dtype, op, n, pre, post, in_place)
             for i, (dtype, op) in enumerate((d, o) for d in DTYPES for o in OPS)
             for j, n in enumerate(LENGTHS)
             for pre, post in ([(1.0, 1.0)] if (i + j) % 3 else [(0.5, 3.0)])
             for in_place in [(i + j) % 2 == 1 and not (op is mt.Average
                                                        and np.dtype(dtype).kind != "f")]]
    inputs = [[rank_input(r, n, dtype, op, seed) for r in range(N)]
              for seed, (dtype, op, n, _, _, _) in enumerate(cases)]
    with _hier(path):
        flat = [_run(xs[R], op, pre, post, ip) for xs, (_, op, _, pre, post, ip)
                in zip(inputs, cases)]
    with _hier(path, hierarchical=True, local_size=2):
        assert world.current().node_comms is not None
        got = [_run(xs[R], op, pre, post, ip) for xs, (_, op, _, pre, post, ip)
               in zip(inputs, cases)]
    for g, f, xs, (dtype, op, n, pre, post, _) in zip(got, flat, inputs, cases):
        _assert_close(g, _mpi_oracle(xs, op, pre, post), f, _exact(dtype, op))


@needs_two_levels
@pytest.mark.parametrize("path", PATHS[:2], ids=[p[0] for p in PATHS[:2]])
def test_grouped_allreduce_through_the_fusion_buffer(path):
    shapes = [(3,), (0,), (5, 7), (1,), (129,), (2, 3, 5)]
    xs = [rank_input(R, int(np.prod(s)), "float32", mt.Sum, i).reshape(s)
          for i, s in enumerate(shapes)]
    ints = [rank_input(R, int(np.prod(s)), "int32", mt.Sum, 50 + i).reshape(s)
            for i, s in enumerate(shapes)]
    results = []
    for hierarchical in (False, True):
        with _hier(path, hierarchical=hierarchical, local_size=2):
            av = mt.grouped_allreduce(xs + ints[:2], op=mt.Average, fusion_threshold_bytes=256)
            sums = [x.copy() for x in ints]
            mt.grouped_allreduce_(sums, op=mt.Sum, fusion_threshold_bytes=64)
            results.append((av, sums))
    (flat_av, flat_sums), (av, sums) = results
    for g, f in zip(av[:len(xs)], flat_av[:len(xs)]):
        np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-6)
    for g, f in zip(av[len(xs):] + sums, flat_av[len(xs):] + flat_sums):
        np.testing.assert_array_equal(g, f)
        assert_same_on_all_ranks(g)


@needs_two_levels
def test_overlap_buckets_take_the_hierarchical_path():
    specs = [((37,), np.float64), ((5, 11), np.float64), ((1,), np.float64), ((300,), np.int64)]
    arrays = [rank_input(R, int(np.prod(s)), d, mt.Sum, 7 + i).reshape(s)
              for i, (s, d) in enumerate(specs)]
    outs = []
    for hierarchical in (False, True):
        with _hier(PATHS[1], hierarchical=hierarchical, local_size=2):
            buckets = overlap.BucketAllreduce(specs, 200,
                                              lambda flat: allreduce_flat(world.current(), flat,
                                                                          mt.Sum),
                                              {"name": "hier overlap"})
            work = [a.copy() for a in arrays]
            for i in reversed(range(len(work))):
                buckets.ready(i, work[i])
            outs.append(buckets.finish(work))
    for g, f in zip(*outs):
        if g.dtype.kind == "f":
            np.testing.assert_allclose(g, f, rtol=1e-12, atol=1e-12)
        else:
            np.testing.assert_array_equal(g, f)
        assert_same_on_all_ranks(g)


@needs_two_levels
def test_the_levels_are_the_emulated_nodes():
    with _hier(PATHS[1], hierarchical=True, local_size=2):
        local, cross = world.current().node_comms
        assert local.allgather(R) == [R - R % 2, R - R % 2 + 1]       # consecutive ranks
        assert cross.allgather(R) == [R % 2, R % 2 + 2]               # same local rank


# --- fuzz ----------------------------------------------------------------------------------------

FUZZ_CASES = 48


def _fuzz_case(i):
    rng = np.random.default_rng([20261123, i])
    dtype = DTYPES[rng.integers(len(DTYPES))]
    op = OPS[rng.integers(len(OPS))]
    n = int(rng.choice([0, 1, 2, 3, 4, 5, 7, 11, 31, 97, 257, 1021, 2053, 8191]))
    pre, post = (1.0, 1.0) if rng.random() < 0.6 else (float(rng.choice([0.5, 2.0])),
                                                         float(rng.choice([0.25, 3.0])))
    in_place = bool(rng.random() < 0.4) and not (op is mt.Average and np.dtype(dtype).kind != "f")
    path = PATHS[rng.integers(len(PATHS))]
    return dtype, op, n, pre, post, in_place, path


@needs_two_levels
def test_fuzz_against_flat_and_mpi():
    cases = [_fuzz_case(i) for i in range(FUZZ_CASES)]
    inputs = [[rank_input(r, n, dtype, op, 1000 + i) for r in range(N)]
              for i, (dtype, op, n, _, _, _, _) in enumerate(cases)]
    failures = []
    for path in PATHS:                  # one re-initialisation per path and side, not per case
        mine = [i for i, case in enumerate(cases) if case[6] == path]
        results = []
        for hierarchical in (False, True):
            with _hier(path, hierarchical=hierarchical, local_size=2):
                results.append([_run(inputs[i][R], *cases[i][1:2], *cases[i][3:6])
                                for i in mine])
        for i, flat, got in zip(mine, *results):
            dtype, op, n, pre, post, in_place, _ = cases[i]
            try:
                _assert_close(got, _mpi_oracle(inputs[i], op, pre, post), flat,
                              _exact(dtype, op))
            except AssertionError as exc:
                failures.append(f"case {i} {cases[i]}: {exc}")
    assert not failures, "\n".join(failures)
