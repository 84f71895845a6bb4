"""bfloat16 (the upper 16 bits of a float32) for the bf16 gradient compression, as bit patterns.

NumPy has no bfloat16 type, so the wire dtype is ``BFLOAT16``, a 2-byte structured dtype whose one
field holds the bits: an array of it cannot be mistaken for uint16 data (whose sums are integer
sums) by a dtype check, yet views as uint16 for free. Each kernel widens to float32 (bits << 16,
exact), computes there and rounds once back to bfloat16, to nearest even, NaN kept quiet: the
arithmetic of a bfloat16 ufunc that computes in float32. A ring allreduce of BFLOAT16 therefore
rounds once per hop, as the fp16 path does with float16, while every byte on the wire is half a
float32's.
"""
import numpy as np
from numba import njit

BFLOAT16 = np.dtype([("bfloat16", "<u2")])

_BLOCK = 1024      # elements widened per block: the float32 temporaries stay in L1


@njit(cache=True, nogil=True, inline="always")
def _round(b):
    """bfloat16 bits (as uint32) of the float32 bits ``b``: to nearest even; NaN stays NaN."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (b >> np.uint32(16)) | np.uint32(0x0040)
    return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True, nogil=True)
def from_float32(dst, src):
    """dst (uint16 view) = bfloat16 of src (uint32 view of float32), 1-D, same length."""
    for i in range(src.size):
        dst[i] = np.uint16(_round(np.uint32(src[i])))


@njit(cache=True, nogil=True)
def to_float32(dst, src):
    """dst (uint32 view of float32) = src (uint16 view) widened: exact."""
    for i in range(src.size):
        dst[i] = np.uint32(src[i]) << np.uint32(16)


@njit(cache=True, nogil=True)
def _reduce(dst, src, kind):
    a = np.empty(_BLOCK, np.uint32)
    b = np.empty(_BLOCK, np.uint32)
    af, bf = a.view(np.float32), b.view(np.float32)
    n = dst.size
    for lo in range(0, n, _BLOCK):
        m = min(_BLOCK, n - lo)
        for i in range(m):
            a[i] = np.uint32(dst[lo + i]) << np.uint32(16)
            b[i] = np.uint32(src[lo + i]) << np.uint32(16)
        if kind == 0:
            for i in range(m):
                af[i] = af[i] + bf[i]
        elif kind == 1:
            for i in range(m):
                af[i] = af[i] * bf[i]
        elif kind == 2:
            for i in range(m):
                if bf[i] < af[i]:
                    af[i] = bf[i]
        else:
            for i in range(m):
                if bf[i] > af[i]:
                    af[i] = bf[i]
        for i in range(m):
            dst[lo + i] = np.uint16(_round(a[i]))


_KINDS = {"sum": 0, "prod": 1, "min": 2, "max": 3}


def reduce_into(dst, src, op):
    """dst = op(dst, src) on BFLOAT16 arrays (1-D, same length), op in sum/prod/min/max."""
    _reduce(dst.view(np.uint16), src.view(np.uint16), _KINDS[op])


@njit(cache=True, nogil=True)
def _scale(a, factor):
    t = np.empty(_BLOCK, np.uint32)
    tf = t.view(np.float32)
    n = a.size
    for lo in range(0, n, _BLOCK):
        m = min(_BLOCK, n - lo)
        for i in range(m):
            t[i] = np.uint32(a[lo + i]) << np.uint32(16)
            tf[i] = tf[i] * factor
            a[lo + i] = np.uint16(_round(t[i]))


def scale(a, factor):
    """a *= factor in place (a C-contiguous BFLOAT16 array), in float32."""
    _scale(a.reshape(-1).view(np.uint16), np.float32(factor))


def encode(array):
    """A new BFLOAT16 array of the float32 ``array`` (any shape)."""
    src = np.ascontiguousarray(array, np.float32)
    out = np.empty(src.shape, BFLOAT16)
    from_float32(out.reshape(-1).view(np.uint16), src.reshape(-1).view(np.uint32))
    return out


def decode(array):
    """A new float32 array of the BFLOAT16 ``array``: exact."""
    src = np.ascontiguousarray(array)
    out = np.empty(src.shape, np.float32)
    to_float32(out.reshape(-1).view(np.uint32), src.reshape(-1).view(np.uint16))
    return out
