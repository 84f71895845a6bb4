"""TextDataset: a text file as next-token windows for a language model (the GPT's data).

    ds = mt.data.TextDataset("input.txt", 64)        # block_size 64, character level, train
    x, y = ds.images[idx], ds.labels[idx]       # int64 (len(idx), 64): tokens s..s+63, s+1..s+64
    ds.vocab_size, ds.encode("To be"), ds.decode(ids)
    ds = mt.data.TextDataset("tiny-shakespeare")   # a catalog text, after `fetch tiny-shakespeare`

Tokens. ``tokens="chars"``: the vocabulary is the sorted set of the file's characters (the file
must be UTF-8; at most 65535 of them), token = index in it. ``tokens="bytes"``: any file, token =
byte value, vocabulary 256.

Cache. The file is tokenised once into a uint16 .npy (memory-mapped by every reader, so a rank
touches only the pages of the windows it reads) with a JSON beside it holding the vocabulary, the
token count and two SHA-256s: of the source text (a changed text is tokenised again) and of the
token file (a corrupt cache is rebuilt). The cache folder is ``PATH.mpitrain/`` next to the file,
or, where that cannot be written, ``$XDG_CACHE_HOME/mpitrain/text/<text SHA-256>/`` (default
``~/.cache``); ``cache_dir=`` names one explicitly. Every file is written to a temp file and
renamed (runtime/atomic.py), tokens before their JSON, so any number of processes may build the
same cache at once (identical bytes) and a reader never sees half of one.

The hashes run the first time a process builds a TextDataset of a file (reading the whole text
and the whole token file). The validated corpus (token memmap, vocabulary, text SHA-256) is then
kept for the process, so the next TextDataset of the same file, tokens and cache_dir (the CLI's
"val" after its "train") hashes nothing: it only stats the text and the cache's two files, and
hashes again when any of them changed (device, inode, size, mtime or ctime differ).

Split. The first 90% of the tokens are "train", the rest "val" (as nanoGPT's prepare.py).

Windows. Sample i of a split is the window of block_size + 1 tokens starting at

    s_i  = floor(u_i * (n_split - block_size))       u_i: the top 53 bits of h_i, over 2^53
    h_i  = splitmix64(base + (i + 1) * 0x9E3779B97F4A7C15)
    base = splitmix64(splitmix64(seed) + split number)       (train 0, val 1)

the i-th output of a SplitMix64 stream keyed by (seed, split): a pure function of (seed, split,
i) -- no rank, no global RNG state -- so every process computes the same windows, and the
sampler's permutation of window indices makes the global batch of step t the same for any number
of ranks. ``windows`` (default n_split // block_size: one pass's worth of tokens) is the number of
samples, ``len(ds)``.

No MPI here. Every failure is a DataError (a ValueError): one line naming the file and the
problem, and nothing half-written left behind.
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from mpitrain.data.catalog import TEXTS
from mpitrain.data.locate import cache_root, home_dir, search_dirs
from mpitrain.runtime import atomic
from mpitrain.runtime.errors import DataError, one_line

__all__ = ["TextDataset", "TOKENIZATIONS", "SPLITS", "locate_text", "window_starts",
           "MAX_VOCAB"]

TOKENIZATIONS = ("chars", "bytes")
SPLITS = ("train", "val")
TRAIN_FRACTION = 0.9
MAX_VOCAB = 65535                       # token ids must fit uint16
CACHE_FORMAT = 1
CHUNK_CHARS = 1 << 24                   # characters tokenised at a time (bounds the temp memory)

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1


def _splitmix64(z):
    """SplitMix64's output function on uint64 values (array or scalar), wrapping mod 2^64."""
    z = np.asarray(z, np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def window_starts(seed, split, index, span):
    """Start offsets (int64, index's shape) of windows ``index`` in [0, span): a pure function
    of (seed, split, index); ``span`` = n_split - block_size, the number of valid starts."""
    split_number = SPLITS.index(split)
    with np.errstate(over="ignore"):
        base = _splitmix64(_splitmix64(np.uint64(int(seed) & _MASK64)) + np.uint64(split_number))
        counter = np.asarray(index, np.int64).astype(np.uint64) + np.uint64(1)
        h = _splitmix64(base + counter * _GAMMA)                                  # uint64
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))               # [0, 1)
    return np.minimum((u * span).astype(np.int64), span - 1)


def locate_text(name, data_dir=None):
    """The file of catalog text ``name`` (e.g. "tiny-shakespeare"), or DataError saying how to
    get it: the given data dir ($MPITRAIN_DATA_DIR), else the per-user cache, as for datasets."""
    spec = TEXTS[name]
    dirs = search_dirs(name, data_dir)
    for directory in dirs:
        path = directory / spec.source.filename
        if path.is_file():
            return path
    where = ", ".join(str(d) for d in dirs)
    raise DataError(f"{name}: {spec.source.filename} not found in {where}; run `python -m "
                    f"mpitrain.data fetch {name}` or put the file in {home_dir(name, data_dir)}")


def _resolve(path):
    """``path`` as a Path: a file, or the name of a catalog text (then its located file)."""
    p = Path(os.fspath(path)).expanduser()
    if not p.exists() and str(path) in TEXTS:
        return locate_text(str(path))
    return p


def _stamp(path):
    """(device, inode, size, mtime, ctime) of a file (a path or an open descriptor): what
    changes when the file is rewritten, known without reading it."""
    s = os.stat(path)
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


def _read_source(path):
    """(the file's bytes, its _stamp taken before reading them)."""
    try:
        with open(path, "rb") as f:
            stamp = _stamp(f.fileno())
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a text file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None
    if not data:
        raise DataError(f"{path}: is empty")
    return data, stamp


def _tokenize(path, data, tokens):
    """(uint16 token ids, vocabulary: list of str or None) of the file's bytes ``data``."""
    if tokens == "bytes":
        return np.frombuffer(data, np.uint8).astype(np.uint16), None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                        f"{e.start}); use --tokens bytes") from None
    chunks = range(0, len(text), CHUNK_CHARS)

    def code_points(start):
        return np.frombuffer(text[start:start + CHUNK_CHARS].encode("utf-32-le"), np.uint32)

    vocab = np.unique(np.concatenate([np.unique(code_points(a)) for a in chunks]))   # (V,)
    if len(vocab) > MAX_VOCAB:
        raise DataError(f"{path}: has {len(vocab)} distinct characters, more than the "
                        f"{MAX_VOCAB} a uint16 token holds; use --tokens bytes")
    ids = np.empty(len(text), np.uint16)                                              # (n,)
    for a in chunks:
        ids[a:a + CHUNK_CHARS] = np.searchsorted(vocab, code_points(a))
    return ids, [chr(c) for c in vocab.tolist()]


def _sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_stamps(folder, tokens):
    """The _stamp of the cache's JSON and of its tokens."""
    return _stamp(folder / f"{tokens}.json"), _stamp(folder / f"{tokens}.npy")


def _open_cache(folder, tokens, checksum):
    """(memmap uint16 (n,), vocab, _cache_stamps taken before reading) from a valid cache in
    ``folder``, else None."""
    meta_path, ids_path = folder / f"{tokens}.json", folder / f"{tokens}.npy"
    try:
        stamps = _cache_stamps(folder, tokens)
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if (meta.get("format") != CACHE_FORMAT or meta.get("tokens") != tokens
                or meta.get("source_sha256") != checksum
                or meta.get("tokens_sha256") != _sha256_file(ids_path)):
            return None
        ids = np.load(ids_path, mmap_mode="r", allow_pickle=False)
        vocab = meta["vocab"]
        size = 256 if tokens == "bytes" else len(vocab)
        if ids.dtype != np.uint16 or ids.ndim != 1 or len(ids) != meta["n_tokens"] \
                or (vocab is not None and not all(isinstance(c, str) for c in vocab)) \
                or meta.get("vocab_size") != size:
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None                     # missing, unreadable or corrupt: rebuild it
    return ids, vocab, stamps


def _write_cache(folder, tokens, checksum, ids, vocab):
    """Tokens then their JSON, each atomically (identical bytes from every writer)."""
    ids_path = folder / f"{tokens}.npy"
    atomic.write(ids_path, lambda f: np.lib.format.write_array(f, ids, allow_pickle=False),
                 prefix=f".{tokens}.npy.", suffix=".part")
    meta = {"format": CACHE_FORMAT, "tokens": tokens, "source_sha256": checksum,
            "tokens_sha256": _sha256_file(ids_path), "n_tokens": int(len(ids)),
            "vocab_size": 256 if vocab is None else len(vocab), "vocab": vocab}
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    atomic.write(folder / f"{tokens}.json", lambda f: f.write(text.encode("utf-8")),
                 prefix=f".{tokens}.json.", suffix=".part")


def _cache_folders(path, checksum, cache_dir):
    if cache_dir is not None:
        return [Path(os.fspath(cache_dir)).expanduser()]
    return [path.parent / f"{path.name}.mpitrain", cache_root() / "text" / checksum[:32]]


# (real path of the text, tokens, cache_dir) -> _Corpus validated by this process
_VALIDATED = {}


class _Corpus:
    """A validated token cache: its tokens (memmap uint16 (n,)), vocab and text SHA-256, and
    what the text and the cache files looked like (_stamp) when they were hashed."""

    def __init__(self, ids, vocab, checksum, source_stamp, folders, folder, cache_stamps):
        self.ids, self.checksum = ids, checksum
        self.vocab = None if vocab is None else tuple(vocab)
        self.source_stamp, self.folders = source_stamp, folders
        self.folder, self.cache_stamps = folder, cache_stamps

    def loaded(self):
        """(ids, vocab, checksum), the vocab a new list: no dataset sees another's edits."""
        return self.ids, None if self.vocab is None else list(self.vocab), self.checksum

    def unchanged(self, path, tokens, cache_dir):
        """Whether the text, the cache folders searched and the cache files are as validated."""
        try:
            return (_stamp(path) == self.source_stamp
                    and _cache_folders(path, self.checksum, cache_dir) == self.folders
                    and _cache_stamps(self.folder, tokens) == self.cache_stamps)
        except OSError:
            return False                # gone or unreadable: let the full path say why


def _load_tokens(path, tokens, cache_dir, check):
    """(memmap uint16 (n,), vocab, checksum): as this process last validated them when no file
    changed since, else from a valid cache, else tokenised and cached.
    ``check(n_tokens)`` raises before anything is written when the text cannot be used."""
    key = (os.path.realpath(path), tokens, None if cache_dir is None else os.fspath(cache_dir))
    known = _VALIDATED.get(key)
    if known is not None and known.unchanged(path, tokens, cache_dir):
        check(len(known.ids))
        return known.loaded()
    data, source_stamp = _read_source(path)
    checksum = hashlib.sha256(data).hexdigest()
    folders = _cache_folders(path, checksum, cache_dir)

    def validated(folder, found):
        ids, vocab, stamps = found
        _VALIDATED[key] = _Corpus(ids, vocab, checksum, source_stamp, folders, folder, stamps)
        return _VALIDATED[key].loaded()

    for folder in folders:
        found = _open_cache(folder, tokens, checksum)
        if found is not None:
            check(len(found[0]))
            return validated(folder, found)
    ids, vocab = _tokenize(path, data, tokens)
    del data
    check(len(ids))
    failures = []
    for folder in folders:
        try:
            _write_cache(folder, tokens, checksum, ids, vocab)
        except OSError as e:
            failures.append(f"{folder} ({e.strerror or one_line(e)})")
            continue
        found = _open_cache(folder, tokens, checksum)
        if found is not None:
            return validated(folder, found)
        failures.append(f"{folder} (written but unreadable)")
    raise DataError(f"{path}: cannot write its token cache in {' or '.join(failures)}")


class _Windows:
    """``images`` / ``labels`` of a TextDataset: window rows gathered on demand from the split's
    memory-mapped tokens (``offset`` 0: inputs, 1: next-token targets)."""

    def __init__(self, dataset, offset):
        self._ds, self._offset = dataset, offset
        self.dtype = np.dtype(np.int64)
        self.ndim = 2

    @property
    def shape(self):
        return (len(self._ds), self._ds.block_size)

    def __len__(self):
        return len(self._ds)

    def __getitem__(self, idx):
        n = len(self._ds)
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(n), dtype=np.int64)
        idx = np.asarray(idx)
        if idx.dtype == bool or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
            raise IndexError(f"{self._ds.name}: window indices must be integers, got "
                             f"{idx.dtype}")
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = idx[(idx < -n) | (idx >= n)][0]
            raise IndexError(f"{self._ds.name}: window {bad} is out of range for {n} windows")
        idx = np.where(idx < 0, idx + n, idx)
        starts = self._ds.starts(idx) + self._offset                            # idx.shape
        steps = np.arange(self._ds.block_size, dtype=np.int64)                  # (T,)
        out = self._ds.data[starts[..., None] + steps].astype(np.int64)         # (*idx, T)
        return out

    def __array__(self, dtype=None, copy=None):
        out = self[np.arange(len(self), dtype=np.int64)]                        # (W, T)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self):
        kind = "labels" if self._offset else "images"
        return f"<{self._ds.name} {kind}: {self.shape[0]} windows x {self.shape[1]} int64>"


class TextDataset:
    """Next-token windows of a text file (see the module docstring).

    path: a text file, or a catalog text's name ("tiny-shakespeare") once fetched.
    block_size: tokens per sample (T); each window spans T + 1 tokens.
    tokens: "chars" (UTF-8 characters, vocabulary from the file) or "bytes" (256).
    split: "train" (the first 90% of the tokens) or "val" (the rest).
    seed: keys the window starts with the split (never the rank).
    windows: samples in the dataset (default n_split // block_size).
    cache_dir: where the token cache lives (default: beside the file, else the user cache).

    images[idx] / labels[idx]: int64 (len(idx), T), tokens s..s+T-1 / s+1..s+T of each window;
    classes = vocab_size; vocab (list of str; None for bytes); encode(str) / decode(ids);
    data: the split's uint16 tokens (memory-mapped); checksum: SHA-256 of the source text.
    """

    fill = None

    def __init__(self, path, block_size=64, tokens="chars", split="train", seed=0,
                 windows=None, cache_dir=None):
        if tokens not in TOKENIZATIONS:
            raise DataError(f"{path}: unknown tokens {tokens!r}; use 'chars' or 'bytes'")
        if split not in SPLITS:
            raise DataError(f"{path}: unknown split {split!r}; use 'train' or 'val'")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
                or block_size < 1:
            raise DataError(f"{path}: block_size must be an integer >= 1, got {block_size!r}")
        if windows is not None and (isinstance(windows, bool)
                                    or not isinstance(windows, (int, np.integer))
                                    or windows < 1):
            raise DataError(f"{path}: windows must be an integer >= 1, got {windows!r}")
        self.path = _resolve(path)
        self.split, self.tokens = split, tokens
        self.block_size, self.seed = int(block_size), int(seed)

        def check(n):
            lengths = {"train": int(n * TRAIN_FRACTION)}
            lengths["val"] = n - lengths["train"]
            if lengths[split] < self.block_size + 1:
                raise DataError(f"{self.path}: the {split} split has {lengths[split]} tokens of "
                                f"{n}, fewer than block_size + 1 = {self.block_size + 1}")

        ids, self.vocab, self.checksum = _load_tokens(self.path, tokens, cache_dir, check)
        cut = int(len(ids) * TRAIN_FRACTION)
        self.data = ids[:cut] if split == "train" else ids[cut:]        # (n_split,) uint16
        self.n_tokens = int(len(ids))
        self.vocab_size = 256 if self.vocab is None else len(self.vocab)
        self.classes = self.vocab_size
        self._span = len(self.data) - self.block_size                   # valid starts
        self.windows = int(windows) if windows is not None else \
            len(self.data) // self.block_size
        if self.vocab is not None:
            self._code_points = np.array([ord(c) for c in self.vocab], np.uint32)   # (V,)
        self.name = f"text:{self.path.name}"
        self.images = _Windows(self, 0)
        self.labels = _Windows(self, 1)

    @property
    def sample_shape(self):
        return (self.block_size,)

    def __len__(self):
        return self.windows

    def starts(self, idx):
        """Start offsets in ``data`` (int64) of windows ``idx`` (int array, any shape)."""
        return window_starts(self.seed, self.split, idx, self._span)

    def encode(self, text):
        """str -> int64 token ids; DataError naming a character the vocabulary lacks."""
        if self.vocab is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        cps = np.frombuffer(text.encode("utf-32-le"), np.uint32)                 # (n,)
        pos = np.minimum(np.searchsorted(self._code_points, cps), self.vocab_size - 1)
        missing = self._code_points[pos] != cps
        if missing.any():
            ch = chr(int(cps[np.argmax(missing)]))
            raise DataError(f"{self.path}: character {ch!r} (U+{ord(ch):04X}) is not in the "
                            f"vocabulary of its {self.vocab_size} characters")
        return pos.astype(np.int64)

    def decode(self, ids):
        """Token ids -> str (bytes mode: UTF-8 with invalid sequences replaced)."""
        ids = np.asarray(ids, np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise DataError(f"{self.path}: token ids must lie in [0, {self.vocab_size}), got "
                            f"[{ids.min()}, {ids.max()}]")
        if self.vocab is None:
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return self._code_points[ids].tobytes().decode("utf-32-le")

    def __repr__(self):
        return (f"TextDataset({self.name!r}, split={self.split!r}, tokens={self.tokens!r}, "
                f"block_size={self.block_size}, windows={self.windows}, "
                f"vocab_size={self.vocab_size}, split_tokens={len(self.data)})")
