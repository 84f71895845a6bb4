"""Overlap of gradient allreduce with backward (mpitrain/comm/overlap.py), under 1..4 ranks.

The oracle is the same as in test_distributed.py: every rank also trains the 1-rank reference
on the whole global batch locally. Here the distributed run passes ``opt.backward_hook`` to
``model.backward``, so buckets start on the comm thread during backward.
"""
import os
import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt

from mpitrain.comm import overlap, world
from mpitrain.parallel.optimizer import DistributedOptimizer

mt.init()
N, R = mt.size(), mt.rank()


def _batch(step, n, shape, dtype):
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((n,) + shape).astype(dtype)  # (n, ...)
    y = rng.integers(0, 10, n).astype(np.int64)           # (n,)
    return x, y


def _model(name, dtype):
    if name == "mlp":
        return mt.models.mlp(in_features=20, hidden=(16, 12), seed=0, dtype=dtype)
    return mt.models.lenet(seed=0, dtype=dtype)


def _train(name, dtype, per_rank, world, rank, steps=10, hook=True, **opt_kw):
    model = _model(name, dtype)
    opt = mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if world > 1 or opt_kw:
        opt = DistributedOptimizer(opt, model.named_parameters(), **opt_kw)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for t in range(steps):
        x, y = _batch(t, world * per_rank, model.input_shape, dtype)
        opt.zero_grad()
        loss_fn.forward(model.forward(np.ascontiguousarray(x[rank::world])),
                        np.ascontiguousarray(y[rank::world]))
        on_done = opt.backward_hook if hook and isinstance(opt, DistributedOptimizer) else None
        model.backward(loss_fn.backward(), on_layer_done=on_done)
        opt.step()
    return model.state_dict()


def _rel_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) / max(float(np.max(np.abs(b[k]))), 1e-30)
               for k in b)


def _identical_on_every_rank(state):
    gathered = mt.allgather_object(state)
    return all(all(np.array_equal(g[k], state[k]) for k in state) for g in gathered)


# tiny buckets (64 bytes) so that even these small models have many in flight at once
@pytest.mark.parametrize("name, per_rank, threshold", [("mlp", 4, 64), ("mlp", 4, None),
                                                       ("lenet", 2, 4096)])
def test_overlapped_n_ranks_times_b_equals_one_rank_times_nb(name, per_rank, threshold):
    dist = _train(name, np.float64, per_rank, N, R, fusion_threshold_bytes=threshold)
    ref = _train(name, np.float64, per_rank * N, 1, 0)
    assert _rel_diff(dist, ref) <= 1e-5
    assert _identical_on_every_rank(dist)


def test_overlap_reruns_are_bitwise_identical_and_match_no_overlap_closely():
    a = _train("mlp", np.float32, 4, N, R, fusion_threshold_bytes=64)
    b = _train("mlp", np.float32, 4, N, R, fusion_threshold_bytes=64)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    off = _train("mlp", np.float32, 4, N, R, overlap=False)
    assert _rel_diff(a, off) <= 1e-5


def test_fp16_compression_with_overlap():
    comp = _train("mlp", np.float32, 4, N, R, steps=5, fusion_threshold_bytes=64,
                  compression=mt.Compression.fp16)
    full = _train("mlp", np.float32, 4, N, R, steps=5, fusion_threshold_bytes=64)
    assert _rel_diff(comp, full) <= 1e-2
    assert _identical_on_every_rank(comp)


def test_plan_is_reverse_layer_order_within_the_threshold():
    model = _model("mlp", np.float32)      # 20x16, 16, 16x12, 12, 12x10, 10 floats
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), fusion_threshold_bytes=800)
    if N == 1:
        assert opt.strategy.bucket_allreduce() is None     # one rank: nothing to overlap
        return
    plan = opt.strategy.bucket_allreduce()
    plan._build()
    # slots are reversed parameters: 2.bias (40 bytes), 2.weight (480), 1.bias (48),
    # 1.weight (768), 0.bias (64), 0.weight (1280: alone, above the threshold)
    assert [[e[0] for e in b.entries] for b in plan.buckets] == [[0, 1, 2], [3], [4], [5]]
    assert [b.total * 4 for b in plan.buckets] == [568, 768, 64, 1280]
    # a bucket of one array is reduced in place in the gradient: no flat buffer
    assert [b.flat is None for b in plan.buckets] == [False, True, True, True]


@pytest.mark.skipif(N == 1, reason="nothing to overlap on one rank")
def test_a_bucket_is_reduced_on_the_comm_thread_before_the_rest_is_ready():
    done = threading.Event()
    threads = []

    def reduce_flat(flat):
        threads.append(threading.current_thread().name)
        try:
            world.current().ring.Allreduce(MPI.IN_PLACE, flat)
        finally:
            done.set()

    arrays = [np.full(3, R + 1.0), np.full(5, 10.0 * (R + 1))]             # (3,), (5,)
    b = overlap.BucketAllreduce([((3,), np.float64), ((5,), np.float64)], 8, reduce_flat,
                                {"name": "test"})
    b.ready(0, arrays[0])
    # bucket 0 completes on the comm thread while bucket 1 has not even been reported
    assert done.wait(60), "bucket 0 was not reduced before finish()"
    b.finish(arrays)
    total = N * (N + 1) / 2
    np.testing.assert_array_equal(arrays[0], np.full(3, total))
    np.testing.assert_array_equal(arrays[1], np.full(5, 10.0 * total))
    assert len(threads) == 2 and all(t.startswith("mpitrain-comm") for t in threads)


@pytest.mark.skipif(N == 1, reason="nothing to overlap on one rank")
def test_comm_thread_error_is_raised_by_finish_on_every_rank_and_world_stays_usable():
    calls = []

    def reduce_flat(flat):
        calls.append(flat.size)
        if len(calls) == 1:
            raise RuntimeError("bucket 0 failed")

    b = overlap.BucketAllreduce([((2,), np.float64)] * 3, 16, reduce_flat, {"name": "err"})
    with pytest.raises(RuntimeError, match="bucket 0 failed"):
        b.finish([np.zeros(2), np.zeros(2), np.zeros(2)])
    assert calls == [2]                     # the later buckets were skipped, not left running
    assert mt.allreduce(np.ones(3), op=mt.Sum)[0] == N


@pytest.mark.skipif(N == 1, reason="nothing to overlap on one rank")
def test_reporting_a_gradient_twice_is_an_error_at_step_not_in_backward():
    model = _model("mlp", np.float64)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters())
    before = model.state_dict(copy=True)
    p = model.parameters()[-1]
    opt.backward_hook([p])
    opt.backward_hook([p])               # a second pass: counted, not raised here
    with pytest.raises(ValueError, match="step\\(\\) after 2 backward passes"):
        opt.step()
    assert all(np.array_equal(v, model.state_dict()[k]) for k, v in before.items())
    assert mt.allreduce(np.ones(3), op=mt.Sum)[0] == N      # the buckets finished everywhere


@pytest.mark.skipif(N == 1, reason="one rank has nothing to overlap")
def test_step_in_skip_synchronize_with_pending_buckets_is_a_clear_error():
    model = _model("mlp", np.float64)
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), fusion_threshold_bytes=64)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    x, y = _batch(0, 4, model.input_shape, np.float64)
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
    with pytest.raises(RuntimeError, match="call opt.synchronize"):
        with opt.skip_synchronize():
            opt.step()
    opt.synchronize()                      # the pending buckets complete on every rank
    with opt.skip_synchronize():
        opt.step()
    assert _identical_on_every_rank(model.state_dict())


@pytest.mark.skipif(N == 1, reason="needs two ranks to disagree")
def test_different_models_on_ranks_raise_collective_error_everywhere():
    model = mt.models.mlp(in_features=20, hidden=(16 + (R == 1),), seed=0)
    # several buckets: the plan is agreed at the first hook
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), fusion_threshold_bytes=256)
    with pytest.raises(mt.CollectiveError, match="differs"):
        opt.backward_hook(model.parameters()[-1:])
    # one bucket's worth (the fused path at synchronize): the average's own agreement
    opt = DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters())
    opt.backward_hook(model.parameters())
    with pytest.raises(mt.CollectiveError, match="differs"):
        opt.synchronize()


def test_fusion_threshold_is_a_parameter_or_a_setting(use_settings):
    xs = [np.full(4, float(R)) for _ in range(3)]                        # 32 bytes each
    mt.grouped_allreduce_(xs, op=mt.Sum, fusion_threshold_bytes=40)
    assert "MPITRAIN_FUSION_THRESHOLD" not in os.environ
    fusion = world.current().fusion
    assert fusion.threshold_bytes == 40
    assert len(fusion.plan(xs)) == 3                                     # one bucket each
    for x in xs:
        np.testing.assert_array_equal(x, np.full(4, float(sum(range(N)))))
    model = _model("mlp", np.float32)

    def wrap(**kw):
        return DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), **kw)
    assert wrap(fusion_threshold_bytes=123).fusion_threshold_bytes == 123
    assert wrap().fusion_threshold_bytes == 4 << 20                      # overlap default
    assert wrap(overlap=False).fusion_threshold_bytes == 64 << 20
    use_settings(fusion_threshold_bytes=256)               # MPITRAIN_FUSION_THRESHOLD, at init
    assert wrap().fusion_threshold_bytes == 256
    with pytest.raises(ValueError, match="fusion_threshold_bytes -1"):
        wrap(fusion_threshold_bytes=-1)


@pytest.mark.skipif(N == 1, reason="nothing to overlap on one rank")
def test_bucket_allreduces_are_watched_for_stalls():
    """Each bucket is marked in flight for the stall watchdog, then cleared (watchdog.py)."""
    from mpitrain.comm import watchdog
    seen = []

    def reduce_flat(flat):
        seen.append(watchdog.current())
        world.current().ring.Allreduce(MPI.IN_PLACE, flat)

    before = watchdog.record().seq
    b = overlap.BucketAllreduce([((3,), np.float64), ((5,), np.float64)], 8, reduce_flat,
                                {"name": "watched"})
    arrays = [np.ones(3), np.ones(5)]
    b.ready(0, arrays[0])
    b.finish(arrays)
    assert [s[1:] for s in seen] == [("allreduce bucket", "bucket 0"),
                                     ("allreduce bucket", "bucket 1")]
    # after the plan's agreement and, at N > 1, the step's (join.py learns steps from it)
    first = before + (3 if world.size() > 1 else 2)
    assert [s[0] for s in seen] == [first, first + 1]
    assert watchdog.current() is None


def test_large_gradients_are_reduced_in_place_without_packing(monkeypatch):
    """A bucket of its own for every array of at least fusion.SOLO_BYTES (no cast needed): it
    is reduced in the caller's array; a float16 wire still packs (it must cast anyway)."""
    monkeypatch.setattr(overlap, "SOLO_BYTES", 64)                      # 8 float64
    specs = [((3,), np.float64), ((8,), np.float64), ((2,), np.float64), ((4, 2), np.float64),
             ((9,), np.float32)]
    b = overlap.BucketAllreduce(specs, 1 << 20, lambda flat: flat, {"name": "solo"},
                                wire_dtypes=[np.float64] * 4 + [np.float16])
    b._build()
    assert [[e[0] for e in k.entries] for k in b.buckets] == [[0], [1], [2], [3], [4]]
    assert [k.flat is None for k in b.buckets] == [True, True, True, True, False]
    b2 = overlap.BucketAllreduce(specs[:3], 1 << 20, lambda flat: flat, {"name": "solo2"})
    monkeypatch.setattr(overlap, "SOLO_BYTES", 1 << 20)
    b2._build()
    assert [[e[0] for e in k.entries] for k in b2.buckets] == [[0, 1, 2]]
