"""mt.Metric (Horovod's example class): a running average across ranks, under 1..4 ranks.

Every expected value is written out from the ranks' inputs (rank r passes r + 1, ...), so the
oracle is arithmetic, not another allreduce.
"""
import math

import numpy as np
import pytest

import mpitrain as mt

N, R = mt.size(), mt.rank()


def test_horovods_shape_averages_across_ranks_and_updates():
    """Rank r passes r + 1, then 10 * (r + 1): the means over ranks are (N+1)/2 and 10 (N+1)/2,
    and avg is their mean, 5.5 (N+1)/2 (N=1: 5.5; N=4: 13.75)."""
    m = mt.Metric("train_loss")
    m.update(float(R + 1))
    assert m.avg == pytest.approx((N + 1) / 2, rel=1e-12)
    m.update(np.float32(10 * (R + 1)))
    assert m.avg == pytest.approx(5.5 * (N + 1) / 2, rel=1e-12)
    assert m.count == 2 * N
    assert m.sum == pytest.approx(11 * N * (N + 1) / 2, rel=1e-12)


@pytest.mark.parametrize("value", [
    lambda r: 0.25 * (r + 1),                            # float
    lambda r: np.float32(0.25 * (r + 1)),                # NumPy scalar
    lambda r: np.array(0.25 * (r + 1), np.float64),      # 0-d array
    lambda r: np.array(r + 1, np.int64) / 4,             # 0-d array from arithmetic
    lambda r: np.int64(r + 1) * 0.25,                    # NumPy scalar from an int
])
def test_scalars_floats_and_0d_arrays_are_accepted(value):
    m = mt.Metric("val_accuracy")
    m.update(value(R))
    assert m.avg == pytest.approx(0.25 * (N + 1) / 2, rel=1e-7)


def test_weights_give_the_mean_over_samples():
    """Rank r averaged over r + 1 samples with mean value r: the mean over all samples is
    sum r (r + 1) / sum (r + 1) (N=2: 2/3; N=4: 20/10 = 2)."""
    m = mt.Metric("weighted")
    m.update(float(R), n=R + 1)
    want = sum(r * (r + 1) for r in range(N)) / sum(r + 1 for r in range(N))
    assert m.avg == pytest.approx(want, rel=1e-12)
    assert m.count == N * (N + 1) // 2


def test_a_rank_with_nothing_to_add_passes_n_0():
    """The last rank has no samples this time (n=0; its value is ignored, even NaN)."""
    m = mt.Metric("uneven")
    last = R == N - 1
    m.update(math.nan if last else 3.0, n=0 if last else 2)
    if N == 1:
        assert math.isnan(m.avg) and m.count == 0        # nothing counted yet: a mean of nothing
    else:
        assert m.avg == 3.0 and m.count == 2 * (N - 1)


def test_avg_before_any_update_is_nan():
    assert math.isnan(mt.Metric("empty").avg)


def test_the_metric_is_the_same_on_every_rank():
    m = mt.Metric("agree")
    for step in range(3):
        m.update(np.float64(R * 0.1 + step))
    assert len(set(mt.allgather_object((m.sum, m.count, m.avg)))) == 1


@pytest.mark.parametrize("value, needle", [
    (np.zeros(2), "array of shape (2,)"),
    (np.zeros((1,)), "array of shape (1,)"),
    ("0.5", "got str"),
    (None, "got NoneType"),
    (True, "is a bool"),
    (1 + 2j, "got complex"),
])
def test_anything_but_a_real_scalar_is_a_value_error_on_every_rank(value, needle):
    m = mt.Metric("bad")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        m.update(value)
    assert m.count == 0


def test_a_bad_value_on_one_rank_raises_on_every_rank_and_nothing_hangs():
    m = mt.Metric("one_bad")
    bad = R == N - 1
    with pytest.raises(ValueError, match="real scalar" if bad else "other rank"):
        m.update(np.ones(3) if bad else 1.0)
    assert m.count == 0
    m.update(2.0)                                        # the metric is still usable
    assert m.avg == 2.0


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_a_bad_n_is_a_value_error(n):
    with pytest.raises(ValueError, match="n .* must be an integer >= 0"):
        mt.Metric("bad_n").update(1.0, n=n)


def test_a_name_is_required():
    with pytest.raises(ValueError, match="non-empty string"):
        mt.Metric("")


def test_metrics_updated_in_a_different_order_are_a_collective_error():
    """The name is part of the cross-rank check, as in Horovod: rank 0 updating "a" while the
    others update "b" raises on every rank instead of mixing the two."""
    if N == 1:
        return
    a, b = mt.Metric("order_a"), mt.Metric("order_b")
    with pytest.raises(mt.CollectiveError, match="name"):
        (a if R == 0 else b).update(1.0)


def test_a_process_set_averages_over_its_ranks_only():
    """Ranks 0..k-1 (k = max(1, N // 2)): the mean of r + 1 over them is (k + 1) / 2."""
    k = max(1, N // 2)
    ps = mt.add_process_set(list(range(k)))
    try:
        if ps.included():
            m = mt.Metric("subset", process_set=ps)
            m.update(float(R + 1))
            assert m.avg == pytest.approx((k + 1) / 2, rel=1e-12)
    finally:
        mt.remove_process_set(ps)
