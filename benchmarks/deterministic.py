"""What ``--deterministic`` costs: step time against the default mode, N = 1 and 2, in one run.

    python benchmarks/deterministic.py [--model mlp lenet] [--ranks 1 2] [--global-batch 128]
        [--micro-shards 8] [--steps 60 30] [--rounds 3] [--threads 1] [--json PATH]
        [--markdown PATH]

Each point launches the real CLI (``mpiexec -n N python -m mpitrain``, synthetic data, the
global batch split N ways) once in the default mode and once with ``--deterministic``, the two
back to back in alternating order, ``--rounds`` times; the figure is the median over rounds of
the summary's ``step_time_ms`` (forward, backward, averaging and update; warm-up steps excluded),
and the ratio is deterministic / default of the same round, median over rounds -- so a drift of
the shared machine's speed between rounds cancels. Both modes run the same ``--threads`` per
rank (default 1: the deterministic mode's default, because OpenBLAS's bits depend on the thread
count); the default mode would otherwise take cores / ranks.

Where the cost comes from (module docstring of mpitrain/parallel/deterministic.py): M/N
passes of G/M samples instead of one pass of G/N (smaller GEMMs, each writing a whole weight gradient, and
more per-layer overhead), log2(M/N) vector additions, and an allreduce that starts only after
backward (no overlap).
A job that fails stops the run: one line and exit 1. Environment: ``MPIEXEC`` as for
benchmarks/scaling.py.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchutil
from scaling import build_command, read_summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["mlp", "lenet"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--micro-shards", type=int, default=8)
    ap.add_argument("--steps", type=int, nargs="+", default=[60, 30],
                    help="steps per job, one per --model (the last repeats)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads per rank, both modes")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    for n in args.ranks:
        if args.global_batch % n or args.micro_shards % n:
            ap.error(f"{n} ranks must divide --global-batch and --micro-shards")
    if args.rounds < 1 or min(args.steps) < 6:
        ap.error("--rounds must be >= 1 and --steps >= 6 (5 warm-up steps are not timed)")
    return args


def run_job(model, n, deterministic, steps, args, folder):
    metrics = Path(folder) / f"{model}-{n}-{int(deterministic)}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = build_command(n, model, "synthetic", args.global_batch // n, steps, metrics,
                        args.timeout, ["--synthetic-samples", str(args.global_batch * 8),
                                       "--threads", str(args.threads),
                                       "--micro-shards", str(args.micro_shards)]
                        + (["--deterministic"] if deterministic else []))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"deterministic.py: {model} N={n} deterministic={deterministic} failed "
                 f"(exit {p.returncode}): {last}")
    summary = read_summary(metrics)
    if not summary["step_time_ms"] > 0:
        sys.exit(f"deterministic.py: {model} N={n}: step time {summary['step_time_ms']!r}")
    return summary["step_time_ms"], summary["comm_time_ms"]


def main(argv=None):
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i, model in enumerate(args.model):
            steps = args.steps[min(i, len(args.steps) - 1)]
            for n in args.ranks:
                runs = {False: [], True: []}
                ratios = []
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    got = {mode: run_job(model, n, mode, steps, args, folder) for mode in order}
                    for mode in order:
                        runs[mode].append(got[mode])
                    ratios.append(got[True][0] / got[False][0])
                row = {"model": model, "ranks": n, "global_batch": args.global_batch,
                       "micro_shards": args.micro_shards, "threads": args.threads,
                       "steps": steps, "rounds": args.rounds,
                       "default_step_ms": statistics.median(t for t, _ in runs[False]),
                       "default_comm_ms": statistics.median(c for _, c in runs[False]),
                       "deterministic_step_ms": statistics.median(t for t, _ in runs[True]),
                       "deterministic_comm_ms": statistics.median(c for _, c in runs[True]),
                       "ratio": statistics.median(ratios), "ratios": ratios}
                rows.append(row)
                print(f"{model:6} N={n}  default {row['default_step_ms']:8.2f} ms  "
                      f"deterministic {row['deterministic_step_ms']:8.2f} ms  "
                      f"ratio {row['ratio']:.2f}x  (rounds {', '.join(f'{x:.2f}' for x in ratios)})",
                      flush=True)
    if args.json:
        benchutil.write_json(args.json, {"argv": sys.argv[1:], "rows": rows})
    table = ["| model | N | default step (comm) ms | deterministic step (comm) ms | ratio |",
             "|---|---|---|---|---|"]
    table += [f"| {r['model']} | {r['ranks']} | {r['default_step_ms']:.2f} "
              f"({r['default_comm_ms']:.2f}) | {r['deterministic_step_ms']:.2f} "
              f"({r['deterministic_comm_ms']:.2f}) | {r['ratio']:.2f}x |" for r in rows]
    text = "\n".join(table) + "\n"
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
