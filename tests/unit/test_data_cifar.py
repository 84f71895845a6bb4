"""CIFAR-10 binary reader: record layout (label, R, G, B planes), record-size checks, load()."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DataError
from mpitrain.data.cifar import read_cifar_batch, read_cifar_batches

MEAN = np.array([0.4914, 0.4822, 0.4465])
STD = np.array([0.2470, 0.2435, 0.2616])


def batch_bytes(images, labels):
    """Records as the CIFAR page describes them: 1 label byte, then 1024 R, 1024 G, 1024 B."""
    out = bytearray()
    for image, label in zip(images, labels):
        out.append(int(label))
        for c in range(3):
            out += image[c].astype(np.uint8).tobytes()          # 32x32 row-major plane
    return bytes(out)


def random_batch(rng, n):
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n)


def test_round_trip_channel_order(tmp_path):
    rng = np.random.default_rng(0)
    images, labels = random_batch(rng, 4)
    images[1, 0], images[1, 1], images[1, 2] = 200, 100, 7      # a recognisable colour
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(batch_bytes(images, labels))
    got_images, got_labels = read_cifar_batch(path)
    assert got_images.shape == (4, 3, 32, 32) and got_images.dtype == np.uint8
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)
    assert (got_images[1, 0] == 200).all() and (got_images[1, 2] == 7).all()


def test_batches_concatenate_in_order(tmp_path):
    rng = np.random.default_rng(1)
    parts = [random_batch(rng, n) for n in (2, 3)]
    paths = []
    for i, (im, lb) in enumerate(parts):
        paths.append(tmp_path / f"b{i}.bin")
        paths[-1].write_bytes(batch_bytes(im, lb))
    images, labels = read_cifar_batches(paths)
    np.testing.assert_array_equal(images, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(labels, np.concatenate([p[1] for p in parts]))


@pytest.mark.parametrize("size", [0, 1, 3072, 3074, 2 * 3073 - 1])
def test_record_size_checked(tmp_path, size):
    path = tmp_path / "test_batch.bin"
    path.write_bytes(bytes(size))
    with pytest.raises(DataError, match="3073-byte") as info:
        read_cifar_batch(path)
    assert str(path) in str(info.value) and f"{size} bytes" in str(info.value)


def test_label_out_of_range_means_misaligned(tmp_path):
    images, labels = random_batch(np.random.default_rng(2), 3)
    labels[2] = 10
    path = tmp_path / "data_batch_2.bin"
    path.write_bytes(batch_bytes(images, labels))
    with pytest.raises(DataError, match="record 2 has label 10"):
        read_cifar_batch(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        read_cifar_batch(tmp_path / "nope.bin")


@pytest.mark.parametrize("subfolder", ["", "cifar-10-batches-bin"])
def test_load_cifar10(tmp_path, subfolder, monkeypatch):
    monkeypatch.delenv("MPITRAIN_DATA", raising=False)
    rng = np.random.default_rng(3)
    folder = tmp_path / "cifar10" / subfolder
    folder.mkdir(parents=True)
    train = []
    for i in range(1, 6):
        im, lb = random_batch(rng, i)                # 1 + 2 + ... + 5 = 15 train samples
        train.append((im, lb))
        (folder / f"data_batch_{i}.bin").write_bytes(batch_bytes(im, lb))
    test_im, test_lb = random_batch(rng, 2)
    (folder / "test_batch.bin").write_bytes(batch_bytes(test_im, test_lb))

    ds = mt.data.load("cifar10", "train", data_dir=tmp_path)
    assert ds.images.shape == (15, 3, 32, 32) and ds.images.dtype == np.float32
    assert ds.labels.dtype == np.int64 and ds.classes == 10 and ds.name == "cifar10"
    raw = np.concatenate([t[0] for t in train]).astype(np.float64)
    want = (raw / 255 - MEAN[None, :, None, None]) / STD[None, :, None, None]
    np.testing.assert_allclose(ds.images, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ds.labels, np.concatenate([t[1] for t in train]))

    test = mt.data.load("cifar10", "test", data_dir=tmp_path)
    assert len(test) == 2 and test.split == "test"
    np.testing.assert_array_equal(test.labels, test_lb)
