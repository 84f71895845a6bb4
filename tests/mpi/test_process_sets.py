"""Process sets (mpitrain/comm/process_sets.py) under 1-4 ranks.

Every collective on a set is compared with mpi4py on the same subgroup (a Split of COMM_WORLD)
and with the NumPy oracle over the members' inputs (tests/support/oracles.py). The set used by
most tests is SET: ranks [0, 2] at N=3 (the README's example), [0, 2, 3] at N=4 (three members,
one outsider), every rank at N <= 2 (a set is then a second communicator over the same ranks,
which still proves the set's own World is what the collectives use). Outsider tests need N >= 3
and skip below. Every rank makes the same add/remove calls in the same order.
"""
import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import watchdog, world
from tests.support.comm import comm_settings
from tests.support.oracles import (DTYPES, assert_matches, assert_same_on_all_ranks,
                                   numpy_oracle, rank_input)

mt.init()
R, N = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
SET = [r for r in range(N) if r != 1] if N >= 3 else list(range(N))
MEMBER = R in SET
SET_RANK = SET.index(R) if MEMBER else -1

with_outsider = pytest.mark.skipif(N < 3, reason="needs a rank outside the set (N >= 3)")
multi_rank = pytest.mark.skipif(N < 2, reason="needs at least 2 ranks")


@pytest.fixture
def ps():
    """SET added for one test, removed afterwards (every rank)."""
    s = mt.add_process_set(SET)
    yield s
    assert mt.remove_process_set(s) is True


@pytest.fixture(scope="module")
def subgroup():
    """mpi4py's communicator over SET: the oracle for collectives on the set."""
    comm = MPI.COMM_WORLD.Split(0 if MEMBER else MPI.UNDEFINED, R)
    yield comm
    if comm != MPI.COMM_NULL:
        comm.Free()


def test_the_global_set_is_every_rank():
    g = mt.global_process_set
    assert g.process_set_id == 0 and g.ranks == list(range(N))
    assert (g.size(), g.rank(), g.included()) == (N, R, True)
    assert mt.process_sets()[0] is g
    assert mt.remove_process_set(g) is False                 # never removed (as in Horovod)


def test_set_properties(ps):
    assert ps.ranks == SET and ps.size() == len(SET) and ps.process_set_id >= 1
    assert ps.included() == MEMBER and ps.rank() == SET_RANK
    assert ps in mt.process_sets()
    assert len(set(mt.allgather_object(ps.process_set_id))) == 1     # same id on every rank
    assert mt.ProcessSet([2, 0]).ranks == [0, 2]                      # sorted, as in Horovod
    assert mt.ProcessSet([2, 0]).rank() is None                       # not added yet


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [mt.Sum, mt.Average, mt.Min, mt.Max])
def test_allreduce_on_a_set_matches_the_oracles(ps, subgroup, dtype, op):
    if not MEMBER:
        return
    n = 37
    x = rank_input(R, n, dtype, op)
    want = numpy_oracle([rank_input(r, n, dtype, op) for r in SET], op, size=len(SET))
    got = mt.allreduce(x, op=op, name="ps.x", process_set=ps)
    assert_matches(got, want)
    y = x.copy()
    if op is mt.Average and y.dtype.kind != "f":           # an integer mean is not in place
        with pytest.raises(ValueError, match=r"Average"):
            mt.allreduce_(y, op=op, process_set=ps)
    else:
        assert mt.allreduce_(y, op=op, process_set=ps) is y
        assert_matches(y, want)
    if op is mt.Sum and dtype == "float64":                # mpi4py's own Allreduce on the group
        mpi = np.empty_like(x)
        subgroup.Allreduce(x, mpi, op=MPI.SUM)
        np.testing.assert_allclose(got, mpi, rtol=1e-12)


def test_every_other_collective_on_a_set_matches_mpi4py(ps, subgroup):
    if not MEMBER:
        return
    k, root = len(SET), SET[-1]                       # root_rank: a global rank, as in Horovod
    mine = rank_input(R, 3 * (R + 1), "float32", mt.Sum).reshape(R + 1, 3)      # (R+1, 3)
    got = mt.allgather(mine, process_set=ps)
    want = np.concatenate(subgroup.allgather(mine))
    np.testing.assert_array_equal(got, want)
    xs = [rank_input(R, 5, "float64", mt.Sum), rank_input(R, 7, "int32", mt.Sum)]
    grouped = mt.grouped_allreduce(xs, op=mt.Sum, process_set=ps)
    for g, x in zip(grouped, xs):
        want = np.empty_like(x)
        subgroup.Allreduce(x, want, op=MPI.SUM)
        np.testing.assert_allclose(g, want, rtol=1e-12)
    ys = [x.copy() for x in xs]
    assert mt.grouped_allreduce_(ys, op=mt.Sum, process_set=ps) == ys
    for y, g in zip(ys, grouped):
        np.testing.assert_array_equal(y, g)
    b = rank_input(R, 6, "int64", mt.Sum)
    np.testing.assert_array_equal(mt.broadcast(b, root, process_set=ps),
                                  subgroup.bcast(b, root=k - 1))
    c = b.copy()
    assert mt.broadcast_(c, root, process_set=ps) is c
    np.testing.assert_array_equal(c, rank_input(root, 6, "int64", mt.Sum))
    rows = 2 * k + 1                                        # first rows % k members get +1
    x = rank_input(R, rows * 2, "float64", mt.Sum).reshape(rows, 2)             # (rows, 2)
    total = np.empty_like(x)
    subgroup.Allreduce(x, total, op=MPI.SUM)
    start = sum(rows // k + (r < rows % k) for r in range(SET_RANK))
    mine_rows = rows // k + (SET_RANK < rows % k)
    np.testing.assert_allclose(mt.reducescatter(x, op=mt.Sum, process_set=ps),
                               total[start:start + mine_rows], rtol=1e-12)
    splits = [(SET_RANK + j) % 3 for j in range(k)]
    send = np.arange(sum(splits) * 2, dtype=np.int16).reshape(-1, 2) + 100 * R   # (rows, 2)
    out, received = mt.alltoall(send, splits=splits, process_set=ps)
    parts = np.split(send, np.cumsum(splits)[:-1])
    want = np.concatenate(subgroup.alltoall(parts)).reshape(-1, 2)
    np.testing.assert_array_equal(out, want)
    assert received.tolist() == [len(p) for p in subgroup.alltoall(parts)]
    mt.barrier(process_set=ps)
    assert mt.broadcast_object({"r": R}, root_rank=root, process_set=ps) == {"r": root}
    assert mt.allgather_object(R, process_set=ps) == SET


@with_outsider
def test_a_rank_outside_the_set_gets_a_value_error_naming_it(ps):
    if MEMBER:
        mt.allreduce(np.ones(2), process_set=ps)           # members are not held up
        return
    x = np.ones(4)
    calls = [lambda: mt.allreduce(x, process_set=ps), lambda: mt.allreduce_(x, process_set=ps),
             lambda: mt.grouped_allreduce([x], process_set=ps),
             lambda: mt.grouped_allreduce_([x], process_set=ps),
             lambda: mt.allgather(x, process_set=ps),
             lambda: mt.broadcast(x, 0, process_set=ps),
             lambda: mt.broadcast_(x, 0, process_set=ps),
             lambda: mt.reducescatter(x, process_set=ps),
             lambda: mt.alltoall(x, process_set=ps), lambda: mt.barrier(process_set=ps),
             lambda: mt.broadcast_object(1, process_set=ps),
             lambda: mt.allgather_object(1, process_set=ps),
             lambda: mt.allreduce_async(x, process_set=ps),
             lambda: mt.broadcast_parameters({"w": x}, process_set=ps)]
    named = re.escape(f"rank {R} is not in ProcessSet(process_set_id={ps.process_set_id}, "
                      f"ranks={SET})")
    for call in calls:
        with pytest.raises(ValueError, match=named):
            call()


@with_outsider
def test_root_rank_outside_the_set_is_a_value_error_on_every_member(ps):
    if MEMBER:
        with pytest.raises(ValueError, match=r"root_rank=1 is not in the process set"):
            mt.broadcast(np.ones(2), 1, process_set=ps)


@multi_rank
def test_two_disjoint_sets_used_alternately():
    evens = mt.add_process_set(range(0, N, 2))
    odds = mt.add_process_set(range(1, N, 2))
    mine = evens if R % 2 == 0 else odds
    other = odds if mine is evens else evens
    assert mine.included() and not other.included()
    for step in range(4):
        x = np.full(3, float(R + step))
        got = mt.allreduce(x, op=mt.Sum, name="alt", process_set=mine)
        np.testing.assert_array_equal(got, np.full(3, sum(r + step for r in mine.ranks)))
        everyone = mt.allreduce(np.array([R]), op=mt.Sum)          # the global set between
        assert everyone.tolist() == [N * (N - 1) // 2]
        gathered = mt.allgather(np.array([R, step]), process_set=mine)
        assert gathered.tolist() == [r_ for r in mine.ranks for r_ in (r, step)]
    assert mt.remove_process_set(odds) and mt.remove_process_set(evens)


@multi_rank
def test_mismatched_add_lists_are_a_collective_error_on_every_rank():
    ranks = [0, 1] if R == 0 else [0]
    with pytest.raises(mt.CollectiveError, match=r"add_process_set: ranks differs across ranks"):
        mt.add_process_set(ranks)
    before = [s.process_set_id for s in mt.process_sets()]
    s = mt.add_process_set([0])                           # nothing was left half-made
    assert [x.process_set_id for x in mt.process_sets()] == before + [s.process_set_id]
    assert mt.remove_process_set(s)


@pytest.mark.parametrize("ranks, match", [
    ([0, 0], r"must be distinct"), ([N], r"must be distinct and in \[0, "),
    ([-1], r"must be distinct"), (["0"], r"integer ranks"), ([0.0], r"integer ranks"),
    (3, r"expected a list of ranks")])
def test_bad_rank_lists_are_the_same_value_error_on_every_rank(ranks, match):
    with pytest.raises(ValueError, match=match):
        mt.add_process_set(ranks)


def test_an_empty_set_is_added_and_no_rank_is_in_it():
    """Horovod accepts add_process_set([]) (its tests add the odd ranks, none at N = 1): a set
    no rank is in, a ValueError on the calling rank for any collective on it."""
    before = [s.process_set_id for s in mt.process_sets()]
    empty = mt.add_process_set([])
    assert empty.ranks == [] and empty.size() == 0 and empty.process_set_id >= 1
    assert empty.included() is False and empty.rank() == -1
    assert len(set(mt.allgather_object(empty.process_set_id))) == 1
    named = re.escape(f"rank {R} is not in ProcessSet(process_set_id={empty.process_set_id}, "
                      f"ranks=[])")
    x = np.ones(3)
    for call in (lambda: mt.allreduce(x, process_set=empty),
                 lambda: mt.allgather(x, process_set=empty),
                 lambda: mt.broadcast(x, 0, process_set=empty),
                 lambda: mt.barrier(process_set=empty),
                 lambda: mt.allgather_object(1, process_set=empty),
                 lambda: mt.join(process_set=empty)):
        with pytest.raises(ValueError, match=named):
            call()
    with pytest.raises(ValueError, match=r"already exists"):
        mt.add_process_set(mt.ProcessSet([]))
    evens = mt.add_process_set(range(0, N, 2))       # the sets Horovod's tests add at N = 1
    odds = mt.add_process_set(range(1, N, 2)) if N > 1 else None
    got = mt.allreduce(np.array([1.0]), op=mt.Sum, process_set=evens if R % 2 == 0 else odds)
    assert got.tolist() == [float(len(range(R % 2, N, 2)))]
    assert mt.allreduce(np.array([R]), op=mt.Sum).tolist() == [N * (N - 1) // 2]
    for s in (odds, evens, empty):
        if s is not None:
            assert mt.remove_process_set(s) is True
    assert [s.process_set_id for s in mt.process_sets()] == before
    assert empty.process_set_id is None and mt.remove_process_set(empty) is False


def test_a_duplicate_set_is_refused_and_remove_then_readd_works():
    s = mt.add_process_set(SET)
    with pytest.raises(ValueError, match=r"already exists"):
        mt.add_process_set(list(reversed(SET)))
    old_id = s.process_set_id
    assert mt.remove_process_set(s) is True
    assert s.process_set_id is None and mt.remove_process_set(s) is False
    with pytest.raises(ValueError, match=r"is not added"):
        mt.allreduce(np.ones(2), process_set=s)
    again = mt.add_process_set(SET)
    assert again.process_set_id > old_id                   # ids are never reused
    if MEMBER:
        got = mt.allreduce(np.array([1.0]), op=mt.Sum, process_set=again)
        assert got.tolist() == [float(len(SET))]
    with pytest.raises(ValueError, match=r"already exists"):
        mt.add_process_set(mt.ProcessSet(SET))
    again_id = again.process_set_id
    assert mt.remove_process_set(again)
    assert mt.add_process_set(s) is s and s.process_set_id > again_id
    with pytest.raises(ValueError, match=r"is already added"):
        mt.add_process_set(s)
    assert mt.remove_process_set(s)


def test_shutdown_drops_every_set():
    s = mt.add_process_set(SET)
    with comm_settings():                                  # mt.shutdown(); mt.init(...)
        assert mt.process_sets() == [mt.global_process_set]
        assert s.process_set_id is None
        with pytest.raises(ValueError, match=r"is not added"):
            mt.allreduce(np.ones(1), process_set=s)
        t = mt.add_process_set(SET)                         # ids start again with the World
        assert t.process_set_id == 1 and mt.remove_process_set(t)


def _params(seed):
    rng = np.random.default_rng(seed)
    return [mt.nn.Parameter(rng.standard_normal((4, 3))), mt.nn.Parameter(rng.standard_normal(5))]


@pytest.mark.parametrize("overlap", [False, True])
def test_distributed_optimizer_on_a_set_keeps_only_the_set_in_sync(ps, overlap):
    """Members average their gradients (SGD: the step of the mean gradient); an outsider steps
    alone and never takes part in a collective; the members' weights stay bitwise equal."""
    params = _params(seed=0)                                 # the same start on every rank
    start = [p.data.copy() for p in params]
    grads = [[np.full(p.data.shape, float(r + 1) * (i + 1)) for i, p in enumerate(params)]
             for r in range(N)]
    opt = mt.optim.SGD(params, lr=0.1)
    if MEMBER:
        opt = mt.DistributedOptimizer(opt, process_set=ps, overlap=overlap)
    for _ in range(2):
        opt.zero_grad()
        for p, g in zip(params, grads[R]):
            p.grad[...] = g
        if overlap and MEMBER:
            opt.backward_hook(list(reversed(params)))
        opt.step()
    for i, (p, s) in enumerate(zip(params, start)):
        g = np.mean([grads[r][i] for r in SET], axis=0) if MEMBER else grads[R][i]
        np.testing.assert_allclose(p.data, s - 2 * 0.1 * g, rtol=1e-12)
    if MEMBER:
        digest = mt.allgather_object(params[0].data.tobytes(), process_set=ps)
        assert len(set(digest)) == 1


@with_outsider
def test_distributed_optimizer_outside_its_set_raises_at_the_step(ps):
    if MEMBER:
        return
    params = _params(seed=1)
    opt = mt.DistributedOptimizer(mt.optim.SGD(params, lr=0.1), process_set=ps)
    for p in params:
        p.grad[...] = 1.0
    with pytest.raises(ValueError, match=r"is not in ProcessSet"):
        opt.step()


def test_broadcast_parameters_and_optimizer_state_on_a_set(ps):
    root = SET[-1]
    params = {"w": np.full(3, float(R)), "b": np.full(2, float(-R))}
    opt = mt.optim.SGD([mt.nn.Parameter(np.zeros(2))], lr=0.1 * (R + 1), momentum=0.5)
    if MEMBER:
        mt.broadcast_parameters(params, root_rank=root, process_set=ps)
        mt.broadcast_optimizer_state(opt, root_rank=root, process_set=ps)
    src = root if MEMBER else R
    np.testing.assert_array_equal(params["w"], np.full(3, float(src)))
    np.testing.assert_array_equal(params["b"], np.full(2, float(-src)))
    assert opt.lr == pytest.approx(0.1 * (src + 1))


@with_outsider
@pytest.mark.timeout(90)
def test_a_stall_in_a_set_names_the_sets_missing_rank(ps, tmp_path_factory):
    """SET's last member arrives late at an allreduce on SET: rank 0's watchdog asks only the
    set's members, and its report names the set and the late member -- not rank 1, which is
    outside the set and waits in a barrier. The late rank leaves once rank 0 had a report with
    every other member present (a file is the signal: MPI is what rank 0 is stuck in)."""
    late = SET[-1]
    present = [r for r in SET if r != late]
    signal = mt.broadcast_object(str(tmp_path_factory.mktemp("ps") / "seen"), root_rank=0)
    found = []

    def collect(stall):
        found.append(stall)
        if R == 0 and stall.present == present:      # the report checked below: rank 0's
            open(signal, "w").close()
    watchdog.start(world.comm(), warning_s=0.5, report=collect)
    before = watchdog.record(ps.process_set_id).seq
    try:
        if MEMBER:
            if R == late:
                deadline = time.monotonic() + 60
                while not os.path.exists(signal) and time.monotonic() < deadline:
                    time.sleep(0.1)
            mt.allreduce(np.ones(2), name="ps.stall", process_set=ps)
        mt.barrier()
    finally:
        watchdog.stop()
        settings = world.current().settings
        watchdog.start(world.comm(), settings.stall_warning_s, settings.stall_shutdown_s)
    if R != 0:
        return
    assert os.path.exists(signal), [s.line for s in found]
    stall = next(s for s in found if s.present == present)
    assert (stall.seq, stall.kind, stall.name) == (before + 1, "allreduce", "ps.stall")
    assert stall.missing == [late] and stall.details[late].startswith("not in a collective")
    assert (f"(collective #{before + 1} of process set {ps.process_set_id} {SET}) on ranks "
            f"{present}; missing ranks [{late}]") in stall.line


def test_collectives_on_a_set_are_deterministic_and_equal_on_members(ps):
    if not MEMBER:
        return
    x = rank_input(R, 5000, "float32", mt.Average, seed=3)          # above the inline size
    a = mt.allreduce(x, process_set=ps)
    b = mt.allreduce(x, process_set=ps)
    assert a.tobytes() == b.tobytes()
    digests = mt.allgather_object(a.tobytes(), process_set=ps)
    assert len(set(digests)) == 1


def test_sets_leave_the_global_set_usable():
    s = mt.add_process_set([0])
    if s.included():
        assert mt.allreduce(np.array([5]), op=mt.Sum, process_set=s).tolist() == [5]
    assert mt.remove_process_set(s)
    assert_same_on_all_ranks(mt.allreduce(np.arange(4.0), op=mt.Sum))


@multi_rank
def test_init_on_a_split_half_makes_it_the_global_set():
    """mt.init(comm) takes any mpi4py communicator as the global set: ranks of sets are ranks of
    that communicator, and sets made on it go with it at shutdown."""
    settings = world.current().settings
    half = MPI.COMM_WORLD.Split(int(R >= N // 2), R)
    mt.shutdown()
    mt.init(half, threads=None, settings=settings)
    try:
        g = mt.global_process_set
        assert (g.size(), g.rank(), g.ranks) == (half.Get_size(), half.Get_rank(),
                                                 list(range(half.Get_size())))
        last = mt.add_process_set([half.Get_size() - 1])
        assert last.included() == (half.Get_rank() == half.Get_size() - 1)
        if last.included():
            assert mt.allgather_object(R, process_set=last) == [R]
    finally:
        mt.shutdown()
        half.Free()
        mt.init(MPI.COMM_WORLD, threads=None, settings=settings)
    assert last.process_set_id is None and mt.process_sets() == [mt.global_process_set]


def test_a_stall_report_names_the_set_and_its_members():
    desc = ("allreduce", {"name": "x"}, None)
    answers = {2: {"q": 1, "seq": 2, "in": False}}
    stall = watchdog.make_stall(0, 4, 3, desc, 61.2, answers, members=[0, 2], set_id=1)
    assert (stall.present, stall.missing) == ([0], [2])
    assert stall.line == ("mpitrain: stalled for 61 s in allreduce 'x' (collective #3 of process "
                          "set 1 [0, 2]) on ranks [0]; missing ranks [2] (rank 2: not in a "
                          "collective, last #2)")
