"""--accumulate K through the CLI: the global batch is ranks x batch x K, and the run is the run of
one rank with that whole global batch (same samples per step, float tolerance), also across a
resume; bad values are one line and exit 2.

Synthetic data of 128 samples and a global batch of 16 make 8 steps an epoch; 12 steps cross
an epoch boundary, and the resumed half starts mid-epoch.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, child_env, load_npz

BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--momentum", "0.9", "--seed", "5", "--steps", "12"]


def mpitrain(n, *flags, cwd, ok=True, env_extra=None):
    env = child_env(**(env_extra or {}))
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpitrain",
           *BASE, *flags]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    if ok:
        assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    return p


def assert_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-4, atol=2e-6), \
            f"{k}: max diff {np.max(np.abs(a[k] - b[k]))}"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulate_2_at_2_ranks_is_one_rank_with_the_whole_global_batch(tmp_path, optimizer):
    opt = ["--optimizer", optimizer] + (["--lr", "0.005"] if optimizer == "adam" else [])
    mpitrain(2, "--batch-size", "4", "--accumulate", "2", *opt, "--save", "acc.npz",
             "--metrics-json", "acc.jsonl", cwd=tmp_path)
    mpitrain(1, "--batch-size", "16", *opt, "--save", "one.npz", cwd=tmp_path)
    acc, one = load_npz(tmp_path / "acc.npz"), load_npz(tmp_path / "one.npz")
    assert_close(acc, one)
    summary = [json.loads(line) for line in open(tmp_path / "acc.jsonl")][-1]
    assert summary["global_batch"] == 16 and summary["steps"] == 12
    # not equal by accident: without accumulation the same flags train on half the samples
    mpitrain(2, "--batch-size", "4", *opt, "--save", "half.npz", cwd=tmp_path)
    half = load_npz(tmp_path / "half.npz")
    assert any(not np.allclose(half[k], one[k], rtol=1e-3, atol=1e-5) for k in one)


def test_resume_with_accumulation_bitwise_and_on_another_n(tmp_path):
    flags = ["--batch-size", "4", "--accumulate", "2", "--warmup-epochs", "1"]
    mpitrain(2, *flags, "--save", "full.npz", cwd=tmp_path)
    ck = tmp_path / "ck"
    mpitrain(2, *flags, "--steps", "5", "--checkpoint-dir", str(ck), cwd=tmp_path)
    p = mpitrain(2, *flags, "--checkpoint-dir", str(ck), "--resume", "--save", "resumed.npz",
                 cwd=tmp_path)
    assert "at step 5" in p.stdout
    full, resumed = load_npz(tmp_path / "full.npz"), load_npz(tmp_path / "resumed.npz")
    for k in full:
        assert np.array_equal(full[k], resumed[k]), k
    # the same checkpoint continued by one rank accumulating 4 passes of 4: global batch 16
    p = mpitrain(1, "--batch-size", "4", "--accumulate", "4", "--warmup-epochs", "1",
                 "--checkpoint-dir", str(ck), "--resume", "--save", "one.npz", cwd=tmp_path)
    assert "at step" in p.stdout
    assert_close(load_npz(tmp_path / "one.npz"), full)


@pytest.mark.parametrize("flags, env, message", [
    (["--accumulate", "0"], None, "--accumulate 0: must be >= 1"),
    (["--accumulate", "-3"], None, "--accumulate -3: must be >= 1"),
    (["--accumulate", "two"], None, "--accumulate='two': expected int"),
    ([], {"MPITRAIN_ACCUMULATE": "0"}, "--accumulate 0: must be >= 1"),
    (["--batch-size", "32", "--accumulate", "3"], None,
     "--batch-size 32 x 2 ranks x --accumulate 3 = 192 exceeds the 128 training samples"),
])
def test_bad_accumulate_is_one_line_and_exit_2(tmp_path, flags, env, message):
    p = mpitrain(2, *flags, cwd=tmp_path, ok=False, env_extra=env)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpitrain: error: {message}"), p.stderr
