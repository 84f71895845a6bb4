"""Allreduce benchmark: mpitrain's allreduce against MPI_Allreduce, interleaved in one run.

    mpiexec -n 2 python benchmarks/allreduce.py [--max-bytes 64M] [--algo auto|ring|mpi]
                                               [--op sum|average] [--out out/bench]
                                               [--json PATH] [--plot [PATH]]

For each float32 size (powers of two, 4 B .. 256 MB) both implementations run the same number of
iterations (at least 20) on the same buffer, alternating ours / MPI (and which goes first), each
timed between barriers; the reported time is the median over iterations of the slowest rank. One
buffer serves both sides because where an array lands in memory (its huge pages, its offsets
against the other buffers) moves one implementation's time by up to a quarter between two
arrays of the same size. Ours is the in-place ``mt.allreduce_`` with ``--op`` (sum by default);
MPI's side is MPI_Allreduce with MPI_SUM, and for ``--op average`` then the 1/N scale a user of
MPI would write (``buf *= 1/N``). algbw = bytes / time; busbw = algbw * 2(N-1)/N
(the bytes each rank must move, so busbw is comparable across N); ratio = t_mpi / t_ours (> 1:
ours is faster). Before timing each size, both results are checked against the exact expected
sum; a wrong value prints the size and exits 1 (on every rank). The check cost (cross-rank
agreement, mpitrain/comm/check.py) is measured at small sizes as ours with the check on vs off.
Rank 0 prints the table and writes JSON (and a PNG with --plot, which needs matplotlib:
``pip install 'mpitrain[bench]'``; without it --plot stops with one line and exit 2 before any
timing).
"""
import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
import benchutil  # noqa: E402


def fmt_bytes(n):
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def iterations(nbytes, budget_s):
    # Rough cost model (20 us + 1 ns/byte) so every size gets ~budget_s per implementation.
    per_call = 20e-6 + nbytes * 1e-9
    return int(min(2000, max(20, budget_s / per_call)))


def verify(comm, n_elems):
    """Exact check of both implementations on integer-valued float32 data."""
    rank, size = comm.Get_rank(), comm.Get_size()
    base = (np.arange(n_elems) % 7).astype(np.float32)            # (n,)
    expected = base * (size * (size + 1) / 2)
    ours = mt.allreduce(base * (rank + 1), op=mt.Sum)
    theirs = base * (rank + 1)
    comm.Allreduce(MPI.IN_PLACE, theirs, op=MPI.SUM)
    ok = np.array_equal(ours, expected) and np.array_equal(theirs, expected)
    return comm.allreduce(ok, op=MPI.LAND)


def bench_size(comm, nbytes, budget_s, op=mt.Sum):
    n = max(1, nbytes // 4)
    buf = np.zeros(n, np.float32)           # (n,), both sides: zeros stay zeros, sum or mean
    inverse = np.float32(1 / comm.Get_size())
    ours = lambda: mt.allreduce_(buf, op=op)                       # noqa: E731

    def theirs():
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if op is mt.Average:
            np.multiply(buf, inverse, out=buf)
    ours(), theirs()                                               # warm-up (JIT, buffers)
    iters = comm.bcast(iterations(n * 4, budget_s), root=0)
    t_ours, t_mpi = [], []
    sides = [(t_ours, ours), (t_mpi, theirs)]
    for i in range(iters):          # alternate who goes first: neither inherits the other's cache
        for times, fn in (sides if i % 2 == 0 else sides[::-1]):
            times.append(benchutil.timed(fn, comm.Barrier))
    slowest = benchutil.slowest(comm, np.median(t_ours), np.median(t_mpi), min(t_ours), min(t_mpi))
    return (n * 4, iters) + tuple(float(v) for v in slowest)


def check_cost(comm, budget_s):
    """Median time of a 4 B and a 4 KB allreduce with the agreement check on and off.

    The check is a setting of the World (MPITRAIN_CHECK), so the two sides run in Worlds of
    their own, alternating in rounds (re-initialising mpitrain between them)."""
    rows = []
    saved = world.current().settings
    for nbytes in (4, 4096):
        buf = np.zeros(nbytes // 4, np.float32)
        times = {True: [], False: []}
        iters = comm.bcast(iterations(nbytes, budget_s), root=0)
        rounds = 6
        for i in range(rounds):
            for on in ((True, False) if i % 2 else (False, True)):
                mt.shutdown()
                mt.init(comm, threads=None, settings=dataclasses.replace(saved, check=on))
                mt.allreduce_(buf, op=mt.Sum)                           # the plan, made once
                for _ in range(max(1, iters // rounds)):
                    times[on].append(benchutil.timed(lambda: mt.allreduce_(buf, op=mt.Sum),
                                                    comm.Barrier))
        med = benchutil.slowest(comm, np.median(times[True]), np.median(times[False]))
        rows.append({"bytes": nbytes, "with_check_s": float(med[0]),
                     "without_check_s": float(med[1])})
    mt.shutdown()
    mt.init(comm, threads=None, settings=saved)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", default="4", help="smallest size (default 4)")
    p.add_argument("--max-bytes", default="256M", help="largest size (default 256M)")
    p.add_argument("--algo", choices=["auto", "ring", "mpi"], default="auto",
                   help="path for our allreduce (sets MPITRAIN_ALLREDUCE)")
    p.add_argument("--op", choices=["sum", "average"], default="sum",
                   help="our allreduce's op (MPI's side sums, then scales for average)")
    p.add_argument("--budget", type=float, default=0.3,
                   help="approximate seconds per size per implementation")
    p.add_argument("--out", default="out/bench", help="directory for allreduce.json/.png")
    p.add_argument("--json", default=None, help="JSON path (default OUT/allreduce.json)")
    p.add_argument("--plot", nargs="?", const="", default=None,
                   help="write a PNG (default OUT/allreduce.png)")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]                      # the machine as the run found it
    os.environ["MPITRAIN_ALLREDUCE"] = args.algo
    mt.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # --plot asks for a PNG: no matplotlib is bad input, found before the first timing. Rank 0
    # alone draws, so its verdict is every rank's (all stop together, none waits in a collective).
    error = benchdeps.require("matplotlib", "--plot") if rank == 0 and args.plot is not None \
        else None
    error = comm.bcast(error, root=0)
    if error:
        if rank == 0:
            print(f"allreduce: error: {error}", file=sys.stderr)
        return 2
    lo, hi = benchutil.parse_bytes(args.min_bytes), benchutil.parse_bytes(args.max_bytes)
    sizes = [1 << k for k in range(2, 40) if lo <= (1 << k) <= hi]
    results = []
    if rank == 0:
        print(f"# allreduce float32, N={size}, ours={args.algo} op={args.op}, "
              f"ring threshold={world.current().settings.ring_threshold(size)} B")
        print("# times: median (and min) over iterations of the slowest rank; bandwidths in GB/s "
              "from the medians; ratio = t_mpi / t_ours (median, min)")
        print(f"{'size':>9} {'iters':>6} {'ours us':>10} {'mpi us':>10} {'ours min':>9} "
              f"{'mpi min':>9} {'algbw':>7} {'busbw':>7} {'mpi bus':>7} {'ratio':>6} {'r(min)':>6}")
    for nbytes in sizes:
        if not verify(comm, max(1, nbytes // 4)):
            if rank == 0:
                print(f"WRONG RESULT at {fmt_bytes(nbytes)}", file=sys.stderr)
            return 1
        nb, iters, t_ours, t_mpi, min_ours, min_mpi = bench_size(
            comm, nbytes, args.budget, mt.Sum if args.op == "sum" else mt.Average)
        bus = 2 * (size - 1) / size if size > 1 else 1.0
        row = {"bytes": nb, "iters": iters, "ours_s": t_ours, "mpi_s": t_mpi,
               "ours_min_s": min_ours, "mpi_min_s": min_mpi,
               "ours_algbw_GBps": nb / t_ours / 1e9, "mpi_algbw_GBps": nb / t_mpi / 1e9,
               "ours_busbw_GBps": nb / t_ours / 1e9 * bus, "mpi_busbw_GBps": nb / t_mpi / 1e9 * bus,
               "ratio": t_mpi / t_ours, "ratio_min": min_mpi / min_ours}
        results.append(row)
        if rank == 0:
            print(f"{fmt_bytes(nb):>9} {iters:>6} {t_ours * 1e6:>10.1f} {t_mpi * 1e6:>10.1f} "
                  f"{min_ours * 1e6:>9.1f} {min_mpi * 1e6:>9.1f} "
                  f"{row['ours_algbw_GBps']:>7.3f} {row['ours_busbw_GBps']:>7.3f} "
                  f"{row['mpi_busbw_GBps']:>7.3f} {row['ratio']:>6.2f} {row['ratio_min']:>6.2f}",
                  flush=True)
    cost = check_cost(comm, args.budget)
    if rank == 0:
        for c in cost:
            print(f"# check cost at {fmt_bytes(c['bytes'])}: "
                  f"{(c['with_check_s'] - c['without_check_s']) * 1e6:.1f} us "
                  f"({c['with_check_s'] * 1e6:.1f} us with, {c['without_check_s'] * 1e6:.1f} us "
                  f"without)")
        write_outputs(args, size, results, cost, load)
    return 0


def write_outputs(args, size, results, cost, load):
    json_path = args.json or os.path.join(args.out, "allreduce.json")
    threshold = world.current().settings.ring_threshold(size)
    benchutil.write_json(json_path, {"ranks": size, "algo": args.algo, "op": args.op,
                                     "ring_threshold_bytes": threshold, "results": results,
                                     "check_cost": cost, "load_average_at_start": load})
    print(f"# wrote {json_path}")
    if args.plot is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    png = args.plot or os.path.join(args.out, "allreduce.png")
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    x = [r["bytes"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.loglog(x, [r["ours_busbw_GBps"] for r in results], "o-", label=f"mpitrain ({args.algo})")
    ax.loglog(x, [r["mpi_busbw_GBps"] for r in results], "s--", label="MPI_Allreduce")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"allreduce float32, N={size}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"# wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
