"""IDX reader (the MNIST / Fashion-MNIST file format), gzipped or raw.

Layout (all integers big-endian):

    bytes 0-1   0x00 0x00            magic
    byte  2     dtype code           0x08 ubyte, 0x09 sbyte, 0x0B int16, 0x0C int32,
                                     0x0D float32, 0x0E float64
    byte  3     ndim                 e.g. 3 for images (N, 28, 28), 1 for labels (N,)
    4 * ndim    dims                 uint32 each
    ...         prod(dims) values    row-major

So "train-images-idx3-ubyte" starts 00 00 08 03 | 00 00 EA 60 (60000) | 00 00 00 1C (28) | ...
The whole file is read once and viewed with np.frombuffer: no per-sample Python loop, so the
60000-image Fashion-MNIST training set loads in well under a second plus gunzip time.
Every inconsistency (magic, dtype code, dims vs. bytes present, images vs. labels) raises
DataError naming the file; a reader that trusts the header silently trains on garbage.
"""
import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from mpitrain.runtime.errors import DataError

__all__ = ["read_idx", "read_idx_header", "read_images_labels"]

DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path, limit=None):
    """File contents, transparently gunzipped (detected by magic, not by file name)."""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == _GZIP_MAGIC
            f.seek(0)
            if not gzipped:
                return f.read() if limit is None else f.read(limit)
            if limit is not None:
                with gzip.GzipFile(fileobj=f) as g:
                    return g.read(limit)
            raw = f.read()
        return gzip.decompress(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: corrupt or truncated gzip data ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _parse_header(path, data):
    """(dtype, dims, header_bytes) from the start of an IDX file's bytes."""
    if len(data) < 4:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, need at least 4)")
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise DataError(f"{path}: not an IDX file (bad magic 0x{data[:4].hex()}, expected "
                        f"0x0000 followed by dtype code and ndim)")
    if code not in DTYPES:
        raise DataError(f"{path}: unknown IDX dtype code 0x{code:02x} (known: "
                        f"{', '.join(f'0x{c:02x}' for c in DTYPES)})")
    if ndim == 0:
        raise DataError(f"{path}: IDX header says 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, need {header} for "
                        f"{ndim} dims)")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    return np.dtype(DTYPES[code]), dims, header


def read_idx_header(path):
    """(dtype, dims) of an IDX file, reading only its header."""
    data = _read_bytes(path, limit=4 + 4 * 255)
    dtype, dims, _ = _parse_header(path, data)
    return dtype.newbyteorder("="), dims


def read_idx(path):
    """The whole IDX array in native byte order, shape = the dims in its header."""
    path = Path(path)
    data = _read_bytes(path)
    dtype, dims, header = _parse_header(path, data)
    count = int(np.prod(dims, dtype=np.int64))
    need = count * dtype.itemsize
    have = len(data) - header
    if have != need:
        what = "truncated" if have < need else "has trailing bytes"
        raise DataError(f"{path}: {what}: header says {'x'.join(map(str, dims))} {dtype.name} "
                        f"= {need} data bytes, file has {have}")
    array = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(dims)
    if dtype.byteorder == ">":                          # multi-byte types: to native order
        array = array.astype(dtype.newbyteorder("="))
    return array


def read_images_labels(images_path, labels_path, image_shape):
    """An MNIST-style pair: uint8 images (N, H, W) and uint8 labels (N,), cross-checked."""
    images = read_idx(images_path)                      # (N, H, W)
    labels = read_idx(labels_path)                      # (N,)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != tuple(image_shape):
        raise DataError(f"{images_path}: expected ubyte images (N, "
                        f"{', '.join(map(str, image_shape))}), got {images.dtype} "
                        f"{images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{labels_path}: expected ubyte labels (N,), got {labels.dtype} "
                        f"{labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels but {images_path} has "
                        f"{len(images)} images")
    return images, labels
