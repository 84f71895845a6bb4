"""Scaling sweep: run ``mpiexec -n N python -m mpitrain`` for each N and model, tabulate, plot.

    python benchmarks/scaling.py --ranks 1 2 4 --model mlp lenet cifar_cnn --mode weak \\
        --steps 50 --out out/bench [--dataset synthetic|fashion-mnist] [--batch-size 64]

Why a runner that launches the real CLI rather than timing a loop in-process: the number users
care about is what ``mpirun -np N python -m mpitrain`` delivers, start-up, thread settings and
all. Every point is one job under ``timeout``; its ``--metrics-json`` summary record
(``samples_per_sec`` global and excluding warm-up, ``step_time_ms``, ``comm_time_ms``, ``ranks``,
``steps``) is the only thing read back.

Modes (``--batch-size`` means a different thing in each, so the table prints both batches):
- weak (Horovod convention): the per-rank batch is fixed at B; the global batch is N*B. Ideal:
  throughput grows as N, step time stays flat.
- strong (PNNL/MaTEx convention): the global batch is fixed at B; each rank takes B/N (an error
  if N does not divide B). Ideal: step time falls as 1/N.

Columns: speedup = throughput(N) / throughput(N0) * N0, with N0 the smallest N of the sweep
(N0 = 1 normally), efficiency = speedup / N, comm share = comm_time_ms / step_time_ms (the
fraction of a step spent in gradient averaging, as measured by the trainer).

``--ceiling``: for every N > 1 also run N *independent* single-rank jobs at the same time (same
per-rank batch, no communication at all) and report their summed throughput as a speedup, the
"no-comm ceiling": what N ranks would reach on this machine if averaging were free. The gap
between it and N is the machine (shared memory bandwidth and caches, clock), the gap between the
real speedup and it is ours (communication and synchronisation). Each independent job gets the
thread budget one of the N ranks would get (cores / N) unless ``--threads`` is passed through.
On the 2-core box the MLP's ceiling at N=2 measured 1.94 (300 steps, best of 3): two replicas
share the 32 MB L3 and the memory bandwidth.

Oversubscription: a point with N above the cores this process may use cannot scale (ranks take
turns on a core); it is still run, but a warning is printed and the point is marked ``*`` in the
table, ``"oversubscribed": true`` in the JSON and a hollow marker in the plot.

Outputs in ``--out``: ``scaling-<mode>.json`` (every point + the sweep's settings),
``scaling-<mode>.png`` (throughput and efficiency vs N against the ideal), ``runs/`` (each job's
metrics and log). ``--markdown [PATH]`` also writes the table as markdown (to PATH, else
stdout), with the command line, for pasting into docs/benchmarks.md. The PNG needs matplotlib
(``pip install 'mpitrain[bench]'``); without it the JSON and markdown are still written and the
PNG is skipped with one line (benchdeps.py).
A failed job stops the sweep: one line naming the point and the job's last error line, exit 1.

Environment: ``MPIEXEC`` (default <repo>/.venv/bin/mpiexec; may carry flags, e.g.
``"mpirun --oversubscribe"``).
"""
import argparse
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
from benchutil import REPO, check_positive, mpiexec_argv, usable_cores, write_text  # noqa: E402

MODELS = ("mlp", "lenet", "cifar_cnn", "resnet20", "resnet32", "resnet56")   # config.MODELS
REQUIRED = ("samples_per_sec", "step_time_ms", "comm_time_ms", "ranks", "steps")


class ScalingError(RuntimeError):
    """A sweep point failed or returned a value that cannot be right; the message is one line."""


def per_rank_batch(mode, batch, n):
    """Per-rank batch for N ranks: B in weak mode, B/N in strong mode (must divide)."""
    if mode == "weak":
        return batch
    if batch % n:
        raise ScalingError(f"strong scaling: global batch {batch} is not divisible by N={n}")
    return batch // n


def build_command(n, model, dataset, batch, steps, metrics_path, timeout_s, extra=()):
    """The argv of one sweep point: timeout + mpiexec -n N + python -m mpitrain + flags."""
    return (["timeout", "-k", "5", str(int(timeout_s))] + mpiexec_argv()
            + ["-n", str(n), sys.executable, "-m", "mpitrain",
               "--model", model, "--dataset", dataset, "--batch-size", str(batch),
               "--steps", str(steps), "--metrics-json", str(metrics_path), "--no-progress"]
            + list(extra))


def read_summary(metrics_path):
    """The last ``{"event": "summary"}`` record of a --metrics-json file (JSON lines)."""
    summary = None
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except OSError as e:
        raise ScalingError(f"no metrics file {metrics_path}: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ScalingError(f"{metrics_path}:{i}: not a JSON line: {line[:60]!r}") from None
        if isinstance(rec, dict) and rec.get("event") == "summary":
            summary = rec
    if summary is None:
        raise ScalingError(f"{metrics_path}: no summary record")
    missing = [k for k in REQUIRED if k not in summary]
    if missing:
        raise ScalingError(f"{metrics_path}: summary lacks {', '.join(missing)}")
    return summary


def threads_flag(extra):
    """The --threads K passed through to the trainer, or None (its default: cores / ranks)."""
    for i, arg in enumerate(extra):
        if arg == "--threads" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return None


def make_point(summary, model, mode, n, batch, cores):
    """One table row from a job's summary; refuses values that cannot be right."""
    sps = float(summary["samples_per_sec"])
    step_ms = float(summary["step_time_ms"])
    comm_ms = float(summary["comm_time_ms"])
    if int(summary["ranks"]) != n:
        raise ScalingError(f"{model} N={n}: the job reports ranks={summary['ranks']}")
    if not (sps > 0 and math.isfinite(sps)) or not (step_ms > 0 and math.isfinite(step_ms)):
        raise ScalingError(f"{model} N={n}: samples_per_sec={sps}, step_time_ms={step_ms}")
    if not 0 <= comm_ms <= step_ms * 1.05 + 1e-3:
        raise ScalingError(f"{model} N={n}: comm_time_ms={comm_ms} exceeds step {step_ms}")
    b = per_rank_batch(mode, batch, n)
    return {"model": model, "mode": mode, "ranks": n, "per_rank_batch": b,
            "global_batch": b * n, "samples_per_sec": sps, "step_time_ms": step_ms,
            "comm_time_ms": comm_ms, "comm_share": comm_ms / step_ms,
            "steps": int(summary["steps"]), "test_accuracy": summary.get("test_accuracy"),
            "oversubscribed": n > cores}


def add_speedup(points):
    """Fill speedup and efficiency per model, relative to the model's smallest N."""
    by_model = {}
    for p in points:
        by_model.setdefault(p["model"], []).append(p)
    for pts in by_model.values():
        base = min(pts, key=lambda p: p["ranks"])
        for p in pts:
            p["speedup"] = p["samples_per_sec"] / base["samples_per_sec"] * base["ranks"]
            p["efficiency"] = p["speedup"] / p["ranks"]
    return points


def best_of(points):
    """Best-of-repeats per (model, N): highest throughput (noise only ever slows a run)."""
    best = {}
    for p in points:
        key = (p["model"], p["ranks"])
        if key not in best or p["samples_per_sec"] > best[key]["samples_per_sec"]:
            best[key] = p
    return [best[k] for k in sorted(best, key=lambda k: (MODELS.index(k[0])
                                                         if k[0] in MODELS else 99, k[1]))]


HEADER = ("model", "N", "batch/rank", "global batch", "samples/s", "speedup", "efficiency",
          "comm share")
CEILING = "no-comm ceiling"


def _header(points):
    return HEADER + ((CEILING,) if any("ceiling_speedup" in p for p in points) else ())


def _cells(p, header=HEADER):
    mark = "*" if p["oversubscribed"] else ""
    cells = (p["model"], f"{p['ranks']}{mark}", str(p["per_rank_batch"]),
             str(p["global_batch"]), f"{p['samples_per_sec']:.1f}", f"{p['speedup']:.2f}",
             f"{p['efficiency']:.2f}", f"{100 * p['comm_share']:.1f}%")
    if CEILING in header:
        cells += (f"{p['ceiling_speedup']:.2f}" if "ceiling_speedup" in p else "-",)
    return cells


def add_ceiling(points, ceilings):
    """ceilings: (model, N) -> summed samples/s of N independent 1-rank jobs (best run); adds
    ``ceiling_samples_per_sec`` and ``ceiling_speedup`` (same base as ``speedup``)."""
    for p in points:
        c = ceilings.get((p["model"], p["ranks"]))
        if c is not None:
            base = p["samples_per_sec"] / p["speedup"]          # the base point's speedup unit
            p["ceiling_samples_per_sec"] = c
            p["ceiling_speedup"] = c / base
    return points


def format_table(points):
    """Plain-text table for stdout; ``*`` marks oversubscribed points."""
    header = _header(points)
    rows = [header] + [_cells(p, header) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    if any(p["oversubscribed"] for p in points):
        lines.append("* oversubscribed: more ranks than cores, not a scaling measurement")
    lines.append(_load_note(points))
    return "\n".join(lines)


def _load_note(points):
    loads = [p["load_before"] for p in points if p.get("load_before") is not None]
    if not loads:
        return ""
    return (f"load average before the kept runs: {min(loads):.1f} .. {max(loads):.1f} "
            f"(other work on the {usable_cores()} cores)")


def format_markdown(points):
    header = _header(points)
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows += ["| " + " | ".join(_cells(p, header)) + " |" for p in points]
    if any(p["oversubscribed"] for p in points):
        rows.append("\n`*` oversubscribed: more ranks than cores.")
    note = _load_note(points)
    if note:
        rows.append("\n" + note[0].upper() + note[1:] + ".")
    return "\n".join(rows)


def plot(points, path, mode, title="", cores=None):
    """Throughput and efficiency vs N per model, with the ideal lines; hollow = oversubscribed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    models = list(dict.fromkeys(p["model"] for p in points))
    for i, model in enumerate(models):
        color = f"C{i}"
        pts = sorted((p for p in points if p["model"] == model), key=lambda p: p["ranks"])
        ns = [p["ranks"] for p in pts]
        base = pts[0]
        ideal = [base["samples_per_sec"] * n / base["ranks"] for n in ns]
        ax_t.plot(ns, [p["samples_per_sec"] for p in pts], "-", color=color, label=model)
        ax_t.plot(ns, ideal, ":", color=color, alpha=0.7)
        ax_e.plot(ns, [p["efficiency"] for p in pts], "-", color=color, label=model)
        for p in pts:
            face = "none" if p["oversubscribed"] else color
            ax_t.plot(p["ranks"], p["samples_per_sec"], "o", mfc=face, mec=color)
            ax_e.plot(p["ranks"], p["efficiency"], "o", mfc=face, mec=color)
            if "ceiling_speedup" in p:
                ax_t.plot(p["ranks"], p["ceiling_samples_per_sec"], "x", color=color)
                ax_e.plot(p["ranks"], p["ceiling_speedup"] / p["ranks"], "x", color=color)
    ns_all = sorted({p["ranks"] for p in points})
    ax_e.axhline(1.0, color="k", ls=":", lw=1, label="ideal")
    if cores is not None and ns_all[-1] > cores:
        for ax in (ax_t, ax_e):
            ax.axvspan(cores * 1.2, ns_all[-1] * 1.2, color="0.9", zorder=0)
        ax_e.text(ns_all[-1], 0.05, "oversubscribed", ha="right", fontsize=8, color="0.4")
    ax_t.plot([], [], "k:", label="ideal (linear)")
    if any(p["oversubscribed"] for p in points):
        ax_t.plot([], [], "ko", mfc="none", label="oversubscribed")
    if any("ceiling_speedup" in p for p in points):
        ax_t.plot([], [], "kx", label="N independent ranks, no comm")
    for ax in (ax_t, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns_all, [str(n) for n in ns_all])
        ax.set_xlabel("ranks N")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("samples/s (global, log scale)")
    ax_e.set_ylabel("efficiency = speedup / N")
    ax_e.set_ylim(0, max(1.2, max(p["efficiency"] for p in points) * 1.1))
    ax_t.legend(fontsize=8)
    ax_e.legend(fontsize=8)
    fig.suptitle(title or f"{mode} scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_point(n, model, args, runs_dir, cores, repeat):
    batch = per_rank_batch(args.mode, args.batch_size, n)
    metrics = runs_dir / f"{model}-{args.mode}-n{n}-r{repeat}.jsonl"
    log = metrics.with_suffix(".log")
    metrics.unlink(missing_ok=True)
    cmd = build_command(n, model, args.dataset, batch, args.steps, metrics, args.timeout,
                        args.extra)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        raise ScalingError(f"{model} N={n}: no exit after {args.timeout + 30} s") from None
    log.write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}")
    if proc.returncode != 0:
        why = "timed out" if proc.returncode in (124, 137) else f"exit {proc.returncode}"
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        last = lines[-1].strip()[:200] if lines else "no output"
        raise ScalingError(f"{model} N={n} failed ({why}): {last} [log: {log}]")
    point = make_point(read_summary(metrics), model, args.mode, n, args.batch_size, cores)
    point["wall_s"] = round(time.perf_counter() - t0, 2)
    point["threads"] = threads_flag(args.extra)
    # The 1-minute load average before the job: on a shared machine, the other work that the
    # ranks competed with (our own ranks are not in it yet).
    point["load_before"] = round(load_before, 2)
    return point


def run_ceiling(n, model, args, runs_dir, repeat):
    """N independent single-rank jobs at once (no communication); their summed samples/s."""
    batch = per_rank_batch(args.mode, args.batch_size, n)
    extra = list(args.extra)
    if threads_flag(extra) is None:         # as one of N ranks on this node would get
        extra += ["--threads", str(max(1, usable_cores() // n))]
    jobs = []
    for i in range(n):
        metrics = runs_dir / f"{model}-{args.mode}-n{n}-alone{i}-r{repeat}.jsonl"
        metrics.unlink(missing_ok=True)
        cmd = build_command(1, model, args.dataset, batch, args.steps, metrics, args.timeout,
                            extra)
        log = metrics.with_suffix(".log")
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            jobs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO),
                         metrics, log))
    failed = None
    for proc, metrics, log in jobs:
        try:
            code = proc.wait(timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "no exit"
        if code != 0 and failed is None:
            failed = f"{model} ceiling N={n}: an independent 1-rank job failed ({code}) " \
                     f"[log: {log}]"
    if failed:
        raise ScalingError(failed)
    return sum(float(read_summary(m)["samples_per_sec"]) for _, m, _ in jobs)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", nargs="+", default=["mlp"], choices=MODELS)
    ap.add_argument("--mode", choices=("weak", "strong"), default="weak")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64,
                    help="per-rank batch (weak) or global batch (strong); default 64")
    ap.add_argument("--dataset", default="synthetic", choices=("synthetic", "fashion-mnist"))
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--repeat", type=int, default=1, help="runs per point; the best is kept")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job")
    ap.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                    help="also write a markdown table (to PATH, default stdout)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also run N independent 1-rank jobs at once per N > 1: the no-comm "
                         "ceiling of this machine")
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="after --: more flags for python -m mpitrain")
    args = ap.parse_args(argv)
    check_positive(ap, args, ("steps", "batch_size", "repeat", "timeout"))
    if any(n < 1 for n in args.ranks):
        ap.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.extra and args.extra[0] == "--":
        args.extra = args.extra[1:]
    return args


def main(argv=None):
    args = parse_args(argv)
    ranks = sorted(set(args.ranks))
    out = Path(args.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    launcher = mpiexec_argv()
    if not launcher or shutil.which(launcher[0]) is None:
        print(f"scaling: error: no MPI launcher {launcher[:1]} (set MPIEXEC)", file=sys.stderr)
        return 1
    try:
        for n in ranks:                      # fail on a bad strong-scaling batch before running
            per_rank_batch(args.mode, args.batch_size, n)
        over = [n for n in ranks if n > cores]
        if over:
            print(f"warning: N={', '.join(map(str, over))} exceeds the {cores} usable cores: "
                  "those points are oversubscribed (marked *)", file=sys.stderr)
        points, ceilings = [], {}
        for model in args.model:
            for n in ranks:
                for r in range(args.repeat):
                    p = run_point(n, model, args, runs_dir, cores, r)
                    print(f"  {model} N={n} run {r + 1}/{args.repeat}: "
                          f"{p['samples_per_sec']:.1f} samples/s", file=sys.stderr, flush=True)
                    points.append(p)
                    if args.ceiling and n > 1:
                        c = run_ceiling(n, model, args, runs_dir, r)
                        print(f"  {model} {n} x 1 rank, no comm, run {r + 1}/{args.repeat}: "
                              f"{c:.1f} samples/s", file=sys.stderr, flush=True)
                        ceilings[(model, n)] = max(c, ceilings.get((model, n), 0.0))
    except ScalingError as e:
        print(f"scaling: error: {e}", file=sys.stderr)
        return 1
    best = add_ceiling(add_speedup(best_of(points)), ceilings)
    print(format_table(best))
    if args.markdown:
        md = (f"`{shlex.join(['python'] + sys.argv)}` ({cores} cores, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, best of {args.repeat})"
              f"\n\n{format_markdown(best)}\n")
        write_text(args.markdown, md)
        if args.markdown != "-":
            print(f"wrote {args.markdown}", file=sys.stderr)
    doc = {"benchmark": "scaling", "mode": args.mode, "dataset": args.dataset,
           "steps": args.steps, "batch_size_arg": args.batch_size, "repeat": args.repeat,
           "cores": cores, "host": platform.node(), "mpiexec": mpiexec_argv(),
           "extra": args.extra, "ceiling": args.ceiling,
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "points": best, "all_runs": points}
    json_path = out / f"scaling-{args.mode}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    png_path = out / f"scaling-{args.mode}.png"
    wrote = [json_path]
    if benchdeps.can_plot(png_path):        # the results above are kept either way
        plot(best, png_path, args.mode,
             title=f"{args.mode} scaling, {args.dataset}, batch {args.batch_size}"
                   f"{' per rank' if args.mode == 'weak' else ' global'}, {cores} cores",
             cores=cores)
        wrote.append(png_path)
    print(f"wrote {' and '.join(map(str, wrote))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
