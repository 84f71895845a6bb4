"""FusionBuffer plan and pack/unpack on one process (the reduce is a stand-in doubling)."""
import numpy as np
import pytest

from mpitrain.comm.fusion import FusionBuffer, check_threshold
from mpitrain.comm.settings import CommSettings


def test_plan_groups_by_dtype_in_input_order_and_splits():
    fb = FusionBuffer(threshold_bytes=64)                               # 16 float32 / 8 float64
    xs = [np.zeros(4, np.float32), np.zeros(3), np.zeros(10, np.float32), np.zeros(5),
          np.zeros(20, np.float32), np.zeros(1, np.float32)]
    plan = fb.plan(xs)
    got = [(b.dtype.name, [e[0] for e in b.entries], b.total) for b in plan]
    assert got == [("float32", [0, 2], 14), ("float32", [4], 20), ("float32", [5], 1),
                   ("float64", [1, 3], 8)]
    assert fb.plan(xs) is plan                                          # cached, fixed
    assert FusionBuffer(threshold_bytes=64).plan([x.copy() for x in xs]).__repr__() == \
        plan.__repr__()                                                 # same on any "rank"


def test_pack_reduce_unpack_round_trip_with_views():
    fb = FusionBuffer(threshold_bytes=1 << 20)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    xs = [base[:, ::2], np.arange(5.0), np.arange(3, dtype=np.float32), np.zeros((0, 2))]
    outs = [np.empty(x.shape, x.dtype) for x in xs]
    calls = []

    def double(flat):
        calls.append(flat.size)
        flat *= 2

    fb.allreduce(xs, outs, double)
    for x, o in zip(xs, outs):
        np.testing.assert_array_equal(o, 2 * x)
    assert sorted(calls) == [5, 15]                      # one f64 bucket (5 + 0), one f32 (12 + 3)


def test_threshold_setting():
    env = {"MPITRAIN_FUSION_THRESHOLD": "123"}
    assert CommSettings.from_env(env).fusion_threshold(64) == 123
    assert CommSettings.from_env({}).fusion_threshold(64) == 64          # the caller's default
    with pytest.raises(ValueError, match="MPITRAIN_FUSION_THRESHOLD='lots'"):
        CommSettings.from_env({"MPITRAIN_FUSION_THRESHOLD": "lots"})
    assert FusionBuffer().threshold_bytes == 64 * 1024 * 1024
    with pytest.raises(ValueError, match="fusion_threshold_bytes -1"):
        check_threshold(-1)


def test_large_arrays_travel_alone_in_place(monkeypatch):
    """Arrays of at least SOLO_BYTES get their own bucket and are reduced in their output,
    never copied through the flat buffer; the small ones around them still share a bucket."""
    from mpitrain.comm import fusion
    monkeypatch.setattr(fusion, "SOLO_BYTES", 64)                       # 16 float32
    fb = FusionBuffer(threshold_bytes=1 << 20)
    xs = [np.ones(3, np.float32), np.ones(16, np.float32), np.ones(2, np.float32),
          np.ones(15, np.float32), np.ones((5, 4), np.float32)]
    plan = fb.plan(xs)
    assert [[e[0] for e in b.entries] for b in plan] == [[1], [4], [0, 2, 3]]
    seen = []
    fb.allreduce(xs, xs, lambda flat: (seen.append(flat), flat.__imul__(2)))
    views = [f for f in seen if f.size in (16, 20)]
    assert [np.shares_memory(v, x) for v, x in zip(views, (xs[1], xs[4]))] == [True, True]
    for x in xs:
        np.testing.assert_array_equal(x, 2)
