"""load_npz: your own image data from NumPy files, memory-mapped, as (train, test) Datasets.

    train, test = mt.data.load_npz("mydata.npz")    # arrays x, y [, x_test, y_test]
    train, test = mt.data.load_npz("mydata/")       # x.npy, y.npy [, x_test.npy, y_test.npy]
    train, test = mt.data.load_npz("data/run1_")    # data/run1_x.npy, data/run1_y.npy, ...

Three layouts are read:
- an .npz written by ``np.savez`` (uncompressed) holding ``x`` and ``y``, optionally ``x_test``
  and ``y_test``;
- a folder holding ``x.npy`` and ``y.npy`` (optionally ``x_test.npy``, ``y_test.npy``);
- a prefix P: the files ``P + "x.npy"``, ``P + "y.npy"`` (and ``P + "x_test.npy"``, ...).
Without a test pair the last 10% of the samples are the test split.

x is float32 (N, ...), already normalised as your model wants it (uint8 pixels are refused: save
``(x / 255).astype(np.float32)`` or your own standardisation); y is integer (N,), labels in
[0, classes), classes = max(y) + 1 over both splits. x is never read whole: .npy files are memory-mapped
(``np.memmap``) after their header, and each member of an .npz is memory-mapped at its offset
inside the zip (its local header and .npy header parsed; the member must be stored, not
deflated), so a rank touches only the pages of the samples it reads. A compressed .npz
(``np.savez_compressed``) cannot be mapped and is refused. Headers are not trusted
(npyfile.py): a shape the file's bytes cannot hold is refused before anything is mapped. The
labels are small and are loaded (as int64), fewer than MAX_CLASSES classes.

No MPI here; every failure is a DataError: one line naming the file and the problem.
"""
import os
import zipfile
from pathlib import Path

import numpy as np

from mpitrain.data.dataset import Dataset
from mpitrain.data.npyfile import array_bytes, read_header, stored_members
from mpitrain.runtime.errors import DataError, one_line

__all__ = ["load_npz", "TEST_FRACTION"]

TEST_FRACTION = 0.1
MAX_CLASSES = 1 << 20       # labels above are a damaged file, not a model's output layer
NAMES = ("x", "y", "x_test", "y_test")


def _map(path, offset, shape, fortran, dtype, where, available):
    """A read-only memmap of ``shape`` at ``offset`` of ``path`` (checked to fit)."""
    nbytes = array_bytes(shape, dtype)
    if nbytes > available:
        raise DataError(f"{where}: truncated: its header says {shape} {dtype} ({nbytes} bytes) "
                        f"but {available} bytes follow")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                     order="F" if fortran else "C")


def _open_npy(path):
    where = str(path)
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype, offset = read_header(f, where)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None
    return _map(path, offset, shape, fortran, dtype, where, size - offset)


def _open_npz(path):
    """{name: memmap} for the members x, y, x_test, y_test present in an uncompressed .npz."""
    arrays = {}
    try:
        with open(path, "rb") as f:
            members = stored_members(path, f)
            for name in NAMES:
                if name + ".npy" not in members:
                    continue
                where = f"{path}: member {name}.npy"
                start, size = members[name + ".npy"]
                f.seek(start)
                shape, fortran, dtype, header = read_header(f, where)
                arrays[name] = _map(path, start + header, shape, fortran, dtype, where,
                                    size - header)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None
    missing = [n + ".npy" for n in ("x", "y") if n not in arrays]
    if missing:
        raise DataError(f"{path}: has no {' or '.join(missing)} (members: "
                        f"{', '.join(sorted(members)) or 'none'}); save with "
                        f"np.savez(path, x=images, y=labels)")
    return arrays


def _open_files(path):
    """{name: memmap} from a folder (D/x.npy) or a prefix (P + "x.npy"), and how it was given."""
    path = Path(path)
    base = (lambda name: path / f"{name}.npy") if path.is_dir() else \
        (lambda name: Path(f"{path}{name}.npy"))
    arrays = {name: _open_npy(base(name)) for name in NAMES if base(name).is_file()}
    missing = [str(base(n)) for n in ("x", "y") if n not in arrays]
    if missing:
        raise DataError(f"{path}: no {' or '.join(missing)}; pass an .npz holding x and y, a "
                        f"folder holding x.npy and y.npy, or a prefix P of P + 'x.npy'")
    return arrays


def _check(where, x, y):
    """(x, y as int64) after checking x float32 (N, ...) and y integer (N,)."""
    if x.dtype == np.uint8:
        raise DataError(f"{where}: x is uint8; convert it to float32 first, e.g. "
                        f"(x / 255).astype(np.float32), or your own normalisation")
    if x.dtype != np.float32:
        raise DataError(f"{where}: x must be float32, got {x.dtype}")
    if x.ndim < 2:
        raise DataError(f"{where}: x must be (N, ...) with one sample per row, got shape "
                        f"{x.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataError(f"{where}: y must be integer labels (N,), got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{where}: x has {len(x)} samples but y has {len(y)} labels")
    y = np.array(y, dtype=np.int64)                     # small: loaded, (N,)
    if len(y) and y.min() < 0:
        raise DataError(f"{where}: label {y.min()} is negative; labels are 0, 1, 2, ...")
    if len(y) and y.max() >= MAX_CLASSES:
        raise DataError(f"{where}: label {y.max()} is too large (labels are 0, 1, 2, ..., "
                        f"fewer than {MAX_CLASSES} classes)")
    return x, y


def load_npz(path):
    """(train, test) Datasets from an uncompressed .npz, a folder or a prefix of .npy files.

    See the module docstring for the layouts; images stay memory-mapped (float32 (N, ...)),
    labels are int64 (N,); classes = max(y) + 1 over both splits; names "npz:<file name>".
    """
    path = Path(os.fspath(path)).expanduser()
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise DataError(f"{path}: not an .npz file; pass an .npz written by np.savez, a "
                            f"folder holding x.npy and y.npy, or a prefix of such files")
        arrays = _open_npz(path)
    elif path.suffix == ".npz":
        raise DataError(f"{path}: no such file")
    else:
        arrays = _open_files(path)
    x, y = _check(f"{path}", arrays["x"], arrays["y"])
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: has {'x_test' if 'x_test' in arrays else 'y_test'} without "
                        f"{'y_test' if 'x_test' in arrays else 'x_test'}")
    if "x_test" in arrays:
        x_test, y_test = _check(f"{path} (test)", arrays["x_test"], arrays["y_test"])
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: x_test samples are {x_test.shape[1:]} but x samples are "
                            f"{x.shape[1:]}")
    else:
        cut = len(x) - int(len(x) * TEST_FRACTION)
        x, x_test, y, y_test = x[:cut], x[cut:], y[:cut], y[cut:]
    if not len(x):
        raise DataError(f"{path}: the training split is empty")
    classes = int(max(y.max(), y_test.max() if len(y_test) else 0)) + 1
    name = f"npz:{path.name or path}"
    return (Dataset(x, y, classes, name, split="train"),
            Dataset(x_test, y_test, classes, name, split="test"))
