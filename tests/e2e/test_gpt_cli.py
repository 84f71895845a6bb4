"""--model gpt on --dataset text:PATH through the CLI: it trains (the validation loss falls well
below a uniform guess), reports val_loss and step_time_ms, prints a sample; --deterministic
writes the same bytes at N = 1, 2, 4 and a resume on another N continues the run exactly; bad
text, shapes and checkpoints are one line and exit 2. Also --dataset npz:PATH for own arrays.

Sizes: a tiny GPT (1-2 layers, width 16, context 16) on a 6 KB generated text, so a run is
launch time plus a few seconds.
"""
import json
import math

import numpy as np
import pytest

from tests.support.launch import run_mpitrain
from tests.support.tensorboard_events import read_scalars
from tests.support.texts import text_file

GPT = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size",
       "16", "--optimizer", "adamw", "--lr", "1e-2", "--betas", "0.9,0.99", "--weight-decay",
       "0.1", "--warmup-steps", "5", "--lr-schedule", "cosine", "--min-lr", "1e-3",
       "--clip-grad-norm", "1.0", "--dropout", "0", "--eval-batches", "4", "--threads", "1",
       "--no-progress"]


def mpitrain(n, *flags, cwd, ok=True):
    return run_mpitrain(n, list(flags), cwd, ok, timeout_s=240)


def records(path, event):
    return [r for r in map(json.loads, open(path)) if r["event"] == event]


def test_gpt_trains_on_a_text_file_and_prints_a_sample(tmp_path):
    text = text_file(tmp_path)
    p = mpitrain(2, *GPT, "--dataset", f"text:{text}", "--batch-size", "4", "--steps", "60",
                 "--seed", "1", "--metrics-json", "m.jsonl", "--sample", "80",
                 "--temperature", "0", "--tensorboard", "tb", cwd=tmp_path)
    summary = records(tmp_path / "m.jsonl", "summary")[-1]
    vocab = len(set(text.read_text()))
    assert summary["val_loss"] < 0.6 * math.log(vocab)          # uniform guess: log(V)
    assert summary["step_time_ms"] > 0 and summary["global_batch"] == 8
    assert "test_accuracy" not in summary and 0 < summary["val_accuracy"] <= 1
    steps = records(tmp_path / "m.jsonl", "step")
    assert all(r["grad_norm"] > 0 and r["tokens_per_sec"] > 0 for r in steps)
    scalars = read_scalars(tmp_path / "tb")           # the same records, as TensorBoard's
    logged = {(tag, step) for tag, _, step in scalars}
    assert {("train/loss", r["step"]) for r in steps} <= logged
    evals = records(tmp_path / "m.jsonl", "eval")
    assert evals and {("eval/val_loss", r["step"]) for r in evals} <= logged
    assert "sample (80 tokens, temperature 0)" in p.stdout
    sample = p.stdout.split("temperature 0):\n", 1)[1]
    assert len(sample.rstrip("\n")) >= 40 and set(sample) <= set(text.read_text()) | {"\n"}


def test_deterministic_gpt_saves_the_same_bytes_at_one_two_and_four_ranks(tmp_path):
    text = text_file(tmp_path)
    files = {}
    for n in (1, 2, 4):
        mpitrain(n, *GPT, "--dataset", f"text:{text}", "--batch-size", str(8 // n),
                 "--steps", "6", "--seed", "2", "--deterministic", "--save", f"n{n}.npz",
                 cwd=tmp_path)
        files[n] = (tmp_path / f"n{n}.npz").read_bytes()
    assert files[1] == files[2] == files[4]


def test_resume_on_another_number_of_ranks_continues_exactly(tmp_path):
    text = text_file(tmp_path)
    # a constant lr after the warm-up: a cosine's length is --steps, which the legs change
    recipe = " ".join(GPT).replace("--lr-schedule cosine --min-lr 1e-3", "").split()
    flags = [*recipe, "--dataset", f"text:{text}", "--seed", "4", "--deterministic"]
    mpitrain(1, *flags, "--batch-size", "8", "--steps", "8", "--save", "whole.npz",
             cwd=tmp_path)
    ck = str(tmp_path / "ck")
    mpitrain(2, *flags, "--batch-size", "4", "--steps", "4", "--checkpoint-dir", ck,
             cwd=tmp_path)
    p = mpitrain(4, *flags, "--batch-size", "2", "--steps", "8", "--checkpoint-dir", ck,
                 "--resume", "--save", "resumed.npz", cwd=tmp_path)
    assert "at step 4" in p.stdout
    assert (tmp_path / "resumed.npz").read_bytes() == (tmp_path / "whole.npz").read_bytes()


def _refused(tmp_path, *flags, n=1):
    p = mpitrain(n, *flags, cwd=tmp_path, ok=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("mpitrain: error")]
    assert len(set(lines)) == 1, p.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("content, words", [
    (b"", "empty"),
    (b"\xff\xfe\x00\x81garbage" * 20, "UTF-8"),
    (b"too short", "block"),
])
def test_bad_text_is_one_line_and_exit_2(tmp_path, content, words):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    line = _refused(tmp_path, *GPT, "--dataset", f"text:{bad}", "--batch-size", "2",
                    "--steps", "1", "--save", "out.npz", n=2)
    assert words in line and str(bad) in line
    assert not (tmp_path / "out.npz").exists()


def test_bad_shapes_and_pairings_are_one_line(tmp_path):
    text = text_file(tmp_path)
    bad_heads = [*GPT, "--dataset", f"text:{text}", "--n-head", "3", "--steps", "1"]
    assert "--n-embd 16 is not divisible by --n-head 3" in _refused(tmp_path, *bad_heads)
    assert "--model gpt" in _refused(tmp_path, "--model", "gpt", "--dataset", "synthetic")


def test_a_checkpoint_of_another_vocabulary_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    one = text_file(tmp_path, "one.txt", seed=0)
    mpitrain(1, *GPT, "--dataset", f"text:{one}", "--batch-size", "4", "--steps", "2",
             "--checkpoint-dir", ck, cwd=tmp_path)
    other = tmp_path / "one.txt"
    other.write_text(one.read_text().replace("dog", "fox"), encoding="utf-8")
    line = _refused(tmp_path, *GPT, "--dataset", f"text:{other}", "--batch-size", "4",
                    "--steps", "3", "--checkpoint-dir", ck, "--resume")
    assert "another vocabulary" in line


def test_npz_arrays_of_your_own_train_an_mlp(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 96)
    x = (rng.standard_normal((96, 1, 4, 4)) + y[:, None, None, None]).astype(np.float32)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    mpitrain(2, "--model", "mlp", "--hidden", "16", "--dataset", f"npz:{tmp_path / 'mine.npz'}",
             "--batch-size", "8", "--steps", "20", "--lr", "0.1", "--no-progress",
             "--metrics-json", "m.jsonl", cwd=tmp_path)
    assert records(tmp_path / "m.jsonl", "summary")[-1]["test_accuracy"] > 0.6
    np.savez(tmp_path / "bad.npz", x=x, y=y[:-1])
    line = _refused(tmp_path, "--model", "mlp", "--dataset", f"npz:{tmp_path / 'bad.npz'}",
                    "--steps", "1")
    assert "bad.npz" in line
