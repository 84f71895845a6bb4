"""Refresh the generated block of docs/benchmarks.md from the JSON/markdown `make bench` wrote.

    python benchmarks/report.py --bench out/bench --doc docs/benchmarks.md

Replaces everything between the two marker lines below (and only that) with: the allreduce table
(ours vs MPI_Allreduce, from allreduce.json), the step table (step.json), and the scaling and
performance-model markdown (scaling-weak.md, perfmodel.md) when present. The hand-written
analysis elsewhere in the document is left alone. Written through a temp file + rename, so an
interrupted run never leaves half a document. Exits 2 with one line when an input is missing.
"""
import argparse
import datetime
import json
import os
import pathlib
import sys

BEGIN = "<!-- make bench: generated block begin (benchmarks/report.py) -->"
END = "<!-- make bench: generated block end -->"


def allreduce_table(data):
    lines = [f"Allreduce, float32, N={data['ranks']}, path `{data['algo']}` "
             f"(ratio = MPI time / ours, > 1: ours faster; medians, min in brackets):", "",
             "| bytes | ours us | MPI us | busbw GB/s | ratio |", "|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['bytes']} | {r['ours_s'] * 1e6:.1f} ({r['ours_min_s'] * 1e6:.1f}) | "
                     f"{r['mpi_s'] * 1e6:.1f} ({r['mpi_min_s'] * 1e6:.1f}) | "
                     f"{r['ours_busbw_GBps']:.3f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}) |")
    return lines


def step_table(path):
    data = json.loads(path.read_text())
    lines = ["Training step, best round (`benchmarks/step.py " + " ".join(data["argv"]) + "`):",
             "", "| model | batch | threads | fwd ms | bwd ms | update ms | step ms | "
             "GEMMs alone ms | step / GEMMs | GFLOP/s | sgemm GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        b = r["best"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['threads']} | {b['fwd_ms']:.2f} | "
                     f"{b['bwd_ms']:.2f} | {b['update_ms']:.2f} | {b['step_ms']:.2f} | "
                     f"{b['gemm_ms']:.2f} | {b['ratio_step_gemm']:.2f} | {b['gflops']:.1f} | "
                     f"{r['blas_gflops']:.1f} |")
    return lines


def build(bench):
    for name in ("allreduce.json", "step.json"):
        if not (bench / name).is_file():
            raise FileNotFoundError(f"{bench / name} not found: run `make bench` first")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    allreduce = json.loads((bench / "allreduce.json").read_text())
    load = allreduce.get("load_average_at_start")
    load = f"{load:.1f} as it began" if load is not None else f"{os.getloadavg()[0]:.1f} at its end"
    out = [BEGIN, "", f"Last `make bench`: {stamp} (load average {load}).", ""]
    out += allreduce_table(allreduce) + [""]
    out += step_table(bench / "step.json") + [""]
    for name in ("scaling-weak.md", "perfmodel.md"):
        if (bench / name).is_file():
            out += [(bench / name).read_text().rstrip(), ""]
    return "\n".join(out + [END])


def splice(doc_text, block):
    """doc_text with the generated block replaced (appended at the end the first time)."""
    if BEGIN in doc_text and END in doc_text:
        head, rest = doc_text.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return doc_text.rstrip() + "\n\n## Latest `make bench` (generated)\n\n" + block + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="out/bench", help="folder `make bench` wrote")
    ap.add_argument("--doc", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    doc = pathlib.Path(args.doc)
    try:
        text = splice(doc.read_text(), build(pathlib.Path(args.bench)))
    except (OSError, KeyError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
    print(f"report: refreshed the generated block of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
