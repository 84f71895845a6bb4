"""``python -m mpitrain --model resnet20`` end to end: --sync-bn at 2 ranks with checkpoints,
--save and resume (running statistics included), and the bad input of the module system.

Every job is small (synthetic 1x28x28 data, batch 8, a few steps) and runs under
``timeout -k 5 240``; MPIEXEC names the launcher (default: the venv's mpich wheel).
"""
import subprocess
import sys

import numpy as np

from mpitrain import checkpoint as ckpt

from tests.support.launch import MPIEXEC, child_env

SMALL = ["--model", "resnet20", "--dataset", "synthetic", "--synthetic-samples", "128",
         "--batch-size", "8", "--no-progress", "--lr", "0.05"]


def mpitrain(n, *flags, cwd):
    """Run the CLI on n ranks; CompletedProcess with text stdout/stderr."""
    env = child_env()
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, "-n", str(n), sys.executable, "-m", "mpitrain",
           *flags]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=270)
    assert proc.returncode not in (124, 137), f"timed out: {cmd}\n{proc.stderr[-2000:]}"
    return proc


def test_resnet20_sync_bn_two_ranks_checkpoint_save_resume(tmp_path):
    ck, save = tmp_path / "ck", tmp_path / "final.npz"
    p = mpitrain(2, *SMALL, "--steps", "3", "--sync-bn", "--dropout", "0.1",
                 "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--save", str(save),
                 cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "269434 parameters" in p.stdout and p.stdout.count("test accuracy:") == 1
    saved = np.load(save)
    assert "stage3.2.bn2.running_var" in saved.files and "fc.weight" in saved.files
    # the running statistics moved away from their initial (0, 1)
    assert np.abs(saved["bn1.running_mean"]).max() > 0
    steps = [s for s, _ in ckpt.list_checkpoints(ck)]
    assert steps == [2, 3]
    last = ckpt.load(ckpt.checkpoint_path(ck, 3))
    np.testing.assert_array_equal(last.params["bn1.running_var"], saved["bn1.running_var"])
    p = mpitrain(2, *SMALL, "--steps", "5", "--sync-bn", "--dropout", "0.1",
                 "--checkpoint-dir", str(ck), "--resume", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "at step 3" in p.stdout


def test_checkpoint_without_running_stats_is_refused_naming_them(tmp_path):
    ck = tmp_path / "ck"
    p = mpitrain(1, *SMALL, "--steps", "1", "--checkpoint-dir", str(ck), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    old = ckpt.load(ckpt.checkpoint_path(ck, 1))
    params = {k: v for k, v in old.params.items() if "running" not in k}
    ckpt.write(ck, 2, params, old.optimizer_state, dict(old.meta, step=2))
    p = mpitrain(2, *SMALL, "--steps", "3", "--checkpoint-dir", str(ck), "--resume",
                 cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip()
    assert "\n" not in line and "does not fit this model" in line
    assert "missing keys ['bn1.running_mean', 'bn1.running_var'," in line


def test_sync_bn_without_batchnorm_warns_and_bad_dropout_exits_2(tmp_path):
    p = mpitrain(2, "--model", "mlp", "--hidden", "16", "--dataset", "synthetic",
                 "--synthetic-samples", "64", "--batch-size", "8", "--steps", "1",
                 "--no-progress", "--sync-bn", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("--sync-bn has no effect, --model mlp has no BatchNorm") == 1
    p = mpitrain(1, *SMALL, "--dropout", "1.5", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == "mpitrain: error: --dropout 1.5: must be in [0, 1)"
