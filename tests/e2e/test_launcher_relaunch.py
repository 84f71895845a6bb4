"""mpitrainrun and what a relaunch can do: ``python -m mpitrain --checkpoint-dir`` relaunched
after a killed rank resumes from its newest checkpoint without --resume-if-exists (to the
uninterrupted run's bytes); a job that exits 2 (bad input) is not restarted; a job that never
reads its checkpoints is told once, at the first restart, that it starts over."""
import subprocess
import sys

import numpy as np

from tests.support.launch import MPIEXEC, REPO, child_env, load_npz

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--seed", "5", "--momentum", "0.9", "--steps", "16"]
LIMIT_S = 240
STARTS_OVER = "the restart begins from the start"


def launcher(*command, flags=(), cwd, env=None):
    cmd = ["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", "mpitrain.run",
           "--mpiexec", MPIEXEC, "--restart-delay", "0.2", *flags, *command]
    p = subprocess.run(cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True,
                       text=True, timeout=LIMIT_S + 30)
    assert p.returncode != 124, f"timed out: {cmd}\n{p.stderr[-3000:]}"
    return p


def test_a_relaunched_cli_job_resumes_without_being_told(tmp_path):
    whole = subprocess.run(["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", "2",
                            sys.executable, "-m", "mpitrain", *BASE, "--save", "whole.npz"],
                           cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    fault = dict(FAULT="kill", FAULT_RANK="1", FAULT_STEP="10")
    p = launcher(sys.executable, FAULTS, *BASE, "--checkpoint-dir", "ck",
                 "--checkpoint-every", "4", "--save", "out.npz",
                 flags=["-np", "2", "--max-restarts", "1"], cwd=tmp_path, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 1 of 1" in p.stderr and STARTS_OVER not in p.stderr
    assert "mpitrain: relaunch 1 (mpitrainrun): resuming from the newest checkpoint in ck" \
        in p.stdout
    assert "mpitrain: resumed from ck/ckpt-00000008.npz at step 8" in p.stdout, p.stdout
    out, want = load_npz(tmp_path / "out.npz"), load_npz(tmp_path / "whole.npz")
    assert all(np.array_equal(out[k], want[k]) for k in want)


def test_bad_input_is_not_restarted(tmp_path):
    p = launcher(sys.executable, "-m", "mpitrain", *BASE, "--lr", "-1",
                 flags=["-np", "2", "--max-restarts", "3"], cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "launch 1" not in p.stderr and "restart 1 of" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "mpitrainrun: the job exited 2, bad input: a restart cannot mend it, so it is not "
        "restarted")


def test_a_job_that_reads_no_checkpoint_is_told_once_that_it_starts_over(tmp_path):
    script = tmp_path / "own.py"
    script.write_text("import os, sys\n"
                      "launch = int(os.environ['MPITRAIN_RESTART_COUNT'])\n"
                      "sys.exit(1 if launch < 2 else 0)\n")
    p = launcher(sys.executable, str(script), flags=["-np", "1", "--max-restarts", "2"],
                 cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 2 of 2" in p.stderr
    assert p.stderr.count(STARTS_OVER) == 1
