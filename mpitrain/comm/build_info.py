"""What this installation can use, as Horovod's build booleans: ``mt.mpi_built()`` and friends.

Horovod answers these from how it was compiled; mpitrain compiles nothing, so each answer is
what is importable and usable in this process now. None of them communicates, so any rank may
ask at any time (``is_homogeneous`` reads a fact the World agreed at init):

- ``mpi_built()``: mpi4py is loaded over a real MPI library (always true once mpitrain imports;
  kept for ported scripts that branch on it);
- ``mpi_threads_supported()``: MPI gave ``MPI_THREAD_MULTIPLE``, so any thread may call MPI at
  any time (the comm thread of overlap.py needs only SERIALIZED);
- ``nccl_built()``: ``cupy.cuda.nccl`` imports and says it is available (the device transport
  may then use NCCL; a GPU is still needed to run it);
- ``cuda_built()``: a CUDA backend can run here: CuPy sees a GPU, or Numba's CUDA target is
  available (the simulator, ``NUMBA_ENABLE_CUDASIM=1``, counts: ``--device cuda --kernels numba``
  runs on it);
- ``is_homogeneous()``: every node runs the same number of ranks (local sizes allgathered once
  by ``init``).
"""
import importlib.util

from mpi4py import MPI

from mpitrain.comm import world


def mpi_built():
    """True: mpi4py is loaded and reports an MPI library (its version string is not empty)."""
    return bool(MPI.Get_library_version().strip())


def mpi_threads_supported():
    """True when MPI runs at ``MPI_THREAD_MULTIPLE`` (initialises mpitrain if needed)."""
    world.current()                 # MPI is initialised (mpi4py's thread level requested)
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def nccl_built():
    """True when ``cupy.cuda.nccl`` imports and reports itself available."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        from cupy.cuda import nccl
        return bool(getattr(nccl, "available", True))
    except Exception:  # noqa: BLE001 - a broken CuPy or a missing libnccl: not usable
        return False


def device_count():
    """Number of visible GPUs (CuPy if installed, else Numba; 1 under the CUDA simulator)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no driver: ask Numba
        from numba import cuda
        return len(cuda.gpus) if cuda.is_available() else 0


def cuda_built():
    """True when a CUDA backend can run here (at least one GPU, real or simulated)."""
    try:
        return device_count() > 0
    except Exception:  # noqa: BLE001 - a driver that fails to answer: no usable device
        return False


def is_homogeneous():
    """True when every node runs the same number of ranks (initialises mpitrain if needed)."""
    return world.current().homogeneous
