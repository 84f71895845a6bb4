"""locate(): priority order data_dir > MPITRAIN_DATA_DIR (older: MPITRAIN_DATA) >
~/.cache/mpitrain > /usr/share/datasets, a given data dir searched alone (no fall-back to the
search path), complete-or-skip, both folder layouts, and the one-line not-found message."""
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
    """Isolated cache and system roots; no MPITRAIN_DATA(_DIR) from the caller's environment."""
    for var in locate_mod.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(locate_mod, "SYSTEM_ROOT", tmp_path / "system")
    return tmp_path


def test_priority_order(roots, monkeypatch):
    explicit = fill(roots / "explicit" / "fashion-mnist")
    env = fill(roots / "env" / "fashion-mnist")
    cache = fill(roots / "xdg" / "mpitrain" / "fashion-mnist")
    system = fill(roots / "system" / "fashion-mnist")
    old_env = fill(roots / "old-env" / "fashion-mnist")
    monkeypatch.setenv("MPITRAIN_DATA", str(roots / "old-env"))
    assert mt.data.locate("fashion-mnist") == old_env
    monkeypatch.setenv("MPITRAIN_DATA_DIR", str(roots / "env"))   # the Config's name wins
    assert mt.data.locate("fashion-mnist", data_dir=roots / "explicit") == explicit
    assert mt.data.locate("fashion-mnist") == env
    monkeypatch.delenv("MPITRAIN_DATA_DIR")
    monkeypatch.setenv("MPITRAIN_DATA", "")                       # empty = unset
    assert mt.data.locate("fashion-mnist", data_dir="") == cache
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
    fill(roots / "xdg" / "mpitrain" / "fashion-mnist", FASHION[:3])
    system = fill(roots / "system" / "fashion-mnist")
    assert mt.data.locate("fashion-mnist") == system
    (system / FASHION[0]).unlink()
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist")
    msg = str(info.value)
    assert f"{roots / 'xdg' / 'mpitrain' / 'fashion-mnist'} lacks t10k-labels-idx1-ubyte[.gz]" \
        in msg
    assert f"{system} lacks train-images-idx3-ubyte[.gz]" in msg


@pytest.fixture
def everywhere_else(roots):
    """The dataset complete in the cache and in the system folder: a fall-back would find it."""
    fill(roots / "xdg" / "mpitrain" / "fashion-mnist")
    fill(roots / "system" / "fashion-mnist")
    assert mt.data.locate("fashion-mnist") == roots / "xdg" / "mpitrain" / "fashion-mnist"
    return roots


def _given(roots, monkeypatch, how, path):
    """Name `path` as the data dir the way `how` says; the data_dir argument for locate()."""
    if how == "data_dir":
        return str(path)
    monkeypatch.setenv(how, str(path))
    return None


GIVEN = ["data_dir", "MPITRAIN_DATA_DIR", "MPITRAIN_DATA"]


@pytest.mark.parametrize("how", GIVEN)
def test_given_data_dir_that_does_not_exist_is_an_error_naming_it(everywhere_else,
                                                                  monkeypatch, how):
    typo = everywhere_else / "typo"
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist", data_dir=_given(everywhere_else, monkeypatch, how, typo))
    msg = str(info.value)
    assert "\n" not in msg and f"{typo} does not exist" in msg, msg
    assert str(everywhere_else / "xdg") not in msg
    assert msg.endswith("(apt-get install -y dataset-fashion-mnist) and give no data dir")
    if how != "data_dir":
        assert f"${how}={typo}" in msg
    else:
        assert f"fetch fashion-mnist --data-dir {typo}`" in msg
    assert not typo.exists()                                  # looking creates nothing


@pytest.mark.parametrize("how", GIVEN)
def test_given_data_dir_without_the_files_is_an_error_naming_it(everywhere_else,
                                                                monkeypatch, how):
    given = everywhere_else / "mine"
    given.mkdir()
    data_dir = _given(everywhere_else, monkeypatch, how, given)
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist", data_dir=data_dir)
    msg = str(info.value)
    named = f"data dir {given}" if how == "data_dir" else f"${how}={given}"
    assert "\n" not in msg, msg
    assert f"data not found in {named} (looked in {given / 'fashion-mnist'}, {given};" in msg, msg
    fill(given / "fashion-mnist", FASHION[1:])                # a partial copy there: reported
    with pytest.raises(DataError) as info:
        mt.data.locate("fashion-mnist", data_dir=data_dir)
    assert f"{given / 'fashion-mnist'} lacks train-images-idx3-ubyte[.gz]" in str(info.value)
    fill(given / "fashion-mnist")
    assert mt.data.locate("fashion-mnist", data_dir=data_dir) == given / "fashion-mnist"


def test_given_data_dir_that_is_a_file(everywhere_else):
    path = everywhere_else / "a-file"
    path.write_text("")
    with pytest.raises(DataError, match=f"data dir {path} is not a directory"):
        mt.data.locate("fashion-mnist", data_dir=path)


def test_search_dirs_and_home_dir_follow_the_given_dir(roots, monkeypatch):
    assert locate_mod.search_dirs("mnist") == [roots / "xdg" / "mpitrain" / "mnist",
                                               roots / "system" / "mnist"]
    assert locate_mod.search_dirs("mnist", roots / "d") == [roots / "d" / "mnist", roots / "d"]
    assert locate_mod.home_dir("mnist") == roots / "xdg" / "mpitrain" / "mnist"
    monkeypatch.setenv("MPITRAIN_DATA_DIR", str(roots / "e"))
    assert locate_mod.home_dir("mnist") == roots / "e" / "mnist"
    assert locate_mod.home_dir("mnist", roots / "d") == roots / "d" / "mnist"


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
