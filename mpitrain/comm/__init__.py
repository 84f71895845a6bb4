"""Collectives over MPI. Public names are listed in __all__; docs/architecture.md draws the layers.

Bottom to top (each module imports only those before it): abort, watchdog, settings,
join_policy (what a rank that has joined can serve: no imports), check,
handles (the comm thread of non-blocking collectives), world (init/shutdown and the
per-communicator World), process_sets, build_info (what can run here), ops, ring, buckets,
fusion, engine, host, overlap, device, collectives (the public API: host or device,
chosen in one place), join (a rank out of data serving the others).
"""
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.build_info import (cuda_built, is_homogeneous, mpi_built, mpi_threads_supported,
                                      nccl_built)
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.collectives import (Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                       allgather_object, allreduce, allreduce_, alltoall, barrier,
                                       broadcast, broadcast_, broadcast_object, grouped_allreduce,
                                       grouped_allreduce_, reducescatter)
from mpitrain.comm.collectives import (allgather_async, allreduce_async, allreduce_async_,
                                       alltoall_async, broadcast_async, broadcast_async_,
                                       grouped_allreduce_async, grouped_allreduce_async_,
                                       reducescatter_async)
from mpitrain.comm.handles import Handle, poll, synchronize
from mpitrain.comm.join import join
from mpitrain.comm.process_sets import (ProcessSet, add_process_set, global_process_set,
                                        process_sets, remove_process_set)
from mpitrain.comm.settings import CommSettings
from mpitrain.comm.world import (cross_rank, cross_size, init, is_initialized, local_rank,
                                 local_size, rank, shutdown, size)

__all__ = [
    "init", "shutdown", "is_initialized", "install_abort_hook", "CommSettings",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "broadcast", "broadcast_", "reducescatter", "alltoall",
    "barrier", "broadcast_object", "allgather_object",
    "CollectiveError",
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather_async", "broadcast_async", "broadcast_async_", "reducescatter_async",
    "alltoall_async", "Handle", "poll", "synchronize", "join",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "process_sets",
    "mpi_built", "mpi_threads_supported", "nccl_built", "cuda_built", "is_homogeneous",
]
