"""DistributedSampler: the global batch at step t is the same set of samples for any N."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mpitrain.data.sampler import DistributedSampler


def _global_sets(n, world, b, seed, epoch, start=0, drop_last=True):
    """Per step: the union of what every rank takes (a sorted array), and the per-rank counts."""
    per_rank = []
    for r in range(world):
        s = DistributedSampler(n, num_replicas=world, rank=r, batch_size=b, seed=seed,
                               drop_last=drop_last)
        s.set_epoch(epoch, start)
        per_rank.append(s.indices())
    counts = {p.shape for p in per_rank}
    steps = per_rank[0].shape[0]
    sets = [np.sort(np.concatenate([p[t] for p in per_rank])) for t in range(steps)]
    return sets, counts


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), global_batch=st.sampled_from([1, 2, 4, 6, 12, 24]),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_global_batch_is_the_same_set_for_any_world_size(n, global_batch, seed, epoch):
    reference, _ = _global_sets(n, 1, global_batch, seed, epoch)
    for world in (2, 3, 4, 6):
        if global_batch % world:
            continue
        sets, counts = _global_sets(n, world, global_batch // world, seed, epoch)
        assert len(counts) == 1  # every rank: the same number of batches of the same size
        assert len(sets) == len(reference) == n // global_batch
        for a, b in zip(sets, reference):
            np.testing.assert_array_equal(a, b)


def test_rank_takes_every_nth_element_of_each_global_batch():
    s = DistributedSampler(10, num_replicas=2, rank=1, batch_size=2, shuffle=False)
    assert s.indices().tolist() == [[1, 3], [5, 7]]  # tail 8, 9 dropped
    assert list(s) == [1, 3, 5, 7] and len(s) == 4
    assert [b.tolist() for b in s.batches()] == [[1, 3], [5, 7]]


def test_epochs_differ_seeds_differ_and_reruns_repeat():
    a = DistributedSampler(100, num_replicas=1, rank=0, batch_size=10, seed=3)
    first = a.indices().copy()
    a.set_epoch(1)
    assert not np.array_equal(first, a.indices())
    b = DistributedSampler(100, num_replicas=1, rank=0, batch_size=10, seed=3)
    np.testing.assert_array_equal(first, b.indices())
    c = DistributedSampler(100, num_replicas=1, rank=0, batch_size=10, seed=4)
    assert not np.array_equal(first, c.indices())


def test_each_sample_at_most_once_per_epoch_with_drop_last():
    sets, _ = _global_sets(103, 4, 5, seed=1, epoch=2)
    seen = np.concatenate(sets)
    assert len(seen) == 100 and len(np.unique(seen)) == 100


def test_padding_wraps_around_and_keeps_counts_equal():
    sets, counts = _global_sets(10, 3, 2, seed=0, epoch=0, drop_last=False)
    assert len(counts) == 1 and len(sets) == 2  # 10 samples -> 2 global batches of 6 (2 padded)
    seen = np.concatenate(sets)
    assert set(seen.tolist()) == set(range(10)) and len(seen) == 12


def test_start_resumes_mid_epoch_at_a_different_world_size():
    # 2 ranks x 3 stopped after 2 global batches (12 samples); 3 ranks x 2 continue from there.
    full, _ = _global_sets(50, 1, 6, seed=7, epoch=1)
    rest, _ = _global_sets(50, 3, 2, seed=7, epoch=1, start=12)
    assert len(rest) == len(full) - 2
    for a, b in zip(rest, full[2:]):
        np.testing.assert_array_equal(a, b)
    # A start that is not a multiple of the new global batch still continues the permutation.
    s = DistributedSampler(50, num_replicas=1, rank=0, batch_size=4, seed=7)
    s.set_epoch(1, start=6)
    np.testing.assert_array_equal(s.indices().ravel(), s.permutation()[6:6 + 4 * 11])


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_replicas=2, rank=2), "rank 2"),
    (dict(num_replicas=0, rank=0), "rank 0"),
    (dict(num_replicas=1, rank=0, batch_size=0), "batch_size 0"),
])
def test_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DistributedSampler(10, **kwargs)


def test_accepts_a_dataset_object():
    class D:
        def __len__(self):
            return 8
    assert len(DistributedSampler(D(), num_replicas=2, rank=0, batch_size=2)) == 4
