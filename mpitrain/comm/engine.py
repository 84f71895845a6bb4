"""The allreduce engine: one contiguous 1-D host array, reduced in place, scaled.

Every host allreduce ends here: single calls and fusion buckets (host.py), and the overlapped
gradient buckets on the comm thread (overlap.py). The path -- MPI_Allreduce or our ring
(ring.py) -- follows the rule written once in docs/architecture.md ("Allreduce path"), from the
World's settings (world.py), the same on every rank. The World is an argument: the global
set's or a process set's (process_sets.py), whichever the caller acts on. Average is a sum,
then a scale by postscale/N; on the ring each rank scales the chunk it completes, before the
allgather (1/N of a pass instead of a whole one, same bits). The ring's scratch buffers belong
to the World. With MPITRAIN_HIERARCHICAL_ALLREDUCE=1 on several nodes the same path runs in
two levels (hierarchical.py).
"""
import numpy as np
from mpi4py import MPI

from mpitrain.comm.hierarchical import hierarchical_allreduce
from mpitrain.comm.watchdog import watched
from mpitrain.comm.ops import MPI_OPS, Average, ReduceOp, mpi_can_reduce, reduce_kind
from mpitrain.comm.ring import ring_allreduce, ring_reduce_scatter
from mpitrain.kernels import cpu
from mpitrain.kernels.cpu.bfloat16 import BFLOAT16
from mpitrain.kernels.cpu.bfloat16 import scale as bfloat16_scale

REDUCERS = {k: (lambda d, s, _k=k: cpu.reduce_into(d, s, _k)) for k in MPI_OPS}
_MPI_OP = {op: MPI_OPS[reduce_kind(op)] for op in ReduceOp}    # by op: no lookups per call


def allreduce_flat(state, flat, op, prescale=1.0, postscale=1.0):
    """Allreduce a contiguous 1-D host array in place across the ranks of ``state`` (a World:
    the global set's or a process set's): prescale, reduce, then scale."""
    settings, comm = state.settings, state.ring
    if prescale != 1.0:
        scale(flat, prescale)
    size = comm.Get_size()
    factor = postscale / size if op is Average else postscale
    if size > 1 and flat.size:
        algo = settings.algorithm                    # the path rule (docs/architecture.md)
        use_ring = (not mpi_can_reduce(flat.dtype) or algo == "ring"
                    or (algo == "auto" and flat.nbytes >= settings.ring_threshold(size)))
        with watched(state.record, "allreduce data"):    # a rank that stops here is named
            if state.node_comms is not None:      # MPITRAIN_HIERARCHICAL_ALLREDUCE (world.py)
                hierarchical_allreduce(*state.node_comms, flat, _MPI_OP[op], factor, scale,
                                       _ring_args(state, flat, op) if use_ring else None)
                return flat
            if use_ring:
                # each rank scales the chunk it completes, before the allgather: same bits
                finish = None if factor == 1.0 else (lambda piece: scale(piece, factor))
                ring_allreduce(comm, flat, *_ring_args(state, flat, op), finish)
                return flat
            comm.Allreduce(MPI.IN_PLACE, flat, op=_MPI_OP[op])
    if factor != 1.0:
        scale(flat, factor)
    return flat


def reduce_scatter_flat(state, flat, op, prescale=1.0, postscale=1.0, bounds=None):
    """The ring allreduce's first phase over a contiguous 1-D host array, in place, scaled:
    afterwards the chunk ``ring.owned_chunk`` of this rank (bounds ``ring.chunk_bounds``) holds
    the reduction over the ranks of ``state`` -- bitwise the chunk ``allreduce_flat`` gives it
    on the ring, half the traffic -- and the other chunks hold partial sums. Always the ring
    (the chunk a rank keeps must not depend on MPI's algorithm); one level, also where the
    allreduce is hierarchical. ``bounds``: the chunks' offsets where they are not the ring's
    even ``chunk_bounds``."""
    comm = state.ring
    if prescale != 1.0:
        scale(flat, prescale)
    size = comm.Get_size()
    factor = postscale / size if op is Average else postscale
    if size > 1 and flat.size:
        finish = None if factor == 1.0 else (lambda piece: scale(piece, factor))
        with watched(state.record, "reduce-scatter data"):
            ring_reduce_scatter(comm, flat, *_ring_args(state, flat, op), finish, bounds)
    elif factor != 1.0:
        scale(flat, factor)
    return flat


def _ring_args(state, flat, op):
    """(reduce, scratch, sub) of the ring over ``flat``; the scratch (two sub-chunks) is the
    World's, one per dtype."""
    dtype = flat.dtype
    sub = max(1, state.settings.ring_subchunk_bytes // dtype.itemsize)
    scratch = state.scratch.get(dtype)
    if scratch is None:
        scratch = state.scratch[dtype] = np.empty(2 * sub, dtype)
    return REDUCERS[reduce_kind(op)], scratch, sub


def scale(flat, factor):
    """flat *= factor in place (integers: in float64, truncated toward zero)."""
    if flat.dtype == np.float16 and flat.flags.c_contiguous:
        cpu.scale(flat, factor)            # NumPy's bits, ~10x faster than NumPy's float16
    elif flat.dtype == BFLOAT16:
        bfloat16_scale(flat, factor)       # in float32, rounded once (the bf16 compression)
    else:
        np.multiply(flat, factor, out=flat, casting="unsafe")
