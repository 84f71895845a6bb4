"""Checkpoint guarantees through the CLI, compared on the final parameters written by --save.

(a) interrupted + resumed == uninterrupted, bitwise, at the same N;
(b) checkpointed at N=2, resumed at N=1 with twice the per-rank batch: within float tolerance;
(c) two reruns with the same seed and N are bitwise identical.

Synthetic data of 128 samples and a global batch of 16 make 8 steps an epoch; the jobs run 12
steps and stop the first half at step 5, so a resume starts mid-epoch and crosses an epoch
boundary, with momentum and an lr warm-up whose state must survive the restart.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, child_env, load_npz

BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--warmup-epochs", "1", "--momentum", "0.9", "--seed", "3"]


def mpitrain(n, *flags, cwd):
    env = child_env()
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpitrain",
           *BASE, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    return p


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert np.array_equal(a[k], b[k]), f"{k}: max diff {np.max(np.abs(a[k] - b[k]))}"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_interrupted_and_resumed_equals_uninterrupted_bitwise(tmp_path, optimizer):
    opt = ["--optimizer", optimizer] + (["--lr", "0.005"] if optimizer == "adam" else [])
    mpitrain(2, "--batch-size", "8", "--steps", "12", *opt, "--save", "full.npz",
             cwd=tmp_path)
    ck = tmp_path / "ck"
    mpitrain(2, "--batch-size", "8", "--steps", "5", *opt, "--checkpoint-dir", str(ck),
             cwd=tmp_path)
    p = mpitrain(2, "--batch-size", "8", "--steps", "12", *opt, "--checkpoint-dir", str(ck),
                 "--resume", "--save", "resumed.npz", cwd=tmp_path)
    assert "resumed from" in p.stdout and "at step 5" in p.stdout
    full, resumed = load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "resumed.npz")
    assert_bitwise(full, resumed)
    # Not trivially equal: training moved the parameters between step 5 and step 12.
    first = params_at_step(ck, 5)
    assert any(not np.array_equal(first[k], full[k]) for k in full)


def params_at_step(ck, step):
    from mpitrain import checkpoint
    return checkpoint.load(checkpoint.checkpoint_path(ck, step)).params


def test_a_killed_job_resumes_bitwise(tmp_path):
    """A real interruption: the job is killed after its step-4 checkpoint appears."""
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--save", "full.npz", cwd=tmp_path)
    ck = tmp_path / "ck"
    env = child_env()
    # --steps far beyond 12 so the job is still running when it is killed.
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain",
           *BASE, "--batch-size", "8", "--steps", "100000", "--checkpoint-dir", str(ck),
           "--checkpoint-every", "4"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Kill as soon as the step-4 checkpoint exists (written atomically, so complete). Poll
        # fast: an idle machine runs this tiny job at < 1 ms per step, and only the newest 3
        # checkpoints are kept, so step 4's is gone about 12 steps later.
        deadline = time.time() + 100
        while not (ck / "ckpt-00000004.npz").exists() and time.time() < deadline:
            time.sleep(0.0005)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert (ck / "ckpt-00000004.npz").exists(), "the step-4 checkpoint was never seen"
    # Keep only the step-4 checkpoint, as if the job had died right after writing it.
    for name in os.listdir(ck):
        if name != "ckpt-00000004.npz":
            os.unlink(ck / name)
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
             "--save", "resumed.npz", cwd=tmp_path)
    assert_bitwise(load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "resumed.npz"))


def test_b_checkpoint_at_2_ranks_resumes_at_1_rank_with_double_batch(tmp_path):
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--save", "n2.npz", cwd=tmp_path)
    ck = tmp_path / "ck"
    mpitrain(2, "--batch-size", "8", "--steps", "5", "--checkpoint-dir", str(ck), cwd=tmp_path)
    mpitrain(1, "--batch-size", "16", "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
             "--save", "n1.npz", cwd=tmp_path)
    n2, n1 = load_npz(tmp_path / "n2.npz"), load_npz(tmp_path / "n1.npz")
    base = params_at_step(ck, 5)
    for k in n2:
        moved = np.max(np.abs(n2[k] - base[k]))
        diff = np.max(np.abs(n1[k] - n2[k]))
        assert diff <= 1e-5 * max(1.0, np.max(np.abs(n2[k]))), (k, diff)
        assert diff < 1e-2 * moved or moved == 0, (k, diff, moved)


def test_c_reruns_are_bitwise_identical(tmp_path):
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--save", "one.npz", cwd=tmp_path)
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--save", "two.npz", cwd=tmp_path)
    assert_bitwise(load_npz(tmp_path / "one.npz"), load_npz(tmp_path / "two.npz"))
    # And the seed matters: another seed gives other parameters.
    mpitrain(2, "--batch-size", "8", "--steps", "12", "--save", "other.npz", "--seed", "4",
             cwd=tmp_path)
    other = load_npz(tmp_path / "other.npz")
    one = load_npz(tmp_path / "one.npz")
    assert any(not np.array_equal(one[k], other[k]) for k in one)


def test_resume_on_more_ranks_when_the_epoch_rest_is_shorter_than_the_new_global_batch(tmp_path):
    # 128 samples, global batch 16: 7 steps leave 16 samples in epoch 0. Three ranks x 8 = 24
    # cannot take a batch there, so they start epoch 1, which holds exactly 5 batches of 24.
    ck = tmp_path / "ck"
    mpitrain(2, "--batch-size", "8", "--steps", "7", "--checkpoint-dir", str(ck), cwd=tmp_path)
    mpitrain(3, "--batch-size", "8", "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
             "--metrics-json", "m.jsonl", cwd=tmp_path)
    summary = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert (summary["steps"], summary["steps_run"], summary["ranks"]) == (12, 5, 3)
    assert summary["epoch"] == 2.0


def test_weights_mode_checkpoint_holds_one_model_and_resumes(tmp_path):
    ck = tmp_path / "ck"
    mpitrain(2, "--batch-size", "8", "--steps", "6", "--average", "weights", "--average-every",
             "3", "--checkpoint-every", "3", "--checkpoint-dir", str(ck), "--save", "w.npz",
             cwd=tmp_path)
    from mpitrain import checkpoint
    last = checkpoint.load(checkpoint.checkpoint_path(ck, 6))
    assert_bitwise(last.params, load_npz(tmp_path / "w.npz"))   # averaged at step 6: one model
    bufs = [k for k in last.optimizer_state if k.startswith("momentum_buffer")]
    assert bufs and all(np.isfinite(last.optimizer_state[k]).all() for k in bufs)
    # Resuming (same N) continues from there to step 9 without error.
    mpitrain(2, "--batch-size", "8", "--steps", "9", "--average", "weights", "--average-every",
             "3", "--checkpoint-dir", str(ck), "--resume", cwd=tmp_path)
    assert checkpoint.load(checkpoint.checkpoint_path(ck, 9)).step == 9


def test_weights_mode_final_average_is_checkpointed_and_the_schedule_survives_resume(tmp_path):
    """--steps 7 with --average-every 3 ends with an extra average at step 7: that one model is
    checkpointed, and a job resumes from it (that the resumed schedule averages at 9, not at
    7 + 3, is checked in tests/mpi/test_distributed.py)."""
    ck = tmp_path / "ck"
    flags = ["--batch-size", "8", "--average", "weights", "--average-every", "3",
             "--checkpoint-every", "3", "--checkpoint-dir", str(ck)]
    mpitrain(2, *flags, "--steps", "7", "--save", "w7.npz", cwd=tmp_path)
    from mpitrain import checkpoint
    assert_bitwise(checkpoint.load(checkpoint.checkpoint_path(ck, 7)).params,
                   load_npz(tmp_path / "w7.npz"))
    mpitrain(2, *flags, "--steps", "9", "--resume", "--save", "w9.npz", cwd=tmp_path)
    assert_bitwise(checkpoint.load(checkpoint.checkpoint_path(ck, 9)).params,
                   load_npz(tmp_path / "w9.npz"))
