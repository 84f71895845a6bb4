"""CIFAR-10 binary batches reader (data_batch_1..5.bin, test_batch.bin).

The "binary version" (cifar-10-binary.tar.gz, folder cifar-10-batches-bin) has no header: each
file is a run of fixed-size records,

    1 byte label (0-9) | 1024 bytes red | 1024 bytes green | 1024 bytes blue

each colour plane a 32x32 row-major image, so one record is 3073 bytes and an official batch of
10000 records is 30,730,000 bytes. Because the planes are already channel-first, viewing the
file as (N, 3073) and reshaping columns 1: to (N, 3, 32, 32) is the whole decoder. Without a
header, the record size is the only structural check there is: a file whose length is not a
multiple of 3073 is truncated or not a CIFAR-10 batch, and a label byte >= 10 means misalignment.
This reader never unpickles anything (the "python version" of CIFAR would need pickle).
"""
from pathlib import Path

import numpy as np

from mpitrain.runtime.errors import DataError

__all__ = ["RECORD_BYTES", "read_cifar_batch", "read_cifar_batches"]

IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32                          # 3073
CLASSES = 10


def read_cifar_batch(path):
    """uint8 images (N, 3, 32, 32) and uint8 labels (N,) from one batch file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) == 0 or len(data) % RECORD_BYTES:
        raise DataError(f"{path}: {len(data)} bytes is not a whole number of {RECORD_BYTES}-byte "
                        f"CIFAR-10 records (truncated or not a CIFAR-10 binary batch)")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)  # (N, 3073)
    labels = records[:, 0]                                                  # (N,)
    if labels.max() >= CLASSES:
        bad = int(np.argmax(labels >= CLASSES))
        raise DataError(f"{path}: record {bad} has label {labels[bad]} (CIFAR-10 labels are "
                        f"0-{CLASSES - 1}; file misaligned or not CIFAR-10)")
    images = records[:, 1:].reshape((-1,) + IMAGE_SHAPE)                   # (N, 3, 32, 32)
    return images, labels


def read_cifar_batches(paths):
    """Several batch files concatenated in the given order."""
    parts = [read_cifar_batch(p) for p in paths]
    if not parts:
        raise DataError("no CIFAR-10 batch files given")
    images = np.concatenate([im for im, _ in parts])                        # (N, 3, 32, 32)
    labels = np.concatenate([lb for _, lb in parts])                        # (N,)
    return images, labels
