"""--checkpoint-async under 1..4 ranks: the files are those a synchronous run writes, one write
at a time, and a write that fails (a full disk) stops every rank with the same OutputError by
the next checkpoint at the latest -- the previous checkpoint intact, nothing torn left behind."""
import errno
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.runtime.errors import OutputError
from mpitrain.train import checkpoint as ckpt
from mpitrain.train import config as cfg
from mpitrain.train import loop
from mpitrain.train.preempt import WRITE_FAILED
from mpitrain.train.setup import run

N, R = mt.size(), mt.rank()


@pytest.fixture
def folder():
    path = mt.broadcast_object(tempfile.mkdtemp(prefix="mt-async-") if R == 0 else None)
    yield path
    mt.barrier()
    if R == 0:
        shutil.rmtree(path, ignore_errors=True)


def config(folder, name, **changes):
    return cfg.Config(dataset="synthetic", synthetic_samples=256, hidden=(8,), batch_size=4,
                      steps=12, checkpoint_dir=os.path.join(folder, name), checkpoint_every=4,
                      progress=False).replace(**changes).validate()


def test_async_checkpoints_are_the_synchronous_ones_one_write_at_a_time(folder, monkeypatch):
    write, busy, overlaps = ckpt.write, [], []

    def slow_write(*args, **kwargs):          # slow enough that training runs on meanwhile
        overlaps.append(len(busy))
        busy.append(threading.current_thread().name)
        time.sleep(0.2)
        try:
            return write(*args, **kwargs)
        finally:
            busy.pop()

    monkeypatch.setattr(ckpt, "write", slow_write)
    run(config(folder, "async", checkpoint_async=True))
    monkeypatch.setattr(ckpt, "write", write)
    run(config(folder, "sync"))
    if R == 0:
        assert overlaps == [0, 0, 0]            # steps 4, 8 (background), 12 (the last, waits)
        for step in (4, 8, 12):
            a = ckpt.load(ckpt.checkpoint_path(os.path.join(folder, "async"), step))
            b = ckpt.load(ckpt.checkpoint_path(os.path.join(folder, "sync"), step))
            assert a.meta == b.meta and a.params.keys() == b.params.keys()
            assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)


def test_a_failed_background_write_stops_every_rank_with_one_error(folder, monkeypatch):
    write, seen = ckpt.write, []

    def full_disk(directory, step, *args, **kwargs):
        if step == 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(directory, step, *args, **kwargs)

    stop = loop.Trainer.stop_if_flagged

    def noting(self, flags):
        if flags & WRITE_FAILED:
            seen.append(self.step)
        return stop(self, flags)

    monkeypatch.setattr(ckpt, "write", full_disk)
    monkeypatch.setattr(loop.Trainer, "stop_if_flagged", noting)
    c = config(folder, "full", checkpoint_async=True, steps=100)
    with pytest.raises(OutputError) as caught:
        run(c)
    message = str(caught.value)
    assert message == (f"cannot write a checkpoint into {c.checkpoint_dir}: "
                       f"{os.strerror(errno.ENOSPC)}")
    assert mt.allgather_object(message) == [message] * N
    # learnt from the step flags after the failure, before the next checkpoint (step 12)
    steps = mt.allgather_object(seen)
    assert all(s == steps[0] for s in steps) and len(steps[0]) <= 1
    assert all(8 < s <= 12 for s in steps[0])
    if R == 0:
        names = sorted(os.listdir(c.checkpoint_dir))
        assert names == ["ckpt-00000004.npz"]                  # intact, nothing torn
        assert ckpt.load(os.path.join(c.checkpoint_dir, names[0])).step == 4
