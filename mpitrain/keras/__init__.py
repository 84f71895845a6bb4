"""mpitrain.keras: horovod.tensorflow.keras's API for Keras 3 on the TensorFlow backend.

    import mpitrain.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="mse")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

Everything of mpitrain.tensorflow (the collectives on tensors, process sets, Compression) plus
DistributedOptimizer, the callbacks and load_model (docs/tensorflow.md). Also importable as
``mpitrain.tensorflow.keras``. Needs TensorFlow and Keras 3: ``pip install
'mpitrain[tensorflow]'``; Keras's backend must be ``tensorflow`` (KERAS_BACKEND).
"""
import importlib.util

if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
    raise ImportError("mpitrain.keras needs TensorFlow and Keras 3: "
                      "pip install 'mpitrain[tensorflow]'") from None

from mpitrain.keras import callbacks
from mpitrain.keras.backend import check_backend
from mpitrain.keras.optimizer import DistributedOptimizer, load_model
from mpitrain.tensorflow import (Adasum, Average, CollectiveError, Compression,
                                 HorovodInternalError, Max, Min, Product, ProcessSet, ReduceOp,
                                 Sum, add_process_set, allgather, allgather_object, allreduce,
                                 alltoall, barrier, broadcast, broadcast_object,
                                 broadcast_variables, ccl_built, cross_rank, cross_size,
                                 cuda_built, ddl_built, gloo_built, gloo_enabled,
                                 global_process_set, grouped_allreduce, is_homogeneous,
                                 is_initialized, join, local_rank, local_size, mpi_built,
                                 mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                 reducescatter, remove_process_set, rocm_built, shutdown, size,
                                 start_timeline, stop_timeline)
from mpitrain.tensorflow import init as _tf_init


def init(comm=None, process_sets=None, threads=0, **kwargs):
    """mpitrain.tensorflow's ``init``, after checking that Keras runs on TensorFlow (one line
    naming the supported backend otherwise)."""
    check_backend()
    _tf_init(comm, process_sets=process_sets, threads=threads, **kwargs)


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
    "start_timeline", "stop_timeline", "Compression",
    "DistributedOptimizer", "callbacks", "load_model",
]
