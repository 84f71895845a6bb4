"""A process a rank starts with child_env() is a world of its own, and the rank's own world is
intact after it (a child that inherits the launcher's variables fails to start under MPICH and
overwrites the parent's rank under Open MPI)."""
import subprocess
import sys

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from tests.support.launch import child_env

CHILD = ("from mpi4py import MPI; w = MPI.COMM_WORLD; "
         "print(w.Get_size(), w.allreduce(w.Get_rank() + 1))")


def test_a_child_of_a_rank_is_a_singleton_and_the_job_goes_on():
    res = subprocess.run([sys.executable, "-c", CHILD], env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["1", "1"], res.stderr[-2000:]
    size = MPI.COMM_WORLD.Get_size()
    got = mt.allreduce(np.full(1000, MPI.COMM_WORLD.Get_rank() + 1.0), op=mt.Sum)
    assert np.array_equal(got, np.full(1000, size * (size + 1) / 2))
