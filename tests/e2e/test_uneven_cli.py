"""--uneven through the CLI: each epoch's partial last global batch is trained, not dropped.

98 synthetic samples and a global batch of 12 leave a tail of 2 samples per epoch: at 3 ranks
(batch 4) rank 2 has no share of it and waits in mt.join while ranks 0 and 1 step; at 1 rank
(batch 12) the tail is one step of 2 samples. Both runs are the same training (float
tolerance), and it differs from the run that drops the tail.
"""
import json

import numpy as np
import pytest

from tests.support.launch import load_npz, run_mpitrain

BASE = ["--dataset", "synthetic", "--synthetic-samples", "98", "--hidden", "16",
        "--no-progress", "--momentum", "0.9", "--seed", "3", "--epochs", "2"]


def mpitrain(n, *flags, cwd, ok=True):
    return run_mpitrain(n, [*BASE, *flags], cwd, ok)


def test_uneven_trains_the_tail_and_three_ranks_match_one(tmp_path):
    mpitrain(3, "--batch-size", "4", "--uneven", "--save", "three.npz",
             "--metrics-json", "three.jsonl", cwd=tmp_path)
    mpitrain(1, "--batch-size", "12", "--uneven", "--save", "one.npz", cwd=tmp_path)
    three, one = load_npz(tmp_path / "three.npz"), load_npz(tmp_path / "one.npz")
    for k in one:
        assert np.allclose(three[k], one[k], rtol=1e-4, atol=2e-6), \
            f"{k}: max diff {np.max(np.abs(three[k] - one[k]))}"
    records = [json.loads(line) for line in open(tmp_path / "three.jsonl")]
    summary = records[-1]
    assert summary["steps"] == 2 * 9                  # 8 full steps + the tail, twice
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["step"] for r in epochs] == [9, 18]
    # not equal by accident: dropping the tail trains another model
    mpitrain(1, "--batch-size", "12", "--save", "dropped.npz", cwd=tmp_path)
    dropped = load_npz(tmp_path / "dropped.npz")
    assert any(not np.allclose(dropped[k], one[k], rtol=1e-3, atol=1e-5) for k in one)


@pytest.mark.parametrize("flags, message", [
    (["--average", "weights"], "--uneven needs --average gradients"),
    (["--accumulate", "2"], "--uneven with --accumulate 2"),
])
def test_uneven_with_what_it_cannot_weigh_is_one_line_and_exit_2(tmp_path, flags, message):
    p = mpitrain(2, "--batch-size", "4", "--uneven", *flags, "--save", "x.npz", cwd=tmp_path,
                 ok=False)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert any(message in line for line in lines), p.stderr
    assert not (tmp_path / "x.npz").exists()
