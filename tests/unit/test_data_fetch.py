"""fetch and the CLI, with no network: sources are file:// URLs or a substituted opener.

Checks: verified download lands under its final name and loads; a checksum failure, a dropped
connection or Ctrl-C leaves no file (not even a .part); mirrors are tried in order; an already
present dataset is not downloaded again; offline gives one line and exit code 2; CIFAR-10's
tarball is verified, unpacked (batches only) and removed.
"""
import dataclasses
import gzip
import hashlib
import importlib
import io
import struct
import tarfile
import urllib.error

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DataError
from mpitrain.data.__main__ import main

catalog = importlib.import_module("mpitrain.data.catalog")
fetch_mod = importlib.import_module("mpitrain.data.fetch")
locate_mod = importlib.import_module("mpitrain.data.locate")

IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")


def idx_gz(array):
    array = np.asarray(array, dtype=np.uint8)
    return gzip.compress(struct.pack(">HBB", 0, 8, array.ndim)
                         + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


def sha(data):
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated roots, and a 'server' folder of tiny Fashion-MNIST files served as file:// URLs."""
    monkeypatch.delenv("MPITRAIN_DATA", raising=False)
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(locate_mod, "SYSTEM_ROOT", tmp_path / "system")
    server = tmp_path / "server"
    server.mkdir()
    rng = np.random.default_rng(0)
    payloads = {}
    for name, n in zip(IDX_NAMES, (5, 5, 3, 3)):
        shape = (n, 28, 28) if "images" in name else (n,)
        payloads[name + ".gz"] = idx_gz(rng.integers(0, 10, shape))
        (server / (name + ".gz")).write_bytes(payloads[name + ".gz"])
    return tmp_path, server, payloads


def serve(monkeypatch, name, sources):
    monkeypatch.setitem(catalog.SPECS, name,
                        dataclasses.replace(catalog.SPECS[name], sources=tuple(sources)))


def serve_fashion(monkeypatch, server, payloads, bad=(), mirror_first=None):
    sources = []
    for filename, data in payloads.items():
        urls = (server / filename).as_uri(),
        if mirror_first:
            urls = (mirror_first + filename,) + urls
        digest = sha(b"something else") if filename in bad else sha(data)
        sources.append(catalog.Source(filename, urls, digest, len(data)))
    serve(monkeypatch, "fashion-mnist", sources)


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*.part"))


def test_download_verify_and_load(env, monkeypatch):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads)
    where = fetch_mod.fetch("fashion-mnist", data_dir=root / "data", log=lambda *a: None)
    assert where == root / "data" / "fashion-mnist"
    for filename, data in payloads.items():
        assert (where / filename).read_bytes() == data
    assert leftovers(root) == []
    ds = mt.data.load("fashion-mnist", "train", data_dir=root / "data")
    assert ds.images.shape == (5, 1, 28, 28)


def test_default_target_is_the_cache(env, monkeypatch):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads)
    where = fetch_mod.fetch("fashion-mnist", log=lambda *a: None)
    assert where == root / "xdg" / "mpitrain" / "fashion-mnist"
    assert mt.data.locate("fashion-mnist") == where


def test_checksum_failure_leaves_nothing(env, monkeypatch):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads, bad={"t10k-images-idx3-ubyte.gz"})
    with pytest.raises(DataError) as info:
        fetch_mod.fetch("fashion-mnist", data_dir=root / "data", log=lambda *a: None)
    msg = str(info.value)
    assert "checksum failed" in msg and "t10k-images-idx3-ubyte.gz" in msg
    assert sha(payloads["t10k-images-idx3-ubyte.gz"]) in msg and "\n" not in msg
    assert not isinstance(info.value, fetch_mod.FetchOffline)
    target = root / "data" / "fashion-mnist"
    assert not (target / "t10k-images-idx3-ubyte.gz").exists()
    assert leftovers(root) == []
    assert main(["fetch", "fashion-mnist", "--data-dir", str(root / "data")]) == 2


def test_mirror_fallback(env, monkeypatch):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads, mirror_first=(root / "nowhere").as_uri() + "/")
    where = fetch_mod.fetch("fashion-mnist", data_dir=root / "data", log=lambda *a: None)
    assert sorted(p.name for p in where.iterdir()) == sorted(payloads)


def test_resume_keeps_verified_files(env, monkeypatch):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads)
    target = root / "data" / "fashion-mnist"
    target.mkdir(parents=True)
    first = "train-images-idx3-ubyte.gz"
    (target / first).write_bytes(payloads[first])
    (target / "t10k-labels-idx1-ubyte.gz").write_bytes(b"stale")          # replaced
    opened = []
    real = fetch_mod.urlopen
    monkeypatch.setattr(fetch_mod, "urlopen", lambda url, **kw: opened.append(url) or real(url))
    fetch_mod.fetch("fashion-mnist", data_dir=root / "data", log=lambda *a: None)
    assert len(opened) == 3 and not any(u.endswith(first) for u in opened)
    assert (target / "t10k-labels-idx1-ubyte.gz").read_bytes() == \
        payloads["t10k-labels-idx1-ubyte.gz"]


def test_already_present_downloads_nothing(env, monkeypatch, capsys):
    root, server, payloads = env
    system = root / "system" / "fashion-mnist"
    system.mkdir(parents=True)
    for filename, data in payloads.items():
        (system / filename).write_bytes(data)
    monkeypatch.setattr(fetch_mod, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    assert main(["fetch", "fashion-mnist"]) == 0
    assert f"already present in {system}" in capsys.readouterr().out


def _offline(*args, **kwargs):
    raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))


def test_offline_one_line_exit_2(env, monkeypatch, capsys):
    root, _, _ = env
    monkeypatch.setattr(fetch_mod, "urlopen", _offline)
    assert main(["fetch", "fashion-mnist", "--data-dir", str(root / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: fetch fashion-mnist: cannot download")
    assert "name resolution" in err
    assert "put train-images-idx3-ubyte.gz" in err and str(root / "d" / "fashion-mnist") in err
    assert "dataset-fashion-mnist" in err
    assert leftovers(root) == []
    with pytest.raises(fetch_mod.FetchOffline):
        fetch_mod.fetch("mnist", log=lambda *a: None)


class _Dropping:
    """A response that delivers one chunk and then fails (or is interrupted)."""

    def __init__(self, error):
        self.error, self.calls, self.headers = error, 0, {"Content-Length": "100"}

    def read(self, n):
        self.calls += 1
        if self.calls == 1:
            return b"x" * 10
        raise self.error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("error", [ConnectionResetError("reset by peer"), KeyboardInterrupt()])
def test_interrupted_download_leaves_nothing(env, monkeypatch, error):
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads)
    monkeypatch.setattr(fetch_mod, "urlopen", lambda *a, **k: _Dropping(error))
    expected = KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else \
        fetch_mod.FetchOffline
    with pytest.raises(expected):
        fetch_mod.fetch("fashion-mnist", data_dir=root / "data", log=lambda *a: None)
    target = root / "data" / "fashion-mnist"
    assert list(target.iterdir()) == []


def _cifar_tarball(rng, members=None):
    files = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, 2, dtype=np.uint8)
        pixels = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        files[name] = np.concatenate([labels[:, None], pixels], axis=1).tobytes()  # (2, 3073)
    files["batches.meta.txt"] = b"airplane\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            if members is not None and name not in members:
                continue
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), files


def test_cifar_tarball(env, monkeypatch):
    root, server, _ = env
    archive, files = _cifar_tarball(np.random.default_rng(0))
    (server / "cifar-10-binary.tar.gz").write_bytes(archive)
    serve(monkeypatch, "cifar10", [catalog.Source(
        "cifar-10-binary.tar.gz", ((server / "cifar-10-binary.tar.gz").as_uri(),), sha(archive),
        len(archive))])
    where = fetch_mod.fetch("cifar10", data_dir=root / "data", log=lambda *a: None)
    assert sorted(p.name for p in where.iterdir()) == sorted(
        f for f in files if f.endswith(".bin"))                   # archive removed, meta skipped
    assert (where / "test_batch.bin").read_bytes() == files["test_batch.bin"]
    assert len(mt.data.load("cifar10", "train", data_dir=root / "data")) == 10


def test_cifar_tarball_missing_member(env, monkeypatch):
    root, server, _ = env
    archive, _ = _cifar_tarball(np.random.default_rng(0), members={"data_batch_1.bin"})
    (server / "c.tar.gz").write_bytes(archive)
    serve(monkeypatch, "cifar10", [catalog.Source(
        "cifar-10-binary.tar.gz", ((server / "c.tar.gz").as_uri(),), sha(archive), 1)])
    with pytest.raises(DataError, match="has no member cifar-10-batches-bin/data_batch_2.bin"):
        fetch_mod.fetch("cifar10", data_dir=root / "data", log=lambda *a: None)
    assert leftovers(root) == []


def test_info_cli(env, monkeypatch, capsys):
    root, server, payloads = env
    folder = root / "d" / "fashion-mnist"
    folder.mkdir(parents=True)
    for filename, data in payloads.items():
        (folder / filename).write_bytes(data)
    assert main(["info", "fashion-mnist", "--data-dir", str(root / "d")]) == 0
    out = capsys.readouterr().out
    assert f"found in {folder}" in out and "uint8 5x28x28" in out and "uint8 3" in out
    assert main(["info", "mnist"]) == 2
    assert "data not found" in capsys.readouterr().err


def _install_system_copy(root, payloads):
    system = root / "system" / "fashion-mnist"
    system.mkdir(parents=True)
    for filename, data in payloads.items():
        (system / filename).write_bytes(data)
    return system


def test_fetch_into_a_new_data_dir_even_when_the_search_path_has_it(env, monkeypatch):
    """--data-dir is a destination for fetch: created if missing, filled even though the search
    path holds a copy (later runs with the same --data-dir look there only)."""
    root, server, payloads = env
    serve_fashion(monkeypatch, server, payloads)
    _install_system_copy(root, payloads)
    where = fetch_mod.fetch("fashion-mnist", data_dir=root / "new" / "dir", log=lambda *a: None)
    assert where == root / "new" / "dir" / "fashion-mnist"
    assert sorted(p.name for p in where.iterdir()) == sorted(payloads)
    assert mt.data.locate("fashion-mnist", data_dir=root / "new" / "dir") == where


def test_info_with_a_missing_data_dir_is_one_line_exit_2(env, capsys):
    root, _, payloads = env
    _install_system_copy(root, payloads)
    assert main(["info", "fashion-mnist"]) == 0
    capsys.readouterr()
    assert main(["info", "fashion-mnist", "--data-dir", str(root / "typo")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: fashion-mnist: data dir {root / 'typo'} does not exist")
    assert not (root / "typo").exists()
