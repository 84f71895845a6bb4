"""locate(): priority order data_dir > MPITRAIN_DATA > ~/.cache/mpitrain > /usr/share/datasets,
complete-or-skip, both folder layouts, and the one-line not-found message."""
import importlib

import pytest

import mpitrain as mt
from mpitrain.data import DataError

locate_mod = importlib.import_module("mpitrain.data.locate")   # mt.data.locate is the function

FASHION = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
CIFAR = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def fill(folder, names=FASHION):
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"")          # locate looks at names only; readers check content
    return folder


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """Isolated cache and system roots; no MPITRAIN_DATA from the caller's environment."""
    monkeypatch.delenv("MPITRAIN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(locate_mod, "SYSTEM_ROOT", tmp_path / "system")
    return tmp_path


def test_priority_order(roots, monkeypatch):
    explicit = fill(roots / "explicit" / "fashion-mnist")
    env = fill(roots / "env" / "fashion-mnist")
    cache = fill(roots / "xdg" / "mpitrain" / "fashion-mnist")
    system = fill(roots / "system" / "fashion-mnist")
    monkeypatch.setenv("MPITRAIN_DATA", str(roots / "env"))
    assert mt.data.locate("fashion-mnist", data_dir=roots / "explicit") == explicit
    assert mt.data.locate("fashion-mnist") == env
    monkeypatch.delenv("MPITRAIN_DATA")
    assert mt.data.locate("fashion-mnist", data_dir=str(roots / "empty")) == cache
    for f in FASHION:
        (cache / f).unlink()
    assert mt.data.locate("fashion-mnist") == system


def test_home_cache_without_xdg(roots, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(roots / "home"))
    cache = fill(roots / "home" / ".cache" / "mpitrain" / "fashion-mnist")
    assert mt.data.locate("fashion-mnist") == cache


def test_data_dir_may_be_the_dataset_folder_itself(roots):
    folder = fill(roots / "my-fmnist")
    assert mt.data.locate("fashion-mnist", data_dir=folder) == folder


def test_raw_idx_files_count(roots):
    folder = fill(roots / "d" / "mnist", [n[:-3] for n in FASHION])   # no .gz
    assert mt.data.locate("mnist", data_dir=roots / "d") == folder


def test_cifar_tarball_layout(roots):
    fill(roots / "d" / "cifar10" / "cifar-10-batches-bin", CIFAR)
    assert mt.data.locate("cifar10", data_dir=roots / "d") == roots / "d" / "cifar10"


def test_partial_folder_is_skipped_and_reported(roots):
    fill(roots / "d" / "fashion-mnist", FASHION[:3])
    system = fill(roots / "system" / "fashion-mnist")
    assert mt.data.locate("fashion-mnist", data_dir=roots / "d") == system
    (system / FASHION[0]).unlink()
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist", data_dir=roots / "d")
    assert f"{roots / 'd' / 'fashion-mnist'} lacks t10k-labels-idx1-ubyte[.gz]" in str(info.value)


def test_not_found_message(roots):
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist")
    msg = str(info.value)
    assert "\n" not in msg
    assert str(roots / "xdg" / "mpitrain" / "fashion-mnist") in msg       # where to put them
    assert str(roots / "system" / "fashion-mnist") in msg                  # where we looked
    assert "train-images-idx3-ubyte.gz" in msg
    assert "python -m mpitrain.data fetch fashion-mnist" in msg
    assert "dataset-fashion-mnist" in msg                                  # the Debian package
    with pytest.raises(DataError) as info:
        mt.data.locate("mnist", data_dir=roots / "d")
    msg = str(info.value)
    assert str(roots / "d" / "mnist") in msg and "Debian" not in msg


def test_unknown_name(roots):
    with pytest.raises(DataError, match="unknown dataset 'svhn'; known: fashion-mnist, mnist"):
        mt.data.locate("svhn")
