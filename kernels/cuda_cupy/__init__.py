"""CUDA backend, CuPy flavour: CuPy arrays, cuBLAS GEMMs, CuPy elementwise/raw kernels.

The same names as kernels/cpu/ (the contract: kernels/__init__.py), gathered from the modules
below as there. Everything but the GEMMs is one kernel per operation, written as a gather over
the output (im2col, col2im, layout changes, pooling), which needs no atomics and sums in a fixed
order (BatchNorm's sums too: norm.py); only max-pool backward scatters with ``atomicAdd`` because
its windows may overlap. The dropout mask uses the contract's exact hash in 32-bit arithmetic, so
masks are bit-identical to the CPU's. Scalars are passed in the array's dtype, so float32 work
stays in float32 (PyTorch's choice; the CPU backend computes its scalars in float64, hence
tolerances). Without CuPy or a CUDA device, importing it raises ImportError (arrays.py).
"""
from mpitrain.kernels import contract
from mpitrain.kernels.cuda_cupy import (
    arrays, conv, dense, losses, norm, optim, pooling, transformer)

name = "cuda-cupy"
globals().update(contract.collect(arrays, dense, losses, conv, pooling, norm, optim,
                                    transformer))
