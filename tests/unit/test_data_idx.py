"""IDX reader: round trips (raw and gzipped, every dtype code) and every corruption it must catch.

The files are written here with struct from the format description, not with our own code, so a
reader and writer cannot agree on the same mistake.
"""
import gzip
import struct

import numpy as np
import pytest

from mpitrain.data import DataError
from mpitrain.data.idx import read_idx, read_idx_header, read_images_labels

CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def idx_bytes(array, code=0x08):
    array = np.asarray(array)
    header = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                   *array.shape)
    return header + array.astype(CODES[code]).tobytes()


def write(path, payload, gz=False):
    path.write_bytes(gzip.compress(payload) if gz else payload)
    return path


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("code", sorted(CODES))
def test_round_trip_every_dtype(tmp_path, gz, code):
    rng = np.random.default_rng(code)
    want = rng.integers(-100, 100, size=(5, 3, 4)).astype(np.dtype(CODES[code]).newbyteorder("="))
    if code == 0x08:
        want = np.abs(want)
    path = write(tmp_path / "a-idx3", idx_bytes(want, code), gz)
    got = read_idx(path)
    assert got.dtype == want.dtype and got.dtype.isnative
    assert got.shape == (5, 3, 4)
    np.testing.assert_array_equal(got, want)


def test_gzip_is_detected_by_content_not_name(tmp_path):
    labels = np.arange(7, dtype=np.uint8)
    raw = write(tmp_path / "labels.gz", idx_bytes(labels))              # raw despite .gz
    zipped = write(tmp_path / "labels", idx_bytes(labels), gz=True)      # gzip without .gz
    np.testing.assert_array_equal(read_idx(raw), labels)
    np.testing.assert_array_equal(read_idx(zipped), labels)


def test_header_only(tmp_path):
    path = write(tmp_path / "x.gz", idx_bytes(np.zeros((9, 28, 28), np.uint8)), gz=True)
    dtype, dims = read_idx_header(path)
    assert dtype == np.uint8 and dims == (9, 28, 28)


def test_empty_array(tmp_path):
    got = read_idx(write(tmp_path / "e", idx_bytes(np.zeros((0, 28, 28), np.uint8))))
    assert got.shape == (0, 28, 28)


def _raises(path, *words):
    with pytest.raises(DataError) as info:
        read_idx(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("gz", [False, True])
def test_wrong_magic(tmp_path, gz):
    payload = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    payload[0] = 0x1E
    _raises(write(tmp_path / "m", bytes(payload), gz), "magic")


def test_unknown_dtype_code(tmp_path):
    payload = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    payload[2] = 0x07
    _raises(write(tmp_path / "d", bytes(payload)), "dtype code 0x07")


def test_zero_dims(tmp_path):
    _raises(write(tmp_path / "z", struct.pack(">HBB", 0, 8, 0)), "0 dimensions")


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_data(tmp_path, gz):
    payload = idx_bytes(np.ones((4, 3, 3), np.uint8))
    msg = _raises(write(tmp_path / "t", payload[:-5], gz), "truncated", "4x3x3", "36", "31")
    assert "uint8" in msg


def test_trailing_bytes(tmp_path):
    payload = idx_bytes(np.ones((4,), np.uint8)) + b"xx"
    _raises(write(tmp_path / "t", payload), "trailing")


@pytest.mark.parametrize("cut", [0, 3, 9])
def test_truncated_header(tmp_path, cut):
    payload = idx_bytes(np.ones((4, 3, 3), np.uint8))[:cut]
    _raises(write(tmp_path / "h", payload), "truncated IDX header")


def test_truncated_gzip_stream(tmp_path):
    zipped = gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8) % 7))
    _raises(write(tmp_path / "g.gz", zipped[: len(zipped) // 2]), "gzip")


def test_corrupt_gzip_stream(tmp_path):
    zipped = bytearray(gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8) % 7)))
    zipped[-8] ^= 0xFF                                  # CRC no longer matches
    _raises(write(tmp_path / "c.gz", bytes(zipped)), "gzip")


def test_missing_file(tmp_path):
    _raises(tmp_path / "nope", "cannot read")


def test_pair_round_trip(tmp_path):
    images = np.arange(3 * 28 * 28, dtype=np.uint32).reshape(3, 28, 28) % 256
    labels = np.array([3, 1, 4])
    ip = write(tmp_path / "i.gz", idx_bytes(images), gz=True)
    lp = write(tmp_path / "l", idx_bytes(labels))
    im, lb = read_images_labels(ip, lp, (28, 28))
    np.testing.assert_array_equal(im, images)
    np.testing.assert_array_equal(lb, labels)


def test_pair_count_mismatch_names_both_files(tmp_path):
    ip = write(tmp_path / "imgs", idx_bytes(np.zeros((3, 28, 28), np.uint8)))
    lp = write(tmp_path / "lbls", idx_bytes(np.zeros((4,), np.uint8)))
    with pytest.raises(DataError, match=r"4 labels but .*imgs has 3 images") as info:
        read_images_labels(ip, lp, (28, 28))
    assert str(lp) in str(info.value)


def test_pair_wrong_image_shape(tmp_path):
    ip = write(tmp_path / "imgs", idx_bytes(np.zeros((3, 27, 28), np.uint8)))
    lp = write(tmp_path / "lbls", idx_bytes(np.zeros((3,), np.uint8)))
    with pytest.raises(DataError, match=r"imgs: expected ubyte images \(N, 28, 28\)"):
        read_images_labels(ip, lp, (28, 28))


def test_pair_labels_not_1d_or_not_ubyte(tmp_path):
    ip = write(tmp_path / "imgs", idx_bytes(np.zeros((3, 28, 28), np.uint8)))
    lp = write(tmp_path / "lbls", idx_bytes(np.zeros((3, 1), np.uint8)))
    with pytest.raises(DataError, match="lbls: expected ubyte labels"):
        read_images_labels(ip, lp, (28, 28))
    lp = write(tmp_path / "lbls", idx_bytes(np.zeros((3,), np.int32), 0x0C))
    with pytest.raises(DataError, match="lbls: expected ubyte labels"):
        read_images_labels(ip, lp, (28, 28))


# -- hostile headers: refused from the header, in one line, before any data is held ----------

def test_255_dims_whose_product_overflows_int64_is_one_line(tmp_path):
    header = struct.pack(">HBB", 0, 0x0D, 255) + struct.pack(">255I", *[0xFFFFFFFF] * 255)
    for gz in (False, True):
        msg = _raises(write(tmp_path / f"d{gz}", header + b"\0" * 64, gz), "header says")
        assert ("truncated" in msg) if not gz else ("more than its" in msg)
        assert "\n" not in msg


def test_a_gzip_inflating_past_its_header_stops_one_byte_after_it(tmp_path):
    """A small gzip whose header declares 4 bytes but that inflates to 64 MiB: the reader holds
    the 4 bytes and reads one more, it never inflates the rest."""
    path = tmp_path / "bomb.gz"
    with gzip.open(path, "wb", compresslevel=9) as g:
        g.write(struct.pack(">HBBI", 0, 8, 1, 4))
        block = bytes(1 << 20)
        for _ in range(64):
            g.write(block)
    assert path.stat().st_size < 200_000
    import tracemalloc
    tracemalloc.start()
    try:
        _raises(path, "trailing bytes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak                    # not the 64 MiB it would inflate to


def test_a_gzip_whose_header_claims_more_than_deflate_can_give_is_refused_unread(tmp_path):
    # 2^31 x 28 x 28 bytes are declared; a gzip of some 40 bytes cannot hold them
    header = struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 1 << 31, 28, 28)
    _raises(write(tmp_path / "claim.gz", header, gz=True), "more than its")


def test_a_pair_with_the_wrong_header_is_refused_before_its_data_is_read(tmp_path):
    """(1000000, 5, 5) images with no data behind the header: what is wrong is the shape, which
    the header alone shows, not the bytes that a reader of the data would miss."""
    images = write(tmp_path / "imgs", idx_bytes(np.zeros((1, 5, 5), np.uint8))[:4] +
                   struct.pack(">3I", 1000000, 5, 5))
    labels = write(tmp_path / "lbls", idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(DataError, match=r"imgs: expected ubyte images \(N, 28, 28\), got uint8 "
                                        r"\(1000000, 5, 5\)"):
        read_images_labels(images, labels, (28, 28))
