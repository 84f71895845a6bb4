"""The catalog's pinned SHA-256s, checked against real files where this machine has them.

Debian's dataset-fashion-mnist re-wraps the official gzips: same deflate stream, but the header
drops the original file name (FNAME) and carries a 2020 mtime. Putting back the official header
(flag FNAME, the original mtime below, XFL 0, OS 3 = Unix, the name) reproduces the official file
byte for byte, so the installed files prove the pinned hashes, and prove the Debian files hold
the official data. The mtimes (2017-08-31 10:50 UTC) were recovered by searching for the header
whose SHA-256 matches.
"""
import hashlib
import struct

import pytest

from mpitrain.data import DataError, locate
from mpitrain.data.catalog import SPECS, spec

ORIGINAL_MTIME = {"train-images-idx3-ubyte.gz": 1504176606,
                  "train-labels-idx1-ubyte.gz": 1504176606,
                  "t10k-images-idx3-ubyte.gz": 1504176627,
                  "t10k-labels-idx1-ubyte.gz": 1504176627}


def _installed_fashion_mnist():
    try:
        folder = locate("fashion-mnist")
    except DataError:
        return None
    return folder if all((folder / f).is_file() for f in ORIGINAL_MTIME) else None


def official_bytes(path):
    """The official gzip for a (possibly re-wrapped) installed file."""
    data = path.read_bytes()
    assert data[:3] == b"\x1f\x8b\x08", f"{path} is not a deflate gzip"
    if data[3] & 0x08:                                  # still has its name: already official
        return data
    assert data[3] == 0, f"{path}: unexpected gzip flags {data[3]:#x}"
    name = path.name[:-3].encode() + b"\0"
    return (b"\x1f\x8b\x08\x08" + struct.pack("<I", ORIGINAL_MTIME[path.name]) + b"\x00\x03"
            + name + data[10:])


@pytest.mark.skipif(_installed_fashion_mnist() is None, reason="Fashion-MNIST .gz not installed")
def test_pinned_fashion_mnist_hashes_match_installed_files():
    folder = _installed_fashion_mnist()
    for source in spec("fashion-mnist").sources:
        data = official_bytes(folder / source.filename)
        assert len(data) == source.size, source.filename
        assert hashlib.sha256(data).hexdigest() == source.sha256, source.filename


def test_catalog_is_consistent():
    for name, s in SPECS.items():
        assert s.name == name and len(s.mean) == len(s.std) == s.sample_shape[0]
        assert len(s.labels) == s.classes
        for source in s.sources:
            assert len(source.sha256) == 64 and int(source.sha256, 16) >= 0
            assert source.urls and all(u.startswith(("https://", "http://")) for u in source.urls)
            assert all(u.endswith("/" + source.filename) for u in source.urls)
        if s.format == "idx":
            assert sorted(x.filename for x in s.sources) == sorted(f + ".gz" for f in s.files)
