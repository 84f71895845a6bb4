"""docs/examples/horovod_mnist.py -- Horovod's PyTorch MNIST example, ported -- on two ranks."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docs" / "examples" / "horovod_mnist.py"


def run(args, tmp_path, timeout=240):
    env = child_env(settings=True)
    return subprocess.run(["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", "2",
                           sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout + 30)


def test_the_port_trains_and_the_replicas_end_bitwise_equal(tmp_path):
    p = run(["--dataset", "synthetic", "--synthetic-samples", "3000", "--epochs", "3",
             "--lr", "0.05", "--log-interval", "20"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "replicas bitwise equal: True (2 ranks" in out
    accuracies = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", out)]
    assert len(accuracies) == 3                                  # one test() per epoch, rank 0
    assert accuracies[-1] > 70.0 and accuracies[-1] > accuracies[0]   # 10 classes: chance is 10
    assert out.count("Train Epoch: 1 [0/") == 1                  # rank 0 alone prints


@pytest.mark.parametrize("dataset_args, dataset", [
    ([], "fashion-mnist"),                       # the default: what `make run` installs
    (["--dataset", "mnist"], "mnist"),
])
def test_missing_data_is_one_line_and_exit_2(tmp_path, dataset_args, dataset):
    p = run([*dataset_args, "--data-dir", str(tmp_path / "nowhere")], tmp_path, timeout=120)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nowhere" in lines[0], p.stderr
    assert lines[0].startswith(f"horovod_mnist: {dataset}: "), lines[0]


def test_the_default_dataset_is_fashion_mnist():
    """The parser's default, read without running the script (its __main__ block does)."""
    spec = importlib.util.spec_from_file_location("horovod_mnist_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parser.get_default("dataset") == "fashion-mnist"
    assert "default: fashion-mnist" in module.parser.format_help()
