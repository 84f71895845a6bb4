"""Crop + flip augmentation: a NumPy reference, determinism, and the same global batch for any N."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data.augment import mix64


def reference(images, dy, dx, flipped, padding, fill):
    """torchvision's RandomCrop(padding) then RandomHorizontalFlip, one sample at a time."""
    out = np.empty_like(images)
    h, w = images.shape[2:]
    for i, image in enumerate(images):
        pads = [np.pad(ch, padding, constant_values=f) for ch, f in
                zip(image, np.broadcast_to(fill, (len(image),)))]
        window = np.stack(pads)[:, dy[i]:dy[i] + h, dx[i]:dx[i] + w]     # (C, H, W)
        out[i] = window[:, :, ::-1] if flipped[i] else window
    return out


@pytest.mark.parametrize("shape,padding", [((64, 1, 28, 28), 2), ((16, 3, 32, 32), 4),
                                           ((5, 2, 7, 9), 3), ((4, 1, 5, 5), 0),
                                           ((1000, 2, 6, 5), 3), ((1000, 1, 4, 4), 3)])
def test_crop_flip_match_the_reference(shape, padding):
    rng = np.random.default_rng(1)
    images = rng.standard_normal(shape, dtype=np.float32)
    before = images.copy()
    fill = rng.standard_normal(shape[1]).astype(np.float32)
    aug = mt.data.Augment(padding, flip=True, seed=7, fill=fill)
    idx = rng.choice(10 ** 6, shape[0], replace=False)
    out = aug(images, idx, epoch=3)
    dy, dx, flipped = aug.choices(idx, 3)
    if shape[0] >= 1000:  # every offset pair, flipped and not, meets the reference
        assert len(set(zip(dy, dx, flipped))) == 2 * (2 * padding + 1) ** 2
    np.testing.assert_array_equal(out, reference(images, dy, dx, flipped, padding, fill))
    np.testing.assert_array_equal(images, before)           # the dataset is never modified
    assert out.dtype == np.float32 and out.shape == shape


def test_padding_is_the_fill_value_and_offsets_cover_the_range():
    images = np.ones((400, 1, 6, 6), np.float32)
    aug = mt.data.Augment(2, flip=False, seed=0, fill=-5.0)
    idx = np.arange(400)
    dy, dx, flipped = aug.choices(idx, 0)
    assert set(dy) == set(range(5)) and set(dx) == set(range(5)) and not flipped.any()
    out = aug(images, idx, 0)
    i = int(np.flatnonzero((dy == 0) & (dx == 0))[0])      # window at the top-left corner
    assert (out[i, 0, :2] == -5).all() and (out[i, 0, :, :2] == -5).all()
    assert (out[i, 0, 2:, 2:] == 1).all()
    centred = np.flatnonzero((dy == 2) & (dx == 2))
    assert (out[centred] == 1).all()


def test_flip_alone_mirrors_about_half_the_samples():
    images = np.arange(2000 * 4, dtype=np.float32).reshape(2000, 1, 1, 4)
    aug = mt.data.Augment(0, flip=True, seed=5)
    out = aug(images, np.arange(2000), 0)
    mirrored = (out == images[:, :, :, ::-1]).all(axis=(1, 2, 3))
    assert ((out == images).all(axis=(1, 2, 3)) ^ mirrored).all()
    assert 0.45 < mirrored.mean() < 0.55


def test_choices_depend_only_on_seed_epoch_and_index():
    aug = mt.data.Augment(4, flip=True, seed=11)
    idx = np.array([5, 900, 17, 3, 42])
    whole = aug.choices(idx, 2)
    for part in (idx[::-1], idx[1:3], idx[:1]):             # another batch, order, size
        got = aug.choices(part, 2)
        pos = [int(np.flatnonzero(idx == i)[0]) for i in part]
        for a, b in zip(got, whole):
            np.testing.assert_array_equal(a, b[pos])
    again = mt.data.Augment(4, flip=True, seed=11).choices(idx, 2)
    for a, b in zip(again, whole):
        np.testing.assert_array_equal(a, b)


def test_epochs_and_seeds_give_different_choices():
    idx = np.arange(512)
    base = mt.data.Augment(4, flip=True, seed=0).choices(idx, 0)
    for other in (mt.data.Augment(4, flip=True, seed=0).choices(idx, 1),
                  mt.data.Augment(4, flip=True, seed=1).choices(idx, 0)):
        same = (base[0] == other[0]) & (base[1] == other[1]) & (base[2] == other[2])
        assert same.mean() < 0.1                            # 1/162 by chance


def test_mix64_array_and_int_agree():
    xs = [0, 1, 2 ** 63 + 5, 2 ** 64 - 1, 123456789]
    got = mix64(np.array(xs, np.uint64))
    assert [int(v) for v in got] == [mix64(x) for x in xs]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_augmented_global_batch_is_the_same_for_any_n(n):
    """Rank r's augmented shard, built by hand for N ranks, reassembles into the N=1 batch."""
    data = mt.data.synthetic(96, shape=(1, 8, 8), seed=0)
    aug = mt.data.Augment(2, flip=True, seed=3, fill=0.5)
    batch = 6                                               # samples per rank at N=1
    one = mt.data.DistributedSampler(len(data), 1, 0, seed=3, batch_size=batch * 6)
    one.set_epoch(1)
    idx1 = one.indices()                                    # (steps, 36)
    expected = [aug(data.images[i], i, 1) for i in idx1]    # (36, 1, 8, 8) per step
    shards = []
    for rank in range(n):
        sampler = mt.data.DistributedSampler(len(data), n, rank, seed=3,
                                             batch_size=batch * 6 // n)
        sampler.set_epoch(1)
        shards.append([(i, aug(data.images[i], i, 1)) for i in sampler.indices()])
    for step, want in enumerate(expected):
        got = {}
        for rank in range(n):
            idx, x = shards[rank][step]
            got.update({int(i): xi for i, xi in zip(idx, x)})
        assert sorted(got) == sorted(int(i) for i in idx1[step])
        for i, xi in zip(idx1[step], want):
            np.testing.assert_array_equal(got[int(i)], xi)


def test_bad_arguments():
    with pytest.raises(ValueError, match="crop padding"):
        mt.data.Augment(-1)
    with pytest.raises(ValueError, match="does not fit"):
        mt.data.Augment(5, flip=True)(np.zeros((2, 1, 5, 5), np.float32), [0, 1], 0)
    with pytest.raises(ValueError, match=r"\(b, C, H, W\)"):
        mt.data.Augment(1)(np.zeros((2, 25), np.float32), [0, 1], 0)
    with pytest.raises(ValueError, match="2 images but 3"):
        mt.data.Augment(1)(np.zeros((2, 1, 5, 5), np.float32), [0, 1, 2], 0)


def test_default_crop_padding():
    assert mt.data.default_crop_padding((1, 28, 28)) == 2
    assert mt.data.default_crop_padding((3, 32, 32)) == 4


def test_fill_none_pads_with_zero():
    out = mt.data.Augment(1, fill=None)(np.ones((50, 1, 3, 3), np.float32), np.arange(50), 0)
    assert set(np.unique(out)) == {0.0, 1.0}
