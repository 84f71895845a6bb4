"""train.Trainer used directly (no CLI), under mpiexec -n 2: ``fit`` owns step, epoch and position,
``resume`` restores them with the model and optimizer, and fit(5) + resume + fit(14) ends bitwise
where an uninterrupted fit(14) does. 96 samples / global batch 16 = 6 steps an epoch, so the
resumed run starts mid-epoch and crosses two epoch boundaries."""
import subprocess
import sys

from tests.support.launch import MPIEXEC, child_env

SCRIPT = """
import sys
import numpy as np
import mpitrain as mt
from mpitrain import checkpoint as ckpt
from mpitrain.train.config import Config
from mpitrain.train import Trainer

mt.init(threads=1)
folder = sys.argv[1]


class Records:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def trainer(steps, **config):
    config = Config(dataset="synthetic", synthetic_samples=96, hidden=(8,), batch_size=8,
                    steps=steps, eval_every=4, progress=False, seed=1, **config)
    train_set = mt.data.synthetic(96, (1, 28, 28), seed=1)
    test_set = mt.data.synthetic(24, (1, 28, 28), seed=2)
    model = mt.models.get("mlp", seed=1, in_features=784, hidden=(8,), classes=10)
    optimizer = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        model.named_parameters())
    return Trainer(config, mt.kernels.get("cpu"), train_set, test_set, model, optimizer, 0.05)


def params(t):
    return {name: value.tobytes() for name, value in t.model.state_dict(copy=True).items()}


full, records = trainer(14), Records()
summary = full.fit(records)
assert (full.step, full.epoch, full.position) == (14, 2, 32), (full.step, full.epoch, full.position)
assert summary["steps"] == summary["steps_run"] == 14 and summary["epoch"] == 2 + 32 / 96
events = [(r["event"], r["step"]) for r in records.records if r["event"] in ("eval", "epoch")]
assert events == [("eval", 4), ("epoch", 6), ("eval", 8), ("eval", 12), ("epoch", 12)], events

first = trainer(5, checkpoint_dir=folder)
first.fit(Records())
mt.barrier()
found, skipped = ckpt.read_latest(folder)
checkpoint = {"path": found.path, "params": found.params, "optimizer": found.optimizer_state,
              "meta": found.meta}

wrong = trainer(14, optimizer="adam")
try:
    wrong.resume(checkpoint)
    raise AssertionError("a checkpoint of another optimizer was accepted")
except ckpt.CheckpointError as exc:
    assert "--optimizer 'sgd', not 'adam'" in str(exc), exc
assert (wrong.step, wrong.epoch, wrong.position) == (0, 0, 0)   # untouched by a refusal

second = trainer(14)
second.resume(checkpoint)
assert (second.step, second.epoch, second.position) == (5, 0, 80)
summary = second.fit(Records())
assert summary["steps_run"] == 9 and (second.step, second.epoch, second.position) == (14, 2, 32)
assert params(second) == params(full), "fit(5) + resume + fit(14) differs from fit(14)"
if mt.rank() == 0:
    print("ok")
"""


def test_trainer_fit_and_resume_own_the_counters(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    env = child_env(settings=True)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script), str(tmp_path / "ck")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[-1] == "ok", p.stdout
    assert sum(line.startswith("test accuracy: ") for line in lines) == 3  # rank 0, each fit
