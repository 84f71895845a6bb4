"""mpitrain.tensorflow: horovod.tensorflow's API on tf.Tensors, over mpitrain's collectives.

    import mpitrain.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)    # averaged over the ranks

No compiler and no build against TensorFlow: the collectives are mpitrain's (checked across
ranks, process sets, join, timeline), reached through NumPy copies of the tensors, eagerly or
as one ``tf.numpy_function`` node inside a tf.function (docs/tensorflow.md). The names follow
horovod.tensorflow. TensorFlow is an optional dependency: ``pip install 'mpitrain[tensorflow]'``;
Keras's names are in ``mpitrain.keras`` (also ``mpitrain.tensorflow.keras``).
"""
import importlib.util

if importlib.util.find_spec("tensorflow") is None:
    raise ImportError("mpitrain.tensorflow needs TensorFlow: "
                      "pip install 'mpitrain[tensorflow]'") from None

from mpitrain import comm
from mpitrain.tensorflow.basics import (ccl_built, cross_rank, cross_size, cuda_built,
                                        ddl_built, gloo_built, gloo_enabled, init,
                                        is_homogeneous, is_initialized, local_rank,
                                        local_size, mpi_built, mpi_enabled,
                                        mpi_threads_supported, nccl_built, rank, rocm_built,
                                        shutdown, size, start_timeline, stop_timeline)
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradients import DistributedGradientTape
from mpitrain.tensorflow.ops import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                     allgather_object, allreduce, alltoall, barrier,
                                     broadcast, broadcast_object, broadcast_variables,
                                     grouped_allreduce, join, reducescatter)

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
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "reducescatter", "alltoall",
    "barrier", "join", "broadcast_object", "allgather_object", "broadcast_variables",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "start_timeline", "stop_timeline", "Compression", "DistributedGradientTape",
]
