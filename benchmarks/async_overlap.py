"""Non-blocking allreduce overlapping a NumPy computation, and what the comm thread costs.

    mpiexec -n 2 python benchmarks/async_overlap.py [--mbytes 16] [--compute-ms 0]
                                                    [--rounds 7] [--json PATH]

Overlap: one allreduce of ``--mbytes`` float32 and one NumPy computation (``a @ b`` on 384x384
float64 matrices, repeated; BLAS releases the GIL), timed alone, in sequence (allreduce, then
compute) and overlapped (``h = mt.allreduce_async(x)``, compute, ``mt.synchronize(h)``), all in
the same run, alternating round by round; medians over ``--rounds``. The computation is sized
to take about as long as the allreduce alone (or ``--compute-ms``). ``hidden`` is the share of
the shorter of the two that the overlap saved: (sequence - overlapped) / min(comm, compute).

Handoff: an 8 B and a 4 KiB allreduce three ways, same run, interleaved: host.py's function
called directly (no dispatch: what the public call cost before process sets and handles),
``mt.allreduce`` (blocking: set -> World, the in-flight check, then the same function on the
caller's thread) and ``mt.synchronize(mt.allreduce_async(x))`` (a hop to the comm thread and
back). Median and best of 7 samples. These are the numbers behind keeping blocking calls
direct (comm/handles.py).

Every result is checked against the expected sum; a wrong value exits 1. BLAS gets one thread
per rank (``mt.init(threads=1)``), so the computation and the comm thread share the rank's core
the way a training step's would.
"""
import argparse
import statistics
import sys
import time

import numpy as np

import benchutil
import mpitrain as mt
from mpitrain.comm import host, world

MATRIX = 384


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=16.0, help="allreduce size in MB (float32)")
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="computation length in ms (0: about the allreduce's own time)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (alternating)")
    ap.add_argument("--small-reps", type=int, default=2000, help="calls per handoff sample")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.mbytes <= 0 or args.rounds < 1 or args.small_reps < 1 or args.compute_ms < 0:
        ap.error("--mbytes, --rounds and --small-reps must be > 0, --compute-ms >= 0")
    return args


def _max_over_ranks(seconds):
    """The slowest rank's time: a collective step ends when its last rank does."""
    return float(mt.allreduce(np.array([seconds]), op=mt.Max, name="bench.max")[0])


def _check(got, want, what):
    if not np.allclose(got, want, rtol=1e-5):
        sys.stderr.write(f"async_overlap: wrong result in {what}\n")
        sys.exit(1)


class Overlap:
    def __init__(self, nbytes, compute_ms):
        n = max(1, int(nbytes) // 4)
        self.x = np.full(n, float(mt.rank() + 1), np.float32)                # (n,)
        self.want = float(mt.size() * (mt.size() + 1) / 2)
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((MATRIX, MATRIX))                        # (M, M)
        self.b = rng.standard_normal((MATRIX, MATRIX)) / MATRIX               # (M, M)
        self.reps = 1
        self.comm()                                                           # warm up
        one = min(benchutil.timed(self.compute) for _ in range(3))
        target = (compute_ms / 1e3 if compute_ms
                  else min(benchutil.timed(self.comm) for _ in range(3)))
        # every rank must run the same computation: the slowest rank's estimate decides
        self.reps = int(mt.allreduce(np.array([max(1, round(target / one))]), op=mt.Max)[0])

    def compute(self):
        c = self.a
        for _ in range(self.reps):
            c = c @ self.b
        return c

    def comm(self):
        out = mt.allreduce(self.x, op=mt.Sum, name="bench.x")
        _check(out[:4], self.want, "allreduce")

    def sequence(self):
        self.comm()
        self.compute()

    def overlapped(self):
        h = mt.allreduce_async(self.x, op=mt.Sum, name="bench.x")
        self.compute()
        _check(mt.synchronize(h)[:4], self.want, "allreduce_async")

    def run(self, rounds):
        cases = {"comm": self.comm, "compute": self.compute, "sequence": self.sequence,
                 "overlapped": self.overlapped}
        times = {k: [] for k in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(_max_over_ranks(benchutil.timed(fn, mt.barrier)))
        return {k: statistics.median(v) for k, v in times.items()}


def handoff(nbytes, reps):
    """{way: (median us, best us)} per allreduce of ``nbytes``, the ways interleaved."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    state = world.current()
    ways = {"host.py": lambda: host.allreduce(state, x, mt.Sum, "bench.small"),
            "blocking": lambda: mt.allreduce(x, op=mt.Sum, name="bench.small"),
            "sync(async)": lambda: mt.synchronize(
                mt.allreduce_async(x, op=mt.Sum, name="bench.small"))}
    samples = {k: [] for k in ways}
    for _ in range(7):
        for name, call in ways.items():
            mt.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                y = call()
            samples[name].append(_max_over_ranks((time.perf_counter() - t0) / reps))
            _check(y[:1], mt.size(), "small allreduce")
    return {k: (statistics.median(v) * 1e6, min(v) * 1e6) for k, v in samples.items()}


def main(argv=None):
    args = parse_args(argv)
    mt.init(threads=1)
    bench = Overlap(args.mbytes * 1e6, args.compute_ms)
    t = bench.run(args.rounds)
    shorter = min(t["comm"], t["compute"])
    hidden = (t["sequence"] - t["overlapped"]) / shorter if shorter > 0 else 0.0
    small = {n: handoff(n, args.small_reps) for n in (8, 4096)}
    result = {"ranks": mt.size(), "mbytes": args.mbytes, "matmul_reps": bench.reps,
              "rounds": args.rounds, "ms": {k: v * 1e3 for k, v in t.items()},
              "speedup": t["sequence"] / t["overlapped"], "hidden": hidden,
              "handoff_us": {str(n): {k: {"median": m, "best": b} for k, (m, b) in w.items()}
                             for n, w in small.items()}}
    if mt.rank() == 0:
        print(f"async_overlap: {mt.size()} ranks, {args.mbytes:g} MB float32 allreduce vs "
              f"{bench.reps} matmuls {MATRIX}x{MATRIX}, median of {args.rounds} rounds")
        print(f"{'case':<12}{'ms':>10}")
        for k in ("comm", "compute", "sequence", "overlapped"):
            print(f"{k:<12}{t[k] * 1e3:>10.2f}")
        print(f"overlapped vs sequence: {result['speedup']:.2f}x faster; "
              f"{hidden * 100:.0f}% of the shorter part hidden")
        print("us per allreduce, median (best) of 7 samples")
        print(f"{'size':<8}" + "".join(f"{k:>20}" for k in small[8]))
        for n, w in small.items():
            print(f"{str(n) + ' B':<8}" + "".join(f"{f'{m:.1f} ({b:.1f})':>20}"
                                                   for m, b in w.values()))
        if args.json:
            benchutil.write_json(args.json, result, indent=2)
    return result


if __name__ == "__main__":
    main()
