"""Per-channel statistics of the training set and standardisation with them."""
import numpy as np
import pytest

import mpitrain as mt


def dataset(images, name="d"):
    return mt.data.Dataset(images.astype(np.float32), np.zeros(len(images), np.int64), 1, name,
                           fill=np.zeros(images.shape[1]))


def test_channel_stats_match_numpy_float64():
    rng = np.random.default_rng(0)
    images = rng.normal([1.0, -2.0, 0.5], [0.5, 3.0, 1.0], (5000, 4, 3)).transpose(0, 2, 1)
    images = np.ascontiguousarray(images[..., None].repeat(2, -1))   # (5000, 3, 4, 2)
    mean, std = mt.data.channel_stats(dataset(images))
    x = images.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, x.std(axis=(0, 2, 3)), rtol=1e-12)
    assert mean.shape == std.shape == (3,)


def test_channel_stats_are_bitwise_reproducible_across_chunks():
    images = np.random.default_rng(1).standard_normal((9000, 1, 3, 3)).astype(np.float32)
    a = mt.data.channel_stats(dataset(images))
    b = mt.data.channel_stats(dataset(images.copy()))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_standardize_gives_zero_mean_unit_std_and_moves_the_fill():
    rng = np.random.default_rng(2)
    train = dataset(rng.normal(3.0, 2.0, (600, 2, 5, 5)))
    test = dataset(rng.normal(3.0, 2.0, (100, 2, 5, 5)))
    mean, std = mt.data.channel_stats(train)
    new_train, new_test = (mt.data.standardize(d, mean, std) for d in (train, test))
    np.testing.assert_allclose(new_train.images.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(new_train.images.std(axis=(0, 2, 3)), 1, atol=1e-5)
    np.testing.assert_allclose(new_test.images, (test.images - mean[None, :, None, None])
                               / std[None, :, None, None], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_train.fill, -mean / std, rtol=1e-6)
    assert new_train.images.dtype == np.float32 and new_train.labels is train.labels


def test_bad_input():
    with pytest.raises(mt.data.DataError, match="constant channel"):
        mt.data.standardize(dataset(np.ones((4, 1, 2, 2))), [1.0], [0.0])
    with pytest.raises(mt.data.DataError, match="1 channels"):
        mt.data.standardize(dataset(np.ones((4, 1, 2, 2))), [1.0, 2.0], [1.0, 1.0])
    with pytest.raises(mt.data.DataError, match="N >= 1"):
        mt.data.channel_stats(np.zeros((0, 1, 2, 2), np.float32))
