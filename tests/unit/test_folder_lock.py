"""runtime/folder_lock.py: one job per checkpoint folder; a dead owner's lock and the temporary
files of a killed writer are taken over and removed."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mpitrain.runtime import folder_lock
from mpitrain.runtime.errors import UsageError

HOLDER = """
import sys, time
from mpitrain.runtime import folder_lock
lock = folder_lock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def _holder(folder):
    """A process holding ``folder``'s lock (started, and locked, when this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_job_is_refused_while_the_owner_lives(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(UsageError) as err:
            folder_lock.acquire(str(tmp_path))
        assert str(err.value) == (
            f"--checkpoint-dir {tmp_path} is in use by another job (pid {proc.pid} on "
            f"{socket.gethostname()}); wait for it to end, or use another folder")
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_of_a_killed_owner_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)             # no cleanup: the lock file stays behind
    proc.wait()
    assert (tmp_path / ".lock").exists()
    with folder_lock.acquire(str(tmp_path)) as lock:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        assert lock.removed == []
    assert not (tmp_path / ".lock").exists()      # released: removed


def test_a_released_lock_is_free_again_and_release_is_idempotent(tmp_path):
    lock = folder_lock.acquire(str(tmp_path / "new"))          # the folder is created
    lock.release()
    lock.release()
    folder_lock.acquire(str(tmp_path / "new")).release()


def test_taking_the_lock_removes_only_stale_temporary_files(tmp_path):
    old = time.time() - 3600
    stale = [tmp_path / ".tmp-abc123.npz", tmp_path / ".tmp-x.part"]
    kept = {"ckpt-00000010.npz": old, ".tmp-future.npz": time.time() + 3600,
            "notes.tmp-1": old}
    for path in stale:
        path.write_bytes(b"half a checkpoint")
        os.utime(path, (old, old))
    for name, when in kept.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (when, when))
    os.mkdir(tmp_path / ".tmp-folder")
    os.symlink(tmp_path / "ckpt-00000010.npz", tmp_path / ".tmp-link.npz")
    with folder_lock.acquire(str(tmp_path)) as lock:
        assert lock.removed == sorted(str(p) for p in stale)
    assert not any(p.exists() for p in stale)
    assert all((tmp_path / name).exists() for name in kept)
    assert (tmp_path / ".tmp-folder").is_dir() and (tmp_path / ".tmp-link.npz").is_symlink()


def test_an_unusable_lock_path_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UsageError, match=r"^--checkpoint-dir .*/file: cannot take its lock \("):
        folder_lock.acquire(str(tmp_path / "file"))
