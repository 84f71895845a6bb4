"""synthetic(): same bytes for a seed (in this and in another process), balanced, learnable."""
import hashlib
import subprocess
import sys

import numpy as np
import pytest

import mpitrain as mt

DIGEST_SNIPPET = (
    "import hashlib, mpitrain as mt; d = mt.data.synthetic(50, (3, 5, 4), 7, seed=123); "
    "print(hashlib.sha256(d.images.tobytes() + d.labels.tobytes()).hexdigest())")


def digest(ds):
    return hashlib.sha256(ds.images.tobytes() + ds.labels.tobytes()).hexdigest()


def test_shape_dtype_and_range():
    ds = mt.data.synthetic(20, shape=(3, 4, 5), classes=4, seed=1)
    assert ds.images.shape == (20, 3, 4, 5) and ds.images.dtype == np.float32
    assert ds.labels.shape == (20,) and ds.labels.dtype == np.int64
    assert ds.classes == 4 and ds.name == "synthetic" and len(ds) == 20
    assert ds.labels.min() >= 0 and ds.labels.max() < 4


def test_defaults_match_lenet_input():
    ds = mt.data.synthetic(3)
    assert ds.sample_shape == (1, 28, 28) and ds.classes == 10


def test_same_seed_same_bytes_other_seed_differs():
    a = mt.data.synthetic(64, (1, 8, 8), 10, seed=7)
    b = mt.data.synthetic(64, (1, 8, 8), 10, seed=7)
    c = mt.data.synthetic(64, (1, 8, 8), 10, seed=8)
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


def test_identical_in_another_process():
    here = digest(mt.data.synthetic(50, (3, 5, 4), 7, seed=123))
    there = subprocess.run([sys.executable, "-c", DIGEST_SNIPPET], capture_output=True,
                           text=True, check=True, timeout=120).stdout.strip()
    assert here == there


def test_balanced_classes():
    ds = mt.data.synthetic(103, (4,), classes=10, seed=0)
    counts = np.bincount(ds.labels, minlength=10)
    assert counts.min() == 10 and counts.max() == 11


def test_roughly_standardised():
    ds = mt.data.synthetic(2000, (1, 8, 8), 10, seed=3)
    assert abs(ds.images.mean()) < 0.1 and abs(ds.images.std() - 1) < 0.1


def test_learnable_by_nearest_class_mean():
    """Fit class means on the first half, classify the second half: far above chance (10%)."""
    ds = mt.data.synthetic(2000, (1, 6, 6), classes=10, seed=5)
    x = ds.images.reshape(len(ds), -1)                                   # (N, 36)
    train, test = slice(0, 1000), slice(1000, 2000)
    means = np.stack([x[train][ds.labels[train] == k].mean(0) for k in range(10)])  # (10, 36)
    dist = ((x[test][:, None, :] - means[None]) ** 2).sum(-1)            # (1000, 10)
    accuracy = (dist.argmin(1) == ds.labels[test]).mean()
    assert accuracy > 0.9, accuracy


def test_zero_samples():
    ds = mt.data.synthetic(0, (2, 2), 3)
    assert ds.images.shape == (0, 2, 2) and len(ds) == 0


@pytest.mark.parametrize("kw,word", [({"n": -1}, "n must"), ({"n": 2.5}, "n must"),
                                     ({"shape": (0, 3)}, "shape"), ({"shape": ()}, "shape"),
                                     ({"classes": 0}, "classes")])
def test_bad_arguments(kw, word):
    args = {"n": 4, "shape": (1, 2, 2), "classes": 2} | kw
    with pytest.raises(ValueError, match=word):
        mt.data.synthetic(**args)
