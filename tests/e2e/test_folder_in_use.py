"""One job per checkpoint folder, and no job outliving its launcher.

A launcher (mpitrainrun) killed with SIGKILL takes its job with it: nothing trains on
unsupervised to race the next launcher on the same folder. A second job started on a folder a
live job holds is refused with one line and exit 2; the folder is free again once the first is
gone. The jobs train until they are stopped; every wait is bounded, and whatever a test started
is killed at its end.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.launch import MPIEXEC as _MPIEXEC
from tests.support.launch import REPO, child_env

# the jobs run in their own folders: a relative launcher path is the repository's
MPIEXEC = _MPIEXEC if os.path.isabs(_MPIEXEC) or os.sep not in _MPIEXEC else str(REPO / _MPIEXEC)

FLAGS = ["-m", "mpitrain", "--dataset", "synthetic", "--synthetic-samples", "256", "--hidden",
         "16", "--batch-size", "8", "--no-progress", "--checkpoint-every", "2"]
LONG = ["--steps", "1000000"]
# No output after the header: a job that writes to its dead launcher's pipe dies of SIGPIPE
# anyway; the one that must be ended is the job that trains on quietly.
QUIET = ["--eval-every", "100000000"]
WAIT_S = 120


def _wait_for(what, condition, limit_s=WAIT_S, proc=None, log=None):
    """Until ``condition()``; fails after ``limit_s`` or when ``proc`` has ended (with ``log``)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        ended = proc is not None and proc.poll() is not None
        assert not ended and time.monotonic() < deadline, f"no {what} after {limit_s} s" + (
            "" if log is None else ":\n" + log.read_text()[-3000:])
        time.sleep(0.2)


def _stat(pid):
    """(state, ppid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _descendants(pid):
    """The live processes below ``pid``: the MPI launcher, its proxy, the ranks."""
    live = {int(e): _stat(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, st in live.items() if st is not None and st[1] == parent
                and st[0] != "Z"]
        found += kids
        todo += kids
    return found


def _alive(pids):
    return [p for p in pids if (_stat(p) or ("Z",))[0] != "Z"]


def _checkpointed(folder):
    return any(p.name.startswith("ckpt-") for p in folder.iterdir())


def _kill_session(sid):
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(3 * WAIT_S + 60)
def test_a_launcher_killed_with_sigkill_takes_its_job_with_it(tmp_path):
    folder = tmp_path / "ck"
    run = subprocess.Popen([sys.executable, "-m", "mpitrain.run", "--mpiexec", MPIEXEC, "-np",
                            "2", sys.executable, *FLAGS, *LONG, *QUIET, "--checkpoint-dir",
                            str(folder), "--resume-if-exists"], cwd=tmp_path, env=child_env(),
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "run.err", "w"),
                           start_new_session=True)
    job = []
    try:
        _wait_for("first checkpoint", lambda: folder.exists() and _checkpointed(folder),
                  proc=run, log=tmp_path / "run.err")
        job = _descendants(run.pid)
        assert len(job) >= 3, job                 # mpiexec, its proxy, the ranks
        run.send_signal(signal.SIGKILL)
        run.wait()
        _wait_for("end of the job", lambda: not _alive(job), limit_s=60)
        # the folder is free: the next launch resumes there
        p = subprocess.run(["timeout", "-k", "5", str(WAIT_S), MPIEXEC, "-n", "2",
                            sys.executable, *FLAGS, "--steps", "1", "--checkpoint-dir",
                            str(folder), "--resume"], cwd=tmp_path, env=child_env(),
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "mpitrain: resumed from" in p.stdout
    finally:
        run.kill()
        run.wait()
        for pid in _alive(job):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(2 * WAIT_S + 60)
@pytest.mark.parametrize("n", [2, 3])
def test_a_second_job_on_a_folder_in_use_is_one_line_exit_2(tmp_path, n):
    folder = tmp_path / "ck"
    first = subprocess.Popen(["timeout", "-k", "5", str(2 * WAIT_S), MPIEXEC, "-n", str(n),
                              sys.executable, *FLAGS, *LONG, "--checkpoint-dir", str(folder)],
                             cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "first.err", "w"), start_new_session=True)
    try:
        _wait_for("first checkpoint", lambda: folder.exists() and _checkpointed(folder),
                  proc=first, log=tmp_path / "first.err")
        p = subprocess.run(["timeout", "-k", "5", str(WAIT_S), MPIEXEC, "-n", str(n),
                            sys.executable, *FLAGS, "--steps", "1", "--checkpoint-dir",
                            str(folder), "--resume"], cwd=tmp_path, env=child_env(),
                           capture_output=True, text=True)
        assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert lines[0].startswith(f"mpitrain: error: --checkpoint-dir {folder} is in use by "
                                   f"another job (pid "), lines
        assert "resumed from" not in p.stdout
    finally:
        _kill_session(first.pid)
        first.wait()


@pytest.mark.timeout(2 * WAIT_S + 60)
@pytest.mark.parametrize("n", [2, 3])
def test_resume_removes_what_a_killed_writer_left(tmp_path, n):
    """A checkpoint half-written when its writer was killed (its temporary file, from before
    this job's lock) is removed when the next job takes the folder; the checkpoints stay."""
    folder = tmp_path / "ck"
    job = ["timeout", "-k", "5", str(WAIT_S), MPIEXEC, "-n", str(n), sys.executable, *FLAGS,
           "--checkpoint-dir", str(folder)]
    p = subprocess.run(job + ["--steps", "4"], cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    left = folder / ".tmp-k1ll3d.npz"
    left.write_bytes(b"PK\x03\x04 the first bytes of a checkpoint, then SIGKILL")
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))
    kept = sorted(p.name for p in folder.iterdir())
    p = subprocess.run(job + ["--steps", "6", "--resume"], cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout
    assert not left.exists()
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n.startswith(".")] == [], names        # no lock, no temp file
    assert len(names) == 3 and set(kept) - {left.name} <= set(names) | {"ckpt-00000002.npz"}
