"""One job per checkpoint folder: a lock file naming its owner, and the leftovers of dead writers.

Two jobs writing one folder prune each other's checkpoints and resume from each other's steps
(a launcher killed with SIGKILL and started again while its job still trains). So a job takes
``<folder>/.lock`` before its first write and holds it to its end (``acquire``; the CLI's rank
0). The file holds its owner -- ``{"pid": ..., "host": ...}`` -- and the owner holds an
exclusive ``flock`` on it: the kernel drops that lock when the owner dies, however it dies
(SIGKILL included), so a lock whose owner is gone is stale by construction and the next job
takes it over; a pid that the system has since given to another process is never mistaken for
the owner. A lock held by a live job is refused with one line naming its pid and host
(``UsageError``: exit code 2). ``release`` removes the file; a crash leaves it, stale.

Taking the lock also removes the folder's stale temporary files (runtime/atomic.py's
``TEMP_PREFIX``, e.g. a checkpoint half-written when its writer was killed): every writer of the
folder holds its lock, so a temporary file older than the lock just taken belongs to a writer
that is gone. Newer ones, and anything that is not a regular file, are left alone.
"""
import fcntl
import json
import os
import socket

from mpitrain.runtime.atomic import TEMP_PREFIX
from mpitrain.runtime.errors import UsageError

LOCK_NAME = ".lock"


class FolderLock:
    """The lock of ``folder``, held by this process until ``release()``. ``removed``: the stale
    temporary files taking it removed (their paths)."""

    def __init__(self, folder, fd, removed):
        self.folder, self.path = folder, os.path.join(folder, LOCK_NAME)
        self.fd, self.removed = fd, removed

    def release(self):
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)              # while still locked: a waiter retries (acquire)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def acquire(folder, flag="--checkpoint-dir"):
    """Lock ``folder`` (created if missing) for this process; a FolderLock. UsageError (naming
    ``flag``) when a live job holds it or it cannot be taken."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd = _locked(os.path.join(folder, LOCK_NAME), flag, folder)
    except OSError as exc:
        raise UsageError(f"{flag} {folder}: cannot take its lock "
                         f"({exc.strerror or exc})") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        os.fsync(fd)
        removed = remove_stale_temps(folder, os.fstat(fd).st_mtime)
    except BaseException:
        os.close(fd)
        raise
    return FolderLock(folder, fd, removed)


def _locked(path, flag, folder):
    """An fd of ``path`` holding its exclusive flock. A lock released and unlinked meanwhile (the
    file we locked is no longer the one at ``path``) is retried on the new file."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise UsageError(f"{flag} {folder} is in use by another job ({owner}); wait for it "
                             f"to end, or use another folder") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _owner(fd):
    """The owner a lock file names, in words."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(data['pid'])} on {data['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock file names no owner yet"


def remove_stale_temps(folder, before):
    """Remove the regular files of ``folder`` named like atomic.py's temporary files and last
    modified before ``before`` (a time.time()); their paths."""
    removed = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat(
                        follow_symlinks=False).st_mtime < before:
                    os.unlink(entry.path)
                    removed.append(entry.path)
            except OSError:
                pass                          # gone meanwhile, or not ours to remove
    return sorted(removed)
