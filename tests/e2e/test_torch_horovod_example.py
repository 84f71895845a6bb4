"""Horovod's own PyTorch MNIST example, ported (docs/examples/pytorch_mnist.py: the import lines
and the dataset changed, nothing else), on two ranks over a small learnable Fashion-MNIST-format
dataset written here: it trains, rank 0 alone prints, and the replicas end bitwise equal."""
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("filelock")

from tests.support.launch import MPIEXEC, child_env      # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docs" / "examples" / "pytorch_mnist.py"

# Runs the port unchanged; DistributedOptimizer is wrapped only to find the model's parameters
# afterwards, which are then compared across ranks bit for bit.
RUNNER = f"""
import runpy, sys
import torch
import mpitrain.torch as hvd

made = []
wrap = hvd.DistributedOptimizer
hvd.DistributedOptimizer = lambda *a, **k: made.append(wrap(*a, **k)) or made[-1]
sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
flat = torch.cat([p.detach().reshape(-1) for g in made[0].param_groups for p in g["params"]])
rows = hvd.allgather(flat[None])
if hvd.rank() == 0:
    same = all(torch.equal(rows[0].view(torch.int32), r.view(torch.int32)) for r in rows)
    print(f"replicas bitwise equal: {{same}} ({{hvd.size()}} ranks, {{flat.numel()}} values)")
"""


def write_fashion_mnist(folder, train=2400, test=400):
    """IDX files in Fashion-MNIST's layout: class c is a bright 8x8 patch at one of 10 places,
    over noise (learnable in an epoch or two)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            row, col = 2 + 12 * (c // 5), 1 + 5 * (c % 5)
            images[i, row:row + 8, col:col + 8] = 220
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                         *array.shape)
            (folder / f"{prefix}-{kind}-ubyte").write_bytes(header + array.tobytes())


def test_the_port_trains_and_the_replicas_end_bitwise_equal(tmp_path):
    write_fashion_mnist(tmp_path / "data" / "fashion-mnist")
    runner = tmp_path / "run_port.py"
    runner.write_text(RUNNER)
    env = child_env(HOME=str(tmp_path))          # the example's FileLock writes ~/.horovod_lock
    cmd = ["timeout", "-k", "5", "240", MPIEXEC, "-n", "2", sys.executable, str(runner),
           "--epochs", "2", "--lr", "0.05", "--data-dir", str(tmp_path / "data"),
           "--log-interval", "5"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=270)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert re.search(r"replicas bitwise equal: True \(2 ranks, \d+ values\)", out), out[-2000:]
    accuracies = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", out)]
    assert len(accuracies) == 2                              # test() once per epoch, rank 0
    assert accuracies[-1] > 60.0, out[-2000:]                # 10 classes: chance is 10%
    assert out.count("Train Epoch: 1 [0/") == 2              # the example prints on every rank
