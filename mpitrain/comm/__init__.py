"""Collectives over MPI. This file is the comm layer's one door: code outside mpitrain/comm/ imports
the names below and nothing past them (tests/unit/test_import_layers.py). mpitrain/__init__.py
re-exports the public ones (its ``__all__``); docs/architecture.md draws the layers.

Bottom to top (each module imports only those before it): abort, watchdog, settings, kinds (every
collective kind, with what a rank that has joined does: no imports), check, handles (the comm
thread of non-blocking collectives), world (init/shutdown and the per-communicator World),
process_sets, build_info (what can run here), gpu (the process's GPU), ops, ring, tree,
hierarchical, buckets, fusion, engine, host, overlap, device, adasum (op=Adasum: the pairwise
combination over one checked allgather), collectives (the public API: host or device, chosen in
one place), join (a rank out of data serving the others), tracing
(``mt.start_timeline`` / ``mt.stop_timeline``).
"""
import numpy as np

from mpitrain.comm.abort import exit_now, install_abort_hook
from mpitrain.comm.build_info import (cuda_built, is_homogeneous, mpi_built, mpi_threads_supported,
                                      nccl_built)
from mpitrain.comm.check import INLINE_BYTES, CollectiveError, format_groups, group
from mpitrain.comm.collectives import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                       allgather_async, allgather_object, allgather_shares,
                                       allgather_shares_async, allreduce, allreduce_,
                                       allreduce_async, allreduce_async_, alltoall,
                                       alltoall_async, barrier, broadcast, broadcast_,
                                       broadcast_async, broadcast_async_, broadcast_object,
                                       fusion_threshold, grouped_allreduce, grouped_allreduce_,
                                       grouped_allreduce_async, grouped_allreduce_async_,
                                       reducescatter, reducescatter_async)
from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES, check_threshold
from mpitrain.comm.gpu import select_device
from mpitrain.comm.engine import allreduce_flat, reduce_scatter_flat
from mpitrain.comm.handles import Handle, poll, synchronize
from mpitrain.comm.handles import ordered as run_ordered
from mpitrain.comm.join import join
from mpitrain.comm.ops import on_device
from mpitrain.comm.overlap import BucketAllreduce
from mpitrain.comm.overlap import plan as overlap_plan
from mpitrain.comm.ring import chunk_bounds, owned_chunk
from mpitrain.comm.process_sets import (ProcessSet, add_process_set, global_process_set,
                                        process_sets, remove_process_set, world_of)
from mpitrain.comm.settings import CommSettings, fusion_threshold_from_env
from mpitrain.comm.tracing import start_timeline, stop_timeline
from mpitrain.comm.tree import PairwiseSum, is_power_of_two, tree_allreduce
from mpitrain.comm.watchdog import watched
from mpitrain.comm.world import (comm, cross_rank, cross_size, init, is_initialized, local_rank,
                                 local_size, rank, shutdown, size)


__all__ = ["Adasum", "add_process_set", "agree", "allgather", "allgather_async", "allgather_object",
           "allgather_shares", "allgather_shares_async",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allreduce_flat",
           "alltoall", "alltoall_async", "Average", "barrier", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "broadcast_object", "bucket_allreduce",
           "BucketAllreduce", "check_threshold", "chunk_bounds",
           "owned_chunk", "bucket_plan", "bucket_reduce_scatter", "CollectiveError", "comm",
           "CommSettings",
           "cross_rank", "cross_size", "cuda_built", "DEFAULT_THRESHOLD_BYTES", "exit_now",
           "format_groups", "fusion_threshold", "fusion_threshold_from_env", "global_process_set",
           "group", "group_size", "grouped_allreduce", "INLINE_BYTES", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "Handle", "init",
           "install_abort_hook", "is_homogeneous", "is_initialized", "is_power_of_two", "join",
           "local_rank", "local_size", "Max", "Min", "mpi_built", "mpi_threads_supported",
           "nccl_built", "on_device", "PairwiseSum", "poll", "process_sets", "ProcessSet",
           "Product", "rank", "ReduceOp", "reducescatter", "reducescatter_async",
           "remove_process_set", "run_ordered", "select_device", "shutdown", "size",
           "start_timeline", "stop_timeline", "Sum", "synchronize", "tree_allreduce",
           "tree_allreduce_", "world_of"]

# What the layer above (mpitrain/parallel) needs beyond the collectives: the cross-rank agreement
# of a step, the fixed-tree sum and the bucketed allreduce that overlaps backward.

def agree(process_set, kind, fields, error=None, ordered=False, who="DistributedOptimizer",
          flags=None, payload=None):
    """Check that every rank of ``process_set`` calls ``kind`` with the same ``fields`` (dict),
    raising on every rank: CollectiveError on a difference, ValueError when a rank has an
    ``error``. ``ordered``: behind whatever collectives are in flight (on the comm thread).
    ``who`` names the caller when this rank is not in ``process_set`` (ValueError).
    ``flags``: an int of this rank's bits carried in the same message; returns their OR over
    the ranks, or None where no message was exchanged (one rank, MPITRAIN_CHECK=0).
    ``payload`` (instead of ``flags``): a 1-D uint8 array of at most INLINE_BYTES carried in
    the same message; returns every rank's, a (size, len(payload)) copy, or None likewise.
    Put its layout in ``fields``, so that ranks sending different layouts raise."""
    agreement = world_of(process_set, who).agreement
    if flags is not None:
        payload = np.array([flags], np.int64).view(np.uint8)
    elif payload is not None:
        payload = np.ascontiguousarray(payload, np.uint8).reshape(-1)
        if payload.size > INLINE_BYTES:
            raise ValueError(f"agree: a payload of {payload.size} bytes; at most "
                             f"{INLINE_BYTES} ride in the agreement")

    def check():            # the payload rows are valid until the next check: read them now
        rows = agreement(kind, fields, error, payload)
        if rows is None:
            return None
        if flags is None:
            return np.array(rows)
        return int(np.bitwise_or.reduce(np.ascontiguousarray(rows).view(np.int64)[:, 0]))
    return run_ordered(check) if ordered else check()


def group_size(process_set, who="DistributedOptimizer"):
    """The number of ranks in ``process_set`` (ValueError, naming ``who``, from outside it)."""
    return world_of(process_set, who).size


def tree_allreduce_(array, add, scratch, process_set, who="DistributedOptimizer"):
    """Sum the contiguous 1-D host ``array`` in place over ``process_set`` in the fixed binary
    tree (comm/tree.py): the same additions in the same order for any power-of-two size."""
    state = world_of(process_set, who)
    with watched(state.record, "tree allreduce"):      # a rank that stops here is named
        tree_allreduce(state.ring, array, add, scratch)


def bucket_allreduce(process_set, layout, threshold_bytes, op, prescale, postscale, name,
                     wire_dtypes=None, who="DistributedOptimizer"):
    """A comm/overlap.py BucketAllreduce over ``process_set``: ``layout`` [(shape, dtype)] in
    submission order, fused into buckets of ``threshold_bytes``, each allreduced (``op``,
    ``prescale``, ``postscale``) on the comm thread as soon as its arrays are ready."""
    state = world_of(process_set, who)
    return BucketAllreduce(
        layout, threshold_bytes, lambda flat: allreduce_flat(state, flat, op, prescale, postscale),
        {"name": name, "op": op.value, "prescale_factor": prescale, "postscale_factor": postscale},
        wire_dtypes=wire_dtypes, state=state)


def bucket_plan(layout, wire_dtypes, threshold_bytes, arrival=True):
    """The buckets (entries: (array index, offset, length); ``total``; ``dtype``) that
    ``bucket_allreduce`` (``arrival``) or the fusion buffer (not ``arrival``) makes of
    ``layout`` [(shape, dtype)] travelling as ``wire_dtypes``: a pure function, the same on
    every rank."""
    return overlap_plan(layout, wire_dtypes, threshold_bytes, arrival)


def bucket_reduce_scatter(process_set, layout, threshold_bytes, op, prescale, postscale, name,
                          wire_dtypes=None, arrival=True, who="DistributedOptimizer",
                          agree_each=False):
    """``bucket_allreduce``'s buckets, each reduce-scattered on the ring instead (sharded
    gradients): after ``finish_flat`` rank r's chunk ``owned_chunk(r, size)`` of each bucket
    (bounds ``chunk_bounds(bucket.total, size)``) holds the bits the ring allreduce would give
    it. ``arrival``: buckets in arrival order, overlapping backward (bucket_allreduce's plan);
    False: the fusion buffer's plan (a grouped allreduce's), run inline at ``finish_flat``.
    ``agree_each``: an agreement before every bucket (other collectives run between them)."""
    state = world_of(process_set, who)
    return BucketAllreduce(
        layout, threshold_bytes,
        lambda flat: reduce_scatter_flat(state, flat, op, prescale, postscale),
        {"name": name, "op": op.value, "prescale_factor": prescale, "postscale_factor": postscale,
         "scatter": True, "arrival": bool(arrival)},
        wire_dtypes=wire_dtypes, state=state, overlap=arrival, arrival=arrival,
        agree_each=agree_each)
