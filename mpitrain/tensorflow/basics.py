"""init and the questions about the job (rank, size, what was built), horovod.tensorflow's names.

Importing mpitrain.tensorflow adds TensorFlow's two thread pools to the rank's thread budget
(runtime/threads.py): ``tf.config.threading``'s intra-op and inter-op parallelism get the same
number as BLAS -- cores / ranks on this node, ``init(threads=n)`` or MPITRAIN_THREADS, a
``tf.config.threading.set_intra_op_parallelism_threads`` called before initialising, or an
exported OMP_NUM_THREADS. TensorFlow fixes its pools when it runs its first operation, so the
budget must be applied before that: importing mpitrain.tensorflow (or calling ``hvd.init()``)
before building models does it; a pool already started is left as it is, with one warning.
"""
import warnings

import tensorflow as tf

from mpitrain import comm as mtcomm
from mpitrain.runtime import threads as thread_budget


class TensorFlowPools:
    """TensorFlow's intra-op and inter-op pools as the thread budget sees them: the intra-op
    size a user set before initialising (0: TensorFlow's own default), and the resize."""

    def __init__(self):
        self.size = tf.config.threading.get_intra_op_parallelism_threads()
        self.warned = False

    def requested(self):
        n = tf.config.threading.get_intra_op_parallelism_threads()
        return n if n != self.size else 0

    def resize(self, n):
        threading = tf.config.threading
        if (threading.get_intra_op_parallelism_threads(),
                threading.get_inter_op_parallelism_threads()) == (n, n):
            self.size = n
            return
        try:
            threading.set_intra_op_parallelism_threads(n)
            threading.set_inter_op_parallelism_threads(n)
        except RuntimeError:                    # TensorFlow's runtime has already started
            if not self.warned:
                self.warned = True
                warnings.warn(f"mpitrain.tensorflow: TensorFlow's thread pools were started "
                              f"before mpitrain could size them to {n} thread(s) a rank; "
                              f"import mpitrain.tensorflow (or call hvd.init()) before running "
                              f"TensorFlow operations", RuntimeWarning, stacklevel=2)
            return
        self.size = threading.get_intra_op_parallelism_threads()


_pools = TensorFlowPools()
if not mtcomm.is_initialized():
    # the budget mt.init will apply, before TensorFlow starts its pools (it fixes them then)
    _pools.resize(thread_budget.resolve(thread_budget.from_env()))
thread_budget.add_pool(_pools.requested, _pools.resize)


def init(comm=None, process_sets=None, threads=0, **kwargs):
    """Initialise on ``comm`` (an mpi4py communicator; default COMM_WORLD); idempotent.

    process_sets: ProcessSets or rank lists to add now (Horovod's ``init(process_sets=...)``).
    threads: this rank's thread budget for BLAS and TensorFlow's pools (0: MPITRAIN_THREADS,
    else an intra-op size set before, else OMP_NUM_THREADS, else cores / local ranks; None:
    leave the pools as they are), applied again when mpitrain is already initialised.
    Other keywords go to ``mt.init``.
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
