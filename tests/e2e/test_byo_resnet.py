"""docs/byo_loop.md's ResNet + SyncBatchNorm block runs as written (synthetic data, a few steps)
under mpiexec -n 2."""
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"


def test_resnet_block_runs_on_two_ranks(tmp_path):
    blocks = re.findall(r"```python resnet\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    code = blocks[0]
    for split, n in (("train", 512), ("test", 64)):
        real = f'mt.data.load("fashion-mnist", "{split}")'
        assert real in code
        code = code.replace(real, f"mt.data.synthetic({n}, seed={len(split)})")
    # 512 samples, 2 ranks x 64: 4 steps
    script = tmp_path / "resnet.py"
    script.write_text(code + '\nif mt.rank() == 0:\n    print("steps", step + 1)\n')
    env = child_env(settings=True)
    p = subprocess.run(["timeout", "-k", "5", "200", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=230)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert out[0].startswith("test accuracy ") and out[1] == "steps 4", out   # rank 0 alone
