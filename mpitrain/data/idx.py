"""IDX reader (the MNIST / Fashion-MNIST file format), gzipped or raw.

Layout (all integers big-endian):

    bytes 0-1   0x00 0x00            magic
    byte  2     dtype code           0x08 ubyte, 0x09 sbyte, 0x0B int16, 0x0C int32,
                                     0x0D float32, 0x0E float64
    byte  3     ndim                 e.g. 3 for images (N, 28, 28), 1 for labels (N,)
    4 * ndim    dims                 uint32 each
    ...         prod(dims) values    row-major

So "train-images-idx3-ubyte" starts 00 00 08 03 | 00 00 EA 60 (60000) | 00 00 00 1C (28) | ...
The header is read first and the data inflated straight into one array of the size it declares:
no per-sample Python loop, so the 60000-image Fashion-MNIST training set loads in well under a
second plus gunzip time, and no more memory than that array. Every inconsistency (magic, dtype
code, dims vs. bytes present, images vs. labels) raises DataError naming the file, before the
data is read where the header alone shows it; a reader that trusts the header silently trains
on garbage, or inflates a small gzip into gigabytes.
"""
import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from mpitrain.runtime.errors import DataError

__all__ = ["read_idx", "read_idx_header", "read_images_labels"]

DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"
MAX_INFLATE_RATIO = 1032        # deflate's most: 258 bytes per 2-bit code, about 1032:1
_CHUNK = 1 << 22                # inflated at a time, straight into the array


def _open(path):
    """(binary stream of the IDX bytes, whether gunzipped, compressed bytes on disk): gzip is
    detected by magic, not by file name, and inflated as it is read."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        size = os.fstat(f.fileno()).st_size
        if f.read(2) == _GZIP_MAGIC:
            f.seek(0)
            return gzip.GzipFile(fileobj=f), True, size
        f.seek(0)
    except OSError as e:
        f.close()
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    return f, False, size


def _read(path, stream, n):
    """Up to ``n`` bytes of ``stream``; DataError naming the file on bad gzip data."""
    try:
        return stream.read(n)
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


def _header(path, stream):
    """(dtype, dims, header bytes) read from the start of ``stream``."""
    data = _read(path, stream, 4)
    if len(data) == 4 and data[:2] == b"\x00\x00":
        data += _read(path, stream, 4 * data[3])
    return _parse_header(path, data)


def read_idx_header(path):
    """(dtype, dims) of an IDX file, reading only its header."""
    stream, _, _ = _open(path)
    with stream:
        dtype, dims, _ = _header(path, stream)
    return dtype.newbyteorder("="), dims


def read_idx(path, expect=None):
    """The whole IDX array in native byte order, shape = the dims in its header.

    The header is read first and nothing larger than what it declares is ever held: the data
    is inflated straight into the array, and one byte past it means trailing bytes. A raw file
    must hold exactly the declared bytes; a gzipped one cannot declare more than deflate can
    give from its size (MAX_INFLATE_RATIO). ``expect(dtype, dims)`` may refuse the header (a
    DataError) before any data is read."""
    path = Path(path)
    stream, gzipped, size = _open(path)
    with stream:
        dtype, dims, header = _header(path, stream)
        if expect is not None:
            expect(dtype.newbyteorder("="), dims)
        need = math.prod(dims) * dtype.itemsize                 # a Python int: never wraps
        shape = f"{'x'.join(map(str, dims))} {dtype.name} = {need} data bytes"
        if not gzipped and size - header != need:
            what = "truncated" if size - header < need else "has trailing bytes"
            raise DataError(f"{path}: {what}: header says {shape}, file has {size - header}")
        if gzipped and need > MAX_INFLATE_RATIO * size:
            raise DataError(f"{path}: header says {shape}, more than its {size} gzipped "
                            f"bytes can hold")
        array = np.empty(dims, dtype)
        view, have = memoryview(array.reshape(-1).view(np.uint8)), 0
        while have < need:
            chunk = _read(path, stream, min(need - have, _CHUNK))
            if not chunk:
                break
            view[have:have + len(chunk)] = chunk
            have += len(chunk)
        if have < need:
            raise DataError(f"{path}: truncated: header says {shape}, file has {have}")
        if _read(path, stream, 1):
            raise DataError(f"{path}: has trailing bytes: header says {shape}, the file has "
                            f"more")
    if dtype.byteorder == ">":                          # multi-byte types: to native order
        array = array.astype(dtype.newbyteorder("="))
    return array


def read_images_labels(images_path, labels_path, image_shape):
    """An MNIST-style pair: uint8 images (N, H, W) and uint8 labels (N,), cross-checked (the
    headers before any data is read)."""
    def images_header(dtype, dims):
        if dtype != np.uint8 or len(dims) != 3 or dims[1:] != tuple(image_shape):
            raise DataError(f"{images_path}: expected ubyte images (N, "
                            f"{', '.join(map(str, image_shape))}), got {dtype} {dims}")

    def labels_header(dtype, dims):
        if dtype != np.uint8 or len(dims) != 1:
            raise DataError(f"{labels_path}: expected ubyte labels (N,), got {dtype} {dims}")
    images = read_idx(images_path, images_header)       # (N, H, W)
    labels = read_idx(labels_path, labels_header)       # (N,)
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels but {images_path} has "
                        f"{len(images)} images")
    return images, labels
