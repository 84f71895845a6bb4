"""Hierarchical allreduce: reduce inside each node, across nodes, then spread inside the node.

``MPITRAIN_HIERARCHICAL_ALLREDUCE=1`` (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE). With M nodes of
L ranks each (world.py's ``local`` and ``cross`` communicators; ``MPITRAIN_NODE_SIZE=k`` emulates
nodes of k consecutive ranks on one machine), a contiguous buffer of n elements is cut into L
chunks (ring.chunk_bounds) and::

    1. reduce-scatter inside the node     each rank ends with one chunk summed over its node
    2. allreduce across nodes             the L chunks in parallel, each among the M ranks with
                                          the same local rank (cross communicator); then scale
    3. allgather inside the node          every rank gets the L finished chunks

Why: the flat ring sends 2(N-1)/N of the buffer per rank over whatever link joins its two ring
neighbours, so the slowest link (between nodes) carries the whole ring's traffic. Here only step
2 crosses nodes, and each rank sends 2(M-1)/M of a chunk of n/L there: the traffic on the
network is L times smaller, while steps 1 and 3 run over shared memory. On one node (or one rank
per node) it is the flat allreduce, and world.py then leaves it off.

Each level takes the path the flat allreduce would take for the whole buffer (the rule in
docs/architecture.md, decided once by engine.py): MPI's Reduce_scatter / Allreduce / Allgatherv,
or our ring's two phases (ring.py) -- always the ring for float16, which MPI cannot reduce. The
rank that finishes a chunk applies Average's 1/N and the postscale to it alone (1/L of a pass).
Results equal the flat allreduce's up to floating-point association (the sum is taken in
another order); integer Sum/Min/Max/Product and float Min/Max are exact. The communicators are
private duplicates (World.node_comms), so no user message can match ours.
"""
import numpy as np
from mpi4py import MPI

from mpitrain.comm.ring import (chunk_bounds, owned_chunk, ring_allgather, ring_allreduce,
                                ring_reduce_scatter)


def hierarchical_allreduce(local, cross, flat, mpi_op, factor, scale, ring=None):
    """Allreduce the contiguous 1-D ``flat`` in place over nodes (``local``) and ``cross``.

    mpi_op: the MPI op (MPI path); factor: multiplies the result (Average's postscale/N), via
    ``scale(piece, factor)``; ring: None for MPI at every level, or (reduce, scratch, sub) for
    our ring (ring.ring_allreduce's arguments).
    """
    size, me = local.Get_size(), local.Get_rank()
    bounds = chunk_bounds(flat.shape[0], size)
    if ring is None:
        lo, hi = bounds[me], bounds[me + 1]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]                  # (size,)
        shard = np.empty(hi - lo, flat.dtype)                                  # (hi - lo,)
        local.Reduce_scatter(flat, shard, counts, mpi_op)
        if shard.size:
            cross.Allreduce(MPI.IN_PLACE, shard, op=mpi_op)
            if factor != 1.0:
                scale(shard, factor)
        flat[lo:hi] = shard
        # chunk r from local rank r to every rank of the node, as raw bytes
        item = flat.dtype.itemsize
        blocks = ([c * item for c in counts], [a * item for a in bounds[:-1]])
        local.Allgatherv(MPI.IN_PLACE, [flat.view(np.uint8), blocks, MPI.BYTE])
        return flat
    reduce, scratch, sub = ring
    ring_reduce_scatter(local, flat, reduce, scratch, sub)
    chunk = owned_chunk(me, size)
    shard = flat[bounds[chunk]:bounds[chunk + 1]]                               # a view
    finish = None if factor == 1.0 else (lambda piece: scale(piece, factor))
    if cross.Get_size() > 1:
        ring_allreduce(cross, shard, reduce, scratch, sub, finish)
    elif finish is not None and shard.size:
        finish(shard)
    ring_allgather(local, flat, sub)
    return flat
