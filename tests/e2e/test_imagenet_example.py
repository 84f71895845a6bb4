"""docs/examples/imagenet_resnet.py -- Horovod's ImageNet ResNet example, ported -- on two ranks.

Rank 1 runs in a folder of its own (mpiexec's per-rank -wdir) with the same relative
--checkpoint-dir: that folder must stay empty, so only rank 0 wrote checkpoints.
"""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain import checkpoint
from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docs" / "examples" / "imagenet_resnet.py"
# 256 samples, 2 ranks x 2 sub-batches of 8 per step: 8 steps per epoch; 64 validation samples
SMALL = ["--dataset", "synthetic", "--synthetic-samples", "256", "--batch-size", "8",
         "--batches-per-allreduce", "2", "--val-batch-size", "20"]
STEPS_PER_EPOCH = 256 // (2 * 8 * 2)
TRAIN = re.compile(r"^Train Epoch +#(\d+): loss (\S+), accuracy (\S+)%, lr (\S+)$", re.M)
VALIDATE = re.compile(r"^Validate Epoch +#(\d+): loss (\S+), accuracy (\S+)%$", re.M)
DIGEST = re.compile(r"replicas bitwise equal: True \(2 ranks, sha256 ([0-9a-f]+)\)")


def run(args, cwd, per_rank_dirs=None, timeout=120):
    """The example on 2 ranks; with per_rank_dirs, rank r runs in per_rank_dirs[r]."""
    python = [sys.executable, str(SCRIPT), *args]
    if per_rank_dirs:
        launch = [MPIEXEC, "-n", "1", "-wdir", str(per_rank_dirs[0]), *python, ":",
                  "-n", "1", "-wdir", str(per_rank_dirs[1]), *python]
    else:
        launch = [MPIEXEC, "-n", "2", *python]
    return subprocess.run(["timeout", "-k", "5", str(timeout), *launch], cwd=cwd,
                          env=child_env(settings=True), capture_output=True, text=True,
                          timeout=timeout + 30)


def epochs_of(out):
    """{epoch: (train loss, train accuracy, lr, val loss, val accuracy)}, each epoch's lines
    checked to appear once (rank 0 alone prints) and to hold finite numbers."""
    train = {int(m[0]): tuple(map(float, m[1:])) for m in TRAIN.findall(out)}
    val = {int(m[0]): tuple(map(float, m[1:])) for m in VALIDATE.findall(out)}
    assert len(TRAIN.findall(out)) == len(train) and len(VALIDATE.findall(out)) == len(val), out
    assert sorted(train) == sorted(val), out
    rows = {e: train[e] + val[e] for e in train}
    assert all(math.isfinite(x) for row in rows.values() for x in row), out
    return rows


def warmup_lr(epochs_done, ranks=2, k=2, base_lr=0.0125, warmup_epochs=5):
    """Horovod's adjust_learning_rate at the last batch of an epoch in the warm-up."""
    adj = 1.0 / ranks * (epochs_done * (ranks - 1) / warmup_epochs + 1)
    return base_lr * ranks * k * adj


def checkpoints(folder):
    return sorted(p.name for p in Path(folder).glob("*.npz"))


def test_trains_checkpoints_on_rank_0_and_resumes_where_it_stopped(tmp_path):
    rank0, rank1 = tmp_path / "rank0", tmp_path / "rank1"
    rank0.mkdir()
    rank1.mkdir()

    p = run(SMALL + ["--epochs", "2"], tmp_path, per_rank_dirs=(rank0, rank1))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = epochs_of(p.stdout)
    assert sorted(rows) == [1, 2] and "resuming" not in p.stdout
    for epoch, row in rows.items():                     # the warm-up, per batch
        assert row[2] == pytest.approx(warmup_lr(epoch), rel=1e-4), (epoch, row)
    assert 0.0 <= rows[2][4] <= 100.0
    assert DIGEST.search(p.stdout), p.stdout
    assert checkpoints(rank0 / "checkpoints") == [
        f"ckpt-{STEPS_PER_EPOCH:08d}.npz", f"ckpt-{2 * STEPS_PER_EPOCH:08d}.npz"]
    assert list(rank1.iterdir()) == []                   # rank 1 wrote nothing
    newest = checkpoint.load(rank0 / "checkpoints" / f"ckpt-{2 * STEPS_PER_EPOCH:08d}.npz")
    assert newest.meta["epoch"] == 1                      # epochs 0 and 1 done

    p = run(SMALL + ["--epochs", "3"], tmp_path, per_rank_dirs=(rank0, rank1))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("resuming from epoch") == 1      # rank 0, once
    assert f"resuming from epoch 2 (step {2 * STEPS_PER_EPOCH})" in p.stdout
    rows = epochs_of(p.stdout)
    assert sorted(rows) == [3]                            # not from epoch 1 again
    assert rows[3][2] == pytest.approx(warmup_lr(3), rel=1e-4)
    assert checkpoints(rank0 / "checkpoints")[-1] == f"ckpt-{3 * STEPS_PER_EPOCH:08d}.npz"
    assert list(rank1.iterdir()) == []
    resumed = DIGEST.search(p.stdout)
    assert resumed, p.stdout

    # The resumed job ends bitwise where an uninterrupted one does.
    whole = tmp_path / "whole"
    whole.mkdir()
    p = run(SMALL + ["--epochs", "3"], whole)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(epochs_of(p.stdout)) == [1, 2, 3]
    assert DIGEST.search(p.stdout)[1] == resumed[1]


@pytest.mark.parametrize("args, needle", [
    (["--checkpoint-format", "./checkpoint-{epoch}.pth.tar"], "--checkpoint-dir"),
    (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
    (["--warmup-epochs", "-1"], "--warmup-epochs -1.0: must be >= 0"),
    (["--synthetic-samples", "20"], "exceeds the 20 training samples"),
    (["--dataset", "cifar10", "--data-dir", "nowhere"], "nowhere"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    p = run(["--dataset", "synthetic", "--epochs", "1", *args], tmp_path, timeout=60)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("imagenet_resnet: "), p.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "checkpoints").exists()


def test_a_damaged_checkpoint_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-00000008.npz").write_bytes(b"not a checkpoint")
    p = run(SMALL + ["--epochs", "1"], tmp_path, timeout=60)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ckpt-00000008.npz" in lines[0], p.stderr
    assert "Train Epoch" not in p.stdout
