"""Atomic file writes: a reader sees the old file or the complete new one, never half of it.

Write to a temp file in the destination's folder (same filesystem, so the rename is atomic),
fsync it, ``os.replace`` it onto the final name, then fsync the folder so the rename itself
survives a crash. On any failure the temp file is removed and the destination is untouched.
Used for checkpoints and ``--save`` (train/checkpoint.py), timelines (mpitrain/timeline/) and verified
downloads (data/fetch.py).
"""
import os
import tempfile


def write(path, writer, mode="wb", prefix=".tmp-", suffix=".part"):
    """Atomically create ``path`` with ``writer(f)`` on a file opened in ``mode``; the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, mode) as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
    return path


def fsync_dir(folder):
    """Make a rename in ``folder`` durable (best effort where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
