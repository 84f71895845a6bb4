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

Streaming. The text is never held whole: it is read CHUNK_BYTES at a time, three times when
there is no cache yet -- its SHA-256 (the cache's key), the vocabulary and the token count (UTF-8
decoded incrementally, so a character split across two chunks is one character), then the
tokens, written after their .npy header chunk by chunk and hashed as they are written. So a
build holds about 16 x CHUNK_BYTES whatever the text's size, and a reader the pages of the
windows it reads. A text rewritten between the passes (its _stamp differs, or the count) is a
DataError rather than tokens of two texts.

The hashes run the first time a process builds a TextDataset of a file (reading the whole text
and the whole token file). The validated corpus (token memmap, vocabulary, text SHA-256) is then
kept for the process, so the next TextDataset of the same file, tokens and cache_dir (the CLI's
"val" after its "train") hashes nothing: it only stats the text and the cache's two files, and
hashes again when any of them changed (device, inode, size, mtime or ctime differ).
``cache_record`` hands that validation to another process as plain data and ``adopt_cache``
takes it where the process sees the very same files (the CLI's ranks on one host: one hashes,
the others adopt); a record whose files look different there is ignored.

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
import codecs
import hashlib
import itertools
import json
import os
from pathlib import Path

import numpy as np

from mpitrain.data.catalog import TEXTS
from mpitrain.data.locate import cache_root, home_dir, search_dirs
from mpitrain.runtime import atomic
from mpitrain.runtime.errors import DataError, one_line

__all__ = ["TextDataset", "TOKENIZATIONS", "SPLITS", "locate_text", "window_starts",
           "MAX_VOCAB", "cache_record", "adopt_cache"]

TOKENIZATIONS = ("chars", "bytes")
SPLITS = ("train", "val")
TRAIN_FRACTION = 0.9
MAX_VOCAB = 65535                       # token ids must fit uint16
CACHE_FORMAT = 1
CHUNK_BYTES = 1 << 22                   # bytes of text read at a time: bounds the memory a pass
                                        # holds (about 16x this, its code points and ids)
CODE_POINTS = 0x110000                  # every Unicode code point

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


def _open_source(path):
    """The text opened for reading (binary), or DataError saying why it cannot be."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a text file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None


def _chunks(path, f):
    """The bytes of open file ``f`` from its start, CHUNK_BYTES at a time: the only memory a
    pass over the text holds. A read error is a DataError (never an OSError, which the cache
    writer takes for a folder it cannot write)."""
    f.seek(0)
    while True:
        try:
            chunk = f.read(CHUNK_BYTES)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None
        if not chunk:
            return
        yield chunk


def _hash_source(path, f):
    """SHA-256 of the open text ``f``, streamed; DataError when it is empty."""
    h, size = hashlib.sha256(), 0
    for chunk in _chunks(path, f):
        h.update(chunk)
        size += len(chunk)
    if not size:
        raise DataError(f"{path}: is empty")
    return h.hexdigest()


def _code_points(path, f):
    """The text's characters as uint32 code points, one array per chunk: UTF-8 decoded
    incrementally, so a character split across two chunks is decoded whole."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    position = 0                                        # bytes handed to the decoder so far
    for chunk in itertools.chain(_chunks(path, f), [None]):
        pending = len(decoder.getstate()[0])            # bytes of a character begun before
        try:
            text = decoder.decode(b"" if chunk is None else chunk, final=chunk is None)
        except UnicodeDecodeError as e:
            offset = position - pending + e.start
            raise DataError(f"{path}: is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                            f"offset {offset}); use --tokens bytes") from None
        position += 0 if chunk is None else len(chunk)
        yield np.frombuffer(text.encode("utf-32-le"), np.uint32)                     # (c,)


def _tokenize(path, f, tokens):
    """First pass over the open text ``f``: (token count, vocabulary: list of str or None)."""
    if tokens == "bytes":
        return _stamp(f.fileno())[2], None
    present = np.zeros(CODE_POINTS, bool)               # (0x110000,): characters seen
    n = 0
    for cps in _code_points(path, f):
        present[cps] = True
        n += len(cps)
    vocab = np.flatnonzero(present)                                                 # (V,)
    if len(vocab) > MAX_VOCAB:
        raise DataError(f"{path}: has {len(vocab)} distinct characters, more than the "
                        f"{MAX_VOCAB} a uint16 token holds; use --tokens bytes")
    return n, [chr(c) for c in vocab.tolist()]


def _token_chunks(path, f, tokens, vocab):
    """Second pass: the text's uint16 token ids, one array per chunk."""
    if tokens == "bytes":
        for chunk in _chunks(path, f):
            yield np.frombuffer(chunk, np.uint8).astype("<u2")
        return
    ids = np.zeros(CODE_POINTS, "<u2")                  # code point -> token id
    ids[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype="<u2")
    for cps in _code_points(path, f):
        yield ids[cps]


class _Hashing:
    """A file that also hashes what is written to it (the token file's SHA-256, without reading
    back a file of twice the text's size)."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.f.write(data)


def _write_tokens(out, path, f, tokens, vocab, n, source_stamp):
    """The .npy of the text's n tokens into ``out``: its header, then the second pass's chunks;
    DataError when the text is no longer the one hashed and counted (rewritten meanwhile)."""
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(np.dtype("<u2")), "fortran_order": False,
              "shape": (n,)})
    written = 0
    for ids in _token_chunks(path, f, tokens, vocab):
        written += len(ids)
        if written > n:
            break
        out.write(ids.tobytes())
    if written != n or _stamp(f.fileno()) != source_stamp:
        raise DataError(f"{path}: changed while it was being tokenised; run again")


def _sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_stamps(folder, tokens):
    """The _stamp of the cache's JSON and of its tokens."""
    return _stamp(folder / f"{tokens}.json"), _stamp(folder / f"{tokens}.npy")


def _open_cache(folder, tokens, checksum, hashed=True):
    """(memmap uint16 (n,), vocab, _cache_stamps taken before reading) from a valid cache in
    ``folder``, else None. ``hashed=False`` skips the token file's SHA-256 (a process that
    hashed these very files, same _cache_stamps, vouches for it: adopt_cache)."""
    meta_path, ids_path = folder / f"{tokens}.json", folder / f"{tokens}.npy"
    try:
        stamps = _cache_stamps(folder, tokens)
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if (meta.get("format") != CACHE_FORMAT or meta.get("tokens") != tokens
                or meta.get("source_sha256") != checksum
                or (hashed and meta.get("tokens_sha256") != _sha256_file(ids_path))):
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


def _write_cache(folder, tokens, checksum, source, n, vocab):
    """Tokens (streamed from ``source``: (path, open file, _stamp)) then their JSON, each
    atomically (identical bytes from every writer)."""
    out = {}

    def write_tokens(f):
        out["file"] = _Hashing(f)
        _write_tokens(out["file"], *source[:2], tokens, vocab, n, source[2])

    atomic.write(folder / f"{tokens}.npy", write_tokens, prefix=f".{tokens}.npy.",
                 suffix=".part")
    meta = {"format": CACHE_FORMAT, "tokens": tokens, "source_sha256": checksum,
            "tokens_sha256": out["file"].sha256.hexdigest(), "n_tokens": int(n),
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


def _key(path, tokens, cache_dir):
    return (os.path.realpath(path), tokens, None if cache_dir is None else os.fspath(cache_dir))


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


def cache_record(path, tokens="chars", cache_dir=None):
    """What this process validated of ``path``'s token cache, as plain data for another process
    (``adopt_cache``): the file names, SHA-256s, vocabulary and _stamps -- never the tokens.
    None when this process has not validated it, or a file changed since."""
    path = _resolve(path)
    key = _key(path, tokens, cache_dir)
    known = _VALIDATED.get(key)
    if known is None or not known.unchanged(path, tokens, cache_dir):
        return None
    return {"key": key, "vocab": known.vocab, "checksum": known.checksum,
            "source_stamp": known.source_stamp, "folders": [str(p) for p in known.folders],
            "folder": str(known.folder), "cache_stamps": known.cache_stamps}


def adopt_cache(records):
    """Take the first of ``records`` (cache_record's, or None) whose text and cache files this
    process sees exactly as the process that hashed them did (same device, inode, size, mtime
    and ctime: the same files on the same machine): its next TextDataset of that text then
    hashes nothing. Returns whether one was taken; one that matches nothing is ignored, and
    the next TextDataset validates the cache itself."""
    for record in records:
        if record is None:
            continue
        try:
            realpath, tokens, cache_dir = record["key"]
            corpus = _Corpus(None, record["vocab"], record["checksum"],
                             tuple(record["source_stamp"]), [Path(p) for p in record["folders"]],
                             Path(record["folder"]),
                             tuple(tuple(s) for s in record["cache_stamps"]))
        except (KeyError, TypeError, ValueError):
            continue
        if not corpus.unchanged(Path(realpath), tokens, cache_dir):
            continue
        found = _open_cache(corpus.folder, tokens, corpus.checksum, hashed=False)
        if found is None or found[2] != corpus.cache_stamps \
                or (None if found[1] is None else tuple(found[1])) != corpus.vocab:
            continue
        corpus.ids = found[0]
        _VALIDATED[tuple(record["key"])] = corpus
        return True
    return False


def _load_tokens(path, tokens, cache_dir, check):
    """(memmap uint16 (n,), vocab, checksum): as this process last validated them when no file
    changed since, else from a valid cache, else tokenised and cached -- the text streamed in
    chunks (a hash, a pass for the vocabulary and count, a pass writing the tokens), so memory
    stays flat whatever its size.
    ``check(n_tokens)`` raises before anything is written when the text cannot be used."""
    key = _key(path, tokens, cache_dir)
    known = _VALIDATED.get(key)
    if known is not None and known.unchanged(path, tokens, cache_dir):
        check(len(known.ids))
        return known.loaded()
    with _open_source(path) as f:
        source_stamp = _stamp(f.fileno())
        checksum = _hash_source(path, f)
        folders = _cache_folders(path, checksum, cache_dir)

        def validated(folder, found):
            ids, vocab, stamps = found
            _VALIDATED[key] = _Corpus(ids, vocab, checksum, source_stamp, folders, folder,
                                      stamps)
            return _VALIDATED[key].loaded()

        for folder in folders:
            found = _open_cache(folder, tokens, checksum)
            if found is not None:
                check(len(found[0]))
                return validated(folder, found)
        n, vocab = _tokenize(path, f, tokens)
        check(n)
        failures = []
        for folder in folders:
            try:
                _write_cache(folder, tokens, checksum, (path, f, source_stamp), n, vocab)
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
