"""docs/byo_loop.md's recipe block runs as written (synthetic data) under mpiexec -n 2."""
import math
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"


def test_recipe_block_runs_on_two_ranks(tmp_path):
    blocks = re.findall(r"```python recipe\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    real = 'mt.data.load("fashion-mnist", "train")'
    assert real in blocks[0]
    # 512 synthetic images of Fashion-MNIST's shape: 4 steps an epoch at 2 x 64, 8 in all.
    code = blocks[0].replace(real, "mt.data.synthetic(512, shape=(1, 28, 28))")
    code += ('\nlast = mt.allgather_object(float(loss))\n'
             'if mt.rank() == 0:\n'
             '    print("steps", step, "lr", opt.lr, "fill", float(train.fill[0]), "loss", last)\n')
    script = tmp_path / "recipe.py"
    script.write_text(code)
    env = child_env(settings=True)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    words = p.stdout.split()
    assert words[:2] == ["steps", "8"], p.stdout
    lr = float(words[3])          # the last step's: 0.1 * (1 + cos(pi * 7 / 8)) / 2
    assert abs(lr - 0.1 * (1 + math.cos(math.pi * 7 / 8)) / 2) < 1e-12
    assert abs(float(words[5])) > 0                      # standardize moved the black pixel
