"""Non-blocking collectives (mpitrain/comm/handles.py, collectives.py's *_async) under 1-4 ranks.

Each async op is compared bitwise with its blocking twin on the same inputs; several handles are
kept in flight at once and completed in another order than submitted; mismatches (order,
arguments) and errors inside a pending op must come out of ``synchronize`` as the same exception
on every rank, with the communicator still usable afterwards -- never a hang.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain import timeline
from mpitrain.comm import handles
from tests.support.comm import comm_settings
from tests.support.oracles import assert_matches, numpy_oracle, rank_input

mt.init()
R, N = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
multi_rank = pytest.mark.skipif(N < 2, reason="needs at least 2 ranks")
with_outsider = pytest.mark.skipif(N < 3, reason="needs a rank outside the set (N >= 3)")


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_mpi_gives_the_thread_level_the_comm_thread_needs():
    """mpi4py asks MPI_Init_thread for MULTIPLE; the comm thread needs SERIALIZED."""
    level = MPI.Query_thread()
    assert level >= MPI.THREAD_SERIALIZED and handles.comm_thread_available()
    assert mt.mpi_threads_supported() == (level == MPI.THREAD_MULTIPLE)


@pytest.mark.parametrize("dtype", ["int32", "float16", "float32", "float64"])
@pytest.mark.parametrize("op", [mt.Sum, mt.Average, mt.Max])
@pytest.mark.parametrize("n", [1, 37, 5000])               # inline, small, above 4 KiB
def test_allreduce_async_equals_the_blocking_call(dtype, op, n):
    x = rank_input(R, n, dtype, op)
    # factors on floats only: full-range integers scaled in float64 overflow their dtype
    pre, post = (0.5, 2.0) if x.dtype.kind == "f" else (1.0, 1.0)
    h = mt.allreduce_async(x, op=op, name="a", prescale_factor=pre, postscale_factor=post)
    got = mt.synchronize(h)
    assert mt.poll(h)
    _same(got, mt.allreduce(x, op=op, name="a", prescale_factor=pre, postscale_factor=post))
    assert_matches(got, numpy_oracle([rank_input(r, n, dtype, op) for r in range(N)], op,
                                     pre, post))
    if op is mt.Average and x.dtype.kind != "f":
        return                                  # an integer mean is not in place (below)
    y = x.copy()
    h = mt.allreduce_async_(y, op=op, name="a_", prescale_factor=pre, postscale_factor=post)
    assert mt.synchronize(h) is y                          # in place: the input array
    _same(y, got)


def test_every_other_async_op_equals_its_blocking_call():
    xs = [rank_input(R, 10, "float32", mt.Sum), rank_input(R, 3000, "float64", mt.Sum),
          rank_input(R, 7, "int64", mt.Sum)]
    for g, b in zip(mt.synchronize(mt.grouped_allreduce_async(xs, op=mt.Sum, name="g")),
                    mt.grouped_allreduce(xs, op=mt.Sum, name="g")):
        _same(g, b)
    ys = [x.copy() for x in xs]
    out = mt.synchronize(mt.grouped_allreduce_async_(ys, op=mt.Sum, name="g_"))
    assert len(out) == len(ys) and all(o is y for o, y in zip(out, ys))        # in place
    for y, b in zip(ys, mt.grouped_allreduce(xs, op=mt.Sum, name="g_")):
        _same(y, b)
    mine = rank_input(R, 2 * (R + 1), "int16", mt.Sum).reshape(R + 1, 2)       # (R+1, 2)
    _same(mt.synchronize(mt.allgather_async(mine, name="ag")), mt.allgather(mine, name="ag"))
    root = N - 1
    b = rank_input(R, 9, "float64", mt.Sum)
    _same(mt.synchronize(mt.broadcast_async(b, root, name="b")), mt.broadcast(b, root))
    c = b.copy()
    assert mt.synchronize(mt.broadcast_async_(c, root, name="b_")) is c
    _same(c, rank_input(root, 9, "float64", mt.Sum))
    x = rank_input(R, 2 * (2 * N + 1), "float32", mt.Sum).reshape(2 * N + 1, 2)  # (2N+1, 2)
    _same(mt.synchronize(mt.reducescatter_async(x, op=mt.Sum, name="rs")),
          mt.reducescatter(x, op=mt.Sum, name="rs"))
    send = np.arange(3 * N, dtype=np.int32) + 100 * R                         # (3N,)
    _same(mt.synchronize(mt.alltoall_async(send, name="a2a")), mt.alltoall(send, name="a2a"))


def test_several_handles_outstanding_complete_in_any_order_of_waiting():
    inputs = [rank_input(R, n, "float64", mt.Sum, seed=n) for n in (3, 900, 20000, 1, 4096)]
    hs = [mt.allreduce_async(x, op=mt.Sum, name=f"many.{i}") for i, x in enumerate(inputs)]
    hs.append(mt.allgather_async(np.array([R]), name="many.gather"))
    hs.append(mt.broadcast_async(np.array([R, R]), 0, name="many.bcast"))
    a = np.zeros((256, 256))                          # the caller computes meanwhile
    for _ in range(3):
        a = np.sin(a + 1.0)
    results = [mt.synchronize(h) for h in reversed(hs)][::-1]
    for x, got in zip(inputs, results):
        want = numpy_oracle([rank_input(r, x.size, "float64", mt.Sum, seed=x.size)
                             for r in range(N)], mt.Sum)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert results[-2].tolist() == list(range(N)) and results[-1].tolist() == [0, 0]
    assert all(mt.poll(h) for h in hs) and not handles.busy()


@multi_rank
@pytest.mark.timeout(60)
def test_poll_never_blocks_and_is_eventually_true():
    """Rank 0 submits first and polls while the others are still asleep: poll returns False at
    once; once everyone has submitted it turns True without synchronize."""
    if R != 0:
        time.sleep(0.5)
    h = mt.allreduce_async(np.ones(3), op=mt.Sum, name="poll")
    if R == 0:
        t0 = time.perf_counter()
        first = mt.poll(h)
        assert time.perf_counter() - t0 < 0.05 and first is False
    deadline = time.monotonic() + 30
    while not mt.poll(h):
        assert time.monotonic() < deadline, "poll never became True"
        time.sleep(0.001)
    assert mt.synchronize(h).tolist() == [float(N)] * 3


@multi_rank
@pytest.mark.timeout(60)
def test_a_different_submission_order_is_a_collective_error_on_every_rank():
    x, y = np.ones(4), np.arange(6.0)
    if R == 0:
        first, second = (mt.allreduce_async(x, name="x"), mt.allgather_async(y, name="y"))
    else:
        second, first = (mt.allgather_async(y, name="y"), mt.allreduce_async(x, name="x"))
    for h in (first, second):
        with pytest.raises(mt.CollectiveError, match=r"ranks called different collectives"):
            mt.synchronize(h)
    # nothing moved, nothing hangs: the next collectives work
    assert mt.synchronize(mt.allreduce_async(np.array([1]), op=mt.Sum)).tolist() == [N]


@multi_rank
@pytest.mark.timeout(60)
def test_mismatched_arguments_are_a_collective_error_at_synchronize():
    x = np.ones(5 if R == 0 else 4)
    h = mt.allreduce_async(x, name="shape")                # returns: nothing checked yet
    with pytest.raises(mt.CollectiveError, match=r"allreduce: shape differs across ranks: "
                                                 r"\(5,\) on ranks \[0\]"):
        mt.synchronize(h)
    hs = [mt.broadcast_async(np.ones(2), root_rank=R % 2, name="root")]
    with pytest.raises(mt.CollectiveError, match=r"root_rank differs across ranks"):
        mt.synchronize(hs[0])
    assert mt.allreduce(np.array([2]), op=mt.Sum).tolist() == [2 * N]


@pytest.mark.timeout(60)
def test_an_exception_in_a_pending_op_is_raised_by_synchronize_on_every_rank():
    # bad on one rank only: every rank learns it through the agreement
    bad = "not an array" if R == 0 else np.ones(3)
    h = mt.allreduce_async(bad, name="bad")
    error = mt.CollectiveError if N > 1 else ValueError
    with pytest.raises(error, match=r"dtype <U12 is not supported"):
        mt.synchronize(h)
    # bad everywhere: the same ValueError on every rank, from synchronize, not from the call
    h = mt.allreduce_async(np.ones(3), op="median")
    with pytest.raises(ValueError, match=r"median"):
        mt.synchronize(h)
    h = mt.allreduce_async_(np.arange(4), op=mt.Average)      # an integer mean is not in place
    with pytest.raises(ValueError, match=r"Average"):
        mt.synchronize(h)
    # the handles after a failed one still run, in order, on every rank
    later = mt.allreduce_async(np.array([3.0]), op=mt.Sum)
    assert mt.synchronize(later).tolist() == [3.0 * N]


def test_blocking_calls_queue_behind_handles_in_flight():
    """A blocking call made while handles are pending runs after them on the comm thread: a
    second thread in the same agreement would corrupt its buffers or hang."""
    big = rank_input(R, 200_000, "float64", mt.Sum)
    hs = [mt.allreduce_async(big, op=mt.Sum, name=f"q.{i}") for i in range(3)]
    mid = mt.allreduce(np.array([R + 1.0]), op=mt.Sum, name="q.blocking")
    objs = mt.allgather_object(R)
    assert all(mt.poll(h) for h in hs)                   # finished before the blocking call
    want = numpy_oracle([rank_input(r, 200_000, "float64", mt.Sum) for r in range(N)], mt.Sum)
    for h in hs:
        np.testing.assert_allclose(mt.synchronize(h), want, rtol=1e-12)
    assert mid.tolist() == [N * (N + 1) / 2] and objs == list(range(N))


def test_handles_are_checked():
    with pytest.raises(ValueError, match=r"expected a handle"):
        mt.synchronize(object())
    with pytest.raises(ValueError, match=r"expected a handle"):
        mt.poll(None)


def test_shutdown_waits_for_handles_in_flight():
    x = rank_input(R, 50_000, "float32", mt.Sum)
    h = mt.allreduce_async(x, op=mt.Sum, name="shutdown")
    with comm_settings():                         # mt.shutdown() waits, then mt.init() again
        assert mt.poll(h)
    _same(mt.synchronize(h), mt.allreduce(x, op=mt.Sum, name="shutdown"))


@with_outsider
def test_async_on_a_process_set():
    ps = mt.add_process_set([0, 2])
    try:
        if ps.included():
            x = rank_input(R, 300, "float64", mt.Sum)
            h = mt.allreduce_async(x, op=mt.Sum, name="ps", process_set=ps)
            g = mt.allreduce_async(x, op=mt.Sum, name="global")      # global, meanwhile
            _same(mt.synchronize(h), mt.allreduce(x, op=mt.Sum, name="ps", process_set=ps))
            mt.synchronize(g)
        else:
            with pytest.raises(ValueError, match=rf"rank {R} is not in ProcessSet"):
                mt.allreduce_async(np.ones(2), process_set=ps)
            mt.synchronize(mt.allreduce_async(np.ones(300), op=mt.Sum, name="global"))
    finally:
        mt.remove_process_set(ps)


def test_each_async_op_is_a_span_on_the_comm_track(tmp_path):
    tl = timeline.activate(timeline.Timeline(tmp_path / "t.json", rank=R))
    try:
        mt.synchronize(mt.allreduce_async(np.ones(3), name="traced"))
    finally:
        timeline.activate(None)
    spans = [e for e in tl.events() if e.get("name") == "allreduce" and e["ph"] == "X"]
    assert [e["args"] for e in spans] == [{"tensor_name": "traced", "process_set": 0}]
    tids = {e["args"]["name"]: e["tid"] for e in tl.events() if e["name"] == "thread_name"}
    assert spans[0]["tid"] == tids["comm"]
