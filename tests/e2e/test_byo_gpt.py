"""docs/byo_loop.md's GPT block runs as written (a small generated text, fewer steps) under
mpiexec -n 2: it trains, evaluates per token on every rank's share and prints a sample."""
import math
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import MPIEXEC, child_env
from tests.support.texts import text_file

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"


def test_gpt_block_runs_on_two_ranks(tmp_path):
    blocks = re.findall(r"```python gpt\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    code = blocks[0]
    for real, small in (("block_size=64", "block_size=16"), ("n_layer=4, n_head=4, n_embd=128",
                        "n_layer=1, n_head=2, n_embd=16"), ("steps = 2000", "steps = 40"),
                        ("warmup_steps=100", "warmup_steps=4"), ("lr=1e-3", "lr=1e-2"),
                        ("LRSchedule(1e-3", "LRSchedule(1e-2"), ("windows=600", "windows=24"),
                        ("min_lr=1e-4", "min_lr=1e-3")):
        assert real in code, real
        code = code.replace(real, small)
    text = text_file(tmp_path, "input.txt")
    script = tmp_path / "gpt.py"
    script.write_text(code)
    p = subprocess.run(["timeout", "-k", "5", "150", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=child_env(settings=True),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    first, sample = p.stdout.split("\n", 1)
    words = first.split()
    assert words[:2] == ["val", "loss"] and float(words[2].rstrip(",")) < math.log(
        len(set(text.read_text())))
    assert float(words[5]) > 0                                  # the norm before clipping
    assert len(sample) >= 150 and set(sample) <= set(text.read_text()) | {"\n"}
