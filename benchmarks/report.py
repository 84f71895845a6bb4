"""The results page: docs/results.md and its plots, from the JSON that `make bench` wrote.

    python benchmarks/report.py --bench out/bench --out docs/results.md

One answer per question -- a training step against PyTorch, scaling with N, the allreduce against
MPI_Allreduce and the ring's bound, the performance model's projection -- each with the script
that measured it, the machine, the date and the load, and PNG plots written beside the page
(``docs/results/``). Inputs in ``--bench``: ``allreduce.json`` and ``step.json`` (required),
``allreduce-ring.json``, ``scaling-weak.json``, ``perfmodel.json`` and ``perfmodel.md`` (used
when present). The page is regenerated whole; the dated lab notes stay in docs/benchmarks.md.
Written through temp files and renames, so an interrupted run never leaves half a page; a
missing input is one line and exit 2, before anything is written.
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import sys

SIZES = (4096, 65536, 1 << 20, 16 << 20, 64 << 20)      # the allreduce table's rows


def load(bench, name, required=True):
    path = bench / name
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} not found: run `make bench` first")
        return None
    return json.loads(path.read_text())


def human(nbytes):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def machine():
    """One line: cores, CPU, Python, MPI library."""
    try:
        from mpi4py import MPI
        mpi = " ".join(MPI.Get_library_version().splitlines()[0].split())
    except Exception:       # noqa: BLE001 - the page says so instead
        mpi = "MPI unknown"
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {mpi}"


# -- the questions ---------------------------------------------------------------------------

def step_section(step):
    rows = [r for r in step["results"] if r.get("torch_step_ms")]
    lines = ["## A training step against PyTorch", "",
             f"`benchmarks/step.py {' '.join(step['argv'])}`: one process, the same model and "
             f"batch in both, alternated round by round; ratio = ours / PyTorch (< 1: ours "
             f"faster), the best round of each and the median of the rounds' ratios.", ""]
    if not rows:
        return lines + ["(no PyTorch in this run: `benchmarks/step.py --torch` measures it)", ""]
    lines += ["| model | batch | threads | ours ms | PyTorch ms | best / best | median ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = sorted(r["ratio_torch_rounds"])
        median = ratios[len(ratios) // 2]
        lines.append(f"| {r['model']} | {r['batch']} | {r['threads']} | "
                     f"{r['best']['step_ms']:.2f} | {r['torch_step_ms']:.2f} | "
                     f"{r['ratio_torch_best']:.2f} | {median:.2f} |")
    torch = rows[0].get("torch_version", "")
    return lines + ["", f"PyTorch {torch}. ![step time against PyTorch](results/step.png)", ""]


def scaling_section(scaling):
    if scaling is None:
        return []
    points = scaling["points"]
    lines = ["## Scaling with N", "",
             "`benchmarks/scaling.py` (weak scaling: the batch per rank fixed), one job per "
             "point, the best of its repeats; efficiency = speedup / N.", "",
             "| model | N | samples/s | speedup | efficiency | comm share |",
             "|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['model']} | {p['ranks']} | {p['samples_per_sec']:.1f} | "
                     f"{p['speedup']:.2f} | {p['efficiency']:.2f} | "
                     f"{100 * p['comm_share']:.1f}% |")
    return lines + ["", "![throughput and efficiency against N](results/scaling.png)", ""]


def ring_bound_GBps(perfmodel):
    """The ring's bus-bandwidth bound on the fitted link, GB/s, or None: its time for S bytes
    is 2(N-1) alpha + (N-1)/N S (2 beta + gamma) (send, and reduce, every chunk twice over), so
    busbw = 2(N-1)/N S / time tends to 2 / (2 beta + gamma), the fit's ``combined``."""
    fit = (perfmodel or {}).get("fit") or {}
    combined = fit.get("combined")
    return None if not combined else 2e-9 / combined


def allreduce_section(auto, ring, perfmodel):
    by = {r["bytes"]: r for r in auto["results"]}
    ring_by = {r["bytes"]: r for r in (ring or {}).get("results", [])}
    lines = ["## The allreduce against MPI_Allreduce", "",
             f"`benchmarks/allreduce.py`, float32, N = {auto['ranks']}, ours and MPI_Allreduce "
             f"alternated in one run; the median of the slowest rank; ratio = MPI time / ours "
             f"(> 1: ours faster); busbw = 2(N-1)/N x bytes / time.", "",
             "| bytes | ours us | MPI us | ratio | ours busbw GB/s | ring alone busbw GB/s |",
             "|---|---|---|---|---|---|"]
    for size in SIZES:
        r = by.get(size)
        if r is None:
            continue
        rr = ring_by.get(size)
        lines.append(f"| {human(size)} | {r['ours_s'] * 1e6:.1f} | {r['mpi_s'] * 1e6:.1f} | "
                     f"{r['ratio']:.2f} | {r['ours_busbw_GBps']:.3f} | "
                     f"{'' if rr is None else format(rr['ours_busbw_GBps'], '.3f')} |")
    bound = ring_bound_GBps(perfmodel)
    if bound is not None:
        lines += ["", f"The ring's bound on this link, from the performance model's fit of "
                      f"these timings (2 / (2 beta + gamma)): {bound:.2f} GB/s."]
    return lines + ["", "![allreduce bus bandwidth against MPI](results/allreduce.png)", ""]


def perfmodel_section(text):
    if not text:
        return []
    return ["## The performance model", "", "`benchmarks/perfmodel.py` fitted on the runs "
            "above and projected:", "", text.strip(), ""]


# -- plots -----------------------------------------------------------------------------------

def plots(folder, step, scaling, auto, ring, perfmodel):
    """The PNGs beside the page: step.png, scaling.png, allreduce.png (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    def save(fig, name):
        path = folder / name
        tmp = path.with_name(path.name + ".tmp.png")
        fig.tight_layout()
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        written.append((tmp, path))

    rows = [r for r in step["results"] if r.get("torch_step_ms")]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar([r["model"] for r in rows], [r["ratio_torch_best"] for r in rows],
               color="tab:blue")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_ylabel("step time, ours / PyTorch")
        ax.set_title(f"training step, batch {rows[0]['batch']}, {rows[0]['threads']} thread(s)")
        save(fig, "step.png")
    if scaling is not None:
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(8, 3.2))
        for model in sorted({p["model"] for p in scaling["points"]}):
            pts = sorted((p for p in scaling["points"] if p["model"] == model),
                         key=lambda p: p["ranks"])
            ns = [p["ranks"] for p in pts]
            line, = ax_t.plot(ns, [p["samples_per_sec"] for p in pts], "o-", label=model)
            base = pts[0]
            ax_t.plot(ns, [base["samples_per_sec"] * n / base["ranks"] for n in ns], ":",
                      color=line.get_color())
            ax_e.plot(ns, [p["efficiency"] for p in pts], "o-", color=line.get_color())
        ax_t.set_xlabel("ranks N")
        ax_t.set_ylabel("samples/s (dotted: ideal)")
        ax_t.legend()
        ax_e.set_xlabel("ranks N")
        ax_e.set_ylabel("efficiency")
        ax_e.set_ylim(0, 1.2)
        save(fig, "scaling.png")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    res = auto["results"]
    ax.plot([r["bytes"] for r in res], [r["ours_busbw_GBps"] for r in res], "o-", ms=3,
            label="ours")
    ax.plot([r["bytes"] for r in res], [r["mpi_busbw_GBps"] for r in res], "s-", ms=3,
            label="MPI_Allreduce")
    if ring is not None:
        rr = ring["results"]
        ax.plot([r["bytes"] for r in rr], [r["ours_busbw_GBps"] for r in rr], "^-", ms=3,
                label="ours, ring alone")
    bound = ring_bound_GBps(perfmodel)
    if bound is not None:
        ax.axhline(bound, color="gray", ls="--", lw=1, label="ring bound (fitted link)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes")
    ax.set_ylabel("bus bandwidth, GB/s")
    ax.set_title(f"allreduce, float32, N = {auto['ranks']}")
    ax.legend(fontsize=8)
    save(fig, "allreduce.png")
    return written


# -- the page ----------------------------------------------------------------------------------

def build(bench):
    """(the page's text, its inputs for the plots); FileNotFoundError for a missing input."""
    auto = load(bench, "allreduce.json")
    step = load(bench, "step.json")
    ring = load(bench, "allreduce-ring.json", required=False)
    scaling = load(bench, "scaling-weak.json", required=False)
    perfmodel = load(bench, "perfmodel.json", required=False)
    md = bench / "perfmodel.md"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_avg = auto.get("load_average_at_start")
    load_avg = (f"{load_avg:.1f} as it began, " if load_avg is not None else ""
                ) + f"{os.getloadavg()[0]:.1f} at its end"
    lines = ["# Results", "",
             "<!-- generated by `make bench` (benchmarks/report.py): edit that, not this -->",
             "", f"The current number for each question, from one `make bench` run: "
                 f"{stamp}, {machine()}, load average {load_avg}. Ratios are measured within "
                 f"one run (the machine may be shared); the dated lab notes behind them, and "
                 f"the runs not repeated here (GPUs, sharding, PyTorch front end), are in "
                 f"[benchmarks.md](benchmarks.md).", ""]
    lines += step_section(step)
    lines += scaling_section(scaling)
    lines += allreduce_section(auto, ring, perfmodel)
    lines += perfmodel_section(md.read_text() if md.is_file() else "")
    return "\n".join(lines).rstrip() + "\n", (step, scaling, auto, ring, perfmodel)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="out/bench", help="folder `make bench` wrote")
    ap.add_argument("--out", default="docs/results.md", help="the page (plots beside it, in "
                                                             "a folder of its name)")
    ap.add_argument("--no-plots", action="store_true", help="the page only")
    args = ap.parse_args(argv)
    page = pathlib.Path(args.out)
    try:
        text, inputs = build(pathlib.Path(args.bench))
        written = []
        if not args.no_plots:
            folder = page.with_suffix("")
            folder.mkdir(parents=True, exist_ok=True)
            written = plots(folder, *inputs)
    except (OSError, KeyError, ValueError, ImportError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(text)
    for tmp_png, png in written:
        os.replace(tmp_png, png)
    os.replace(tmp, page)
    print(f"report: wrote {page}" + (f" and {len(written)} plots in {page.with_suffix('')}"
                                     if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
