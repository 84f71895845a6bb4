"""mpitrain.torch against plain PyTorch and DistributedDataParallel (gloo), on the CPU.

    OMP_NUM_THREADS=1 python benchmarks/torch_frontend.py --json out/bench/torch-1.json
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_frontend.py \
        --baseline out/bench/torch-1.json --json out/bench/torch-2.json

(a) one rank: the step time of a plain torch loop vs the same loop with
    ``hvd.DistributedOptimizer`` (its hooks and bookkeeping: at N=1 nothing is averaged);
(b) N ranks, weak scaling (batch 64 per rank): the step time with ``hvd.DistributedOptimizer``
    vs ``torch.nn.parallel.DistributedDataParallel`` over gloo, steps alternating in the same
    job; efficiency = the one-rank plain step of (a) (``--baseline`` its JSON) / this step;
(c) N ranks: ``hvd.allreduce_`` of float32 tensors from 4 KiB to 64 MiB vs
    ``torch.distributed.all_reduce`` (gloo), both in place, averaged (ours) / summed (gloo).

Models: a ResNet-18-style CIFAR network (3x3 stem, no max-pool, four stages of two BasicBlocks
at 64..512 channels, 11.2 M parameters, 3x32x32 input) and the MLP of the zoo (784-1024-1024-10),
batch 64 per rank, SGD with momentum; nanoGPT's GPT as its train.py trains it (``gpt``: the
"baby" shape, 0.81 M parameters in 52 tensors, batch 12 per rank, AdamW, clipping between
backward and step). One thread per rank; the median over timed steps after
warm-up steps, the compared loops' steps alternating. Prints tables; ``--json PATH`` writes
the numbers.
"""
import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import benchutil
import gpt_step
import mpitrain.torch as hvd


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(classes=10):
    layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def mlp():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


# nanoGPT's train.py on the "baby" Shakespeare shape of benchmarks/gpt_step.py: 4 layers,
# 4 heads, 128 channels, block 64, vocabulary 65, batch 12 per rank; AdamW (weight decay on the
# matrices only, as nanoGPT's configure_optimizers) and clip_grad_norm_(1.0) between backward
# and step, DDP's way (the averaged gradients are clipped).
GPT = dict(vocab=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def gpt():
    return gpt_step.torch_gpt(**GPT)


MODELS = {"resnet18": (resnet18, (3, 32, 32)), "mlp": (mlp, (784,)), "gpt": (gpt, None)}
BATCH = {"gpt": 12}


def inputs(name, batch):
    g = torch.Generator().manual_seed(hvd.rank())
    if name == "gpt":
        ids = torch.randint(0, GPT["vocab"], (batch, GPT["block_size"] + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return (torch.randn(batch, *MODELS[name][1], generator=g),
            torch.randint(0, 10, (batch,), generator=g))


def step_times(runs, name, batch, warmup, steps):
    """Median seconds of zero_grad + forward + backward (+ clipping for the GPT) + step for
    each (model, optimizer) of ``runs``, whose steps alternate, in reversed order every other
    round (a load change on the machine hits all of them alike), each after a barrier."""
    x, y = inputs(name, BATCH.get(name, batch))
    times = [[] for _ in runs]
    for i in range(warmup + steps):
        order = list(zip(runs, times))
        for (model, opt), kept in (order if i % 2 == 0 else order[::-1]):
            hvd.barrier()       # no rank starts a step behind: skew is no run's cost
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if name == "gpt":
                model(x, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= warmup:
                kept.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def make_optimizer(name, model):
    if name == "gpt":
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0}], lr=1e-3,
                                 betas=(0.9, 0.99))
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def plain(name):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    return model, make_optimizer(name, model)


def ours(name):
    model, opt = plain(name)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def ddp(name):
    model = nn.parallel.DistributedDataParallel(plain(name)[0])
    return model, make_optimizer(name, model)


def slowest(seconds):
    """A step is as slow as the slowest rank's."""
    return max(hvd.allgather_object(seconds))


def start_gloo():
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def allreduce_times(nbytes, repeats):
    """(ours, gloo) median seconds of one in-place allreduce of nbytes of float32."""
    t = torch.ones(nbytes // 4)
    mine, gloo = [], []
    for i in range(repeats + 2):                   # interleaved, first two not counted
        a = benchutil.timed(lambda: hvd.allreduce_(t, op=hvd.Average), hvd.barrier)
        b = benchutil.timed(lambda: dist.all_reduce(t), hvd.barrier)
        if i >= 2:
            mine.append(a)
            gloo.append(b)
    return slowest(statistics.median(mine)), slowest(statistics.median(gloo))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mlp"], choices=MODELS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=20, help="allreduces per size")
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--json")
    parser.add_argument("--baseline", help="JSON of a one-rank run (--json): efficiencies "
                                           "against its plain torch step")
    args = parser.parse_args()
    hvd.init(threads=1)
    n, report = hvd.size(), {"ranks": hvd.size(), "batch": args.batch, "threads": 1}
    say = print if hvd.rank() == 0 else (lambda *a, **k: None)
    if n == 1:
        say(f"(a) one rank, batch {args.batch}, 1 thread: median step, ms")
        say(f"{'model':10} {'torch':>9} {'hvd.DistributedOptimizer':>25} {'overhead':>9}")
        for name in args.models:
            t0, t1 = step_times([plain(name), ours(name)], name, args.batch, args.warmup,
                                args.steps)
            report[f"step.{name}"] = {"torch_s": t0, "ours_s": t1}
            say(f"{name:10} {t0 * 1e3:9.2f} {t1 * 1e3:25.2f} {100 * (t1 / t0 - 1):8.1f}%")
    else:
        start_gloo()
        base = {}
        if args.baseline:
            with open(args.baseline) as f:
                base = json.load(f)
        say(f"(b) {n} ranks, batch {args.batch} per rank, 1 thread each: median step, ms "
            f"(eff: the one-rank plain torch step of --baseline / this step)")
        say(f"{'model':10} {'1 rank':>8} {'ours':>8} {'eff':>6} {'DDP gloo':>9} {'eff':>6}")
        for name in args.models:
            mine, theirs = step_times([ours(name), ddp(name)], name, args.batch, args.warmup,
                                      args.steps)
            mine, theirs = slowest(mine), slowest(theirs)
            alone = base.get(f"step.{name}", {}).get("torch_s", float("nan"))
            report[f"scaling.{name}"] = {"one_rank_s": alone, "ours_s": mine, "ddp_s": theirs}
            say(f"{name:10} {alone * 1e3:8.2f} {mine * 1e3:8.2f} {alone / mine:6.2f} "
                f"{theirs * 1e3:9.2f} {alone / theirs:6.2f}")
        say(f"\n(c) {n} ranks: in-place allreduce of float32 tensors, median us")
        say(f"{'bytes':>10} {'hvd.allreduce_':>15} {'dist.all_reduce':>16} {'ratio':>6}")
        nbytes = 4096
        while nbytes <= args.max_bytes:
            repeats = args.repeats if nbytes < (8 << 20) else max(3, args.repeats // 4)
            a, b = allreduce_times(nbytes, repeats)
            report[f"allreduce.{nbytes}"] = {"ours_s": a, "gloo_s": b}
            say(f"{nbytes:>10} {a * 1e6:15.1f} {b * 1e6:16.1f} {b / a:6.2f}")
            nbytes *= 4
        dist.destroy_process_group()
    if args.json and hvd.rank() == 0:
        benchutil.write_json(args.json, report)


if __name__ == "__main__":
    main()
