"""mt.start_timeline(path) / mt.stop_timeline() at run time (tracing.py), under 1..4 ranks.

Every rank records from start to stop; rank 0 writes the merged Chrome trace, as --timeline
does. Training steps before start and after stop must leave no event in the file.
"""
import json
import os
import tempfile

import numpy as np
import pytest

import mpitrain as mt
from mpitrain import timeline
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()


def _shared_dir():
    """A temp folder every rank knows (rank 0 makes it)."""
    path = tempfile.mkdtemp(prefix="mt-timeline-") if R == 0 else None
    return mt.broadcast_object(path, root_rank=0)


def _trainer():
    model = mt.models.mlp(in_features=12, hidden=(10,), seed=0, dtype=np.float64)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               fusion_threshold_bytes=256)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    rng = np.random.default_rng(R)

    def step(i):
        with timeline.current().span("user-step", step=i):
            x = rng.standard_normal((4, 12))                              # (4, 12)
            y = rng.integers(0, 10, 4).astype(np.int64)                   # (4,)
            opt.zero_grad()
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
            opt.step()
    return step


def _read_on_every_rank(path):
    doc = None
    if R == 0:
        with open(path) as f:
            doc = json.load(f)
    return mt.broadcast_object(doc, root_rank=0)


def test_events_only_between_start_and_stop_and_rank_0_writes():
    folder = _shared_dir()
    path = os.path.join(folder, "trace.json")
    step = _trainer()
    step(0)                                   # before start: not in the file
    tl = mt.start_timeline(path, mark_cycles=True)
    assert tl is timeline.current() and tl.enabled
    step(1)
    step(2)
    written = mt.stop_timeline()
    assert written == (path if R == 0 else None)
    assert not timeline.current().enabled
    step(3)                                   # after stop: not in the file
    assert mt.stop_timeline() is None         # nothing recording: nothing to do, every rank
    doc = _read_on_every_rank(path)
    assert doc["otherData"]["ranks"] == N
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for r in range(N):
        steps = sorted(e["args"]["step"] for e in spans
                       if e["pid"] == r and e["name"] == "user-step")
        assert steps == [1, 2]
        if N > 1:                              # one averaging round per step, and its marker
            assert sum(e["pid"] == r and e["name"] == "synchronize" for e in spans) == 2
            assert sum(e["pid"] == r and e["name"] == "cycle" and e["ph"] == "i"
                       for e in doc["traceEvents"]) == 2
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    # the file opens in the summary tool (python -m mpitrain.timeline)
    assert set(timeline.summarize(doc)) == set(range(N))
    mt.barrier()
    if R == 0:
        os.remove(path)
        os.rmdir(folder)


def test_start_twice_or_a_path_rank_0_cannot_write_raise_on_every_rank():
    folder = _shared_dir()
    path = os.path.join(folder, "t.json")
    mt.start_timeline(path)
    with pytest.raises(ValueError, match="already recording"):
        mt.start_timeline(path)
    assert mt.stop_timeline() == (path if R == 0 else None)
    # rank 0 cannot write a folder: every rank learns it, none starts recording
    error = mt.CollectiveError if N > 1 else ValueError
    with pytest.raises(error, match="is a folder, expected a file path"):
        mt.start_timeline(folder)
    assert not timeline.current().enabled
    with pytest.raises(error, match="does not exist"):
        mt.start_timeline(os.path.join(folder, "missing", "t.json"))
    with pytest.raises(ValueError, match="expected a file path"):
        mt.start_timeline("  ")
    mt.barrier()
    if R == 0:
        os.remove(path)
        os.rmdir(folder)
