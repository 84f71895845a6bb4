"""init and the questions about the job (rank, size, what was built), horovod.torch's names.

``init`` is mpitrain's ``mt.init`` plus PyTorch's thread pool: each rank's intra-op threads get
the same budget as BLAS (cores / ranks on this node; ``init(threads=n)`` or MPITRAIN_THREADS
overrides it, ``threads=None`` leaves both pools alone). N ranks each running a torch pool as
wide as the machine oversubscribe the cores, the CPU scaling trap of data-parallel training.
"""
import torch

# the comm layer under another name: ``init``'s first parameter is Horovod's ``comm``
from mpitrain import comm as mtcomm
from mpitrain.runtime import threads as thread_budget


def init(comm=None, process_sets=None, threads=0, **kwargs):
    """Initialise on ``comm`` (an mpi4py communicator; default COMM_WORLD); idempotent.

    process_sets: ProcessSets or rank lists to add now (Horovod's ``init(process_sets=...)``).
    threads: this rank's thread budget for BLAS and torch (0: MPITRAIN_THREADS, else cores /
    local ranks; None: leave the pools as they are). Other keywords go to ``mt.init``.
    """
    mtcomm.init(comm, threads=threads, **kwargs)
    if threads is not None:
        budget = threads or thread_budget.from_env() or thread_budget.default_threads(
            mtcomm.local_size())
        torch.set_num_threads(budget)
    for process_set in process_sets or ():
        mtcomm.add_process_set(process_set)


shutdown = mtcomm.shutdown
is_initialized = mtcomm.is_initialized
rank = mtcomm.rank
size = mtcomm.size
local_rank = mtcomm.local_rank
local_size = mtcomm.local_size
cross_rank = mtcomm.cross_rank
cross_size = mtcomm.cross_size
mpi_built = mtcomm.mpi_built
mpi_threads_supported = mtcomm.mpi_threads_supported
nccl_built = mtcomm.nccl_built
cuda_built = mtcomm.cuda_built
is_homogeneous = mtcomm.is_homogeneous
start_timeline = mtcomm.start_timeline
stop_timeline = mtcomm.stop_timeline


def mpi_enabled():
    """True: collectives run over MPI (Horovod's name)."""
    return True


def gloo_built():
    """False: no Gloo controller here (collectives run over MPI)."""
    return False


gloo_enabled = gloo_built


def rocm_built():
    """False: no ROCm build."""
    return False


def ddl_built():
    return False


def ccl_built():
    return False
