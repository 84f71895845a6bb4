"""Hierarchical vs flat allreduce in one run (MPITRAIN_HIERARCHICAL_ALLREDUCE, hierarchical.py).

    mpiexec -n 4 python benchmarks/hierarchical.py --node-size 2            # 2x2 emulated nodes
    mpiexec -launcher fork -hosts localhost:2,127.0.0.1:2 -n 4 \\
        python benchmarks/hierarchical.py                                    # two MPI nodes

The two sides are Worlds with different settings (hierarchical on / off, same node size and
path), so they alternate in rounds, re-initialising mpitrain between them (outside the timed
region); each allreduce is timed between barriers, and a side's time is the median over its
iterations of the slowest rank. Before timing, both sides' results are checked against the
exact sum (integer-valued float32), on every rank. Rank 0 prints a table and writes JSON.
``--node-size`` emulates nodes of k consecutive ranks; without it the nodes are MPI's own
(``Split_type(COMM_TYPE_SHARED)``), which is what the two-host launch above gives.
"""
import argparse
import dataclasses
import sys

import numpy as np
from mpi4py import MPI

import benchutil
import mpitrain as mt
from mpitrain.comm import world


def use(comm, base, hierarchical):
    mt.shutdown()
    mt.init(comm, threads=None, settings=dataclasses.replace(base, hierarchical=hierarchical))
    return world.current().node_comms is not None


def correct(comm, n):
    base = (np.arange(n) % 7).astype(np.float32)                   # (n,)
    got = mt.allreduce(base * (comm.Get_rank() + 1), op=mt.Sum)
    ok = np.array_equal(got, base * (comm.Get_size() * (comm.Get_size() + 1) / 2))
    return comm.allreduce(ok, op=MPI.LAND)


def bench(comm, base, nbytes, rounds, iters):
    n = nbytes // 4
    buf = np.ones(n, np.float32)                                   # (n,)
    times = {False: [], True: []}
    for r in range(rounds):
        for hierarchical in ((False, True) if r % 2 == 0 else (True, False)):
            use(comm, base, hierarchical)
            mt.allreduce_(buf, op=mt.Average)                      # warm-up: scratch, JIT
            for _ in range(iters):
                times[hierarchical].append(
                    benchutil.timed(lambda: mt.allreduce_(buf, op=mt.Average), comm.Barrier))
    medians = benchutil.slowest(comm, np.median(times[False]), np.median(times[True]))
    return float(medians[0]), float(medians[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-size", type=int, default=None,
                   help="emulate nodes of k consecutive ranks (MPITRAIN_NODE_SIZE)")
    p.add_argument("--sizes", default="64K,1M,8M,32M", help="float32 message sizes")
    p.add_argument("--algo", choices=["auto", "ring", "mpi"], default="auto")
    p.add_argument("--rounds", type=int, default=4, help="alternations of the two sides")
    p.add_argument("--iters", type=int, default=5, help="allreduces per side and round")
    p.add_argument("--json", default="out/bench/hierarchical.json")
    args = p.parse_args(argv)
    try:
        sizes = [benchutil.parse_bytes(item) for item in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: expected sizes like 64K,1M,8M")
    comm = MPI.COMM_WORLD
    mt.init(comm, threads=None)
    base = dataclasses.replace(world.current().settings, local_size=args.node_size,
                               algorithm=args.algo)
    if not use(comm, base, True):
        if comm.Get_rank() == 0:
            print(f"hierarchical.py: {comm.Get_size()} ranks in nodes of {mt.local_size()}: no "
                  f"two levels of equal nodes (use --node-size or a multi-host launch)",
                  file=sys.stderr)
        return 2
    for nbytes in sizes:
        for hierarchical in (False, True):
            use(comm, base, hierarchical)
            if not correct(comm, nbytes // 4):
                if comm.Get_rank() == 0:
                    print(f"wrong result at {nbytes} bytes (hierarchical={hierarchical})")
                return 1
    rows = []
    for nbytes in sizes:
        flat, hier = bench(comm, base, nbytes, args.rounds, args.iters)
        rows.append({"bytes": nbytes, "flat_s": flat, "hierarchical_s": hier,
                     "speedup": flat / hier})
    if comm.Get_rank() == 0:
        print(f"# {comm.Get_size()} ranks = {mt.cross_size()} nodes x {mt.local_size()} "
              f"({'emulated' if args.node_size else 'MPI nodes'}), path {args.algo}, "
              f"float32 Average; median of the slowest rank")
        print(f"{'bytes':>10} {'flat ms':>10} {'hier ms':>10} {'flat/hier':>10}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['flat_s'] * 1e3:>10.3f} {r['hierarchical_s'] * 1e3:>10.3f} "
                  f"{r['speedup']:>10.2f}")
        benchutil.write_json(args.json, {
            "ranks": comm.Get_size(), "nodes": mt.cross_size(),
            "ranks_per_node": mt.local_size(), "emulated": bool(args.node_size),
            "algo": args.algo, "results": rows})
        print(f"# wrote {args.json}")
    mt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
