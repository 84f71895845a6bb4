"""--deterministic through the CLI: N = 1, 2, 4 ranks at one global batch write byte-identical
--save files (MLP and LeNet, SGD with momentum and Adam; ResNet-20 with its BatchNorm running
statistics), also across a checkpoint/resume that changes N; the step records are the same numbers; N = 3 and the flags the mode cannot keep its
promise with are one line and exit 2.

Sizes: a global batch of 16 in the default 8 micro-shards of 2 samples; 10+ steps cross an
epoch end (64 or 128 samples). Launches are the cost here, so each case is one run per N.
"""
import json
import re
import subprocess
import sys

import pytest

from tests.support.launch import MPIEXEC, REPO, child_env, run_mpitrain

G = 16


def mpitrain(n, *flags, cwd, ok=True):
    return run_mpitrain(n, ["--dataset", "synthetic", "--no-progress", "--seed", "3",
                            "--deterministic", *flags], cwd, ok, timeout_s=150)


def steps(path):
    return [(r["step"], r["loss"], r["accuracy"]) for r in map(json.loads, open(path))
            if r["event"] in ("step", "epoch")]


CASES = {
    "mlp-sgd": ["--model", "mlp", "--hidden", "32,16", "--synthetic-samples", "128",
                "--optimizer", "sgd", "--momentum", "0.9", "--dropout", "0.25", "--steps", "12"],
    "mlp-adam": ["--model", "mlp", "--hidden", "32", "--synthetic-samples", "128",
                 "--optimizer", "adam", "--lr", "0.003", "--steps", "12"],
    "lenet-sgd": ["--model", "lenet", "--synthetic-samples", "64", "--optimizer", "sgd",
                  "--momentum", "0.9", "--lr", "0.02", "--augment", "crop,flip", "--steps", "10"],
    "lenet-adam": ["--model", "lenet", "--synthetic-samples", "64", "--optimizer", "adam",
                   "--lr", "0.001", "--steps", "10"],
    # BatchNorm: running statistics replayed in micro-shard order (deterministic.py)
    "resnet20-sgd": ["--model", "resnet20", "--synthetic-samples", "64", "--optimizer", "sgd",
                     "--momentum", "0.9", "--lr", "0.05", "--weight-decay", "5e-4",
                     "--steps", "10"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_two_and_four_ranks_save_the_same_bytes(tmp_path, case):
    files = {}
    for n in (1, 2, 4):
        mpitrain(n, *CASES[case], "--batch-size", str(G // n), "--save", f"n{n}.npz",
                 "--metrics-json", f"n{n}.jsonl", cwd=tmp_path)
        files[n] = (tmp_path / f"n{n}.npz").read_bytes()
    assert files[2] == files[1] and files[4] == files[1]
    # the records' loss and accuracy are summed in micro-shard order: the same numbers too
    assert steps(tmp_path / "n4.jsonl") == steps(tmp_path / "n1.jsonl")


def test_resume_on_another_n_is_the_uninterrupted_run(tmp_path):
    flags = CASES["mlp-sgd"][:-2] + ["--warmup-epochs", "1"]
    mpitrain(1, *flags, "--batch-size", str(G), "--steps", "20", "--save", "whole.npz",
             cwd=tmp_path)
    ck = str(tmp_path / "ck")
    mpitrain(2, *flags, "--batch-size", str(G // 2), "--steps", "10", "--checkpoint-dir", ck,
             cwd=tmp_path)
    p = mpitrain(4, *flags, "--batch-size", str(G // 4), "--steps", "20", "--checkpoint-dir",
                 ck, "--resume", "--save", "resumed.npz", cwd=tmp_path)
    assert "at step 10" in p.stdout
    assert (tmp_path / "resumed.npz").read_bytes() == (tmp_path / "whole.npz").read_bytes()


def test_resuming_with_other_micro_shards_warns(tmp_path):
    """Allowed (the job goes on), but the bits change: one warning line says so."""
    flags = ["--synthetic-samples", "64", "--hidden", "8", "--batch-size", "8"]
    ck = str(tmp_path / "ck")
    mpitrain(1, *flags, "--steps", "2", "--checkpoint-dir", ck, cwd=tmp_path)
    p = mpitrain(1, *flags, "--steps", "3", "--checkpoint-dir", ck, "--resume",
                 cwd=tmp_path)
    assert "warning" not in p.stderr                    # same --micro-shards: no warning
    p = mpitrain(1, *flags, "--steps", "4", "--micro-shards", "4", "--checkpoint-dir", ck,
                 "--resume", cwd=tmp_path)
    assert "was written with --micro-shards 8; continuing with --micro-shards 4" in p.stderr


@pytest.mark.parametrize("n, flags, message", [
    (3, ["--batch-size", "8"], "--deterministic needs a power-of-two number of ranks dividing "
                               "--micro-shards 8, got 3 ranks"),
    (2, ["--batch-size", "8", "--micro-shards", "2", "--model", "mlp"], None),
    (2, ["--batch-size", "3"], "--deterministic: the global batch of 6 samples does not divide "
                               "into --micro-shards 8"),
    (2, ["--batch-size", "6"], "--deterministic: the global batch of 12 samples does not divide "
                               "into --micro-shards 8 equal micro-shards; --micro-shards 4 does"),
    (1, ["--micro-shards", "6"], "--micro-shards 6: must be a power of two"),
    (1, ["--average", "weights"], "--deterministic does not support --average weights"),
    (1, ["--fp16-allreduce"], "--deterministic does not support --fp16-allreduce"),
    (1, ["--model", "resnet20", "--sync-bn"], "--deterministic does not support --sync-bn"),
])
def test_what_it_cannot_promise_is_one_line_and_exit_2(tmp_path, n, flags, message):
    if message is None:                       # a valid combination: M = N = 2, k = 1 pass
        mpitrain(n, "--synthetic-samples", "64", "--hidden", "8", "--steps", "2", *flags,
                 "--save", "ok.npz", cwd=tmp_path)
        return
    p = mpitrain(n, "--synthetic-samples", "64", "--steps", "2", *flags, "--save", "x.npz",
                 cwd=tmp_path, ok=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpitrain: error: {message}"), p.stderr
    assert not (tmp_path / "x.npz").exists()


def test_own_loop_example_of_the_docs_saves_the_same_bytes_at_one_and_two_ranks(tmp_path):
    """docs/byo_loop.md's ``deterministic=True`` loop, as written."""
    doc = (REPO / "docs" / "byo_loop.md").read_text()
    code, = re.findall(r"```python deterministic\n(.*?)```", doc, flags=re.S)
    (tmp_path / "det.py").write_text(code)
    for n in (1, 2):
        p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable,
                            "det.py"], cwd=tmp_path, env=child_env(settings=True),
                           capture_output=True, text=True, timeout=150)
        assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "params-2.npz").read_bytes() == (tmp_path / "params-1.npz").read_bytes()
