"""Collectives over MPI (see ring.py for the algorithm). Public names are listed in __all__.

world.py: communicators, ranks, abort hook; ring.py: the ring allreduce; collectives.py: the
Horovod-style API; fusion.py: the fusion buffer; check.py: cross-rank agreement.
"""
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.collectives import (Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                       allgather_object, allreduce, allreduce_, alltoall, barrier,
                                       broadcast, broadcast_, broadcast_object, grouped_allreduce,
                                       grouped_allreduce_, reducescatter)
from mpitrain.comm.world import (cross_rank, cross_size, init, install_abort_hook,
                                 is_initialized, local_rank, local_size, rank, shutdown, size)

__all__ = [
    "init", "shutdown", "is_initialized", "install_abort_hook",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "broadcast", "broadcast_", "reducescatter", "alltoall",
    "barrier", "broadcast_object", "allgather_object",
    "CollectiveError",
]
