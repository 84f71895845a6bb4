"""mpitrain.torch: horovod.torch's API on torch.Tensors, over mpitrain's collectives.

    import mpitrain.torch as hvd
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

No compiler and no build against torch: the collectives are mpitrain's (checked across ranks,
overlapped, join, process sets, timeline), reached through zero-copy views of the tensors
(docs/pytorch.md). The names follow horovod.torch; each module's docstring says where ours
differ. torch is an optional dependency: ``pip install 'mpitrain[torch]'``.
"""
import importlib.util

if importlib.util.find_spec("torch") is None:
    raise ImportError("mpitrain.torch needs PyTorch: pip install 'mpitrain[torch]'") from None

from mpitrain import comm
from mpitrain.torch.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                   gloo_built, gloo_enabled, init, is_homogeneous,
                                   is_initialized, local_rank, local_size, mpi_built,
                                   mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                   rocm_built, shutdown, size, start_timeline, stop_timeline)
from mpitrain.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpitrain.torch.compression import Compression
from mpitrain.torch.deterministic import micro_shards
from mpitrain.torch.ops import (Adasum, Average, Handle, Max, Min, Product, SparseHandle, Sum,
                                allgather, allgather_async, allgather_object, allreduce,
                                allreduce_, allreduce_async, allreduce_async_, alltoall,
                                alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                                broadcast_async_, broadcast_object, grouped_allgather,
                                grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                                grouped_allreduce_async, grouped_allreduce_async_,
                                grouped_reducescatter, grouped_reducescatter_async, join, poll,
                                reducescatter, reducescatter_async, sparse_allreduce_async,
                                synchronize)
from mpitrain.torch.optimizer import DistributedOptimizer
from mpitrain.torch.sync_batchnorm import SyncBatchNorm
from mpitrain.torch.zero import ZeroRedundancyOptimizer

CollectiveError = comm.CollectiveError
# Horovod's error for a collective that failed inside the library: ours is CollectiveError (a
# RuntimeError, raised on every rank), so ``except hvd.HorovodInternalError`` catches it.
HorovodInternalError = CollectiveError
ReduceOp = comm.ReduceOp
ProcessSet = comm.ProcessSet
global_process_set = comm.global_process_set
add_process_set = comm.add_process_set
remove_process_set = comm.remove_process_set

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "cuda_built", "rocm_built", "gloo_built", "gloo_enabled", "ddl_built",
    "ccl_built", "is_homogeneous",
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "ReduceOp", "CollectiveError",
    "HorovodInternalError",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async", "SparseHandle", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "alltoall",
    "alltoall_async", "barrier", "join", "poll", "synchronize", "Handle",
    "broadcast_object", "allgather_object",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "start_timeline", "stop_timeline",
    "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "Compression", "SyncBatchNorm", "ZeroRedundancyOptimizer", "micro_shards",
]
