"""CPU backend: NumPy arrays, numba.njit kernels, BLAS GEMM.

The contract: kernels/__init__.py; the package's namespace is its kernels (kernels/contract.py),
gathered from the modules below. Every kernel takes preallocated, C-contiguous outputs, so a
training step allocates nothing once the layers' workspaces exist. Elementwise kernels work on
flat views (``a.reshape(-1)`` is a view of a contiguous array), so one compiled specialisation
serves every rank of array. The outer loops over the batch are ``prange``: with one Numba thread
(the trainer's default, threads.py) they run serially at no cost; with more threads they split
over samples, which never share an element. ``nogil=True`` everywhere: the gradient allreduce
thread (comm/overlap.py) runs while they do.
"""
from mpitrain.kernels import contract
from mpitrain.kernels.cpu import (
    arrays, columns, conv, dense, losses, norm, optim, pooling, transformer)

name = "cpu"
globals().update(contract.collect(arrays, dense, losses, columns, conv, pooling, norm, optim,
                                    transformer))
