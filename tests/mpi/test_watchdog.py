"""Stall watchdog (mpitrain/comm/watchdog.py) under 1-4 ranks.

A late rank is simulated by sleeping before the collective; the waiting ranks run a watchdog
with a short warning period and collect reports through the ``report`` callback. Every test
ends with all ranks past the same collectives (and a barrier), the default watchdog restarted.
"""
import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import watchdog, world

R = MPI.COMM_WORLD.Get_rank()
N = MPI.COMM_WORLD.Get_size()
WARNING_S = 0.5
LATE_S = 2.0

multi_rank = pytest.mark.skipif(N < 2, reason="needs at least 2 ranks")


@pytest.fixture
def reports():
    """Restart this rank's watchdog with a short warning; yields (start, reports list)."""
    found = []
    lock = threading.Lock()

    def collect(stall):
        with lock:
            found.append((time.monotonic(), stall))

    def start(**kwargs):
        kwargs.setdefault("warning_s", WARNING_S)
        kwargs.setdefault("report", collect)
        watchdog.start(world.comm(), **kwargs)

    yield start, found
    watchdog.stop()
    mt.barrier()
    settings = world.current().settings
    watchdog.start(world.comm(), settings.stall_warning_s, settings.stall_shutdown_s)


def _idle(last):
    """A rank's answer when it is between collectives, ``last`` the number of its last one."""
    return f"not in a collective, last #{last}" if last else "not in a collective yet"


def _threads():
    return [t for t in threading.enumerate() if t.name == "mpitrain-watchdog"]


@pytest.mark.timeout(30)
def test_agree_records_and_clears_the_collective():
    before = watchdog.record().seq
    mt.allreduce(np.ones(3), name="w.x")
    mt.broadcast(np.ones(2), root_rank=0)
    assert watchdog.current() is None
    watchdog.record().enter(("allreduce", {"name": "w.y"}, None))
    assert watchdog.current() == (watchdog.record().seq, "allreduce", "w.y")
    watchdog.record().leave()
    watchdog.record().seq -= 1          # not a real agreement: keep numbers aligned across ranks
    assert watchdog.current() is None
    # one agreement per collective, and only when there is someone to agree with; the
    # broadcast's data phase is an entry of its own (the small allreduce rides in its agreement)
    assert watchdog.record().seq - before == (3 if N > 1 else 1)


@multi_rank
@pytest.mark.timeout(90)
def test_late_rank_is_reported_missing(reports, tmp_path_factory):
    """Rank 1 arrives late. It waits (sleeping, at least LATE_S) until a waiting rank has had a
    report that names every other rank present -- on a loaded machine a rank's watchdog thread
    may miss the 2 s answer window of an early query ("no answer"), so the late rank does not
    leave after a fixed time -- with a file as the signal: MPI is what the others are stuck in."""
    start, found = reports
    signal = mt.broadcast_object(str(tmp_path_factory.mktemp("late") / "seen"), root_rank=0)
    present = [r for r in range(N) if r != 1]

    def collect(stall):
        found.append((time.monotonic(), stall))
        if stall.present == present:
            open(signal, "w").close()
    start(report=collect)
    seq = watchdog.record().seq + 1
    began = time.monotonic()
    if R == 1:
        time.sleep(LATE_S)
        deadline = time.monotonic() + 60
        while not os.path.exists(signal) and time.monotonic() < deadline:
            time.sleep(0.1)
    mt.allreduce(np.ones(4), name="grad.fc1")
    waited = time.monotonic() - began
    mt.barrier()
    if R == 1:
        assert found == []
        return
    assert found, "no stall report"
    assert any(stall.present == present for _, stall in found), [s.line for _, s in found]
    for _, stall in found:
        assert (stall.seq, stall.kind, stall.name) == (seq, "allreduce", "grad.fc1")
        assert 1 in stall.missing and stall.details[1] == _idle(seq - 1)
        assert all(stall.details[r] == "no answer" for r in stall.missing if r != 1), stall.line
        assert stall.waited_s >= WARNING_S
        assert stall.line.startswith("mpitrain: stalled for ")
    line = next(s.line for _, s in found if s.present == present)
    assert f"in allreduce 'grad.fc1' (collective #{seq}) on ranks {present}; " \
           f"missing ranks [1] (rank 1: {_idle(seq - 1)})" in line
    # repeated while the stall lasts, at most once per warning period
    times = [t for t, _ in found]
    assert all(b - a >= WARNING_S * 0.9 for a, b in zip(times, times[1:])), times
    assert len(found) <= waited / WARNING_S + 1


@multi_rank
@pytest.mark.timeout(60)
def test_rank_inside_another_collective_is_named(reports):
    """Rank 1 waits in a (simulated) broadcast of its own while the others are in allreduce."""
    start, found = reports
    start()
    seq = watchdog.record().seq + 1
    if R == 1:
        watchdog.record().enter(("broadcast", {"name": "weights", "root_rank": 0}, None))
        time.sleep(LATE_S)
        watchdog.record().leave()
        watchdog.record().seq -= 1      # it was not a real agreement: stay aligned with the others
    mt.allreduce(np.ones(2), name="loss")
    mt.barrier()
    if R != 1:
        assert found
        stall = found[0][1]
        # under load another waiting rank's watchdog can miss the answer window: "no answer"
        assert 1 in stall.missing and all(stall.details[r] == "no answer"
                                          for r in stall.missing if r != 1), stall.details
        assert stall.details[1].startswith(f"in broadcast 'weights' #{seq} for "), stall.details
    else:
        assert found and found[0][1].kind == "broadcast"
        assert found[0][1].present == [1] and found[0][1].missing == [r for r in range(N)
                                                                       if r != 1]


@multi_rank
@pytest.mark.timeout(60)
def test_rank_without_watchdog_is_no_answer(reports):
    start, found = reports
    start(warning_s=0 if R == 1 else WARNING_S, answer_timeout_s=0.3)
    assert bool(_threads()) == (R != 1)
    if R == 1:
        time.sleep(LATE_S)
    mt.allreduce(np.ones(1), name="x")
    mt.barrier()
    if R != 1:
        assert found
        assert all(1 in s.missing and set(s.details.values()) == {"no answer"}
                   for _, s in found)


@multi_rank
@pytest.mark.timeout(60)
def test_stall_shutdown_calls_abort_after_its_time(reports):
    start, found = reports
    aborted = []
    start(warning_s=100, shutdown_s=0.5, abort=aborted.append)
    if R == 1:
        time.sleep(1.5)
    mt.allreduce(np.ones(1), name="y")
    mt.barrier()
    assert found == []                    # the warning period was never reached
    if R != 1:
        assert aborted and aborted[0].missing == [1] and aborted[0].waited_s >= 0.5
    else:
        assert aborted == []


@pytest.mark.timeout(30)
def test_disabled_and_stop_leave_no_thread(reports):
    start, _ = reports
    watchdog.start(world.comm(), warning_s=0)                    # MPITRAIN_STALL_WARNING=0
    assert _threads() == [] and not watchdog.running()
    start()
    assert watchdog.running() == (N > 1)
    watchdog.stop()
    assert _threads() == [] and not watchdog.running()


def test_settings_from_environment():
    def stall(env):
        s = mt.CommSettings.from_env(env)
        return s.stall_warning_s, s.stall_shutdown_s
    assert stall({}) == (60.0, 600.0)      # a hung job ends after 10 minutes by default
    assert stall({"MPITRAIN_STALL_WARNING": "2.5", "MPITRAIN_STALL_SHUTDOWN": "30"}) == (2.5, 30.0)
    with pytest.raises(ValueError, match="MPITRAIN_STALL_WARNING='soon'"):
        stall({"MPITRAIN_STALL_WARNING": "soon"})
    with pytest.raises(ValueError, match="MPITRAIN_STALL_SHUTDOWN='-1'"):
        stall({"MPITRAIN_STALL_SHUTDOWN": "-1"})


def test_report_line_names_each_missing_rank():
    desc = ("allreduce", {"name": "g"}, None)
    answers = {1: {"in": False, "seq": 6}, 2: {"in": True, "seq": 7, "kind": "allreduce"},
               3: {"in": True, "seq": 6, "kind": "broadcast", "name": "w", "waited": 12.0}}
    stall = watchdog.make_stall(0, 5, 7, desc, 61.2, answers)
    assert stall.present == [0, 2] and stall.missing == [1, 3, 4]
    assert stall.line == (
        "mpitrain: stalled for 61 s in allreduce 'g' (collective #7) on ranks [0, 2]; missing "
        "ranks [1, 3, 4] (rank 1: not in a collective, last #6; rank 3: in broadcast 'w' #6 "
        "for 12 s; rank 4: no answer)")
    alone = watchdog.make_stall(1, 2, 1, ("barrier", {}, None), 3.0, None)
    assert "on rank 1; missing ranks unknown" in alone.line and "barrier (collective #1)" in \
        alone.line


def test_report_line_names_a_rank_that_left():
    desc = ("allreduce", {"name": "only rank 0"}, None)
    answers = {1: {"left": True, "seq": 2}, 2: {"left": True, "seq": 0}}
    stall = watchdog.make_stall(0, 3, 3, desc, 1.2, answers)
    assert stall.present == [0] and stall.missing == [1, 2]
    assert stall.line.endswith("missing ranks [1, 2] (rank 1: left the job after #2; rank 2: "
                               "left the job before its first collective)")
