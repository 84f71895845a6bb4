"""Downloading a dataset from its official source, verified, never half-written.

    fetch("fashion-mnist")          # -> directory holding the files

1. If locate() already finds the dataset (on the search path, e.g. Debian's /usr/share/datasets;
   with a given data dir, only there), say where and stop: no download, no second copy.
2. Otherwise download each file of catalog.py's sources into the target directory
   (data_dir/<name>, else $MPITRAIN_DATA_DIR/<name>, else ~/.cache/mpitrain/<name>; a given
   data dir is a destination here, so it is created if missing):
   stream into a temp file *in that directory* (".name.XXXX.part"), hashing as it arrives, fsync,
   compare the SHA-256 with the pinned one, and only then os.replace() it onto the final name
   (atomic on POSIX, same file system). A failed check, a dropped connection or Ctrl-C deletes
   the temp file, so the cache only ever holds verified files, and a rerun picks up where the
   last one stopped (files already present with the right hash are kept).
3. A text (catalog.TEXTS, e.g. tiny-shakespeare) is one file: kept where the search finds it
   with the pinned SHA-256, else downloaded into the target directory the same way.
4. CIFAR-10 comes as one tarball: after verifying it, only the six expected batch members are
   copied out (regular files, known names; nothing else in the archive is trusted, so no path
   tricks), each through the same temp-then-rename step; the tarball is deleted last.

Mirrors listed for a file are tried in order; the hash makes them interchangeable. When no
source can be reached the error is one line saying where to put the files by hand instead.
"""
import hashlib
import http.client
import shutil
import tarfile
import urllib.request

from mpitrain.runtime import atomic
from mpitrain.data.catalog import TEXTS, spec as _spec, text_spec
from mpitrain.data.cifar import RECORD_BYTES
from mpitrain.runtime.errors import DataError, FetchOffline
from mpitrain.data.locate import home_dir, locate, search_dirs, where_to_put

__all__ = ["fetch", "FetchOffline", "sha256_file"]

TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20
urlopen = urllib.request.urlopen        # module attribute so tests can substitute an opener


class _Mismatch(Exception):
    pass


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def _progress(total, desc):
    from tqdm import tqdm     # imported here: only downloads need it
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, leave=False)


def _write_atomically(dest, writer):
    """``writer(f)`` into ".<name>.XXXX.part" beside ``dest``, renamed onto it once complete
    (atomic.py): an exception from ``writer`` -- a failed check included -- leaves no file."""
    atomic.write(dest, writer, prefix=f".{dest.name}.", suffix=".part")


def _download_one(url, source, dest):
    """Download url into a temp file next to dest, verify, rename; FetchOffline / _Mismatch."""
    try:
        response = urlopen(url, timeout=TIMEOUT_S)
    except (OSError, http.client.HTTPException) as e:
        raise FetchOffline(str(getattr(e, "reason", None) or e)) from None

    def receive(f):
        h, n = hashlib.sha256(), 0
        total = int(response.headers.get("Content-Length") or source.size)
        with _progress(total, dest.name) as bar:
            while True:
                try:
                    chunk = response.read(CHUNK_BYTES)
                except (OSError, http.client.HTTPException) as e:
                    raise FetchOffline(f"connection lost after {n} bytes ({e})") from None
                if not chunk:
                    break
                f.write(chunk)
                h.update(chunk)
                n += len(chunk)
                bar.update(len(chunk))
        if h.hexdigest() != source.sha256:
            raise _Mismatch(f"{url}: checksum failed: got {n} bytes with SHA-256 "
                            f"{h.hexdigest()}, expected {source.size} bytes with SHA-256 "
                            f"{source.sha256}; discarded")

    with response:
        _write_atomically(dest, receive)


def _download(source, dest, spec, data_dir, where=None):
    """Try each URL of `source`; raise DataError (checksum) or FetchOffline (unreachable).
    ``where``: the "put it there by hand" hint (default: the dataset's where_to_put)."""
    unreachable, mismatched = [], []
    for url in source.urls:
        try:
            _download_one(url, source, dest)
            return
        except FetchOffline as e:
            unreachable.append((url, str(e)))
        except _Mismatch as e:
            mismatched.append(str(e))
    if mismatched:
        raise DataError(f"fetch {spec.name}: {'; '.join(mismatched)}")
    reasons = {reason for _, reason in unreachable}
    tried = "; ".join(f"{url}: {reason}" for url, reason in unreachable) if len(reasons) > 1 \
        else f"{', '.join(url for url, _ in unreachable)} ({reasons.pop()})"
    raise FetchOffline(f"fetch {spec.name}: cannot download {tried}; without network access, "
                       f"{where or where_to_put(spec, data_dir, fetch=False)}")


def _extract_cifar(archive, spec, target):
    """Copy the expected batch files out of the verified tarball, each atomically."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for filename in spec.files:
                member_name = f"{spec.archive_dir}/{filename}"
                try:
                    member = tar.getmember(member_name)
                except KeyError:
                    raise DataError(f"{archive}: has no member {member_name}") from None
                if not member.isfile() or member.size % RECORD_BYTES:
                    raise DataError(f"{archive}: member {member_name} is not a CIFAR-10 batch "
                                    f"({member.size} bytes)")
                with tar.extractfile(member) as src:
                    _write_atomically(target / filename,
                                      lambda f: shutil.copyfileobj(src, f, CHUNK_BYTES))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"{archive}: cannot extract ({e})") from None


def _target_dir(name, data_dir):
    """The directory fetch writes `name` into (home_dir), created if missing."""
    target = home_dir(name, data_dir)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"fetch {name}: cannot create {target} ({e.strerror or e})") from None
    return target


def _fetch_text(name, data_dir, force, log):
    """A catalog text (TEXTS): one file, kept where it is found when its SHA-256 is right."""
    spec = text_spec(name)
    source = spec.source
    if not force:
        for directory in search_dirs(name, data_dir):
            path = directory / source.filename
            if path.is_file() and sha256_file(path) == source.sha256:
                log(f"{name}: already present in {directory}; nothing to download")
                return directory
    target = _target_dir(name, data_dir)
    log(f"{name}: downloading {source.filename} ({source.size / 1e6:.1f} MB) to {target}")
    _download(source, target / source.filename, spec, data_dir,
              where=f"put {source.filename} (SHA-256 {source.sha256}) in {target}")
    log(f"{name}: ready in {target}")
    return target


def fetch(name, data_dir=None, force=False, log=print):
    """Make dataset or text `name` available; returns the directory holding it."""
    if name in TEXTS:
        return _fetch_text(name, data_dir, force, log)
    spec = _spec(name)
    if not force:
        try:
            where = locate(name, data_dir)
        except DataError:
            pass
        else:
            log(f"{name}: already present in {where}; nothing to download")
            return where
    target = _target_dir(name, data_dir)
    for source in spec.sources:
        dest = target / source.filename
        if dest.is_file() and sha256_file(dest) == source.sha256:
            log(f"{dest}: already downloaded and verified")
            continue
        log(f"{name}: downloading {source.filename} ({source.size / 1e6:.1f} MB) to {target}")
        _download(source, dest, spec, data_dir)
    if spec.format == "cifar":
        archive = target / spec.sources[0].filename
        _extract_cifar(archive, spec, target)
        archive.unlink()
    log(f"{name}: ready in {target}")
    return target
