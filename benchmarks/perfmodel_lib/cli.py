"""Performance model: fit our ring's alpha/beta/gamma, predict step time and efficiency to N=1024.

The command line (benchmarks/perfmodel.py runs ``main``): read the inputs, fit, plan, project,
validate, print the report, write perfmodel.json (and the markdown, and the PNG when matplotlib
is installed: benchdeps.py).
"""
import argparse
import json
import shlex
import sys
from pathlib import Path

import benchdeps
import benchutil

from .errors import ModelError
from .fitting import fit, fit_mpi, per_byte
from .inputs import (load_allreduce, load_backward_share, load_scaling, load_step, measure_local,
                     sweep_settings)
from .network import network_params, parse_link
from .plans import make_plans, plan_json
from .report import format_report, plot
from .simulate import calibrate, project, validate


MODELS = ("mlp", "lenet", "cifar_cnn")


def parse_range(text):
    """'LO:HI' bytes (either side may be empty) -> (lo, hi)."""
    try:
        lo, hi = text.split(":")
        lo, hi = float(lo or 0), float(hi or "inf")
    except ValueError:
        raise ModelError(f"--fit-bytes {text!r}: expected LO:HI in bytes, e.g. 65536:") from None
    if lo > hi:
        raise ModelError(f"--fit-bytes {text!r}: LO > HI")
    return lo, hi


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allreduce", required=True, nargs="+",
                    help="JSON of benchmarks/allreduce.py (several: e.g. --algo auto and ring)")
    ap.add_argument("--allreduce-stat", choices=("median", "min"), default="median",
                    help="which allreduce timing to fit (default median)")
    ap.add_argument("--ring-threshold-bytes", type=int, default=None,
                    help="buckets below this go to MPI_Allreduce (default: our allreduce's)")
    ap.add_argument("--step", required=True, nargs="+",
                    help="JSON of benchmarks/step.py (several: e.g. one per --threads)")
    ap.add_argument("--step-stat", choices=("median", "best"), default="median",
                    help="which round of the step benchmark to use (default median)")
    ap.add_argument("--scaling", help="JSON of benchmarks/scaling.py (validation)")
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batch-size", type=int, default=64, help="per-rank batch of projections")
    ap.add_argument("--link", action="append", default=[], help="BANDWIDTH,LATENCY e.g. "
                    "25Gbps,5us (repeatable)")
    ap.add_argument("--max-ranks", type=int, default=1024)
    ap.add_argument("--fusion-threshold-bytes", type=int, default=None,
                    help="bucket size (default: the trainer's, 4 MiB with overlap, 64 MiB "
                         "without)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="model the trainer's --no-overlap: every bucket averaged after "
                         "backward (default: allreduce overlapped with backward)")
    ap.add_argument("--compute-from", choices=("step", "scaling"), default="step",
                    help="compute time per step: the step benchmark (default), or the sweep's "
                         "N=1 points minus their packing (validates the comm model on N>=2)")
    ap.add_argument("--fit-bytes", default=None, metavar="LO:HI",
                    help="fit only ring timings with LO <= bytes <= HI (e.g. 65536:16777216)")
    ap.add_argument("--cores", type=int, default=None, help="cores of this node (validation)")
    ap.add_argument("--no-measure", action="store_true",
                    help="do not time the local reduce/copy kernels (gamma unknown, mu = 0)")
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                    help="also write the report with markdown tables (to PATH, default stdout)")
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_ranks < 1:
        ap.error(f"--batch-size and --max-ranks must be >= 1, got {args.batch_size}, "
                 f"{args.max_ranks}")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        links = [parse_link(s) for s in args.link]
        timings = load_allreduce(args.allreduce, args.allreduce_stat)
        ring_obs, reduce_obs = timings["ring"], timings["reduce"]
        steps = load_step(args.step, args.step_stat)
        missing = [m for m in args.model if m not in steps]
        if missing:
            raise ModelError(f"step JSON {args.step}: no records for {', '.join(missing)}")
        copy_obs = None
        if not args.no_measure:
            measured_red, copy_obs = measure_local()
            reduce_obs = reduce_obs or measured_red
        if args.fit_bytes:
            lo, hi = parse_range(args.fit_bytes)
            ring_obs = [o for o in ring_obs if lo <= o[0] <= hi]
        fitted = fit(ring_obs, reduce_obs)
        mpi = fit_mpi(timings["mpi"]) if len({o[0] for o in timings["mpi"]}) >= 2 else None
        mu = per_byte(copy_obs) if copy_obs else 0.0
        shares = load_backward_share(args.step, args.step_stat)
        plans = make_plans(args.model, not args.no_overlap, args.fusion_threshold_bytes,
                           shares, args.batch_size)
        nets = [network_params(fitted, link, mpi, args.ring_threshold_bytes)
                for link in [None] + links]
        cores = args.cores or benchutil.usable_cores()
        sweep, points = load_scaling(args.scaling) if args.scaling else ({}, [])
        # Like with like: predict the sweep's points as its jobs ran (their recorded flags).
        settings = sweep_settings(sweep)
        val_plans = plans
        if settings is not None and (settings["overlap"] != (not args.no_overlap)
                                     or settings["fusion_threshold_bytes"] is not None):
            batch = int(points[0]["per_rank_batch"]) if points else args.batch_size
            val_plans = make_plans(args.model, settings["overlap"],
                                   settings["fusion_threshold_bytes"], shares, batch)
        if args.compute_from == "scaling":
            if not points:
                raise ModelError("--compute-from scaling needs --scaling")
            steps = calibrate(points, val_plans, nets[0], mu, cores)
            missing = [m for m in args.model if m not in steps]
            if missing:
                raise ModelError(f"--compute-from scaling: no N=1 point for {', '.join(missing)}")
        proj = project(args.model, steps, plans, nets, mu, args.batch_size, args.max_ranks)
        rows = validate(points, steps, val_plans, nets[0], mu, cores)
        if args.compute_from == "scaling":
            rows = [r for r in rows if r["ranks"] > 1]
    except ModelError as e:
        print(f"perfmodel: error: {e}", file=sys.stderr)
        return 2
    print(format_report(fitted, mu, nets, proj, rows, args.model, mpi=mpi, plans=plans,
                        val_plans=val_plans))
    if args.markdown:
        md = (f"`{shlex.join(['python'] + sys.argv)}`\n\n"
              + format_report(fitted, mu, nets, proj, rows, args.model, markdown=True,
                              mpi=mpi, plans=plans, val_plans=val_plans) + "\n")
        benchutil.write_text(args.markdown, md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "perfmodel", "fit": fitted, "mpi_fit": mpi, "copy_s_per_byte": mu,
           "networks": nets, "batch_per_rank": args.batch_size, "cores": cores,
           "compute_from": args.compute_from, "overlap": not args.no_overlap,
           "fusion_plans": {m: plan_json(p) for m, p in plans.items()},
           "validation_plans": {m: plan_json(p) for m, p in val_plans.items()},
           "inputs": {"allreduce": args.allreduce, "step": args.step, "scaling": args.scaling},
           "validation": rows, "projection": proj}
    (out / "perfmodel.json").write_text(json.dumps(doc) + "\n")
    wrote = [out / "perfmodel.json"]
    if benchdeps.can_plot(out / "perfmodel.png"):       # the results above are kept either way
        plot(proj, rows, args.model, out / "perfmodel.png")
        wrote.append(out / "perfmodel.png")
    print(f"wrote {' and '.join(map(str, wrote))}", file=sys.stderr)
    return 0
