"""What mpitrain.torch's ``deterministic=True`` costs: step time against the default mode.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_deterministic.py \
        [--global-batch 64] [--micro-shards 4] [--steps 30] [--warmup 5] [--json PATH]

One job, both modes on the same model, steps alternating (default, deterministic, default,
...), so a drift of the shared machine's speed falls on both. Default: each rank one forward
and backward of G/N samples, ``hvd.DistributedOptimizer`` averaging in its buckets during
backward. Deterministic: ``backward_passes_per_step=M/N``, ``deterministic=True``, each rank
M/N passes of G/M samples from ``hvd.micro_shards`` (torch's generator seeded per micro-shard),
the fixed-tree sum after the last pass and the BatchNorm replay at ``step()``. Models: a small
CIFAR-shaped CNN with BatchNorm and dropout (SGD with momentum) and nanoGPT's "baby" GPT
(gpt_step.py; AdamW, clipping between the average and the step). The figure is the median
step time (zero_grad to step, every rank's slowest) after warm-up; ratio = deterministic /
default. One thread per rank (the deterministic mode needs a fixed thread count).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import benchutil
import gpt_step
import mpitrain.torch as hvd


# nanoGPT's "baby" Shakespeare shape (benchmarks/gpt_step.py's defaults)
GPT = dict(vocab=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 8 * 8, 10))


class Case:
    """One model in one mode: its optimizer and one timed step on a global batch."""

    def __init__(self, name, deterministic, passes):
        torch.manual_seed(0)
        self.name, self.deterministic, self.passes = name, deterministic, passes
        if name == "cnn":
            self.model = cnn()
            inner = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
            self.clip = None
        else:
            self.model = gpt_step.torch_gpt(**GPT)
            inner = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
            self.clip = 1.0
        kwargs = dict(backward_passes_per_step=passes, deterministic=True) if deterministic \
            else {}
        self.opt = hvd.DistributedOptimizer(
            inner, named_parameters=self.model.named_parameters(), **kwargs)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.model.train()

    def loss(self, x, y):
        if self.name == "cnn":
            return F.cross_entropy(self.model(x), y)
        return self.model(x, y)

    def step(self, x, y, step, micro_shards):
        opt = self.opt
        opt.zero_grad()
        if self.deterministic:
            for xb, yb in hvd.micro_shards(x, y, micro_shards=micro_shards, step=step):
                self.loss(xb, yb).backward()
        else:
            n, r = hvd.size(), hvd.rank()
            b = x.shape[0] // n
            self.loss(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]).backward()
        if self.clip is None:
            opt.step()
        else:
            opt.synchronize()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            with opt.skip_synchronize():
                opt.step()


def batch(name, g, step):
    gen = torch.Generator().manual_seed(step)
    if name == "cnn":
        return torch.randn(g, 3, 32, 32, generator=gen), torch.randint(0, 10, (g,),
                                                                       generator=gen)
    data = torch.randint(0, GPT["vocab"], (g, GPT["block_size"] + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def measure(name, args):
    n = hvd.size()
    cases = [Case(name, False, 1), Case(name, True, args.micro_shards // n)]
    times = {False: [], True: []}
    for step in range(args.warmup + args.steps):
        x, y = batch(name, args.global_batch, step)
        for case in cases:
            hvd.barrier()
            start = time.perf_counter()
            case.step(x, y, step, args.micro_shards)
            seconds = max(hvd.allgather_object(time.perf_counter() - start))
            if step >= args.warmup:
                times[case.deterministic].append(seconds)
    default, det = (statistics.median(times[k]) * 1e3 for k in (False, True))
    return {"model": name, "ranks": n, "global_batch": args.global_batch,
            "micro_shards": args.micro_shards, "default_ms": round(default, 2),
            "deterministic_ms": round(det, 2), "ratio": round(det / default, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["cnn", "gpt"], choices=["cnn", "gpt"])
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-shards", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    hvd.init(threads=1)
    torch.use_deterministic_algorithms(True)
    rows = [measure(name, args) for name in args.model]
    if hvd.rank() == 0:
        print(f"{'model':6} {'N':>2} {'G':>4} {'M':>3} {'default ms':>11} "
              f"{'determ. ms':>11} {'ratio':>6}")
        for r in rows:
            print(f"{r['model']:6} {r['ranks']:>2} {r['global_batch']:>4} "
                  f"{r['micro_shards']:>3} {r['default_ms']:>11.2f} "
                  f"{r['deterministic_ms']:>11.2f} {r['ratio']:>6.3f}")
        if args.json:
            benchutil.write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
