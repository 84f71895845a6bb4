"""Ctrl-C (SIGINT): every rank stops after the same step with exit code 130 and exactly one line
from rank 0 saying where, whichever ranks the signal reached -- one non-zero rank (``kill -INT`` of its
pid), rank 0 alone, every rank at the same step, or the launcher (MPICH's mpiexec forwards a
real Ctrl-C to every rank).

The rank signals itself at an exact step (tests/support/faults.py, FAULT=int): no timing. The
launcher case waits for a checkpoint file before signalling, and checks only the line's form.
"""
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.launch import MPIEXEC, REPO, child_env

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--batch-size", "4", "--seed", "3"]
LIMIT_S = 150


def job(n, *flags, cwd, env):
    cmd = ["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", str(n), sys.executable, FAULTS,
           *BASE, *flags]
    return subprocess.run(cmd, cwd=cwd, env=child_env(**env), capture_output=True, text=True,
                          timeout=LIMIT_S + 30)


def interrupt_lines(stderr):
    return [line for line in stderr.splitlines() if "interrupt" in line.lower()]


@pytest.mark.parametrize("n,rank", [(2, "1"), (3, "2"), (3, "1"), (2, "0"), (3, "all")])
def test_sigint_to_some_ranks_is_one_line_and_exit_130(tmp_path, n, rank):
    ck = tmp_path / "ck"
    fault = dict(FAULT="int", FAULT_RANK=rank, FAULT_STEP="3")     # before step 4
    p = job(n, "--steps", "12", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            cwd=tmp_path, env=fault)
    assert p.returncode == 130, p.stderr[-3000:]
    assert interrupt_lines(p.stderr) == [
        f"mpitrain: interrupted at step 4; the last checkpoint is step 2 in {ck} (--resume "
        f"continues from it)"], p.stderr[-3000:]
    assert sorted(q.name for q in ck.iterdir()) == ["ckpt-00000002.npz"]


def test_sigint_without_a_checkpoint_folder(tmp_path):
    p = job(2, "--steps", "12", cwd=tmp_path, env=dict(FAULT="int", FAULT_RANK="1",
                                                       FAULT_STEP="5"))
    assert p.returncode == 130, p.stderr[-3000:]
    assert interrupt_lines(p.stderr) == [
        "mpitrain: interrupted at step 6; no checkpoint was written"]


def test_sigint_too_late_for_the_last_steps_flags(tmp_path):
    """Weights mode exchanges flags every --average-every steps only: a SIGINT before the last
    step (10, not a multiple of 4) is carried by the exchange after the last step."""
    p = job(3, "--steps", "10", "--average", "weights", "--average-every", "4", cwd=tmp_path,
            env=dict(FAULT="int", FAULT_RANK="2", FAULT_STEP="9"))
    assert p.returncode == 130, p.stderr[-3000:]
    assert interrupt_lines(p.stderr) == [
        "mpitrain: interrupted at step 10; no checkpoint was written"], p.stderr[-3000:]


@pytest.mark.timeout(2 * LIMIT_S)
@pytest.mark.parametrize("n", [2, 3])
def test_ctrl_c_to_the_launcher_is_one_line_from_rank_0(tmp_path, n):
    ck = tmp_path / "ck"
    cmd = ["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", str(n), sys.executable, "-m",
           "mpitrain", *BASE, "--steps", "1000000", "--checkpoint-dir", str(ck),
           "--checkpoint-every", "4"]
    launcher = subprocess.Popen(cmd[4:], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + LIMIT_S - 20
        while not (ck / "ckpt-00000004.npz").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=LIMIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 130, err[-3000:]
    lines = interrupt_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(r"mpitrain: interrupted at step \d+; the last checkpoint is step \d+ in "
                        + re.escape(str(ck)) + r" \(--resume continues from it\)", lines[0])
