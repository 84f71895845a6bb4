"""The in-memory dataset every reader returns, and the one error type of the data package.

A Dataset is deliberately dumb: two host arrays and a class count. Sharding, shuffling and
batching belong to the sampler and the training loop; keeping the arrays plain numpy means every
rank can slice them with no copies and the same code serves real and synthetic data.

Images are float32 (N, C, H, W) for the image datasets (synthetic data may use any per-sample
shape), already normalised: pixels scaled to [0, 1], then standardised with fixed per-dataset
mean/std constants (see catalog.py). Fixed constants (not statistics of whatever was loaded)
keep train and test on the same scale and every rank bitwise identical.
"""
import numpy as np

from mpitrain.runtime.errors import DataError

__all__ = ["DataError", "Dataset"]


class Dataset:
    """Normalised images + int64 labels held on the host.

    images:  float32 (N, *sample_shape), (N, C, H, W) for image datasets
    labels:  int64 (N,), values in [0, classes)
    classes: number of classes
    name:    e.g. "fashion-mnist"; split: "train" / "test" (or None)
    fill:    float32 (C,), the value a black (zero) pixel has after normalisation: what crop
             augmentation pads with (None: 0, e.g. synthetic data)
    """

    def __init__(self, images, labels, classes, name, split=None, fill=None):
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.float32:
            raise DataError(f"{name}: images must be float32, got {images.dtype}")
        if images.ndim < 2:
            raise DataError(f"{name}: images must be (N, ...), got shape {images.shape}")
        if labels.dtype != np.int64 or labels.ndim != 1:
            raise DataError(f"{name}: labels must be int64 (N,), got {labels.dtype} "
                            f"{labels.shape}")
        if len(images) != len(labels):
            raise DataError(f"{name}: {len(images)} images but {len(labels)} labels")
        if int(classes) < 1:
            raise DataError(f"{name}: classes must be >= 1, got {classes}")
        if len(labels) and (labels.min() < 0 or labels.max() >= classes):
            raise DataError(f"{name}: labels must lie in [0, {classes}), got "
                            f"[{labels.min()}, {labels.max()}]")
        self.images = images    # (N, C, H, W) float32
        self.labels = labels    # (N,) int64
        self.classes = int(classes)
        self.name = str(name)
        self.split = split
        self.fill = None if fill is None else np.asarray(fill, np.float32)  # (C,)

    @property
    def sample_shape(self):
        """Shape of one sample, e.g. (1, 28, 28)."""
        return tuple(self.images.shape[1:])

    def __len__(self):
        return len(self.labels)

    def __repr__(self):
        split = f", split={self.split!r}" if self.split else ""
        return (f"Dataset({self.name!r}{split}, n={len(self)}, sample_shape={self.sample_shape}, "
                f"classes={self.classes})")
