"""mpitrain.torch's sharded optimizers against PyTorch's ZeroRedundancyOptimizer, on the CPU.

    OMP_NUM_THREADS=1 MPITRAIN_ALLREDUCE=ring mpiexec -n 2 python benchmarks/torch_zero.py \
        [--steps 20] [--warmup 3] [--json PATH]

nanoGPT's GPT on the "baby" shape of benchmarks/torch_frontend.py (its model, its AdamW with
nanoGPT's two groups -- weight decay 0.1 on the matrices, none on the rest -- lr 1e-3, betas
(0.9, 0.99); ``clip_grad_norm_(1.0)`` between backward and step), batch 12 per rank, one thread
per rank, four replicas of the same model in the same job:

(a) ``hvd.DistributedOptimizer(AdamW)``, unsharded;
(b) ``hvd.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, ...)`` (the optimizer state split);
(c) ``hvd.DistributedOptimizer(AdamW, sharding="gradients")`` (state and gradients split;
    clipped with ``opt.clip_grad_norm_``, which the three mpitrain runs all use);
(d) PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer(groups, AdamW, ...)`` over
    ``DistributedDataParallel`` with the gloo backend (rendezvous as torch_frontend.py's).

Memory per rank, after the last step (what is held between steps): the bytes of the local
optimizer's state tensors (for (b) and (d) their inner ``optim``) and of the gradients still
set (``p.grad`` not None). DDP's own bucket buffers (a flat copy of the gradients, kept
between steps) are not counted. Time: zero_grad + forward + backward + clip + step, the four
replicas alternating step by step (the order rotated every step; a load change hits all
alike), a barrier before each step; each step's slowest rank, the median over ``--steps``
after ``--warmup``, and its ratio to (d). Then the parameters: (b) and (c) bit for bit against
(a) (the same bits are expected; at N >= 3 with MPITRAIN_ALLREDUCE=ring, which the script sets
unless it is set), and (d)'s largest absolute difference from (a) (DDP sums in another order).
Prints a table; ``--json PATH`` writes the numbers. torch missing: one line, exit 2.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchdeps  # noqa: E402
import benchutil  # noqa: E402

VARIANTS = ("a", "b", "c", "d")
LABELS = {"a": "(a) hvd.DistributedOptimizer",
          "b": "(b) hvd.ZeroRedundancyOptimizer",
          "c": "(c) hvd.DistributedOptimizer(sharding=\"gradients\")",
          "d": "(d) torch ZeroRedundancyOptimizer + DDP (gloo)"}
SHORT = {"a": "(a) hvd DistOpt", "b": "(b) hvd ZeRO", "c": "(c) hvd gradients",
         "d": "(d) torch ZeRO+DDP"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    ap.add_argument("--batch", type=int, default=12, help="sequences per rank")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ["steps", "batch"])
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def check_torch(prog):
    """One line from rank 0 and exit 2 on every rank, before anything is built, where torch
    (or its gloo backend) is missing."""
    error = benchdeps.require("torch", prog)
    if error is None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_gloo_available()):
            error = f"{prog} needs torch.distributed with the gloo backend (variant (d))"
    if error:
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def state_bytes(state):
    """The bytes of every tensor in an optimizer's ``state`` (nested dicts and lists)."""
    import torch
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def main(argv=None):
    args = parse_args(argv)
    prog = "torch_zero.py"
    check_torch(prog)
    os.environ.setdefault("MPITRAIN_ALLREDUCE", "ring")     # read by hvd.init
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    import mpitrain.torch as hvd
    import torch_frontend as tf         # its nanoGPT model, AdamW groups and gloo rendezvous

    hvd.init(threads=1)
    torch.set_num_threads(1)
    n, rank = hvd.size(), hvd.rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    tf.start_gloo()

    def adamw_groups(model):
        """torch_frontend's AdamW for ``model``: its groups (params, weight decay) and the
        other hyper-parameters, for the ZeroRedundancyOptimizers' ``**defaults``."""
        base = tf.make_optimizer("gpt", model)
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                  for g in base.param_groups]
        defaults = {"lr": base.defaults["lr"], "betas": base.defaults["betas"]}
        return groups, defaults

    def build(variant):
        model = tf.plain("gpt")[0]          # torch.manual_seed(0): the same weights everywhere
        if variant == "d":
            model = nn.parallel.DistributedDataParallel(model)
            groups, defaults = adamw_groups(model)
            return model, TorchZeRO(groups, optimizer_class=torch.optim.AdamW, **defaults)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if variant == "b":
            groups, defaults = adamw_groups(model)
            return model, hvd.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **defaults)
        sharding = "gradients" if variant == "c" else "none"
        return model, hvd.DistributedOptimizer(tf.make_optimizer("gpt", model),
                                               named_parameters=model.named_parameters(),
                                               sharding=sharding)

    runs = {v: build(v) for v in VARIANTS}
    params0 = list(runs["a"][0].parameters())
    elements = sum(p.numel() for p in params0)
    report = {"ranks": n, "threads": 1, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "model": dict(tf.GPT), "parameters": elements,
              "tensors": len(params0), "allreduce": os.environ["MPITRAIN_ALLREDUCE"],
              "variants": LABELS}
    say(f"nanoGPT baby GPT ({elements / 1e6:.2f} M parameters in {len(params0)} tensors), "
        f"AdamW, clip 1.0, batch {args.batch} x {tf.GPT['block_size']} per rank, {n} ranks, "
        f"1 thread each, MPITRAIN_ALLREDUCE={report['allreduce']}")

    def batch(i):
        g = torch.Generator().manual_seed(1000 * i + rank)     # the same for every variant
        ids = torch.randint(0, tf.GPT["vocab"], (args.batch, tf.GPT["block_size"] + 1),
                            generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step(variant, x, y):
        model, opt = runs[variant]
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        if variant == "d":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm_(1.0)        # the whole gradients' norm, sharded or not
        opt.step()

    times = {v: [] for v in VARIANTS}
    errors = {}
    total = args.warmup + args.steps
    for i in range(total):
        x, y = batch(i)
        k = i % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            if v in errors:
                continue
            hvd.barrier()       # no rank starts a step behind: skew is no variant's cost
            start = time.perf_counter()
            try:
                step(v, x, y)
            except Exception as e:      # reported, the others go on (raised on every rank)
                errors[v] = f"step {i}: {type(e).__name__}: {e}"
                say(f"{SHORT[v]} failed at {errors[v]}")
                continue
            if i >= args.warmup:
                times[v].append(time.perf_counter() - start)

    # memory held between steps, on each rank
    def held(variant):
        model, opt = runs[variant]
        local = opt.optim if variant in ("b", "d") else opt
        params = list(model.parameters())
        return {"optimizer_state": state_bytes(local.state),
                "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
                "parameters": sum(p.nbytes for p in params),
                "state_tensors_of": sum(1 for p in params if p in local.state)}

    memory = {v: hvd.allgather_object(held(v)) for v in VARIANTS}
    own = {v: hvd.allgather_object(runs[v][1].memory_bytes()) for v in "abc"}
    for v in VARIANTS:
        report[f"memory.{v}"] = {k: [m[k] for m in memory[v]] for k in memory[v][0]}
        if v in own:
            report[f"memory_bytes.{v}"] = own[v]

    # step times: each step's slowest rank, then the median
    med = {}
    for v in VARIANTS:
        if v in errors:
            continue
        per_rank = hvd.allgather_object(times[v])
        slow = [max(t) for t in zip(*per_rank)]
        med[v] = statistics.median(slow)
        report[f"step.{v}"] = {"median_s": med[v], "slowest_per_step_s": slow}
    if "d" in med:
        report["ratio_to_d"] = {v: med[v] / med["d"] for v in med}

    # parameters: (b), (c) bit for bit against (a); (d) how far
    base = [p.detach() for p in runs["a"][0].parameters()]
    same, differ = {}, {}
    for v in ("b", "c"):
        mine = [p.detach() for p in runs[v][0].parameters()]
        bad = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum())
                  for a, b in zip(base, mine))
        worst = max(float((a - b).abs().max()) for a, b in zip(base, mine))
        gathered = hvd.allgather_object((bad, worst))
        same[v] = all(b == 0 for b, _ in gathered)
        differ[v] = {"elements_differing_per_rank": [b for b, _ in gathered],
                     "max_abs_diff": max(w for _, w in gathered)}
    theirs = [p.detach() for p in runs["d"][0].module.parameters()]
    d_diff = max(hvd.allgather_object(max(float((a - b).abs().max())
                                          for a, b in zip(base, theirs))))
    d_scale = max(float(a.abs().max()) for a in base)
    report["same_bits_as_a"] = same
    report["differences_from_a"] = differ
    report["d_max_abs_diff_from_a"] = d_diff
    report["max_abs_parameter"] = d_scale
    if errors:
        report["errors"] = errors

    say(f"\nper rank, after {total} steps (largest over the {n} ranks; share of (a)'s), and "
        f"the median step over {args.steps} (after {args.warmup} warm-up), slowest rank")
    say(f"{'variant':20} {'optimizer state':>20} {'gradients':>20} {'step':>9} {'/ (d)':>6}")
    a_mem = report["memory.a"]
    for v in VARIANTS:
        m = report[f"memory.{v}"]
        cells = []
        for k in ("optimizer_state", "gradients"):
            top, ref = max(m[k]), max(a_mem[k])
            cells.append(f"{top / 1e6:8.3f} MB ({top / ref:.3f})" if ref else f"{top:>20}")
        t = f"{med[v] * 1e3:6.1f} ms" if v in med else "failed"
        r = f"{med[v] / med['d']:6.3f}" if v in med and "d" in med else ""
        say(f"{SHORT[v]:20} {cells[0]:>20} {cells[1]:>20} {t:>9} {r:>6}")
    say("per rank (MB, rank 0..N-1): " + "; ".join(
        f"{v} state {'/'.join(f'{b / 1e6:.3f}' for b in report[f'memory.{v}']['optimizer_state'])}"
        f" grads {'/'.join(f'{b / 1e6:.3f}' for b in report[f'memory.{v}']['gradients'])}"
        for v in VARIANTS))
    def verdict(v):
        if same[v]:
            return f"{v} the same bits"
        count = sum(differ[v]["elements_differing_per_rank"])
        return f"{v} DIFFERENT ({count} elements, max |diff| {differ[v]['max_abs_diff']:.3g})"

    say(f"parameters after {total} steps against (a): {verdict('b')}, {verdict('c')}; "
        f"d max |diff| {d_diff:.3g} (largest |parameter| {d_scale:.3g})")
    for v, e in errors.items():
        say(f"error in {LABELS[v]}: {e}")
    dist.destroy_process_group()
    if args.json and rank == 0:
        benchutil.write_json(args.json, report)


if __name__ == "__main__":
    main()
