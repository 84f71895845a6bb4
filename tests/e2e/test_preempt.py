"""Preemption: a stop signal to one rank (or to the launcher) stops every rank after the same
step, with a checkpoint, exit code 32; --resume then ends bitwise where an uninterrupted run
ends.

The signal is sent at an exact step by tests/support/faults.py (no timing), except in the
launcher test, which waits for a checkpoint file before signalling and compares against an
uninterrupted run of whatever length that gives.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, REPO, child_env, load_npz

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--batch-size", "8", "--seed", "3", "--momentum", "0.9"]
LIMIT_S = 150


def job(n, *flags, cwd, env=None, script=None, ok=True):
    program = [sys.executable, FAULTS] if script else [sys.executable, "-m", "mpitrain"]
    cmd = ["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", str(n), *program, *BASE, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True,
                       text=True, timeout=LIMIT_S + 30)
    if ok:
        assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    return p


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


MODES = {
    # (flags, steps done when the signal comes, the step the job stops after, flags of the
    # checkpointed runs)
    "gradients": ([], 5, 6, []),
    "deterministic": (["--deterministic"], 5, 6, []),
    # no agreement per step in weights mode: the stop waits for the next average (step 6);
    # momentum stays per rank there (a checkpoint holds its mean), so none, to compare bits
    "weights": (["--average", "weights", "--average-every", "3", "--momentum", "0"], 4, 6, []),
    # a background write of step 4 before the stop's own checkpoint
    "async": (["--checkpoint-async"], 5, 6, ["--checkpoint-every", "4"]),
}


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_to_one_rank_checkpoints_at_the_next_step_and_resume_is_bitwise(tmp_path,
                                                                                mode):
    flags, signalled_at, stopped_at, every = MODES[mode]
    job(2, *flags, "--steps", "12", "--save", "full.npz", cwd=tmp_path)
    ck = tmp_path / "ck"
    flags = flags + every
    fault = dict(FAULT="term", FAULT_RANK="1", FAULT_STEP=str(signalled_at))
    p = job(2, *flags, "--steps", "12", "--checkpoint-dir", str(ck), cwd=tmp_path, env=fault,
            script=True, ok=False)
    assert p.returncode == 32, p.stderr[-3000:]
    line = (f"mpitrain: preempted (SIGTERM) after step {stopped_at}; the checkpoint of step "
            f"{stopped_at} is in {ck} (--resume continues from it)")
    assert p.stderr.strip().splitlines()[-1] == line, p.stderr[-3000:]
    names = sorted(os.listdir(ck))
    assert names[-1] == f"ckpt-{stopped_at:08d}.npz" and not any("tmp" in n for n in names)
    p = job(2, *flags, "--steps", "12", "--checkpoint-dir", str(ck), "--resume", "--save",
            "resumed.npz", cwd=tmp_path)
    assert f"at step {stopped_at}" in p.stdout
    assert_bitwise(load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "resumed.npz"))


def test_preempted_without_a_checkpoint_folder_says_so(tmp_path):
    fault = dict(FAULT="term", FAULT_RANK="0", FAULT_STEP="2")
    p = job(2, "--steps", "12", cwd=tmp_path, env=fault, script=True, ok=False)
    assert p.returncode == 32
    assert p.stderr.strip().splitlines()[-1] == ("mpitrain: preempted (SIGTERM) after step 3; "
                                                 "no checkpoint was written (no "
                                                 "--checkpoint-dir)")


def test_preempt_signals_none_lets_the_signal_end_the_job(tmp_path):
    fault = dict(FAULT="term", FAULT_RANK="1", FAULT_STEP="2")
    p = job(2, "--steps", "12", "--preempt-signals", "none", cwd=tmp_path, env=fault,
            script=True, ok=False)
    assert p.returncode not in (0, 32, 124, 137), p.stderr[-2000:]


@pytest.mark.timeout(2 * LIMIT_S)
def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    ck = tmp_path / "ck"
    cmd = ["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", "mpitrain.run", "-np", "2",
           "--mpiexec", MPIEXEC, sys.executable, "-m", "mpitrain", *BASE, "--steps", "1000000",
           "--checkpoint-dir", str(ck), "--checkpoint-every", "4"]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + LIMIT_S - 20
        while not (ck / "ckpt-00000004.npz").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=LIMIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 32, err[-3000:]
    from mpitrain import checkpoint
    last = checkpoint.load(checkpoint.list_checkpoints(ck)[-1][1])    # whole, checksum valid
    assert f"preempted (SIGTERM) after step {last.step};" in err
    # the stop is where the resume starts: continuing it 4 steps equals 4 more uninterrupted
    end = str(last.step + 4)
    job(2, "--steps", end, "--checkpoint-dir", str(ck), "--resume", "--save", "resumed.npz",
        cwd=tmp_path)
    job(2, "--steps", end, "--save", "full.npz", cwd=tmp_path)
    assert_bitwise(load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "resumed.npz"))
