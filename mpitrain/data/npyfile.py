""".npy headers and .npz members read without trusting them: what a header claims is checked
against the bytes the file holds before anything is allocated.

A file is input someone else may have written (a dataset, a checkpoint whose checksum anyone
can recompute), so:
- a .npy header is read from a bounded prefix (MAX_HEADER_BYTES), its dims must be integers
  >= 0, its dtype plain numbers (no Python objects), and its size is computed in Python ints
  (``np.prod`` of (2^32, 2^32) wraps around int64 to 0);
- an .npz member must be stored, as ``np.savez`` writes it: a deflated member's declared size
  says nothing about what it inflates to, and a stored one can be memory-mapped or read with
  one ``readinto`` of exactly its size; it must lie inside the file, behind a sound local header.
So a file of n bytes costs at most n bytes of memory, whatever its headers say.

No MPI here; every failure is a DataError naming the file (and the member).
"""
import io
import math
import os
import struct
import zipfile

import numpy as np

from mpitrain.runtime.errors import DataError, one_line

__all__ = ["MAX_HEADER_BYTES", "read_header", "array_bytes", "stored_members"]

MAX_HEADER_BYTES = 1 << 16          # np.save writes a few hundred; numpy refuses over 10000
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")          # zip local file header, 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"
_PREAMBLE = 12                      # magic (6), version (2), header length (2 or 4)


def array_bytes(shape, dtype):
    """Bytes of an array of ``shape`` and ``dtype``, as a Python int (never wraps)."""
    return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize


def read_header(f, where):
    """(shape, fortran_order, dtype, header_bytes) of the .npy header at ``f``'s position; ``f``
    is left at the header's end (the data). DataError if it is not a sound header."""
    start = f.tell()
    head = io.BytesIO(f.read(_PREAMBLE + MAX_HEADER_BYTES))
    try:
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(
                head, max_header_size=MAX_HEADER_BYTES)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(
                head, max_header_size=MAX_HEADER_BYTES)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError) as e:
        raise DataError(f"{where}: not a .npy array ({one_line(e)})") from None
    if dtype.hasobject:
        raise DataError(f"{where}: holds Python objects ({dtype}); save plain numbers")
    if any(d < 0 for d in shape):
        raise DataError(f"{where}: its header has a negative dimension {shape}")
    f.seek(start + head.tell())
    return shape, fortran, dtype, head.tell()


def stored_members(path, f):
    """{member name: (offset of its data in the file, its size)} of the zip archive open as
    ``f``; DataError unless every member is stored, unencrypted and inside the file."""
    size = os.fstat(f.fileno()).st_size
    members = {}
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OverflowError, struct.error,
            NotImplementedError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not an .npz (zip) file ({one_line(e)})") from None
    for info in infos:
        where = f"{path}: member {info.filename}"
        if info.compress_type != zipfile.ZIP_STORED:
            raise DataError(f"{where} is compressed, so it cannot be memory-mapped or its size "
                            f"checked; save with np.savez (not np.savez_compressed) or as .npy "
                            f"files")
        if info.flag_bits & 0x1:
            raise DataError(f"{where} is encrypted")
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
            raise DataError(f"{where}: bad zip local header at offset {info.header_offset}")
        fields = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if info.file_size != info.compress_size or start + info.file_size > size:
            raise DataError(f"{where}: truncated: the archive says {info.file_size} bytes at "
                            f"offset {start}, the file has {size}")
        members[info.filename] = (start, info.file_size)
    return members
