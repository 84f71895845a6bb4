"""Sharding: the bytes each rank holds, its peak RSS and the step time, per sharding.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/sharding.py [--json PATH]
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sharding.py --memory-only \
        --n-layer 8 --n-head 8 --n-embd 512 --block-size 256 [--only SHARDING]

The zoo's GPT with AdamW under ``DistributedOptimizer(..., sharding=S)`` for S in "none",
"optimizer" (ZeRO stage 1: the optimizer state split), "gradients" (stage 2: the gradient
buckets reduce-scattered, the optimizer state and the gradients split) and "parameters" (stage
3: the parameters split too, each layer's gathered for its forward and its backward), one
replica of the model per sharding in the same job.

Memory: ``DistributedOptimizer.memory_bytes()`` per rank (the largest over the ranks) after one
step -- "gradients" releases the whole gradients at the step and keeps its 1/N shard; during
backward a step's gradients still exist whole until their bucket is reduce-scattered;
"parameters" keeps its share of the parameters from the end of the first step on, and during a
step holds whole only the layers being computed and prefetched -- and
each column's share of the unsharded one against 1/N. Peak RSS: ``ru_maxrss`` of each rank's
process at the end (and before the replicas were built), the largest over the ranks, and the
resident set at the end (the first step of "parameters" runs on whole parameters, so its
saving shows after it, not in the peak); with all
shardings in one process it counts every replica, so ``--only S`` builds just one and a run
per sharding gives each its own peak.

Time: one rank's training step (forward, backward with the overlapped average, AdamW, for the
sharded runs the parameters' allgathers), the replicas alternating step by step in the same job
(the order rotated every step; a load change hits all alike); the median of the slowest rank's
step, and its ratio to "none". The final parameters of every replica are compared bit for bit
with the unsharded one's: the same bits are expected with the ring allreduce (the benchmark
sets MPITRAIN_ALLREDUCE=ring unless it is set; at N = 2 any algorithm gives the same bits).
``--memory-only``: two untimed steps (the table after the first; the second's backward runs
with the optimizer state already written, whose zeroed pages count in RSS only once written),
no timed steps; ``--no-step``: none at all (a model too large to step on this machine still
tells its bytes; the "gradients" column of "gradients" then counts the whole gradients
allocated at construction beside the shard: 1 + 1/N).
"""
import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402

SHARDINGS = ("none", "optimizer", "gradients", "parameters")
COLUMNS = ("parameters", "gradients", "optimizer_state")


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
    ap.add_argument("--memory-only", action="store_true",
                    help="two untimed steps, the memory table, no timed steps")
    ap.add_argument("--no-step", action="store_true",
                    help="with --memory-only: no step at all (bytes as built)")
    ap.add_argument("--only", choices=SHARDINGS,
                    help="build this sharding only (its own peak RSS)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ["n_layer", "n_head", "n_embd", "block_size", "vocab",
                                        "batch", "steps"])
    if args.no_step and not args.memory_only:
        ap.error("--no-step needs --memory-only")
    if args.warmup < 1 and not args.memory_only:
        ap.error("--warmup must be at least 1 (the memory table is taken after the first step)")
    return args


def peak_rss_bytes():
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes():
    """This process's resident set now (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("MPITRAIN_ALLREDUCE", "ring")     # read by mt.init
    import numpy as np

    import mpitrain as mt

    mt.init(threads=1)
    n, rank = mt.size(), mt.rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    shardings = (args.only,) if args.only else SHARDINGS
    rss_before = max(mt.allgather_object(peak_rss_bytes()))

    def replica(sharding):
        model = mt.models.get("gpt", vocab_size=args.vocab, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        inner = mt.optim.AdamW(model.parameters(), lr=1e-3, no_decay=mt.optim.is_bias_or_norm)
        return model, mt.DistributedOptimizer(inner, model.named_parameters(), sharding=sharding)

    runs = {s: replica(s) for s in shardings}
    elements = sum(p.size for p in next(iter(runs.values()))[0].parameters())
    report = {"ranks": n, "parameters": int(elements), "model": vars(args),
              "allreduce": os.environ["MPITRAIN_ALLREDUCE"], "shardings": list(shardings)}
    say(f"GPT {args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, block "
        f"{args.block_size}: {elements / 1e6:.2f} M parameters, AdamW, {n} ranks, batch "
        f"{args.batch} per rank, MPITRAIN_ALLREDUCE={report['allreduce']}")

    loss_fn = mt.nn.SoftmaxCrossEntropy()
    rng = np.random.default_rng(rank)
    x = rng.integers(0, args.vocab, (args.batch, args.block_size), dtype=np.int64)
    y = rng.integers(0, args.vocab, (args.batch, args.block_size), dtype=np.int64)

    first_step = {}     # the process's peak RSS after the first step's backward, and its step

    def step(sharding):
        model, opt = runs[sharding]
        opt.zero_grad()
        loss_fn(model.forward_through(x), y)
        model.backward(loss_fn.backward(), on_layer_done=opt.backward_hook)
        after_backward = peak_rss_bytes()
        opt.step()
        first_step.setdefault(sharding, (after_backward, peak_rss_bytes()))

    steps_done = 0
    times = {s: [] for s in shardings}
    total = 0 if args.no_step else 2 if args.memory_only else args.warmup + args.steps
    for i in range(total):
        k = i % len(shardings)
        for sharding in shardings[k:] + shardings[:k]:
            mt.barrier()
            start = time.perf_counter()
            step(sharding)
            if i >= args.warmup and not args.memory_only:
                times[sharding].append(max(mt.allgather_object(time.perf_counter() - start)))
        steps_done += 1
        if i == 0:
            memory_table(mt, runs, report, n, say, steps_done)
    if total == 0:
        memory_table(mt, runs, report, n, say, 0)

    if times and all(times.values()):
        med = {s: statistics.median(t) for s, t in times.items()}
        report["step_s"] = med
        say(f"step, median of {args.steps} (alternated), slowest rank:")
        for s in shardings:
            ratio = f"  / none {med[s] / med['none']:.3f}" if "none" in med else ""
            say(f"  {s:10} {med[s] * 1e3:8.1f} ms{ratio}")
        if "none" in med:
            report["step_ratio"] = {s: med[s] / med["none"] for s in shardings}
    if "none" in runs and steps_done and len(runs) > 1:
        base = runs["none"][0].state_dict()
        same = {}
        for s in shardings:
            if s == "none":
                continue
            with runs[s][1].full_parameters():      # collective: sharded parameters
                mine = runs[s][0].state_dict(copy=True)
            local = all(mine[k].tobytes() == base[k].tobytes() for k in base)
            same[s] = all(mt.allgather_object(local))
        report["same_bits"] = same
        say(f"parameters after {steps_done} steps against none: " + ", ".join(
            f"{s} {'the same bits' if v else 'DIFFERENT'}" for s, v in same.items()))

    rss = mt.allgather_object(peak_rss_bytes())
    now = max(mt.allgather_object(rss_bytes()))
    report["peak_rss_bytes"] = {"max": max(rss), "per_rank": rss, "before_replicas": rss_before}
    report["rss_bytes_at_end"] = now
    say(f"peak RSS per rank ({', '.join(shardings)} built): {max(rss) / 2**20:.0f} MiB "
        f"(before the replicas: {rss_before / 2**20:.0f} MiB; at the end, after "
        f"{steps_done} steps: {now / 2**20:.0f} MiB)")
    if first_step:      # in step order: with several replicas each includes those before it
        worst = {s: [max(v) for v in zip(*mt.allgather_object(first_step[s]))]
                 for s in shardings}
        report["peak_rss_bytes"]["first_step"] = {
            s: {"after_backward": b, "after_step": a} for s, (b, a) in worst.items()}
        say("  first step, peak so far: " + ", ".join(
            f"{s} {b / 2**20:.0f} MiB after backward, {a / 2**20:.0f} after the step"
            for s, (b, a) in worst.items()))
    if args.json and rank == 0:
        benchutil.write_json(args.json, report)


def memory_table(mt, runs, report, n, say, steps_done):
    say(f"memory per rank after {steps_done} step(s), MB (share of none's; 1/N = {1 / n:.4f})")
    say(f"{'sharding':10} {'parameters':>18} {'gradients':>18} {'optimizer state':>18}")
    for sharding, (_, opt) in runs.items():
        held = opt.memory_bytes()
        report[f"memory.{sharding}"] = {k: max(mt.allgather_object(v)) for k, v in held.items()}
    base = report.get("memory.none")
    shares = {}
    for sharding in runs:
        worst = report[f"memory.{sharding}"]
        if base is not None:
            shares[sharding] = {k: worst[k] / base[k] for k in COLUMNS if base[k]}
        cells = []
        for k in COLUMNS:
            share = shares.get(sharding, {}).get(k)
            cells.append(f"{worst[k] / 1e6:9.2f}" + (f" ({share:.4f})" if share is not None
                                                      else " " * 9))
        say(f"{sharding:10} " + " ".join(f"{c:>18}" for c in cells))
    if base is not None:
        report["shares"] = shares
        if "optimizer" in shares:       # the key the stage-1 runs wrote
            report["optimizer_state_share"] = shares["optimizer"]["optimizer_state"]


if __name__ == "__main__":
    main()
