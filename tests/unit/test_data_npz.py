"""load_npz: .npz (np.savez), folder and prefix layouts; images memory-mapped, never read whole;
compressed .npz, uint8 images, mismatched lengths and missing arrays refused in one line."""

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DataError, load_npz
from tests.support.mapped import memory_mapped


def arrays(n=20, shape=(3, 4, 5), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + shape).astype(np.float32)      # (n, 3, 4, 5)
    y = rng.integers(0, 6, n).astype(np.int32)                    # (n,)
    y[0] = 6                                                      # classes = 7
    return x, y


def check_pair(train, test, x, y, x_test, y_test):
    for ds, xs, ys, split in ((train, x, y, "train"), (test, x_test, y_test, "test")):
        assert isinstance(ds, mt.data.Dataset) and ds.split == split
        assert memory_mapped(ds.images) and ds.images.dtype == np.float32
        np.testing.assert_array_equal(ds.images, xs)
        assert ds.labels.dtype == np.int64
        np.testing.assert_array_equal(ds.labels, ys)
        assert ds.classes == 7 and ds.sample_shape == xs.shape[1:] and ds.fill is None


def test_npz_without_test_split_takes_the_last_tenth(tmp_path):
    x, y = arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    train, test = load_npz(tmp_path / "d.npz")
    check_pair(train, test, x[:18], y[:18], x[18:], y[18:])
    assert train.name == "npz:d.npz" and len(train) == 18 and len(test) == 2


def test_npz_with_test_arrays(tmp_path):
    x, y = arrays()
    xt, yt = arrays(5, seed=1)
    np.savez(tmp_path / "d.npz", y_test=yt, x=x, x_test=xt, y=y, extra=np.arange(3))
    train, test = load_npz(str(tmp_path / "d.npz"))
    check_pair(train, test, x, y, xt, yt)


def test_npz_fortran_order_and_large_header(tmp_path):
    x, y = arrays()
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(x), y=y)
    train, _ = load_npz(tmp_path / "f.npz")
    np.testing.assert_array_equal(train.images, x[:18])


def test_folder_and_prefix(tmp_path):
    x, y = arrays()
    xt, yt = arrays(4, seed=2)
    folder = tmp_path / "folder"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    check_pair(*load_npz(folder), x[:18], y[:18], x[18:], y[18:])
    for name, a in (("x", x), ("y", y), ("x_test", xt), ("y_test", yt)):
        np.save(tmp_path / f"run1_{name}.npy", a)
    check_pair(*load_npz(tmp_path / "run1_"), x, y, xt, yt)


def test_reading_samples_touches_only_their_pages(tmp_path):
    """A batch read goes through the map: change the file under it and the batch sees it."""
    x, y = arrays(100, (64,))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    train, _ = load_npz(tmp_path)
    with open(tmp_path / "x.npy", "r+b") as f:
        f.seek(-64 * 4 * 11, 2)                       # sample 89 (train's last), in place
        f.write(np.full(64, 7.0, np.float32).tobytes())
    np.testing.assert_array_equal(train.images[89], np.full(64, 7.0, np.float32))


def one_line_error(path, match):
    with pytest.raises(DataError) as info:
        load_npz(path)
    text = str(info.value)
    assert match in text and "\n" not in text, text
    return text


def test_compressed_npz_refused(tmp_path):
    x, y = arrays()
    np.savez_compressed(tmp_path / "c.npz", x=x, y=y)
    text = one_line_error(tmp_path / "c.npz", "is compressed, so it cannot be memory-mapped")
    assert "np.savez (not np.savez_compressed)" in text and str(tmp_path / "c.npz") in text


def test_bad_arrays(tmp_path):
    x, y = arrays()
    np.savez(tmp_path / "len.npz", x=x, y=y[:-1])
    one_line_error(tmp_path / "len.npz", "x has 20 samples but y has 19 labels")
    np.savez(tmp_path / "u8.npz", x=(x * 10).astype(np.uint8), y=y)
    one_line_error(tmp_path / "u8.npz", "x is uint8; convert it to float32 first")
    np.savez(tmp_path / "f64.npz", x=x.astype(np.float64), y=y)
    one_line_error(tmp_path / "f64.npz", "x must be float32, got float64")
    np.savez(tmp_path / "yf.npz", x=x, y=y.astype(np.float32))
    one_line_error(tmp_path / "yf.npz", "y must be integer labels (N,)")
    np.savez(tmp_path / "neg.npz", x=x, y=-np.ones(20, np.int64))
    one_line_error(tmp_path / "neg.npz", "label -1 is negative")
    np.savez(tmp_path / "flat.npz", x=x.reshape(-1), y=y)
    one_line_error(tmp_path / "flat.npz", "x must be (N, ...)")
    np.savez(tmp_path / "nox.npz", images=x, y=y)
    one_line_error(tmp_path / "nox.npz", "has no x.npy")
    np.savez(tmp_path / "half.npz", x=x, y=y, x_test=x)
    one_line_error(tmp_path / "half.npz", "has x_test without y_test")
    np.savez(tmp_path / "shape.npz", x=x, y=y, x_test=x[:, :1], y_test=y)
    one_line_error(tmp_path / "shape.npz", "x_test samples are (1, 4, 5)")
    (tmp_path / "text.npz").write_text("not a zip")
    one_line_error(tmp_path / "text.npz", "not an .npz file")
    one_line_error(tmp_path / "nowhere", "no ")


def test_truncated_npy(tmp_path):
    x, y = arrays()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(data[:-100])
    one_line_error(tmp_path, "truncated")


def test_a_missing_npz_file_is_named_as_such(tmp_path):
    with pytest.raises(DataError, match=r"missing\.npz: no such file$"):
        load_npz(tmp_path / "missing.npz")


def _npy(header, body=b""):
    """A .npy file's bytes: a header claiming anything (an attacker's), then ``body``."""
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + body


@pytest.mark.parametrize("shape, match", [
    ((2**32, 2**32), "truncated: its header says (4294967296, 4294967296) float32 "
                     "(73786976294838206464 bytes) but 64 bytes follow"),
    ((-5, 3), "its header has a negative dimension (-5, 3)"),
])
@pytest.mark.parametrize("layout", ["folder", "npz"])
def test_a_header_the_file_cannot_hold_is_one_line(tmp_path, shape, match, layout):
    crafted = _npy({"descr": "<f4", "fortran_order": False, "shape": shape}, bytes(64))
    _, y = arrays()
    if layout == "folder":
        (tmp_path / "x.npy").write_bytes(crafted)
        np.save(tmp_path / "y.npy", y)
        one_line_error(tmp_path, match)
    else:
        import io
        import zipfile
        labels = io.BytesIO()
        np.save(labels, y)
        with zipfile.ZipFile(tmp_path / "d.npz", "w") as zf:       # stored, as np.savez
            zf.writestr("x.npy", crafted)
            zf.writestr("y.npy", labels.getvalue())
        text = one_line_error(tmp_path / "d.npz", match)
        assert "member x.npy" in text


def test_a_label_too_large_for_any_model_is_one_line(tmp_path):
    x, y = arrays()
    y = y.astype(np.int64)
    y[3] = 10**9
    np.savez(tmp_path / "big.npz", x=x, y=y)
    one_line_error(tmp_path / "big.npz", "label 1000000000 is too large")
