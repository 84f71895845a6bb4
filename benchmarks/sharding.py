"""Optimizer-state sharding: the bytes each rank holds and the step time, sharded vs unsharded.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/sharding.py [--json PATH]
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sharding.py --memory-only \
        --n-layer 8 --n-head 8 --n-embd 512 --block-size 256

Memory: ``DistributedOptimizer.memory_bytes()`` of the zoo's GPT with AdamW, for
``sharding="none"`` and ``"optimizer"``, per rank (parameters, gradients, optimizer state) and
the optimizer state's share of the unsharded one against 1/N. Time: one rank's training step
(forward, backward, the average, AdamW, for the sharded run the parameters' allgather) of two
replicas of the same model, one per sharding, alternating step by step in the same job (a load
change hits both alike); the median of the slowest rank's step. The final parameters of the two
replicas are compared bit for bit. ``--memory-only`` builds the optimizers without stepping (a
model too large to step on this machine still tells its bytes).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ["n_layer", "n_head", "n_embd", "block_size", "vocab",
                                        "batch", "steps"])
    return args


def main(argv=None):
    args = parse_args(argv)
    import numpy as np

    import mpitrain as mt

    mt.init(threads=1)
    n, rank = mt.size(), mt.rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    def replica(sharding):
        model = mt.models.get("gpt", vocab_size=args.vocab, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        inner = mt.optim.AdamW(model.parameters(), lr=1e-3, no_decay=mt.optim.is_bias_or_norm)
        return model, mt.DistributedOptimizer(inner, model.named_parameters(), sharding=sharding)

    runs = {s: replica(s) for s in ("none", "optimizer")}
    elements = sum(p.data.size for p in runs["none"][0].parameters())
    report = {"ranks": n, "parameters": int(elements), "model": vars(args)}
    say(f"GPT {args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, block "
        f"{args.block_size}: {elements / 1e6:.2f} M parameters, AdamW, {n} ranks")
    say(f"{'sharding':10} {'parameters':>12} {'gradients':>12} {'optimizer':>12}  per rank, MB")
    for sharding, (_, opt) in runs.items():
        held = opt.memory_bytes()
        worst = {k: max(mt.allgather_object(v)) for k, v in held.items()}
        report[f"memory.{sharding}"] = worst
        say(f"{sharding:10} {worst['parameters'] / 1e6:12.2f} {worst['gradients'] / 1e6:12.2f} "
            f"{worst['optimizer_state'] / 1e6:12.2f}")
    share = (report["memory.optimizer"]["optimizer_state"]
             / report["memory.none"]["optimizer_state"])
    report["optimizer_state_share"] = share
    say(f"optimizer state per rank, sharded / unsharded: {share:.4f} (1/N = {1 / n:.4f})")
    if not args.memory_only:
        loss_fn = mt.nn.SoftmaxCrossEntropy()
        rng = np.random.default_rng(rank)
        x = rng.integers(0, args.vocab, (args.batch, args.block_size), dtype=np.int64)
        y = rng.integers(0, args.vocab, (args.batch, args.block_size), dtype=np.int64)
        times = {s: [] for s in runs}
        for i in range(args.warmup + args.steps):
            for sharding, (model, opt) in runs.items():
                mt.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                loss_fn(model.forward_through(x), y)
                model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
                opt.step()
                if i >= args.warmup:
                    times[sharding].append(max(mt.allgather_object(time.perf_counter() - start)))
        med = {s: statistics.median(t) for s, t in times.items()}
        report["step_s"] = med
        say(f"step, median of {args.steps} (alternated): none {med['none'] * 1e3:.1f} ms, "
            f"optimizer {med['optimizer'] * 1e3:.1f} ms, ratio "
            f"{med['optimizer'] / med['none']:.3f}")
        a, b = (runs[s][0].state_dict() for s in ("optimizer", "none"))
        same = all(a[k].tobytes() == b[k].tobytes() for k in b)
        report["same_bits"] = same
        say(f"parameters after {args.warmup + args.steps} steps, sharded vs unsharded: "
            f"{'the same bits' if same else 'DIFFERENT'}")
    if args.json and rank == 0:
        benchutil.write_json(args.json, report)


if __name__ == "__main__":
    main()
