"""Exact distributed evaluation and the sampler's cross-rank agreement, under 1..4 ranks."""
import numpy as np
import pytest

import mpitrain as mt

N, R = mt.size(), mt.rank()


def _model():
    return mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=1)


@pytest.mark.parametrize("n, batch", [(10, 3), (11, 1000), (2, 4), (0, 5)])
def test_every_sample_is_scored_exactly_once(n, batch):
    """n samples over N ranks (10 over 3: shares of 4, 3, 3; 2 over 4: two ranks score none):
    the totals are the single-process evaluation of the whole set."""
    data = mt.data.synthetic(n, shape=(12,), classes=3, seed=5)
    model = _model()
    got = mt.evaluate(model, data, batch_size=batch)
    assert got["total"] == n
    if n == 0:
        return
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    want_loss = loss_fn.forward(model.forward(data.images), data.labels)     # all n at once
    assert got["correct"] == loss_fn.correct
    assert got["accuracy"] == loss_fn.correct / n
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
    assert len(set(map(str, mt.allgather_object(got)))) == 1                 # same on every rank
    assert model.training                                                    # mode restored


def test_shard_partitions_the_dataset():
    shares = mt.allgather_object(mt.data.shard(10).tolist())
    assert sorted(sum(shares, [])) == list(range(10))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_evaluate_rejects_a_bad_batch_size_on_every_rank():
    with pytest.raises(ValueError, match="batch_size 0"):
        mt.evaluate(_model(), mt.data.synthetic(4, shape=(12,), classes=3), batch_size=0)


@pytest.mark.parametrize("kwargs, needle", [
    (lambda: dict(batch_size=64 if R < N - 1 else 32), "batch_size differs across ranks"),
    (lambda: dict(batch_size=8, seed=R), "seed differs across ranks"),
    (lambda: dict(batch_size=8, num_replicas=N, rank=0), "same rank="),
])
def test_sampler_arguments_that_differ_across_ranks_raise_on_every_rank(kwargs, needle):
    if N == 1:
        mt.data.DistributedSampler(100, **kwargs())      # one rank: nothing can differ
        return
    with pytest.raises(mt.CollectiveError, match=needle):
        mt.data.DistributedSampler(100, **kwargs())


def test_sampler_with_equal_arguments_agrees_and_counts_batches():
    s = mt.data.DistributedSampler(100, batch_size=8, seed=3)
    assert s.num_batches() == 100 // (8 * N)
    assert len(set(mt.allgather_object(s.num_batches()))) == 1
