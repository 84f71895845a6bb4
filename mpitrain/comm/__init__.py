"""Collectives over MPI. Public names are listed in __all__; docs/architecture.md draws the layers.

Bottom to top (each module imports only those before it): abort, watchdog, settings, check,
world (init/shutdown and the per-communicator World), build_info (what can run here), ops, ring,
buckets, fusion, engine, host, overlap, device, collectives (the public API: host or device,
chosen in one place).
"""
from mpitrain.comm.abort import install_abort_hook
from mpitrain.comm.build_info import (cuda_built, is_homogeneous, mpi_built, mpi_threads_supported,
                                      nccl_built)
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.collectives import (Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                       allgather_object, allreduce, allreduce_, alltoall, barrier,
                                       broadcast, broadcast_, broadcast_object, grouped_allreduce,
                                       grouped_allreduce_, reducescatter)
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
    "mpi_built", "mpi_threads_supported", "nccl_built", "cuda_built", "is_homogeneous",
]
