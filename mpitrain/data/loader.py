"""load(name, split): locate a named dataset, read it with its format's reader, normalise.

The one place that turns raw uint8 pixels into the float32 inputs models see:

    x = (pixel / 255 - mean[c]) / std[c]        computed as  pixel * a[c] - b[c]

with the fixed constants from catalog.py, in place on one float32 copy (no float64 detour, no
per-sample loop), so the full Fashion-MNIST training set is ready in about a second.
"""
import numpy as np

from mpitrain.data.catalog import check_split, spec as _spec
from mpitrain.data.cifar import read_cifar_batches
from mpitrain.data.dataset import Dataset
from mpitrain.runtime.errors import DataError
from mpitrain.data.idx import read_images_labels
from mpitrain.data.locate import dataset_files, locate

__all__ = ["load", "normalise"]


def normalise(pixels, mean, std):
    """uint8 (N, C, H, W) -> float32 (N, C, H, W) standardised per channel."""
    channels = pixels.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"normalise: {channels} channels but {len(mean)} means, "
                         f"{len(std)} stds")
    a = (1.0 / (255.0 * np.asarray(std, np.float64))).astype(np.float32)     # (C,)
    b = (np.asarray(mean, np.float64) / np.asarray(std, np.float64)).astype(np.float32)
    images = pixels.astype(np.float32)                                        # (N, C, H, W)
    images *= a.reshape(1, channels, 1, 1)
    images -= b.reshape(1, channels, 1, 1)
    return images


def load(name, split="train", data_dir=None, normalize=True):
    """Dataset `name` ("fashion-mnist", "mnist", "cifar10"), split "train" or "test".

    normalize=False: pixels only scaled to [0, 1] (for your own statistics, see normalize.py).
    """
    spec = _spec(name)
    check_split(split)
    directory = locate(name, data_dir)
    paths, _ = dataset_files(spec, directory)
    files = [paths[f] for f in spec.splits[split]]
    if spec.format == "idx":
        pixels, labels = read_images_labels(files[0], files[1], spec.sample_shape[1:])
        pixels = pixels[:, None]                                    # (N, 1, H, W)
    else:
        pixels, labels = read_cifar_batches(files)                  # (N, 3, 32, 32)
    if len(labels) and labels.max() >= spec.classes:
        bad = int(np.argmax(labels >= spec.classes))
        culprit = files[1] if spec.format == "idx" else directory
        raise DataError(f"{culprit}: label {labels[bad]} at index {bad} is out of range for "
                        f"{spec.classes} classes")
    mean, std = (spec.mean, spec.std) if normalize else ((0.0,) * len(spec.mean),
                                                         (1.0,) * len(spec.std))
    images = normalise(pixels, mean, std)                           # (N, C, H, W) float32
    fill = -np.asarray(mean, np.float64) / np.asarray(std, np.float64)  # a black pixel, (C,)
    return Dataset(images, labels.astype(np.int64), spec.classes, name, split=split, fill=fill)
