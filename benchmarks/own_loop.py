"""A user's own loop (docs/byo_loop.md) with mt.init()'s thread budget vs the libraries' defaults.

    mpiexec -n 2 python benchmarks/own_loop.py [--model mlp] [--batch 64] [--steps 20]
                                               [--rounds 3] [--json PATH]

``mt.init()`` gives each rank's BLAS ``cores / ranks on this node`` threads and Numba one, as
``python -m mpitrain`` does; before, a loop of one's own kept the libraries' defaults (a BLAS
pool and a Numba pool as wide as the machine, in every rank). Both settings are timed in the same
run, alternating round by round (``--rounds`` of ``--steps`` steps each, after two warm-up
steps), so the ratio holds on a noisy machine. Reported: the median step time of each setting.
The loop is the byo_loop.md one on synthetic data (no files needed).
"""
import argparse

import numba
import numpy as np

import benchutil
import mpitrain as mt
from mpitrain.runtime import threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=["mlp", "lenet"])
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting (alternating)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("batch", "steps", "rounds"))
    return args


def library_defaults():
    """What a process has without mt.init's budget: BLAS and Numba as wide as the machine."""
    n = threads.cores()
    threads.configure(n)                      # BLAS n (Numba is set to 1 there) ...
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))   # ... and Numba n again


def budget():
    threads.configure(0, mt.local_size())


def main(argv=None):
    args = parse_args(argv)
    mt.init()
    shape = (1, 28, 28)
    data = mt.data.synthetic(args.batch * mt.size() * 8, shape=shape, seed=0)
    model = mt.models.get(args.model, seed=0)
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters())
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = mt.data.DistributedSampler(data, batch_size=args.batch, seed=0)
    batches = sampler.indices()                                             # (steps, b)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    in_shape = model.input_shape

    def step(i):
        idx = batches[i % len(batches)]
        opt.zero_grad()
        loss_fn(model(data.images[idx].reshape((len(idx),) + in_shape)), data.labels[idx])
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
        opt.step()

    settings = {"mt.init budget": budget, "library defaults": library_defaults}
    times = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, apply in settings.items():
            apply()
            for i in range(2):
                step(i)                                                     # warm-up
            mt.barrier()
            for i in range(args.steps):
                times[name].append(benchutil.timed(lambda: step(i)))
    slowest = {name: np.max(mt.allgather_object(t), axis=0) for name, t in times.items()}
    result = {"ranks": mt.size(), "model": args.model, "batch": args.batch,
              "cores": threads.cores(),
              "median_step_ms": {n: float(np.median(t)) * 1e3 for n, t in slowest.items()}}
    if mt.rank() == 0:
        ms = result["median_step_ms"]
        print(f"own loop, {args.model}, {mt.size()} rank(s) on {threads.cores()} cores, "
              f"batch {args.batch}: median step (slowest rank)")
        for name, value in ms.items():
            print(f"  {name:18s} {value:8.1f} ms")
        print(f"  defaults / budget  {ms['library defaults'] / ms['mt.init budget']:8.2f}x")
        if args.json:
            benchutil.write_json(args.json, result, indent=2)
    return result


if __name__ == "__main__":
    main()
