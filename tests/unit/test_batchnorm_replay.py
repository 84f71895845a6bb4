"""BatchNorm.batch_sums / update_running and deterministic.BatchNormReplay: replaying the recorded
batch sums in order gives the running statistics of the forwards themselves, bit for bit; any
other order (what N ranks moving their own copies would give) does not."""
import numpy as np

import mpitrain as mt
from mpitrain.parallel.deterministic import BatchNormReplay


def _batches():
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((4, 3, 5, 5)) * 3 + i).astype(np.float32) for i in range(4)]


def test_replay_in_order_is_the_forwards_bitwise():
    model = mt.nn.Sequential(mt.nn.BatchNorm2d(3), mt.nn.BatchNorm2d(3))
    replay = BatchNormReplay(model)
    replay.begin_step()
    for x in _batches():
        model.forward(x)
        replay.after_pass()
    want = [b.copy() for b in model.buffers()]
    for b in model.buffers():
        b[...] = 7.0                         # what a rank's own updates would have left
    replay.end_step(lambda rows: rows)       # one rank: its rows are every row
    for got, w in zip(model.buffers(), want):
        assert got.tobytes() == w.tobytes()


def test_another_order_gives_other_bits():
    bn = mt.nn.BatchNorm2d(3)
    sums = []
    for x in _batches():
        bn.forward(x)
        sums.append(bn.batch_sums())
    want = bn.running_mean.copy()
    other = mt.nn.BatchNorm2d(3)
    for s in sums[::-1]:
        other.update_running(s)
    assert other.running_mean.tobytes() != want.tobytes()
    again = mt.nn.BatchNorm2d(3)
    for s in sums:
        again.update_running(s)
    assert again.running_mean.tobytes() == want.tobytes()
