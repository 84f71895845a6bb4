"""The contract's dropout hash, shared by every backend.

The mask of element i is keep iff ``mix32(mix32(i) ^ mix32(seed)) >> 8 >= threshold(p)``, with
mix32 = lowbias32 (Chris Wellons' 32-bit integer hash). Each backend evaluates the per-element
part in its own kernel language (both Numba ones: ``mix32_lanes``; Numba's caches key a kernel on
its own file only, so clear them after editing it); the two per-call values are computed once,
here, so the test is bit-for-bit the same on the CPU, in Numba CUDA and in CuPy.
"""
import numpy as np


def mix32(x):
    """lowbias32 on a Python int (taken modulo 2**32)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def keep_threshold(p):
    """Integer keep threshold on the top 24 bits of the hash, for drop probability ``p``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return int(p * 16777216.0)


def mix32_lanes(x):
    """mix32 on a uint64 holding a uint32, in NumPy integers: the CPU's ``njit`` and numba.cuda's
    device ``jit`` compile this function into their dropout kernels."""
    x = x & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    return x ^ (x >> np.uint64(16))
