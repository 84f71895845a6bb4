"""docs/byo_loop.md's example runs as written (on synthetic data, for speed) under mpiexec -n 2."""
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"


def example_code():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_example_is_about_fifteen_lines():
    lines = [line for line in example_code().splitlines() if line.strip()]
    assert len(lines) <= 18


def test_example_runs_on_two_ranks(tmp_path):
    code = example_code()
    real = 'mt.data.load("fashion-mnist", "train")'
    assert real in code
    # Same loop, 2048 synthetic samples instead of the 60000 real ones: 16 steps, not 468.
    code = code.replace(real, "mt.data.synthetic(2048)").replace("step % 100", "step % 5")
    code += ('\nif mt.rank() == 0:\n'
             '    print("steps", step + 1, "final", float(loss))\n')
    script = tmp_path / "byo.py"
    script.write_text(code)
    env = child_env(settings=True)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert out[0].startswith("step 0: loss ")
    assert len([line for line in out if line.startswith("step ")]) == 4   # rank 0 alone prints
    steps, final = out[-1].split()[1], float(out[-1].split()[3])
    assert steps == str(2048 // (64 * 2))
    assert final < float(out[0].split()[-1])                                # it learned
