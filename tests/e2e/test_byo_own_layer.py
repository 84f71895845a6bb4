"""docs/byo_loop.md's "Write your own layer" block: its layer passes a finite-difference
gradient check, and the block runs as written (synthetic data) under mpiexec -n 2 and trains.
Also RMSprop's state through mt.broadcast_optimizer_state on two ranks."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from tests.support.gradcheck import check_layer
from tests.support.launch import MPIEXEC, child_env

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "byo_loop.md"


def block():
    blocks = re.findall(r"```python ownlayer\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


def _run_two_ranks(tmp_path, code, name):
    script = tmp_path / name
    script.write_text(code)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=child_env(settings=True),
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_the_layer_passes_a_gradient_check():
    namespace = {"__name__": "ownlayer"}              # not __main__: define, do not train
    exec(compile(block(), "byo_loop.md:ownlayer", "exec"), namespace)
    rng = np.random.default_rng(0)
    layer = namespace["LowRank"](5, 4, rank=2, seed=1, dtype=np.float64)
    assert [name for name, _ in layer.named_parameters()] == ["a", "b"]
    check_layer(layer, rng.standard_normal((3, 5)), rng)


def test_the_block_trains_on_two_ranks(tmp_path):
    code = block()
    real = 'mt.data.load("fashion-mnist", "train")'
    assert real in code
    # 2048 synthetic images instead of 60000 real ones: 16 steps of 2 x 64
    code = code.replace(real, "mt.data.synthetic(2048)").replace("step % 100", "step % 5")
    code += textwrap.indent(textwrap.dedent("""
        sums = mt.allgather_object([float(p.data.sum()) for p in model.parameters()])
        if mt.rank() == 0:
            print("steps", step + 1, "final", float(loss), "replicas equal", sums[0] == sums[1])
        """), "    ")
    out = _run_two_ranks(tmp_path, code, "ownlayer.py").splitlines()
    first = float(out[0].split()[-1])
    assert out[0].startswith("step 0: loss ") and len(out) == 5, out
    assert out[-1].split()[:2] == ["steps", "16"] and out[-1].endswith("replicas equal True")
    assert float(out[-1].split()[3]) < first                      # it learned


def test_broadcast_optimizer_state_gives_every_rank_the_roots_rmsprop_state(tmp_path):
    code = textwrap.dedent("""
        import numpy as np
        import mpitrain as mt

        mt.init()
        r = mt.rank()
        params = [mt.nn.Parameter(np.full((3, 2), 1.0 + r)), mt.nn.Parameter(np.zeros(2))]
        opt = mt.optim.RMSprop(params, lr=0.01 * (r + 1), momentum=0.9, centered=True)
        rng = np.random.default_rng(r)
        for _ in range(1 + r):                   # per-rank state and step count
            for p in params:
                p.grad[...] = rng.standard_normal(p.shape)
            opt.step()
        opt = mt.DistributedOptimizer(opt)
        root = mt.broadcast_object(opt.state_dict(), root_rank=1)
        mt.broadcast_optimizer_state(opt, root_rank=1)
        state = opt.state_dict()
        same = sorted(state) == sorted(root) and all(
            np.array_equal(np.asarray(state[k]), np.asarray(root[k])) for k in root)
        flags = mt.allgather_object(bool(same))
        if r == 0:
            print("keys", " ".join(sorted(k for k in state if "." in k)))
            print("step", state["step"], "lr", state["lr"], "all equal", all(flags))
        """)
    out = _run_two_ranks(tmp_path, code, "rmsprop_broadcast.py").splitlines()
    assert out[0] == ("keys grad_avg.0 grad_avg.1 momentum_buffer.0 momentum_buffer.1 "
                      "square_avg.0 square_avg.1")
    assert out[1] == "step 2 lr 0.02 all equal True"
