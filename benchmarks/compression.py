"""Gradient compression on a GPT-shaped gradient set: bytes on the wire and time per step, one run.

    mpiexec -n 2 python benchmarks/compression.py [--d-model 256] [--layers 4] [--vocab 8192]
                                                  [--rank 4] [--steps 10] [--rounds 3]
                                                  [--json PATH]

The gradient set is a GPT's parameters (token and position embeddings, per layer the attention's
four d x d projections, the MLP's d x 4d and 4d x d, two LayerNorms, a final one). Each mode --
``none``, ``fp16``, ``bf16``, ``powersgd`` (rank ``--rank``, compressing from the first step)
and ``adasum`` (op=mt.Adasum, uncompressed) where N is a power of two -- gets its own
mt.DistributedOptimizer (SGD, lr 0) over those parameters, with the same random gradients on
each step, and is timed through ``synchronize()`` (cast, fused allreduce,
cast back: the engine's whole gradient path after backward, no overlap). Time: the slowest
rank's, best of ``--rounds`` rounds of the mean of ``--steps`` steps; modes alternate within a
round, so a noisy machine slows them alike. Bytes: what each rank sends per step, the ring's
2(N-1)/N of the wire buffer (PowerSGD's: the P and Q factors and the uncompressed gradients;
Adasum's allgather: N-1 buffers).
"""
import argparse
import sys

import numpy as np

import benchutil
import mpitrain as mt
from mpitrain.parallel.optimizer import DistributedOptimizer


def gpt_shapes(d, layers, vocab, context=256):
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(d,)] * 4 + [(d, 4 * d), (4 * d,), (4 * d, d), (d,)]
        shapes += [(d,), (d,), (d,), (d,)]                       # two LayerNorms
    return shapes + [(d,), (d,)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ["d_model", "layers", "vocab", "rank", "steps",
                                        "rounds"])
    mt.init()
    n, rank = mt.size(), mt.rank()
    shapes = gpt_shapes(args.d_model, args.layers, args.vocab)
    elements = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(s).astype(np.float32) * 1e-2 for s in shapes]
    modes = {"none": dict(compression=mt.Compression.none),
             "fp16": dict(compression=mt.Compression.fp16),
             "bf16": dict(compression=mt.Compression.bf16),
             "powersgd": dict(compression=mt.Compression.powersgd(rank=args.rank,
                                                                  start_iter=0))}
    if n & (n - 1) == 0:
        modes["adasum"] = dict(op=mt.Adasum)
    runs = {}
    for mode, kw in modes.items():
        params = [mt.nn.Parameter(np.zeros(s, np.float32)) for s in shapes]
        opt = DistributedOptimizer(mt.optim.SGD(params, lr=0.0),
                                   [(f"p{i}", p) for i, p in enumerate(params)], overlap=False,
                                   **kw)
        runs[mode] = (params, opt)

    def step(mode):
        params, opt = runs[mode]
        for p, g in zip(params, grads):
            p.grad[...] = g
        opt.synchronize()
        opt.step()

    best = {mode: float("inf") for mode in modes}
    for mode in modes:
        step(mode)                                                     # JIT, buffers
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    for _ in range(args.rounds):
        for mode in modes:
            t = benchutil.timed(lambda: [step(mode) for _ in range(args.steps)], before=mt.barrier)
            best[mode] = min(best[mode], float(benchutil.slowest(comm, t)[0]) / args.steps)
    rows = []
    for mode in modes:
        wire = 2 if mode in ("fp16", "bf16") else 4
        values = elements
        if mode == "powersgd":
            comp = modes[mode]["compression"]
            values = 0
            for s in shapes:
                r = comp.compressed_rank(s)
                size = int(np.prod(s))
                values += size if r is None else (s[0] + size // s[0]) * r
        sent = values * wire * ((n - 1) if mode == "adasum" else 2 * (n - 1) / n)
        rows.append({"mode": mode, "ms_per_step": round(best[mode] * 1e3, 2),
                     "bytes_sent_per_rank": int(sent)})
    if rank == 0:
        print(f"N = {n}, {len(shapes)} gradients, {elements} float32 values "
              f"({elements * 4 / 2**20:.1f} MiB)")
        for r in rows:
            print(f"{r['mode']:>8}: {r['ms_per_step']:8.2f} ms/step, "
                  f"{r['bytes_sent_per_rank'] / 2**20:7.1f} MiB sent per rank")
        if args.json:
            benchutil.write_json(args.json, {"ranks": n, "elements": elements,
                                             "argv": sys.argv[1:], "modes": rows})


if __name__ == "__main__":
    main()
