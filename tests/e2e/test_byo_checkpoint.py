"""docs/byo_loop.md's checkpoint block (synthetic data) under mpiexec -n 2: run for two epochs,
run again for three -- it resumes at epoch 2, not at step 0 -- and end on the same bytes as an
uninterrupted three-epoch run."""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from mpitrain import checkpoint as ck
from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"
SAMPLES = 512           # 4 steps an epoch at 2 ranks x 64


def _block():
    blocks = re.findall(r"```python checkpoint\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


def _run(folder, epochs):
    """The block for ``epochs`` epochs in ``folder`` (its checkpoints/ kept between runs);
    rank 0's stdout lines."""
    code = _block()
    real = 'mt.data.load("fashion-mnist", "train")'
    assert real in code and "epochs = 3\n" in code
    code = code.replace(real, f"mt.data.synthetic({SAMPLES})")
    code = code.replace("epochs = 3\n", f"epochs = {epochs}\n")
    code += ('\nif mt.rank() == 0:\n'
             '    print("resumed from", meta)\n')
    folder.mkdir(exist_ok=True)
    script = folder / "byo_checkpoint.py"
    script.write_text(code)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=folder, env=child_env(settings=True),
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.splitlines()


def _epochs(lines):
    return [int(line.split()[1].rstrip(":")) for line in lines if line.startswith("epoch ")]


def _steps(folder):
    return [s for s, _ in ck.list_checkpoints(folder / "checkpoints")]


def test_checkpoint_block_resumes_where_it_stopped(tmp_path):
    stopped = tmp_path / "stopped"
    first = _run(stopped, epochs=2)
    assert _epochs(first) == [0, 1] and first[-1] == "resumed from None"
    assert _steps(stopped) == [4, 8]

    second = _run(stopped, epochs=3)
    assert _epochs(second) == [2], second                   # not from step 0
    assert second[-1] == "resumed from {'step': 8, 'epoch': 1}"
    assert _steps(stopped) == [4, 8, 12]
    resumed = ck.load(ck.checkpoint_path(stopped / "checkpoints", 12))
    assert resumed.meta["epoch"] == 2

    straight = tmp_path / "straight"
    whole = _run(straight, epochs=3)
    assert _epochs(whole) == [0, 1, 2]
    assert _steps(straight) == [4, 8, 12]
    assert whole[2] == second[0]                            # epoch 2's loss, to the printed digit
    uninterrupted = ck.load(ck.checkpoint_path(straight / "checkpoints", 12))
    for name, value in uninterrupted.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    assert resumed.optimizer_state["step"] == uninterrupted.optimizer_state["step"] == 12
