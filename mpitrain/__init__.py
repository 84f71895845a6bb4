"""mpitrain: data-parallel training over MPI with our own ring-allreduce.

    import mpitrain as mt
    mt.init()
    avg = mt.allreduce(x)                       # mean across ranks (mt.Average)

Each section below re-exports one layer of the package; ``__all__`` is the public contract
(see docs/architecture.md).
"""


def _source_tree_kernels():
    """Run from a checkout without an install (``python -m mpitrain`` in the repository root,
    pytest's ``pythonpath = .``, ``make gpu-check`` on a GPU machine), the ``kernels/`` folder
    beside this package is ``mpitrain.kernels``, as setup.py's ``package_dir`` makes it when
    installed."""
    import importlib.util
    import os
    import sys
    if importlib.util.find_spec(__name__ + ".kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    spec = importlib.util.spec_from_file_location(
        __name__ + ".kernels", os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    setattr(sys.modules[__name__], "kernels", module)     # as the import system would


_source_tree_kernels()

# Collectives (mpitrain/comm): init, rank/size, allreduce, ..., CollectiveError; non-blocking
# forms (comm/handles.py), process sets, uneven data (comm/join.py) and what can run here
# (Horovod's build booleans: comm/build_info.py), the timeline switched on and off at run time
# (comm/tracing.py; --timeline does a whole CLI run).
from mpitrain.comm import (Adasum, Average, CollectiveError, CommSettings, Handle, Max, Min,
                           Product, ProcessSet, ReduceOp, Sum, add_process_set, allgather,
                           allgather_async, allgather_object, allreduce, allreduce_,
                           allreduce_async,
                           allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                           broadcast_, broadcast_async, broadcast_async_, broadcast_object,
                           cross_rank, cross_size, cuda_built, global_process_set,
                           grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                           grouped_allreduce_async_, init, install_abort_hook, is_homogeneous,
                           is_initialized, join, local_rank, local_size, mpi_built,
                           mpi_threads_supported, nccl_built, poll, process_sets, rank,
                           reducescatter, reducescatter_async, remove_process_set, shutdown, size,
                           start_timeline, stop_timeline, synchronize)

# Training (parallel/): parameter/optimizer-state broadcast, the optimizer wrapper,
# compression.
from mpitrain.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpitrain.parallel.gradients import Compression
from mpitrain.parallel.optimizer import DistributedOptimizer
# Checkpoints for your own loop: mt.checkpoint.save / load_latest (collective, rank 0 writes).
from mpitrain.train import checkpoint

# Evaluation (parallel/evaluation.py): every test sample scored once, counts summed across ranks.
from mpitrain.parallel.evaluation import evaluate
from mpitrain.parallel.metric import Metric

# Model side (no MPI inside): layers, models, optimizers, datasets.
from mpitrain import data, nn, optim
from mpitrain.nn import models

__version__ = "0.1.0"
__all__ = [
    # collectives
    "init", "shutdown", "is_initialized", "install_abort_hook", "CommSettings",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "broadcast", "broadcast_", "reducescatter", "alltoall",
    "barrier", "broadcast_object", "allgather_object", "CollectiveError",
    "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather_async", "broadcast_async", "broadcast_async_", "reducescatter_async",
    "alltoall_async", "poll", "synchronize", "Handle", "join",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set", "process_sets",
    "mpi_built", "mpi_threads_supported", "nccl_built", "cuda_built", "is_homogeneous",
    # training
    "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer", "Compression",
    "checkpoint",
    "evaluate", "Metric", "start_timeline", "stop_timeline",
    # model side
    "nn", "optim", "data", "models",
]
