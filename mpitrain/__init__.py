"""mpitrain: data-parallel training over MPI with our own ring-allreduce.

    import mpitrain as mt
    mt.init()
    avg = mt.allreduce(x)                       # mean across ranks (mt.Average)

Each section below re-exports one layer of the package; ``__all__`` is the public contract
(see docs/architecture.md).
"""


def _source_tree_kernels():
    """Run from a checkout without an install (``python -m mpitrain`` in the repository root,
    pytest's ``pythonpath = .``, the lent GPU machine), the ``kernels/`` folder beside this
    package is ``mpitrain.kernels``, as setup.py's ``package_dir`` makes it when installed."""
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

# Collectives (mpitrain/comm): init, rank/size, allreduce, ..., CollectiveError.
from mpitrain.comm import (Average, CollectiveError, CommSettings, Max, Min, Product, ReduceOp,
                           Sum, allgather, allgather_object, allreduce, allreduce_, alltoall,
                           barrier, broadcast, broadcast_, broadcast_object, cross_rank,
                           cross_size, grouped_allreduce, grouped_allreduce_, init,
                           install_abort_hook, is_initialized, local_rank, local_size, rank,
                           reducescatter, shutdown, size)
# What can run here (Horovod's build booleans): comm/build_info.py.
from mpitrain.comm import (cuda_built, is_homogeneous, mpi_built, mpi_threads_supported,
                           nccl_built)
# Non-blocking collectives (comm/handles.py), process sets (comm/process_sets.py) and uneven
# data (comm/join.py).
from mpitrain.comm import (Handle, ProcessSet, add_process_set, allgather_async,
                           allreduce_async, allreduce_async_, alltoall_async, broadcast_async,
                           broadcast_async_, global_process_set, grouped_allreduce_async,
                           grouped_allreduce_async_, join, poll, process_sets,
                           reducescatter_async, remove_process_set, synchronize)

# Training (distributed.py): parameter/optimizer-state broadcast, the optimizer wrapper,
# compression.
from mpitrain.distributed import (Compression, DistributedOptimizer, broadcast_optimizer_state,
                                  broadcast_parameters)

# Evaluation (evaluation.py): every test sample scored once, counts summed across ranks.
from mpitrain.evaluation import evaluate

# The timeline switched on and off at run time (tracing.py; --timeline does a whole CLI run).
from mpitrain.tracing import start_timeline, stop_timeline

# Model side (no MPI inside): layers, models, optimizers, datasets.
from mpitrain import data, nn, optim
from mpitrain.nn import models

__version__ = "0.1.0"
__all__ = [
    # collectives
    "init", "shutdown", "is_initialized", "install_abort_hook", "CommSettings",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "ReduceOp", "Sum", "Average", "Min", "Max", "Product",
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
    "evaluate", "start_timeline", "stop_timeline",
    # model side
    "nn", "optim", "data", "models",
]
