"""What a DDP or Horovod user does in the first hour with mpitrain.torch, at N = 1 and 2: no
silent mistakes. Clipping (or unscaling, or scaling) ``p.grad`` between backward and ``step()``
acts on the averaged gradients, as under DDP; parameters no rank used keep no
gradient and do not move; replicas that start different raise at the first step; the thread
budget reaches torch however mpitrain was initialised, and honours OMP_NUM_THREADS and
``torch.set_num_threads``."""
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tests.support.launch import MPIEXEC, child_env      # noqa: E402

COMMON = """
import sys
import torch
import mpitrain.torch as hvd
from mpitrain.runtime import threads as budget

def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

def batch(step):
    g = torch.Generator().manual_seed(100 * step + hvd.rank())
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)

def say(*words):        # one write per line: the ranks share the launcher's stdout
    sys.stdout.write(" ".join([f"rank {hvd.rank()}:", *map(str, words)]) + "\\n")
    sys.stdout.flush()
"""

CASES = {
    # DDP's habit: clip (or unscale, or scale by hand) between backward and step, no
    # synchronize(): the edit acts on the averaged gradients, as under DDP
    "edit": """
hvd.init()
def averaged(net, x, y):          # every rank's gradient averaged by hand, on a copy
    ref = model()
    ref.load_state_dict(net.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return [hvd.allreduce(p.grad, op=hvd.Average) for p in ref.parameters()]

for edit in ("none", "clip", "scale", "unscale"):
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = batch(0)
    expected = averaged(net, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    loss = torch.nn.functional.mse_loss(net(x), y)
    (scaler.scale(loss) if edit == "unscale" else loss).backward()
    if edit == "clip":
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
        total = torch.sqrt(sum(g.pow(2).sum() for g in expected))
        expected = [g * min(1.0, 1e-3 / (float(total) + 1e-6)) for g in expected]
        assert float(norm) > 1e-3
    elif edit == "scale":
        for p in net.parameters():
            p.grad.mul_(0.5)
        expected = [g * 0.5 for g in expected]
    elif edit == "unscale":
        scaler.unscale_(opt)
    err = max(float((p.grad - g).abs().max()) for p, g in zip(net.parameters(), expected))
    scaler.step(opt) if edit == "unscale" else opt.step()
    moved = max(float((p.detach() - (b - 0.1 * g)).abs().max())
                for p, b, g in zip(net.parameters(), before, expected))
    say(edit, "grad error", "ok" if err < 1e-6 else err,
        "step error", "ok" if moved < 1e-6 else moved)
""",
    # a parameter no rank uses, and one that only rank 0 uses
    "unused": """
hvd.init()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.never = torch.nn.Linear(4, 2)
        self.rank0 = torch.nn.Linear(4, 2)
    def forward(self, x):
        out = self.used(x)
        return out + self.rank0(x) if hvd.rank() == 0 else out
net = Net()
opt = hvd.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5),
                               named_parameters=net.named_parameters())
never = [p.detach().clone() for p in net.never.parameters()]
rank0 = [p.detach().clone() for p in net.rank0.parameters()]
for step in range(3):
    opt.zero_grad()
    net(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    say("step", step, "never.grad", [p.grad is None for p in net.never.parameters()],
        "rank0.grad", [p.grad is None for p in net.rank0.parameters()])
say("never moved:", not any(not torch.equal(a, p.detach())
                            for a, p in zip(never, net.never.parameters())),
    "state:", any(p in opt.state for p in net.never.parameters()),
    "rank0 moved:", all(not torch.equal(a, p.detach())
                        for a, p in zip(rank0, net.rank0.parameters())))
""",
    # broadcast_parameters forgotten: every rank built its own random model
    "unbroadcast": """
hvd.init()
net = model(seed=hvd.rank())
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
for step in range(2):
    x, y = batch(step)
    try:
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        say("stepped")
    except hvd.CollectiveError as e:
        say("CollectiveError:", str(e).splitlines()[0])
        opt.zero_grad()
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
""",
    # no hvd.init(): the first collective initialises, and torch still gets the budget
    "no_init": """
hvd.allreduce(torch.ones(3))
say("torch threads", torch.get_num_threads(), "budget", budget.resolve(0, hvd.local_size()),
    "cores", budget.cores())
""",
    "init": """
hvd.init()
say("torch threads", torch.get_num_threads())
""",
    "set_before_init": """
torch.set_num_threads(3)
hvd.init()
say("torch threads", torch.get_num_threads())
""",
}


def run(case, n, **env):
    script = COMMON + CASES[case]
    environ = child_env(**env)
    for key in [k for k, v in env.items() if v is None]:
        environ.pop(key)
    p = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", str(n), sys.executable,
                        "-c", script], env=environ, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return sorted(line for line in p.stdout.splitlines() if line.startswith("rank "))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_edit_between_backward_and_step_acts_on_the_averaged_gradients(n):
    lines = run("edit", n)
    for r in range(n):
        for edit in ("none", "clip", "scale", "unscale"):
            assert f"rank {r}: {edit} grad error ok step error ok" in lines, lines


@pytest.mark.parametrize("n", [1, 2])
def test_parameters_no_rank_used_keep_no_gradient_and_do_not_move(n):
    lines = run("unused", n)
    for r in range(n):
        assert f"rank {r}: step 2 never.grad [True, True] rank0.grad [False, False]" in lines, \
            lines
        assert f"rank {r}: never moved: True state: False rank0 moved: True" in lines, lines


def test_replicas_that_start_different_raise_on_every_rank_at_the_first_step():
    lines = run("unbroadcast", 2)
    for r in range(2):
        error = next(x for x in lines if x.startswith(f"rank {r}: CollectiveError"))
        assert "hvd.broadcast_parameters(model.state_dict(), root_rank=0)" in error, error
        assert "different parameters" in error
    # after the broadcast the next step goes through
    assert lines.count("rank 0: stepped") == 1 and lines.count("rank 1: stepped") == 1, lines


def test_an_entry_point_without_init_gives_torch_the_budget():
    lines = run("no_init", 2, OMP_NUM_THREADS=None, OPENBLAS_NUM_THREADS=None,
                NUMBA_NUM_THREADS=None)
    for line in lines:
        words = line.split()
        threads, expected, cores = int(words[4]), int(words[6]), int(words[8])
        assert expected == max(1, cores // 2) and threads == expected, line


def test_an_exported_omp_num_threads_is_honoured():
    assert run("init", 1, OMP_NUM_THREADS="1") == ["rank 0: torch threads 1"]
    assert run("init", 1, OMP_NUM_THREADS="1", MPITRAIN_THREADS="2") == [
        "rank 0: torch threads 2"]


def test_torch_set_num_threads_before_init_is_honoured():
    assert run("set_before_init", 1, OMP_NUM_THREADS=None) == ["rank 0: torch threads 3"]
