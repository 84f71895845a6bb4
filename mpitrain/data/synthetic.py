"""A seeded synthetic classification dataset of any shape: for tests, benchmarks, and no-data runs.

Each class c gets a fixed random prototype P[c] ~ N(0, 1) of the sample shape; a sample of class c
is (P[c] + sigma * noise) / sqrt(1 + sigma^2), so pixels have roughly zero mean and unit variance
like the normalised real datasets. Two prototypes differ by about sqrt(2 * D) in D dimensions, so
even a linear model separates the classes: loss curves go down and accuracy is a meaningful check.

Determinism: everything comes from one np.random.default_rng(seed) (PCG64) drawn in a fixed order
(prototypes, then the label permutation, then the noise), so a seed gives the same bytes on every
process and every platform, and ranks never need to broadcast it. Labels are balanced (class
i % classes, permuted), so every class is present whenever n >= classes.
"""
import numpy as np

from mpitrain.data.dataset import Dataset

__all__ = ["synthetic"]

NOISE = 1.0


def synthetic(n, shape=(1, 28, 28), classes=10, seed=0):
    """Dataset "synthetic": n samples of `shape`, `classes` classes, same bytes for a seed."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"synthetic: n must be an int >= 0, got {n!r}")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1
                        for d in shape):
        raise ValueError(f"synthetic: shape must be positive ints, got {shape!r}")
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or classes < 1:
        raise ValueError(f"synthetic: classes must be an int >= 1, got {classes!r}")
    rng = np.random.default_rng(seed)
    prototypes = rng.standard_normal((classes,) + shape, dtype=np.float32)   # (K, *shape)
    labels = rng.permutation(np.arange(n, dtype=np.int64) % classes)         # (n,)
    images = rng.standard_normal((n,) + shape, dtype=np.float32)             # (n, *shape)
    images *= np.float32(NOISE)
    images += prototypes[labels]
    images *= np.float32(1.0 / np.sqrt(1.0 + NOISE * NOISE))
    return Dataset(images, labels, int(classes), "synthetic")
