"""CPU backend: NumPy arrays, numba.njit kernels, BLAS GEMM (see kernels/__init__.py for the contract)."""
import numpy as np
from numba import njit, prange  # noqa: F401

name = "cpu"

# --- Memory, GEMM, layer, loss, conv, pooling, dropout and optimizer kernels (engine) ---


# --- Collective reductions (comm): reduce_into(dst, src, op) ---
