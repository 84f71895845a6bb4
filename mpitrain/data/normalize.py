"""Per-channel standardisation with statistics of the training set.

``load()`` already standardises every real dataset with the fixed mean/std of its training split
(catalog.py, measured once on the real files). ``channel_stats`` + ``standardize`` recompute that
from whatever training set was loaded -- synthetic data, a subset, another copy -- and apply it to
the training and the test set alike (test statistics never leak in):

    mean, std = mt.data.channel_stats(train)          # float64 (C,) each, over N, H, W
    train, test = mt.data.standardize(train, mean, std), mt.data.standardize(test, mean, std)

Every rank loads the same full arrays, and the sums run in a fixed order (chunks of samples, NumPy's
pairwise float64 sums), so every rank gets bitwise the same statistics without communicating.
Standardising already-standardised images composes two affine maps: the result is the raw pixels
standardised by the recomputed statistics, up to float32 rounding.
"""
import numpy as np

from mpitrain.data.dataset import Dataset
from mpitrain.runtime.errors import DataError

__all__ = ["channel_stats", "standardize", "NORMALIZATIONS"]

NORMALIZATIONS = ("fixed", "train", "none")
_CHUNK = 4096  # samples per float64 partial sum: bounded temporary memory


def channel_stats(dataset):
    """(mean, std) per channel of ``dataset.images`` (N, C, ...): float64 (C,), population std."""
    images = np.asarray(getattr(dataset, "images", dataset))
    if images.ndim < 3 or len(images) == 0:
        raise DataError(f"channel statistics need images (N, C, ...) with N >= 1, got shape "
                        f"{images.shape}")
    c = images.shape[1]
    axes = (0,) + tuple(range(2, images.ndim))
    count = images.size // c
    total = np.zeros(c, np.float64)
    for start in range(0, len(images), _CHUNK):
        total += images[start:start + _CHUNK].sum(axis=axes, dtype=np.float64)   # (C,)
    mean = total / count
    shape = (1, c) + (1,) * (images.ndim - 2)
    squares = np.zeros(c, np.float64)
    for start in range(0, len(images), _CHUNK):
        centred = images[start:start + _CHUNK].astype(np.float64) - mean.reshape(shape)
        squares += np.square(centred).sum(axis=axes)                           # (C,)
    return mean, np.sqrt(squares / count)


def standardize(dataset, mean, std):
    """A new Dataset with images ``(x - mean[c]) / std[c]`` (float32) and its ``fill`` moved too."""
    images = dataset.images
    c = images.shape[1]
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    if mean.shape != (c,) or std.shape != (c,):
        raise DataError(f"{dataset.name}: {c} channels but mean {mean.shape}, std {std.shape}")
    if not np.all(std > 0):
        raise DataError(f"{dataset.name}: a channel has std {std.min()}; cannot standardise a "
                        f"constant channel")
    shape = (1, c) + (1,) * (images.ndim - 2)
    scale = (1.0 / std).astype(np.float32).reshape(shape)                        # (1, C, 1, ...)
    shift = (mean / std).astype(np.float32).reshape(shape)
    out = images * scale                                                         # (N, C, ...)
    out -= shift
    fill = np.zeros(c, np.float64) if dataset.fill is None else dataset.fill.astype(np.float64)
    return Dataset(out, dataset.labels, dataset.classes, dataset.name, split=dataset.split,
                   fill=((fill - mean) / std).astype(np.float32))
