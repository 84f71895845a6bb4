"""A name given to a non-blocking collective belongs to it until it finishes: a second call
with that name meanwhile is a ValueError at the call (Horovod's rule), and nothing is queued.
NumPy arrays, the comm layer itself. Runs as 1 process and under mpiexec -n 2, 3, 4."""
import threading

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.comm import handles


@pytest.mark.skipif(not handles.comm_thread_available(), reason="no comm thread")
def test_a_pending_name_is_refused_then_free_once_finished():
    gate = threading.Event()
    blocker = handles.submit(gate.wait, 60)    # holds the comm thread: what follows is pending
    try:
        first = mt.allreduce_async(np.ones(2), op=mt.Sum, name="grad.0")
        with pytest.raises(ValueError, match="'grad.0' is still in flight"):
            mt.allreduce_async(np.ones(2), op=mt.Sum, name="grad.0")
        with pytest.raises(ValueError, match="in flight"):
            mt.allgather_async(np.ones(2), name="grad.0")
        other = mt.allreduce_async(np.ones(2), op=mt.Sum, name="grad.1")   # another name
        unnamed = [mt.allreduce_async(np.ones(2), op=mt.Sum) for _ in range(2)]
    finally:
        gate.set()
    handles.synchronize(blocker)
    for h in [first, other] + unnamed:
        assert mt.synchronize(h).tolist() == [mt.size()] * 2
    again = mt.allreduce_async(np.ones(2), op=mt.Sum, name="grad.0")
    assert mt.synchronize(again).tolist() == [mt.size()] * 2
