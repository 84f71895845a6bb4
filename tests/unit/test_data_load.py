"""load(): IDX datasets from generated files (normalisation, splits, errors) and, when installed,
the real Fashion-MNIST."""
import gzip
import importlib
import struct

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DataError, Dataset

locate_mod = importlib.import_module("mpitrain.data.locate")   # mt.data.locate is the function

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def idx_bytes(array):
    array = np.asarray(array, dtype=np.uint8)
    return (struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            + array.tobytes())


def make_idx_dataset(folder, sizes=(6, 4), gz=True, seed=0, image_hw=(28, 28)):
    """Tiny MNIST-layout dataset in `folder`; returns {split: (uint8 images, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for (split, (img_name, lbl_name)), n in zip(FILES.items(), sizes):
        images = rng.integers(0, 256, (n,) + image_hw, dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        for name, arr in ((img_name, images), (lbl_name, labels)):
            data = idx_bytes(arr)
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
        out[split] = (images, labels)
    return out


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("MPITRAIN_DATA", raising=False)
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)


@pytest.mark.parametrize("name,mean,std,gz", [("fashion-mnist", 0.2860, 0.3530, True),
                                              ("mnist", 0.1307, 0.3081, False)])
def test_load_idx_dataset(tmp_path, name, mean, std, gz):
    raw = make_idx_dataset(tmp_path / name, gz=gz)
    for split in ("train", "test"):
        ds = mt.data.load(name, split, data_dir=tmp_path)
        images, labels = raw[split]
        assert isinstance(ds, Dataset) and ds.name == name and ds.split == split
        assert ds.images.shape == (len(labels), 1, 28, 28) and ds.images.dtype == np.float32
        assert ds.images.flags["C_CONTIGUOUS"]
        assert ds.labels.dtype == np.int64 and ds.classes == 10 and len(ds) == len(labels)
        want = (images[:, None].astype(np.float64) / 255 - mean) / std
        np.testing.assert_allclose(ds.images, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ds.labels, labels)


def test_load_without_normalisation_and_the_fill_of_a_black_pixel(tmp_path):
    raw = make_idx_dataset(tmp_path / "fashion-mnist")
    plain = mt.data.load("fashion-mnist", "train", data_dir=tmp_path, normalize=False)
    np.testing.assert_allclose(plain.images, raw["train"][0][:, None] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(plain.fill, [0.0])
    fixed = mt.data.load("fashion-mnist", "train", data_dir=tmp_path)
    np.testing.assert_allclose(fixed.fill, [-0.2860 / 0.3530], rtol=1e-6)
    black = np.zeros((1, 1, 28, 28), np.uint8)
    np.testing.assert_allclose(mt.data.loader.normalise(black, (0.2860,), (0.3530,))[0, 0, 0, 0],
                               fixed.fill[0], rtol=1e-6)    # what crop pads with


def test_default_split_is_train(tmp_path):
    make_idx_dataset(tmp_path / "mnist", sizes=(5, 2))
    assert len(mt.data.load("mnist", data_dir=tmp_path)) == 5


def test_bad_name_and_split(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        mt.data.load("imagenet")
    with pytest.raises(DataError, match="unknown split 'val'"):
        mt.data.load("mnist", "val", data_dir=tmp_path)
    assert issubclass(DataError, ValueError)


def test_count_mismatch_through_load(tmp_path):
    folder = tmp_path / "mnist"
    make_idx_dataset(folder, sizes=(6, 4), gz=False)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3)))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: 3 labels but .* 4 images"):
        mt.data.load("mnist", "test", data_dir=tmp_path)
    mt.data.load("mnist", "train", data_dir=tmp_path)          # the other split is fine


def test_label_out_of_range(tmp_path):
    folder = tmp_path / "mnist"
    make_idx_dataset(folder, sizes=(3, 2), gz=False)
    (folder / "train-labels-idx1-ubyte").write_bytes(idx_bytes([1, 10, 2]))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: label 10 at index 1"):
        mt.data.load("mnist", "train", data_dir=tmp_path)


def test_truncated_real_layout_file(tmp_path):
    folder = tmp_path / "fashion-mnist"
    make_idx_dataset(folder, sizes=(3, 2))
    path = folder / "train-images-idx3-ubyte.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-100]))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz: truncated"):
        mt.data.load("fashion-mnist", "train", data_dir=tmp_path)


@pytest.fixture
def search_path_has_it(tmp_path, monkeypatch):
    """A fake HOME whose ~/.cache/mpitrain, and a fake /usr/share/datasets, hold Fashion-MNIST."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(locate_mod, "SYSTEM_ROOT", tmp_path / "system")
    make_idx_dataset(tmp_path / "home" / ".cache" / "mpitrain" / "fashion-mnist", sizes=(5, 2))
    make_idx_dataset(tmp_path / "system" / "fashion-mnist", sizes=(7, 3), gz=False)
    assert len(mt.data.load("fashion-mnist")) == 5             # the search path finds it
    return tmp_path


@pytest.mark.parametrize("how", ["argument", "MPITRAIN_DATA_DIR", "MPITRAIN_DATA"])
def test_given_data_dir_is_authoritative(search_path_has_it, monkeypatch, how):
    """A data dir that is missing, or lacks the files, is an error naming it -- never a silent
    load of the copy the search path would find."""
    root = search_path_has_it
    missing, empty = root / "typo", root / "empty"
    empty.mkdir()
    for path, why in ((missing, "does not exist"), (empty, "data not found in")):
        data_dir = str(path)
        if how != "argument":
            monkeypatch.setenv(how, str(path))
            data_dir = None
        with pytest.raises(ValueError) as info:                # DataError is a ValueError
            mt.data.load("fashion-mnist", "train", data_dir=data_dir)
        assert isinstance(info.value, DataError)
        msg = str(info.value)
        assert str(path) in msg and why in msg and "\n" not in msg, msg
    assert not missing.exists()
    make_idx_dataset(empty / "fashion-mnist", sizes=(4, 1))
    assert len(mt.data.load("fashion-mnist", data_dir=None if how != "argument" else empty)) == 4


def test_dataset_validates_its_arrays():
    x = np.zeros((2, 1, 2, 2), np.float32)
    with pytest.raises(DataError, match="float32"):
        Dataset(x.astype(np.float64), np.zeros(2, np.int64), 2, "d")
    with pytest.raises(DataError, match="int64"):
        Dataset(x, np.zeros(2, np.int32), 2, "d")
    with pytest.raises(DataError, match="2 images but 3 labels"):
        Dataset(x, np.zeros(3, np.int64), 2, "d")
    with pytest.raises(DataError, match=r"\[0, 2\)"):
        Dataset(x, np.array([0, 2]), 2, "d")
    assert Dataset(x, np.array([0, 1]), 2, "d").sample_shape == (1, 2, 2)


def _real_fashion_mnist():
    try:
        return mt.data.locate("fashion-mnist")
    except DataError:
        return None


@pytest.mark.skipif(_real_fashion_mnist() is None, reason="Fashion-MNIST not installed")
def test_real_fashion_mnist():
    train = mt.data.load("fashion-mnist", "train")
    test = mt.data.load("fashion-mnist", "test")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == np.float32 and train.labels.dtype == np.int64
    # Fashion-MNIST is balanced: 6000 / 1000 of each of the 10 classes.
    assert (np.bincount(train.labels, minlength=10) == 6000).all()
    assert (np.bincount(test.labels, minlength=10) == 1000).all()
    # The fixed constants really standardise the training set.
    assert abs(float(train.images.mean(dtype=np.float64))) < 1e-3
    assert abs(float(train.images.std(dtype=np.float64)) - 1) < 1e-3
    # Generous bound (the machine is shared); ~1 s is typical.
