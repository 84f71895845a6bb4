"""``mpiexec -n N python -m mpitrain`` end to end: output discipline, metrics, bad input -> exit 2.

Every job is tiny (synthetic data, an MLP with one hidden layer of 16) and runs under
``timeout -k 5 120``; MPIEXEC names the launcher (default: the venv's mpich wheel).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, child_env

TINY = ["--dataset", "synthetic", "--synthetic-samples", "256", "--hidden", "16",
        "--batch-size", "8", "--no-progress"]


def mpitrain(n, *flags, cwd, env=None):
    """Run the CLI on n ranks; CompletedProcess with text stdout/stderr."""
    clean = child_env(**(env or {}))
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpitrain",
           *flags]
    proc = subprocess.run(cmd, cwd=cwd, env=clean, capture_output=True, text=True, timeout=150)
    assert proc.returncode not in (124, 137), f"timed out: {cmd}\n{proc.stderr[-2000:]}"
    return proc


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_two_ranks_train_print_once_and_report(tmp_path):
    metrics = tmp_path / "m.jsonl"
    save = tmp_path / "final.npz"
    p = mpitrain(2, *TINY, "--epochs", "2", "--metrics-json", str(metrics), "--save", str(save),
                 cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("mpitrain: 2 rank(s)") == 1       # config printed once, by rank 0
    per_rank = max(1, len(os.sched_getaffinity(0)) // 2)    # cores / ranks on this node
    assert f"2 rank(s) x {per_rank} thread(s)" in p.stdout
    assert p.stdout.count("test accuracy:") == 1
    assert "Traceback" not in p.stderr
    recs = records(metrics)
    summary = recs[-1]
    assert summary["event"] == "summary"
    for key in ("test_accuracy", "samples_per_sec", "step_time_ms", "comm_time_ms", "ranks",
                "steps"):
        assert key in summary, key
    assert summary["ranks"] == 2
    assert summary["steps"] == 2 * (256 // 16)              # 2 epochs of 16 global batches
    assert summary["test_samples"] == 64                     # every test sample scored once
    assert summary["test_accuracy"] > 0.9                    # synthetic classes are separable
    assert summary["samples_per_sec"] > 0
    assert 0 < summary["comm_time_ms"] <= summary["step_time_ms"]
    steps = [r for r in recs if r["event"] == "step"]
    epochs = [r for r in recs if r["event"] == "epoch"]
    assert len(epochs) == 2 and all("test_accuracy" in r for r in epochs)
    assert steps and all({"loss", "accuracy", "samples_per_sec", "comm_time_ms"} <= set(r)
                         for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    with np.load(save, allow_pickle=False) as z:
        assert sorted(z.files) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert z["0.weight"].shape == (784, 16) or z["0.weight"].shape == (16, 784)
    assert sorted(os.listdir(tmp_path)) == ["final.npz", "m.jsonl"]


def test_one_rank_equals_default_launch_without_mpiexec(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_")}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "mpitrain", *TINY, "--steps", "3"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "mpitrain: 1 rank(s)" in p.stdout and "test accuracy:" in p.stdout


@pytest.mark.parametrize("flags", [["--average", "weights", "--average-every", "2"],
                                   ["--threads", "3", "--fusion-threshold-bytes", "0"],
                                   ["--fp16-allreduce"], ["--optimizer", "adam", "--lr", "0.01"],
                                   ["--scale-lr", "--warmup-epochs", "0.5"]])
def test_variants_run(tmp_path, flags):
    metrics = tmp_path / "m.jsonl"
    p = mpitrain(2, *TINY, "--steps", "10", "--metrics-json", str(metrics), *flags,
                 cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert records(metrics)[-1]["steps"] == 10


def test_eval_every_and_checkpoint_every_count_steps(tmp_path):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    p = mpitrain(2, *TINY, "--steps", "12", "--eval-every", "5", "--checkpoint-every", "4",
                 "--checkpoint-dir", str(ck), "--metrics-json", str(metrics), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    evals = [r["step"] for r in records(metrics) if r["event"] == "eval"]
    assert evals == [5, 10]
    assert sorted(os.listdir(ck)) == [f"ckpt-000000{s:02d}.npz" for s in (4, 8, 12)]


def test_env_sets_flags_and_flags_win(tmp_path):
    metrics = tmp_path / "m.jsonl"
    p = mpitrain(2, *TINY, "--metrics-json", str(metrics), cwd=tmp_path,
                 env={"MPITRAIN_STEPS": "4", "MPITRAIN_BATCH_SIZE": "4"})
    assert p.returncode == 0, p.stderr
    summary = records(metrics)[-1]
    assert summary["steps"] == 4                 # from the environment
    assert summary["global_batch"] == 2 * 8      # TINY's --batch-size 8 beats MPITRAIN_BATCH_SIZE
    p = mpitrain(2, "--no-progress", cwd=tmp_path, env={"MPITRAIN_BATCH_SIZE": "0"})
    assert p.returncode == 2 and p.stderr.strip() == "mpitrain: error: --batch-size 0: must be >= 1"


def test_a_crash_on_one_rank_aborts_the_job_with_its_traceback(tmp_path):
    """Not bad input but a bug on rank 1 mid-training: the abort hook ends every rank, no hang."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import sys\n"
        "from mpitrain import comm\n"
        "import mpitrain as mt\n"
        "from mpitrain.train import loop, setup\n"
        "from mpitrain.train.cli import run_cli\n"
        "comm.install_abort_hook()\n"
        "mt.init()\n"
        "if mt.rank() == 1:\n"
        "    def boom(self, *args):\n"
        "        raise ZeroDivisionError('injected on rank 1')\n"
        "    loop.Trainer.train_step = boom\n"
        f"sys.exit(run_cli({TINY + ['--steps', '50']!r}))\n")
    clean = child_env(settings=True)
    start = time.time()
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=clean, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode not in (0, 2, 124, 137), (p.returncode, p.stderr[-2000:])
    assert "injected on rank 1" in p.stderr and "ZeroDivisionError" in p.stderr
    assert time.time() - start < 100


def test_bad_input_seen_by_one_rank_only_still_exits_2_everywhere(tmp_path):
    """Data missing on one node only: every rank must stop with exit 2, not hang or abort."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import sys\n"
        "import mpitrain as mt\n"
        "from mpitrain.train import loop, setup\n"
        "from mpitrain.train.cli import run_cli\n"
        "mt.init()\n"
        "if mt.rank() == 1:\n"
        "    def missing(config):\n"
        "        raise mt.data.DataError('/node2/data: no such directory (rank 1 only)')\n"
        "    setup._datasets = missing\n"
        f"sys.exit(run_cli({TINY + ['--steps', '3']!r}))\n")
    clean = child_env(settings=True)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=clean, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.strip() == "mpitrain: error: /node2/data: no such directory (rank 1 only)"


@pytest.mark.parametrize("env, needle", [
    ({"MPITRAIN_RING_THRESHOLD": "lots"}, "MPITRAIN_RING_THRESHOLD='lots' is not an integer"),
    ({"MPITRAIN_ALLREDUCE": "tree"}, "MPITRAIN_ALLREDUCE='tree': expected ring, mpi or auto"),
    ({"MPITRAIN_STALL_WARNING": "-1"}, "MPITRAIN_STALL_WARNING='-1' must be >= 0"),
])
def test_bad_comm_setting_is_one_line_exit_2(tmp_path, env, needle):
    """The comm layer's MPITRAIN_* settings are read (and agreed) at mt.init(): a bad one is bad
    input like a bad flag -- one line on rank 0, exit 2 everywhere, no traceback."""
    p = mpitrain(2, *TINY, "--steps", "2", cwd=tmp_path, env=env)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpitrain: error: {needle}"), p.stderr


def test_help_prints_once(tmp_path):
    p = mpitrain(2, "--help", cwd=tmp_path)
    assert p.returncode == 0
    assert p.stdout.count("usage:") == 1 and "--fusion-threshold-bytes" in p.stdout


def _corrupt_data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (d / name).write_bytes(b"\x00\x00\x08\x03not an idx file")
    return d


def _other_model_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    p = mpitrain(1, *TINY, "--steps", "2", "--checkpoint-dir", str(ck), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return ck


BAD = {
    "unknown model": (["--model", "resnet50"], "--model 'resnet50'"),
    "batch 0": (["--batch-size", "0"], "--batch-size 0"),
    "negative lr": (["--lr", "-0.1"], "--lr -0.1"),
    "unknown flag": (["--bogus"], "--bogus"),
    "corrupt dataset": (["--dataset", "fashion-mnist", "--data-dir", "{data}"], "{data}"),
    "missing dataset": (["--dataset", "cifar10", "--model", "cifar_cnn",
                         "--data-dir", "{tmp}/nowhere"], "cifar"),
    "more ranks than test samples": (["--synthetic-samples", "4", "--batch-size", "1"],
                                     "test set has only 1"),
    "batch larger than data": (["--synthetic-samples", "8", "--batch-size", "8"], "exceeds"),
    "checkpoint of another model": (["--model", "lenet", "--hidden", "", "--resume",
                                     "--checkpoint-dir", "{ck}"], "--model 'mlp'"),
    "resume without dir": (["--resume"], "--resume needs --checkpoint-dir"),
    "unwritable output path": (["--timeline", "/proc/nope/t.json"], "--timeline"),
    "fresh run into another run's checkpoints": (["--checkpoint-dir", "{ck}"],
                                                 "already holds checkpoints"),
    "unknown augmentation": (["--augment", "crop,rotate"], "unknown augmentation 'rotate'"),
    "unknown lr schedule": (["--lr-schedule", "poly"], "--lr-schedule 'poly'"),
    "crop padding too large": (["--augment", "crop", "--crop-padding", "28"],
                               "--crop-padding 28"),
    "milestones out of order": (["--epochs", "9", "--lr-schedule", "step", "--lr-milestones",
                                 "6,3"], "strictly increasing"),
    "infinite lr": (["--lr", "inf"], "--lr inf: must be a finite number"),
    "infinite weight decay": (["--weight-decay", "inf"], "--weight-decay inf: must be a finite"),
    "infinite warm-up": (["--warmup-epochs", "inf"], "--warmup-epochs inf: must be a finite"),
    "negative --nonfinite-steps": (["--nonfinite-steps", "-1"], "--nonfinite-steps -1"),
    "sharding weights": (["--sharding", "optimizer", "--average", "weights"],
                         "has no gradients to shard"),
    "model too large for memory": (["--hidden", "1000000000000"],
                                   "--model mlp --hidden 1000000000000: its parameters do not "
                                   "fit in memory"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_on_rank_0_exit_2_no_files(tmp_path, case):
    flags, needle = BAD[case]
    fill = {"tmp": tmp_path}
    if "{data}" in " ".join(flags):
        fill["data"] = _corrupt_data_dir(tmp_path)
    if "{ck}" in " ".join(flags):
        fill["ck"] = _other_model_checkpoint(tmp_path)
    flags = [f.format(**fill) for f in flags]
    needle = needle.format(**fill)
    if case == "checkpoint of another model":  # lenet takes no --hidden: drop TINY's
        base = [f for f in TINY if f not in ("--hidden", "16")]
        flags = [f for f in flags if f not in ("--hidden", "")]
    else:
        base = TINY
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    metrics = tmp_path / "m.jsonl"
    p = mpitrain(2, *base, *flags, "--metrics-json", str(metrics), "--save",
                 str(tmp_path / "s.npz"), cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr                 # one line, from rank 0 only, no traceback
    assert lines[0].startswith("mpitrain: error: ") and needle in lines[0], lines[0]
    assert p.stdout == ""
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before                           # no metrics, no save, no checkpoint


def _fake_search_path(tmp_path):
    """A per-user cache ($XDG_CACHE_HOME/mpitrain/fashion-mnist) holding a tiny valid
    Fashion-MNIST (32 train, 4 test samples): what a silent fall-back would train on."""
    import struct
    cache = tmp_path / "cache"
    folder = cache / "mpitrain" / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 32), ("t10k", 4)):
        for kind, shape in (("images-idx3", (n, 28, 28)), ("labels-idx1", (n,))):
            array = rng.integers(0, 10, shape, dtype=np.uint8)
            header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                         *array.shape)
            (folder / f"{prefix}-{kind}-ubyte").write_bytes(header + array.tobytes())
    return {"XDG_CACHE_HOME": str(cache)}


DATA_DIR_CASES = {
    "--data-dir that does not exist": (["--data-dir", "{tmp}/typo"], {}, "{tmp}/typo"),
    "--data-dir without the files": (["--data-dir", "{tmp}/empty"], {}, "{tmp}/empty"),
    "MPITRAIN_DATA_DIR that does not exist": ([], {"MPITRAIN_DATA_DIR": "{tmp}/typo"},
                                              "{tmp}/typo"),
}


@pytest.mark.parametrize("case", sorted(DATA_DIR_CASES))
def test_given_data_dir_is_not_replaced_by_the_search_path(tmp_path, case):
    """A data dir the user named is authoritative: missing (or lacking the files) is one line
    naming it and exit 2 on every rank -- even though the search path holds a usable copy."""
    env = _fake_search_path(tmp_path)
    base = [("fashion-mnist" if f == "synthetic" else f) for f in TINY] + ["--steps", "2"]
    p = mpitrain(1, *base, cwd=tmp_path, env=env)            # the fake search path works
    assert p.returncode == 0 and "test accuracy:" in p.stdout, p.stderr[-2000:]
    (tmp_path / "empty").mkdir()
    flags, more_env, named = DATA_DIR_CASES[case]
    flags = [f.format(tmp=tmp_path) for f in flags]
    env.update({k: v.format(tmp=tmp_path) for k, v in more_env.items()})
    named = named.format(tmp=tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    p = mpitrain(2, *base, *flags, "--metrics-json", str(tmp_path / "m.jsonl"), cwd=tmp_path,
                 env=env)
    assert p.returncode == 2, (p.returncode, p.stdout[-1000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("mpitrain: error: fashion-mnist: data ") and named in lines[0]
    assert str(tmp_path / "cache") not in lines[0]
    assert p.stdout == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
