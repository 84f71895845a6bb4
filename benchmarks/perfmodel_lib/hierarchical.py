"""Flat vs hierarchical allreduce on M nodes of L ranks: which is faster, for which sizes.

    python -m perfmodel_lib.hierarchical --nodes 16 --per-node 8 \\
        --intra 20GB/s,1us --inter 25Gbps,5us [--gamma 0.1ns] [--sizes 4K,1M,64M]

(run from benchmarks/, where perfmodel_lib lives). Both are our ring (network.ring_time's
model: alpha per message, beta per byte on the link, gamma per byte reduced); N = M L.

Flat ring over N ranks numbered node by node: each of its 2(N-1) steps moves a chunk n/N
between neighbours, and the steps are synchronous, so every step waits for the slowest link
on the ring -- with M > 1 nodes some neighbours are on different nodes, so every step costs
the inter-node alpha_x + n/N beta_x::

    T_flat = 2(N-1) (alpha_x + n/N beta_x) + (N-1)/N n gamma

Hierarchical (comm/hierarchical.py): a ring reduce-scatter inside the node, a ring allreduce
of each n/L shard across the M nodes (the L shards at once, sharing the node's link: a node
sends 2(M-1)/M n bytes in all, as L streams), a ring allgather inside the node::

    T_hier = 2(L-1) (alpha_i + n/L beta_i) + (L-1)/L n gamma              inside, twice half
           + 2(M-1) alpha_x + 2(M-1)/M n beta_x + (M-1)/M (n/L) gamma     across, L streams

So the network latency term drops from 2(N-1) alpha_x to 2(M-1) alpha_x, and the bytes through
a node's link from 2(N-1)/N n to 2(M-1)/M n (M=2: from ~2n to n); the price is 2(L-1) more
intra-node steps. Latency-bound sizes gain as soon as the network is slower than the node
(2(N-1) alpha_x -> 2(M-1) alpha_x); bandwidth-bound ones save 2(N-1)/N - 2(M-1)/M of n through
the node's link (most at M=2), which must pay for 2(L-1)/L n inside the node -- so they gain
only where the node's link is much faster than the network (NVLink vs Ethernet). With one node
(M=1) or one rank per node (L=1) the two are the same algorithm. ``--shared-link 0`` gives each of the L streams a link of its own (a node
with one NIC per GPU), dividing the across term's beta part by L.

Not modelled: the MPI path (MPI's own algorithms; our allreduce takes MPI below 32 MiB on both
sides), contention inside the node, and the pipelining that overlaps the reduction (gamma) with
transfers. Measured on one machine: docs/benchmarks.md, "Hierarchical allreduce".
"""
import argparse
import sys

import numpy as np

import benchutil

from .errors import ModelError
from .network import parse_link


def flat_time(n, nodes, per_node, intra, inter, gamma=0.0):
    """Seconds for one flat ring allreduce of n bytes over nodes x per_node ranks.
    intra, inter: {"alpha": s, "beta": s/byte} (network.parse_link)."""
    n = np.asarray(n, dtype=float)
    ranks = nodes * per_node
    if ranks == 1:
        return np.zeros_like(n)
    link = inter if nodes > 1 else intra
    return 2 * (ranks - 1) * (link["alpha"] + n / ranks * link["beta"]) \
        + (ranks - 1) / ranks * n * gamma


def hierarchical_time(n, nodes, per_node, intra, inter, gamma=0.0, shared_link=True):
    """Seconds for one hierarchical allreduce (arguments as flat_time). shared_link: the
    per_node cross-node streams share one link (else each has its own)."""
    n = np.asarray(n, dtype=float)
    if nodes == 1 or per_node == 1:
        return flat_time(n, nodes, per_node, intra, inter, gamma)
    m, k = nodes, per_node
    inside = 2 * (k - 1) * (intra["alpha"] + n / k * intra["beta"]) + (k - 1) / k * n * gamma
    streams = k if shared_link else 1
    across = 2 * (m - 1) * inter["alpha"] + 2 * (m - 1) / m * (n / k) * streams * inter["beta"] \
        + (m - 1) / m * (n / k) * gamma
    return inside + across


def compare(sizes, nodes, per_node, intra, inter, gamma=0.0, shared_link=True):
    """[{"bytes", "flat_s", "hierarchical_s", "speedup" (flat / hierarchical)}] per size."""
    rows = []
    for n in sizes:
        flat = float(flat_time(n, nodes, per_node, intra, inter, gamma))
        hier = float(hierarchical_time(n, nodes, per_node, intra, inter, gamma, shared_link))
        rows.append({"bytes": int(n), "flat_s": flat, "hierarchical_s": hier,
                     "speedup": flat / hier if hier > 0 else 1.0})
    return rows


def _sizes(text):
    try:
        return [benchutil.parse_bytes(item) for item in text.split(",")]
    except ValueError:
        raise ModelError(f"--sizes {text!r}: expected sizes like 4K,1M,64M") from None


def _seconds_per_byte(text):
    value = text.strip()
    for unit, scale in (("ns", 1e-9), ("us", 1e-6), ("s", 1.0)):
        if value.endswith(unit):
            try:
                return float(value[:-len(unit)]) * scale
            except ValueError:
                break
    raise ModelError(f"--gamma {text!r}: expected seconds per byte like 0.1ns")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--intra", required=True, help="link inside a node: BANDWIDTH,LATENCY")
    p.add_argument("--inter", required=True, help="link between nodes: BANDWIDTH,LATENCY")
    p.add_argument("--gamma", default="0ns", help="reduction cost per byte (default 0ns)")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M")
    p.add_argument("--shared-link", type=int, choices=(0, 1), default=1,
                   help="1: a node's cross-node streams share one link (default)")
    args = p.parse_args(argv)
    try:
        if args.nodes < 1 or args.per_node < 1:
            raise ModelError("--nodes and --per-node must be >= 1")
        rows = compare(_sizes(args.sizes), args.nodes, args.per_node, parse_link(args.intra),
                       parse_link(args.inter), _seconds_per_byte(args.gamma),
                       bool(args.shared_link))
    except ModelError as exc:
        print(f"perfmodel_lib.hierarchical: {exc}", file=sys.stderr)
        return 2
    print(f"# {args.nodes} nodes x {args.per_node} ranks; intra {args.intra}, inter "
          f"{args.inter}, gamma {args.gamma}")
    print(f"{'bytes':>12} {'flat ms':>10} {'hier ms':>10} {'flat/hier':>10}")
    for r in rows:
        print(f"{r['bytes']:>12} {r['flat_s'] * 1e3:>10.4f} {r['hierarchical_s'] * 1e3:>10.4f} "
              f"{r['speedup']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
