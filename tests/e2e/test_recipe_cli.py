"""The training recipe through ``mpiexec -n N python -m mpitrain``: --augment crop,flip with
--lr-schedule cosine on synthetic data at 2 ranks (lr per step, N-independence, resume).

Synthetic data of 128 samples, (1, 28, 28) images for an MLP with 16 hidden units, global batch
16: 8 steps an epoch, 16 in the 2-epoch run.
"""
import json
import math
import shutil
import subprocess
import sys

import numpy as np

from tests.support.launch import MPIEXEC, child_env, load_npz

BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--epochs", "2", "--seed", "5", "--momentum", "0.9",
        "--weight-decay", "5e-4", "--augment", "crop,flip", "--lr-schedule", "cosine"]


def mpitrain(n, *flags, cwd):
    env = child_env()
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpitrain",
           *BASE, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    return p


def test_augmented_cosine_run_at_2_ranks_equals_1_rank_and_resumes_bitwise(tmp_path):
    metrics = tmp_path / "m.jsonl"
    ck = tmp_path / "ck"
    mpitrain(2, "--batch-size", "8", "--save", "two.npz", "--metrics-json", str(metrics),
             "--checkpoint-dir", str(ck), "--checkpoint-every", "12", cwd=tmp_path)
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    assert recs[-1]["steps"] == 16 and len(steps) == 16
    for r in steps:   # the lr of step s (t = s - 1 steps taken before it), PyTorch's formula
        want = 0.05 * (1 + math.cos(math.pi * (r["step"] - 1) / 16)) / 2
        assert abs(r["lr"] - want) < 1e-12, (r["step"], r["lr"], want)
    # (no accuracy claim: synthetic prototypes are pixel noise, which shifts and flips scramble)

    # Same global batch (augmented identically, sample by sample) on 1 rank x 16.
    mpitrain(1, "--batch-size", "16", "--save", "one.npz", cwd=tmp_path)
    two, one = load_npz(tmp_path / "two.npz"), load_npz(tmp_path / "one.npz")
    for k in two:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # Without augmentation the run differs: the flags above did change the batches.
    mpitrain(1, "--batch-size", "16", "--augment", "none", "--save", "plain.npz", cwd=tmp_path)
    plain = load_npz(tmp_path / "plain.npz")
    assert any(np.abs(plain[k] - one[k]).max() > 1e-3 for k in one)

    # Resume mid-epoch 2 from step 12: schedule, augmentation and momentum continue exactly.
    again = tmp_path / "again"
    again.mkdir()
    from mpitrain import checkpoint
    shutil.copy(checkpoint.checkpoint_path(ck, 12), again)
    p = mpitrain(2, "--batch-size", "8", "--checkpoint-dir", str(again), "--resume",
                 "--save", "resumed.npz", cwd=tmp_path)
    assert "at step 12" in p.stdout
    resumed = load_npz(tmp_path / "resumed.npz")
    for k in two:
        assert np.array_equal(resumed[k], two[k]), k
