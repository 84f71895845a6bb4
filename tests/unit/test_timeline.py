"""Timeline: Chrome-trace event format, merging ranks through a fake communicator, atomic write,
and what a span costs when the timeline is off (``span_overhead_ns`` measures it; not asserted)."""
import json
import os
import time

import pytest

from mpitrain import timeline
from mpitrain.timeline import Timeline, merge, summary, write_trace


class FakeComm:
    """Stands in for an mpi4py communicator: ``gather`` of plain objects through a shared dict.
    Non-root ranks must close before the root, as their sends precede its receive in MPI."""

    def __init__(self, rank, size, mailbox):
        self.rank, self.size, self.mailbox = rank, size, mailbox

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def gather(self, obj, root=0):
        # A real gather pickles; a JSON round trip proves the payload is plain data.
        self.mailbox[self.rank] = json.loads(json.dumps(obj))
        if self.rank != root:
            return None
        assert sorted(self.mailbox) == list(range(self.size)), "a rank did not send"
        return [self.mailbox[r] for r in range(self.size)]


def span_overhead_ns(enabled, n=2000, rounds=15):
    """Mean cost in ns of one ``with tl.span(...)`` (with one arg) over ``n`` spans, best of
    ``rounds`` (short rounds: on a loaded machine most of them run without being preempted)."""
    tl = Timeline("unused.json" if enabled else None, 0, max_events=n)
    best = float("inf")
    for _ in range(rounds):
        tl._events.clear()
        t0 = time.perf_counter_ns()
        for i in range(n):
            with tl.span("allreduce", cat="comm", bucket=i):
                pass
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_span_event_format(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(path, rank=0)
    with tl.span("forward", cat="compute", batch=64):
        time.sleep(0.002)
    with tl.span("allreduce", cat="comm", bucket=1) as s:
        s.set(bytes=4096)
    tl.instant("epoch", epoch=1)
    assert tl.close() == os.fspath(path)
    doc = _load(path)
    assert doc["displayTimeUnit"] == "ms"
    evs = doc["traceEvents"]
    meta = [e for e in evs if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "rank 0"}} in meta
    assert any(e["name"] == "thread_name" and e["args"] == {"name": "main"} for e in meta)
    fwd, ar, ep = [e for e in evs if e["ph"] != "M"]
    assert fwd["name"] == "forward" and fwd["ph"] == "X" and fwd["cat"] == "compute"
    assert fwd["pid"] == 0 and fwd["tid"] == 0 and fwd["args"] == {"batch": 64}
    assert 2000 <= fwd["dur"] < 2e6                   # microseconds: slept 2 ms
    assert fwd["ts"] >= 0
    assert ar["args"] == {"bucket": 1, "bytes": 4096} and ar["ts"] >= fwd["ts"] + fwd["dur"]
    assert ep["ph"] == "i" and ep["s"] == "t" and ep["args"] == {"epoch": 1}
    assert "dur" not in ep


def test_span_records_exception_and_reraises(tmp_path):
    tl = Timeline(tmp_path / "t.json", rank=0)
    with pytest.raises(KeyError):
        with tl.span("update"):
            raise KeyError("x")
    (ev,) = [e for e in tl.events() if e["ph"] == "X"]
    assert ev["args"] == {"error": "KeyError"}


def test_complete_and_named_threads(tmp_path):
    tl = Timeline(tmp_path / "t.json", rank=3)
    t0 = tl.now_us()
    t1 = t0 + 250.0
    tl.complete("iallreduce", t0, t1, tid="comm", bucket=0)
    with tl.span("backward"):
        pass
    evs = tl.events()
    names = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert names == {0: "main", 1: "comm"}
    (ia,) = [e for e in evs if e["name"] == "iallreduce"]
    assert ia["pid"] == 3 and ia["tid"] == 1 and ia["dur"] == pytest.approx(250.0, abs=0.01)
    assert ia["ts"] == pytest.approx(t0, abs=0.01)
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.complete("bad", 10.0, 5.0)


def test_merge_across_ranks_with_fake_comm(tmp_path):
    path = tmp_path / "trace.json"
    mailbox = {}
    tls = [Timeline(path, rank=r) for r in range(3)]
    # Pretend rank 2 started 1000 us after rank 0 and rank 1 500 us after it.
    for r, tl in enumerate(tls):
        tl._origin_wall_us = 1e9 + 500.0 * r
        with tl.span("step", step=r):
            pass
    for r in (1, 2):
        assert tls[r].close(FakeComm(r, 3, mailbox)) is None
    assert not path.exists()                           # only rank 0 writes
    assert tls[0].close(FakeComm(0, 3, mailbox)) == os.fspath(path)
    doc = _load(path)
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    steps = {e["pid"]: e for e in evs if e["name"] == "step"}
    assert {p: e["args"]["step"] for p, e in steps.items()} == {0: 0, 1: 1, 2: 2}
    local = [tl.events() for tl in tls]
    for r in range(3):
        (own,) = [e for e in local[r] if e["name"] == "step"]
        assert steps[r]["ts"] == pytest.approx(own["ts"] + 500.0 * r, abs=0.01)
    assert doc["otherData"]["ranks"] == 3
    # Idempotent: a second close does not gather again (would fail: the mailbox is stale).
    assert tls[0].close(FakeComm(0, 3, {})) is None


def test_merge_rejects_nothing():
    with pytest.raises(ValueError):
        merge([])


def test_max_events_drops_and_counts(tmp_path):
    tl = Timeline(tmp_path / "t.json", rank=0, max_events=2)
    for _ in range(5):
        with tl.span("s"):
            pass
    assert tl.dropped == 3
    tl.close()
    doc = _load(tmp_path / "t.json")
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 2
    assert doc["otherData"]["dropped_events"] == {"0": 3}


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(path, {"traceEvents": []})
    before = path.read_text()
    with pytest.raises(TypeError):
        write_trace(path, {"traceEvents": [object()]})  # not JSON serialisable mid-write
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]   # temp file cleaned up


def test_write_creates_directory(tmp_path):
    path = tmp_path / "a" / "b" / "trace.json"
    write_trace(path, {"traceEvents": []})
    assert _load(path) == {"traceEvents": []}


def test_disabled_is_shared_noop(tmp_path):
    tl = Timeline(None, rank=1)
    s1 = tl.span("forward", bytes=3)
    s2 = tl.span("backward")
    assert s1 is s2                                    # one shared object, nothing allocated
    with s1 as s:
        s.set(bytes=5)
    tl.instant("x")
    tl.complete("y", 0.0, 1.0)
    assert [e for e in tl.events() if e["ph"] != "M"] == [] and tl._events == []
    assert tl.close(FakeComm(1, 2, {})) is None        # no gather, no file: nothing to hang on
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        Timeline(None, rank=-1)
    with pytest.raises(ValueError, match="path"):
        Timeline("  ", rank=0)
    with pytest.raises(ValueError, match="Timeline or None"):
        timeline.activate("trace.json")


def test_current_and_activate(tmp_path):
    assert not timeline.current().enabled
    tl = Timeline(tmp_path / "t.json", rank=0)
    try:
        assert timeline.activate(tl) is tl and timeline.current() is tl
        with timeline.current().span("pack", cat="fusion"):
            pass
        assert [e["name"] for e in tl.events() if e["ph"] == "X"] == ["pack"]
    finally:
        timeline.activate(None)
    assert not timeline.current().enabled


def test_span_when_off_is_one_shared_object_and_records_nothing():
    """Off, a span costs one attribute check: the same do-nothing object every time (its cost
    is measured by ``span_overhead_ns``, a benchmark, not asserted here)."""
    tl = Timeline(None, 0)
    spans = {id(tl.span("allreduce", cat="comm", bucket=i)) for i in range(3)}
    assert len(spans) == 1
    with tl.span("pack"):
        pass
    assert [e for e in tl.events() if e["ph"] != "M"] == []       # metadata only


def test_summarize_and_cli(tmp_path, capsys):
    doc = {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
        {"name": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 3000.0},
        {"name": "allreduce", "ph": "X", "pid": 0, "tid": 0, "ts": 3000.0, "dur": 1000.0},
        {"name": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 4000.0, "dur": 3000.0},
        {"name": "forward", "ph": "X", "pid": 1, "tid": 0, "ts": 10.0, "dur": 500.0},
        {"name": "epoch", "ph": "i", "pid": 1, "tid": 0, "ts": 10.0, "s": "t"}]}
    got = timeline.summarize(doc)
    assert got[0] == [("forward", 2, 6.0, pytest.approx(6 / 7)),
                      ("allreduce", 1, 1.0, pytest.approx(1 / 7))]
    assert got[1] == [("forward", 1, 0.5, 1.0)]
    path = tmp_path / "t.json"
    write_trace(path, doc)
    assert summary.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "allreduce" in out and "85.7%" in out
    assert summary.main([str(tmp_path / "missing.json")]) == 2
    assert summary.main([]) == 2
