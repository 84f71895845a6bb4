"""CUDA backend, Numba flavour: ``numba.cuda.jit`` kernels for every name of the contract.

Nothing here needs CuPy, so the whole training step (GEMM included) also runs under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``) on a machine without a GPU; that is how CI checks this
package. Arrays are Numba device arrays; CuPy arrays (anything exposing
``__cuda_array_interface__``) are accepted too and wrapped with ``numba.cuda.as_cuda_array`` (zero
copy). Host NumPy arrays are refused with a TypeError: Numba would silently copy them both ways on
every launch, which hides bugs in the layer code and costs two PCIe transfers per kernel.

The same names as kernels/cpu/ (the contract: kernels/__init__.py), gathered from the modules
below as there; launch shapes and disk caching: arrays.py. Reductions (``total`` and
``count_correct`` in arrays.py, BatchNorm's sums in norm.py) are deterministic: every block reduces
its part in shared memory into float64 partials, which are then added in block order.
"""
from mpitrain.kernels import contract
from mpitrain.kernels.cuda_numba import (
    arrays, conv, dense, losses, norm, optim, pooling, transformer)

name = "cuda-numba"
globals().update(contract.collect(arrays, dense, losses, conv, pooling, norm, optim,
                                    transformer))
