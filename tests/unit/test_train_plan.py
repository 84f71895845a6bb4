"""train/plan.py and train/progress.py on one process: which samples each pass of a step reads
and with what weight (plain, --accumulate, the --uneven tail, --deterministic micro-shards), and
the counters a resume restores. The ranks are simulated by giving the sampler num_replicas/rank."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data.sampler import DistributedSampler
from mpitrain.optim import LRSchedule
from mpitrain.train.config import Config
from mpitrain.train.plan import MicroShardPlan, StepPlan, make_plan
from mpitrain.train.progress import Progress


def plan_of(n, size, rank, **config):
    config = Config(dataset="synthetic", **config)
    sampler = DistributedSampler(n, size, rank, seed=3,
                                 batch_size=config.batch_size * config.accumulate)
    model = mt.models.get("mlp", in_features=4, hidden=(3,), classes=2)
    plan = make_plan(config, sampler, size, rank, model)
    sampler.set_epoch(0)
    return plan, sampler


def test_plain_steps_are_the_samplers_shares_in_one_pass():
    plan, sampler = plan_of(40, 2, 1, batch_size=4)
    assert type(plan) is StepPlan
    steps = plan.steps()
    assert len(steps) == 5 and all(s.samples == 8 and not s.joins for s in steps)
    assert [s.weight for s in steps] == [1.0] * 5
    np.testing.assert_array_equal(np.stack([s.idx for s in steps]), sampler.indices())
    assert [m.shape for m in steps[0].micro_batches()] == [(4,)]


def test_accumulate_cuts_a_share_into_k_micro_batches_of_weight_1_over_k():
    plan, sampler = plan_of(48, 2, 0, batch_size=4, accumulate=3)
    step = plan.steps()[0]
    assert (step.passes, step.weight, step.samples) == (3, 1 / 3, 24)
    micro = step.micro_batches()
    assert micro.shape == (3, 4)
    np.testing.assert_array_equal(micro.ravel(), sampler.indices()[0])


@pytest.mark.parametrize("rank, share", [(0, 2), (1, 2), (2, 1)])
def test_the_uneven_tail_is_one_weighted_step_then_join(rank, share):
    # 29 samples, 3 ranks x 4: two full global batches, a tail of 5 strided over the ranks
    plan, sampler = plan_of(29, 3, rank, batch_size=4, uneven=True)
    steps = plan.steps()
    assert len(steps) == 3 and [s.joins for s in steps] == [False, False, True]
    tail = steps[-1]
    assert len(tail.idx) == share and tail.samples == 5 and tail.passes == 1
    assert tail.weight == 3 * share / 5      # the average over ranks is the tail's mean


def test_a_rank_without_a_share_of_the_tail_makes_no_pass():
    plan, _ = plan_of(25, 3, 2, batch_size=4, uneven=True)     # tail of 1 sample: rank 0's
    tail = plan.steps()[-1]
    assert tail.joins and len(tail.idx) == 0 and list(tail.micro_batches()) == []


def test_micro_shards_are_contiguous_slices_in_micro_shard_order():
    one, sampler = plan_of(64, 1, 0, batch_size=16, deterministic=True, micro_shards=8)
    two = [plan_of(64, 2, r, batch_size=8, deterministic=True, micro_shards=8)[0]
           for r in (0, 1)]
    assert isinstance(one, MicroShardPlan)
    whole = one.steps()[0]
    assert (whole.passes, whole.weight) == (8, 1 / 8)
    halves = [p.steps()[0] for p in two]
    assert [h.passes for h in halves] == [4, 4] and halves[0].weight == 1 / 8
    # rank 0 then rank 1 read exactly the one-rank micro-shards, in the same order
    np.testing.assert_array_equal(
        np.concatenate([h.micro_batches() for h in halves]), whole.micro_batches())


def test_progress_counts_steps_epochs_and_samples():
    p = Progress(Config(dataset="synthetic", epochs=2), n_train=20, global_batch=8)
    assert (p.steps_per_epoch(), p.total_steps(), p.remaining_steps()) == (2, 4, 4)
    assert p.advance(8) is False and (p.step, p.epoch, p.position) == (1, 0, 8)
    assert p.advance(8) is True and (p.step, p.epoch, p.position) == (2, 1, 0)
    assert p.remaining_steps() == 2 and not p.done()
    p.advance(8), p.advance(8)
    assert p.done() and p.epochs_done() == 2


def test_the_lr_is_a_function_of_the_position_alone():
    config = Config(dataset="synthetic", epochs=4, warmup_epochs=2.0, lr_schedule="cosine")
    schedule = LRSchedule(0.1, "cosine", total_steps=8, steps_per_epoch=2)
    a, b = (Progress(config, n_train=16, global_batch=8) for _ in range(2))
    for _ in range(3):
        a.advance(8)
    b.step, b.epoch, b.position = 3, 1, 8            # what a resume restores
    assert a.lr(schedule) == b.lr(schedule)
    fresh = Progress(config, n_train=16, global_batch=8)
    assert fresh.lr(schedule) == pytest.approx(0.1 * 0.25 * schedule.decay(0))


def test_an_epoch_of_many_steps_makes_each_step_only_when_it_is_taken():
    """A large corpus has millions of steps an epoch; --steps 5 takes five. The plan holds the
    epoch's index array, not one object per step: 400000 steps cost about their indices."""
    import tracemalloc
    plan, sampler = plan_of(400_000, 1, 0, batch_size=1)
    tracemalloc.start()
    try:
        steps = plan.steps()
        taken = [step for _, step in zip(range(5), steps)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(steps) == 400_000 and len(taken) == 5
    np.testing.assert_array_equal(taken[4].idx, sampler.indices()[4])
    np.testing.assert_array_equal(steps[-1].idx, sampler.indices()[-1])
    assert peak < 20 << 20, peak          # the permutation and its (steps, 1) view: ~6.4 MB
