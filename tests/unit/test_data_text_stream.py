"""TextDataset on a text read in chunks: the tokens, vocabulary and errors do not depend on the
chunk size (a character split across two chunks, a bad byte in a later chunk), memory stays
bounded by the chunk however large the text, and a cache another process validated is adopted
without hashing while one whose files changed is not.

Oracle: the text tokenised whole by plain Python (sorted set of characters, index of each).
Memory: peak RSS (resource.getrusage) of a child process that builds and then reopens the
cache of a generated 48 MB text with 1 MiB chunks, against the text's size: a whole-file
tokeniser holds the bytes, the decoded text and the ids at once (over 4x the text).
"""
import hashlib
import importlib
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from mpitrain.data import DataError, TextDataset

text_mod = importlib.import_module("mpitrain.data.text")

TEXT = "Ünïcödé — “quotes” and 日本語 too; 𝄞 clef.\nplain ascii line\n" * 40


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(text_mod, "_VALIDATED", {})
    return tmp_path


def reference(text):
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return np.array([index[c] for c in text], np.uint16), vocab


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 22])
def test_tokens_do_not_depend_on_the_chunk_size(home, monkeypatch, chunk):
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", chunk)
    path = home / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    ds = TextDataset(path, block_size=8, cache_dir=home / f"c{chunk}")
    ids, vocab = reference(TEXT)
    assert ds.vocab == vocab and ds.n_tokens == len(TEXT)
    np.testing.assert_array_equal(ds.data, ids[:int(len(ids) * 0.9)])
    raw = TEXT.encode("utf-8")
    by = TextDataset(path, block_size=8, tokens="bytes", cache_dir=home / f"c{chunk}")
    np.testing.assert_array_equal(by.data, np.frombuffer(raw, np.uint8)[:int(len(raw) * 0.9)])
    meta = json.loads((home / f"c{chunk}" / "chars.json").read_text())
    assert meta["tokens_sha256"] == hashlib.sha256(
        (home / f"c{chunk}" / "chars.npy").read_bytes()).hexdigest()


@pytest.mark.parametrize("chunk", [1, 5, 1 << 22])
def test_bad_utf8_offset_does_not_depend_on_the_chunk_size(home, monkeypatch, chunk):
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", chunk)
    good = ("ab日本" * 10).encode("utf-8")
    cases = {"bad.txt": (good + b"\xe9xyz" + good, f"byte 0xe9 at offset {len(good)}"),
             "cut.txt": (good + "日".encode("utf-8")[:2], f"byte 0xe6 at offset {len(good)}")}
    for name, (payload, message) in cases.items():
        (home / name).write_bytes(payload)
        with pytest.raises(DataError, match=message):
            TextDataset(home / name, block_size=4)
    assert not list(home.glob("*.mpitrain"))


def test_a_text_changed_while_tokenised_is_refused(home, monkeypatch):
    path = home / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    real = text_mod._tokenize

    def then_append(p, f, tokens):
        counted = real(p, f, tokens)
        with open(path, "a", encoding="utf-8") as out:
            out.write("more")
        return counted
    monkeypatch.setattr(text_mod, "_tokenize", then_append)
    with pytest.raises(DataError, match="changed while it was being tokenised"):
        TextDataset(path, block_size=8)
    assert not any(p.is_file() for p in (home / "t.txt.mpitrain").rglob("*"))


def count_hashes(monkeypatch):
    calls = []

    def sha256(*args):
        calls.append(1)
        return hashlib.sha256(*args)
    monkeypatch.setattr(text_mod, "hashlib", types.SimpleNamespace(sha256=sha256))
    return calls


def test_a_validated_cache_is_adopted_without_hashing(home, monkeypatch):
    path = home / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    built = TextDataset(path, block_size=8)
    record = text_mod.cache_record(path, "chars")
    assert record is not None and text_mod.cache_record(path, "bytes") is None
    monkeypatch.setattr(text_mod, "_VALIDATED", {})          # another process on this machine
    hashes = count_hashes(monkeypatch)
    assert text_mod.adopt_cache([None, record])
    ds = TextDataset(path, block_size=8, split="val")
    assert hashes == [] and ds.vocab == built.vocab and ds.checksum == built.checksum
    np.testing.assert_array_equal(ds.data, reference(TEXT)[0][int(len(TEXT) * 0.9):])

    monkeypatch.setattr(text_mod, "_VALIDATED", {})
    tokens_file = home / "t.txt.mpitrain" / "chars.npy"
    raw = bytearray(tokens_file.read_bytes())
    raw[-1] ^= 0x01
    tokens_file.write_bytes(bytes(raw))                      # changed since it was hashed
    assert not text_mod.adopt_cache([record])
    ds = TextDataset(path, block_size=8)                     # validated, found bad, rebuilt
    assert len(hashes) == 4
    np.testing.assert_array_equal(ds.data, reference(TEXT)[0][:int(len(TEXT) * 0.9)])
    assert not text_mod.adopt_cache([{"key": "nonsense"}])


MEMORY_CHILD = r"""
import resource, sys, time
import numpy as np
import mpitrain.data.text as text_mod
text_mod.CHUNK_BYTES = 1 << 20
path, tokens = sys.argv[1], sys.argv[2]
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = peak_mb()
t0 = time.perf_counter()
ds = text_mod.TextDataset(path, block_size=32, tokens=tokens)
built = peak_mb()
text_mod._VALIDATED.clear()
again = text_mod.TextDataset(path, block_size=32, tokens=tokens, split="val")
x = ds.images[np.arange(16)]
print(before, built, peak_mb(), ds.n_tokens, ds.vocab_size, int(x.sum()), time.perf_counter() - t0)
"""

LINE = "the quick brown fox — jumps over the lazy dog 日本\n"


@pytest.mark.parametrize("tokens", ["chars", "bytes"])
def test_memory_stays_bounded_by_the_chunk(home, tokens):
    path = home / "big.txt"
    line = LINE.encode("utf-8")
    repeats = (48 << 20) // len(line)
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(line * (repeats // 16))
    size_mb = path.stat().st_size / (1 << 20)
    p = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(path), tokens],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    before, built, final, n, vocab_size, total, seconds = map(float, p.stdout.split())
    n_expected = (repeats // 16) * 16 * (len(LINE) if tokens == "chars" else len(line))
    assert n == n_expected and vocab_size == (len(set(LINE)) if tokens == "chars" else 256)
    assert total > 0
    # 1 MiB chunks: about 16 MiB of buffers in a pass and the 2 MiB code-point tables, against
    # a 48 MiB text (whole-file: its bytes, the decoded text and the ids, over 200 MiB)
    assert built - before < 40 and final - before < 40, (before, built, final, size_mb)
