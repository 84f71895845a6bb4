"""init and the questions about the job (rank, size, what was built), horovod.torch's names.

Importing mpitrain.torch adds PyTorch's intra-op pool to the rank's thread budget
(runtime/threads.py), so torch gets the same number as BLAS -- cores / ranks on this node,
``init(threads=n)`` or MPITRAIN_THREADS, a ``torch.set_num_threads`` called before
initialising, or an exported OMP_NUM_THREADS -- however mpitrain was initialised: by
``hvd.init()`` or by the first call that needs it (every entry point initialises on its own,
the same way; ``init`` is still the place for ``comm``, process sets and ``threads``). N ranks
each running a torch pool as wide as the machine oversubscribe the cores, the CPU scaling trap
of data-parallel training (15-30x slower steps).
"""
import torch

# the comm layer under another name: ``init``'s first parameter is Horovod's ``comm``
from mpitrain import comm as mtcomm
from mpitrain.runtime import threads as thread_budget


class TorchPool:
    """torch's intra-op pool as the thread budget sees it: the size a user set since the
    last resize (``torch.set_num_threads`` before ``init``), and the resize itself."""

    def __init__(self):
        self.size = torch.get_num_threads()

    def requested(self):
        n = torch.get_num_threads()
        return n if n != self.size else 0

    def resize(self, n):
        torch.set_num_threads(n)
        self.size = torch.get_num_threads()


_pool = TorchPool()
thread_budget.add_pool(_pool.requested, _pool.resize)


def init(comm=None, process_sets=None, threads=0, **kwargs):
    """Initialise on ``comm`` (an mpi4py communicator; default COMM_WORLD); idempotent.

    process_sets: ProcessSets or rank lists to add now (Horovod's ``init(process_sets=...)``).
    threads: this rank's thread budget for BLAS and torch (0: MPITRAIN_THREADS, else a
    ``torch.set_num_threads`` called before, else OMP_NUM_THREADS, else cores / local ranks;
    None: leave the pools as they are), applied again when mpitrain is already initialised.
    Other keywords go to ``mt.init``.

    Deterministic training (``DistributedOptimizer(..., deterministic=True)`` with the batches of
    ``micro_shards``: the same bits for any power-of-two number of ranks) also needs what no
    optimizer can set for you, on every rank, before the model is built:
    ``torch.use_deterministic_algorithms(True)`` (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8
    in the environment), and one fixed torch thread count for every N -- ``threads=1`` here,
    or the same ``threads=n`` at every N -- since a CPU reduction's blocking follows the thread
    count; the same dtype, model code and torch version at every N; the same global batch on
    every rank. The optimizer refuses what it can check (see DistributedOptimizer).
    """
    first = not mtcomm.is_initialized()
    mtcomm.init(comm, threads=threads, **kwargs)
    if threads is not None and not first:
        thread_budget.configure(threads or thread_budget.from_env(), mtcomm.local_size())
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
