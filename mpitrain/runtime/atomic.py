"""Atomic file writes: a reader sees the old file or the complete new one, never half of it.

Write to a temp file in the destination's folder (same filesystem, so the rename is atomic),
fsync it, ``os.replace`` it onto the final name, then fsync the folder so the rename itself
survives a crash. On any failure the temp file is removed and the destination is untouched.
The file gets the permissions a plain ``open`` would give it (0666 less the umask), not the
temp file's private 0600, so a checkpoint or a shared token cache stays readable by others.
Used for checkpoints and ``--save`` (train/checkpoint.py), timelines (mpitrain/timeline/),
verified downloads (data/fetch.py) and the text token cache (data/text.py).
"""
import os
import tempfile

# The process's umask, read once at import (reading it means setting it, which is not
# thread-safe later, when a checkpoint may be written on a background thread).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


TEMP_PREFIX = ".tmp-"      # every temp file's name starts so (runtime/folder_lock.py clears
                           # those a killed writer left behind)


def write(path, writer, mode="wb", prefix=TEMP_PREFIX, suffix=".part"):
    """Atomically create ``path`` with ``writer(f)`` on a file opened in ``mode``; the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
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
