"""``python -m mpitrain --sharding optimizer|gradients|parameters``: the parameters of the
unsharded run, bit for bit, at N = 2 and 3 (the ring at 3); a sharded job's checkpoint holds the
unsharded state, so an unsharded job resumes from it to the uninterrupted run's bits, and a
sharded job on another N resumes from it too; a GPT with sharded parameters evaluates, samples
and saves as the unsharded one; what cannot be sharded is one line and exit code 2."""
import subprocess
import sys

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, REPO, child_env, load_npz, run_mpitrain
from tests.support.texts import text_file

TINY = ["--dataset", "synthetic", "--synthetic-samples", "256", "--hidden", "16",
        "--batch-size", "8", "--no-progress", "--optimizer", "adam", "--lr", "0.01",
        "--steps", "12"]


RING = {"MPITRAIN_ALLREDUCE": "ring"}


@pytest.mark.parametrize("clip", [[], ["--clip-grad-norm", "0.05"]], ids=["plain", "clip"])
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_run_ends_on_the_unsharded_bits(tmp_path, n, clip):
    for sharding in ("optimizer", "gradients", "parameters", "none"):
        run_mpitrain(n, [*TINY, *clip, "--sharding", sharding, "--save", f"{sharding}.npz"],
                     tmp_path, env=RING)
    whole = load_npz(tmp_path / "none.npz")
    for sharding in ("optimizer", "gradients", "parameters"):
        sharded = load_npz(tmp_path / f"{sharding}.npz")
        assert sharded.keys() == whole.keys()
        for key in whole:
            assert sharded[key].tobytes() == whole[key].tobytes(), (sharding, key)


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_a_sharded_checkpoint_resumes_unsharded_and_on_another_n(tmp_path, sharding):
    ck = ["--checkpoint-dir", "ck", "--checkpoint-every", "6"]
    run_mpitrain(3, [*TINY, "--sharding", sharding, *ck, "--save", "whole.npz"], tmp_path,
                 env=RING)
    # the run again from its step-6 checkpoint, unsharded: the same 6 last steps
    (tmp_path / "ck" / "ckpt-00000012.npz").unlink()
    run_mpitrain(3, [*TINY, "--sharding", "none", *ck, "--resume", "--save", "resumed.npz"],
                 tmp_path, env=RING)
    resumed, whole = load_npz(tmp_path / "resumed.npz"), load_npz(tmp_path / "whole.npz")
    for key in whole:
        assert resumed[key].tobytes() == whole[key].tobytes(), key
    # and on two ranks, sharded: it loads its slices of the same state and trains on
    run_mpitrain(2, [*TINY, "--steps", "14", "--sharding", sharding, *ck, "--resume",
                     "--save", "other_n.npz"], tmp_path)
    assert all(np.isfinite(v).all() for v in load_npz(tmp_path / "other_n.npz").values())


@pytest.mark.parametrize("flags,message", [
    (["--sharding", "gradients", "--average", "weights"], "has no gradients to shard"),
    (["--sharding", "parameters", "--average", "weights"], "has no gradients to shard"),
])
def test_what_cannot_be_sharded_is_one_line_and_exit_2(tmp_path, flags, message):
    p = run_mpitrain(2, [*TINY, *flags], tmp_path, ok=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], p.stderr[-2000:]


def test_the_launcher_restarts_a_killed_sharded_job_to_the_same_bits(tmp_path):
    """SIGKILL of rank 1 before step 8 (tests/support/faults.py); mpitrainrun restarts the job,
    which resumes from the step-6 checkpoint and ends on the uninterrupted run's bits."""
    flags = [*TINY, "--sharding", "gradients"]
    run_mpitrain(2, [*flags, "--save", "whole.npz"], tmp_path)
    cmd = ["timeout", "-k", "5", "240", sys.executable, "-m", "mpitrain.run", "--mpiexec",
           MPIEXEC, "--restart-delay", "0.2", "-np", "2", "--max-restarts", "1",
           sys.executable, str(REPO / "tests" / "support" / "faults.py"), *flags,
           "--checkpoint-dir", "ck", "--checkpoint-every", "3", "--resume-if-exists",
           "--save", "restarted.npz"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=270,
                       env=child_env(FAULT="kill", FAULT_RANK="1", FAULT_STEP="7"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 1 of 1" in p.stderr
    assert "resumed from" in p.stdout and "at step 6" in p.stdout, p.stdout[-2000:]
    whole, restarted = load_npz(tmp_path / "whole.npz"), load_npz(tmp_path / "restarted.npz")
    for key in whole:
        assert restarted[key].tobytes() == whole[key].tobytes(), key


def test_deterministic_sharded_checkpoint_resumes_on_any_n_to_the_same_bytes(tmp_path):
    """--deterministic --sharding gradients at N = 4, checkpointed at step 6; resumed at N = 2
    with sharded parameters and at N = 1 unsharded, each ends on the bytes of the uninterrupted
    run (whose bytes are those of an unsharded one-rank run too)."""
    flags = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
             "--no-progress", "--seed", "3", "--optimizer", "adam", "--lr", "0.01",
             "--deterministic", "--global-batch-size", "16", "--steps", "12"]
    ck = ["--checkpoint-dir", "ck", "--checkpoint-every", "6"]
    run_mpitrain(4, [*flags, "--sharding", "gradients", *ck, "--save", "whole.npz"], tmp_path,
                 timeout_s=150)
    pieces = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "ckpt-00000006.shard-00003-of-00004.npz" in pieces, pieces
    (tmp_path / "ck" / "ckpt-00000012.npz").unlink()
    p = run_mpitrain(2, [*flags, "--sharding", "parameters", *ck, "--resume", "--save",
                         "two.npz"], tmp_path, timeout_s=150)
    assert "at step 6" in p.stdout, p.stdout[-2000:]
    (tmp_path / "ck" / "ckpt-00000012.npz").unlink()        # the N = 2 run's: from 6 again
    p = run_mpitrain(1, [*flags, "--sharding", "none", *ck, "--resume", "--save", "one.npz"],
                     tmp_path, timeout_s=150)
    assert "at step 6" in p.stdout, p.stdout[-2000:]
    run_mpitrain(1, [*flags, "--save", "plain.npz"], tmp_path, timeout_s=150)
    whole = (tmp_path / "whole.npz").read_bytes()
    assert (tmp_path / "two.npz").read_bytes() == whole
    assert (tmp_path / "one.npz").read_bytes() == whole
    assert (tmp_path / "plain.npz").read_bytes() == whole


def test_a_gpt_with_sharded_parameters_evaluates_samples_and_saves_the_unsharded_bits(
        tmp_path):
    text = text_file(tmp_path)
    gpt = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
           "--block-size", "16", "--optimizer", "adamw", "--lr", "1e-2", "--clip-grad-norm",
           "1.0", "--dropout", "0", "--eval-batches", "2", "--eval-every", "5", "--no-progress",
           "--dataset", f"text:{text}", "--batch-size", "4", "--steps", "10", "--seed", "1",
           "--sample", "40", "--temperature", "0"]
    out = {}
    for sharding in ("parameters", "none"):
        p = run_mpitrain(2, [*gpt, "--sharding", sharding, "--save", f"{sharding}.npz",
                             "--metrics-json", f"{sharding}.jsonl"], tmp_path)
        out[sharding] = p.stdout.split("temperature 0):\n", 1)[1]
    sharded, whole = load_npz(tmp_path / "parameters.npz"), load_npz(tmp_path / "none.npz")
    for key in whole:
        assert sharded[key].tobytes() == whole[key].tobytes(), key
    assert out["parameters"] == out["none"] and len(out["none"].rstrip("\n")) == 40
    evals = [(tmp_path / f"{s}.jsonl").read_text().count('"eval"') for s in out]
    assert evals[0] == evals[1] > 0


def test_an_uneven_tail_with_sharding_ends_on_the_unsharded_bits(tmp_path):
    """98 samples, a global batch of 12 at 3 ranks: the tail's 2 samples leave rank 2 without
    a share; it joins with its sharded optimizer and steps its share as the others step."""
    flags = ["--dataset", "synthetic", "--synthetic-samples", "98", "--hidden", "16",
             "--no-progress", "--optimizer", "adam", "--lr", "0.01", "--seed", "3",
             "--epochs", "2", "--batch-size", "4", "--uneven", "--clip-grad-norm", "0.05"]
    for sharding in ("optimizer", "gradients", "parameters", "none"):
        run_mpitrain(3, [*flags, "--sharding", sharding, "--save", f"{sharding}.npz"],
                     tmp_path, env=RING)
    whole = load_npz(tmp_path / "none.npz")
    for sharding in ("optimizer", "gradients", "parameters"):
        sharded = load_npz(tmp_path / f"{sharding}.npz")
        for key in whole:
            assert sharded[key].tobytes() == whole[key].tobytes(), (sharding, key)
