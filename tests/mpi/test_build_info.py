"""Horovod's build booleans (comm/build_info.py): real booleans, true to what runs here."""
import importlib.util

from mpi4py import MPI

import mpitrain as mt

NAMES = ("mpi_built", "mpi_threads_supported", "nccl_built", "cuda_built", "is_homogeneous")


def test_every_answer_is_a_bool_and_exported():
    for name in NAMES:
        assert name in mt.__all__
        assert type(getattr(mt, name)()) is bool, name


def test_mpi_answers_match_the_library():
    assert mt.mpi_built() is True                # we run under MPI right now
    assert mt.mpi_threads_supported() is (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    # the same answer on every rank: one MPI library, one requested thread level
    assert len(set(mt.allgather_object(mt.mpi_threads_supported()))) == 1


def test_nccl_and_cuda_follow_what_is_importable():
    if importlib.util.find_spec("cupy") is None:
        assert mt.nccl_built() is False
        from numba import cuda
        assert mt.cuda_built() is bool(cuda.is_available() and len(cuda.gpus) > 0)


def test_homogeneous_on_one_machine_and_on_emulated_nodes(use_settings):
    assert mt.is_homogeneous() is True           # one host: one node of mt.size() ranks
    assert mt.local_size() == mt.size()
    if mt.size() % 2 == 0:
        use_settings(local_size=2)               # MPITRAIN_NODE_SIZE=2: nodes of two ranks
        assert mt.local_size() == 2
        assert mt.is_homogeneous() is True
    # the answer needs no collective: one rank alone may ask
    if mt.rank() == 0:
        assert mt.is_homogeneous() is True
    mt.barrier()
