"""The CPU's memory kernels and reduce_into: flat njit loops over NumPy arrays (float16 on its
bits: kernels/cpu/half.py)."""
import numpy as np
from numba import njit

from mpitrain.kernels.checks import flat, sizes_match
from mpitrain.kernels.cpu import bfloat16, half


def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


def to_device(host):
    """A C-contiguous copy: the CPU "device" must not alias the caller's array."""
    return np.array(host, copy=True, order="C")


def to_host(a):
    return a


def synchronize():
    pass


@njit(cache=True, nogil=True)
def _fill(a, value):
    for i in range(a.size):
        a[i] = value


@njit(cache=True, nogil=True)
def _copy(dst, src):
    for i in range(dst.size):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def _scale(a, factor):
    for i in range(a.size):
        a[i] = a[i] * factor


@njit(cache=True, nogil=True)
def add_flat(dst, src):
    for i in range(dst.size):
        dst[i] = dst[i] + src[i]


@njit(cache=True, nogil=True)
def _total(a):
    s = 0.0
    for i in range(a.size):
        s += a[i]
    return s


def fill(a, value):
    if a.dtype == np.float16:
        one = np.empty(1, np.float16)
        one.fill(value)                 # NumPy's own conversion of value, once
        _fill(flat(a).view(np.uint16), one.view(np.uint16)[0])
    else:
        _fill(flat(a), value)


def copy(dst, src):
    sizes_match(src, dst)
    if dst.dtype == np.float16 or src.dtype == np.float16:
        cast(dst, src)
    else:
        _copy(flat(dst, "dst"), flat(src, "src"))


def scale(a, factor):
    if a.dtype != np.float16:
        _scale(flat(a), factor)
        return
    a_flat = flat(a)
    # NumPy's promotion decides the arithmetic: a Python float or int (weak, NEP 50) or a float16
    # becomes a float16 first; a float32 keeps float32. Either runs as one float32 multiply.
    # Anything else (a float64 scalar computes in float64) keeps NumPy's own multiply.
    kind = np.result_type(a.dtype, factor) if np.ndim(factor) == 0 else None
    if kind == np.float16:
        half.scale(a_flat.view(np.uint16), np.float32(np.array(factor, dtype=np.float16)))
    elif kind == np.float32:
        half.scale(a_flat.view(np.uint16), np.float32(factor))
    else:
        np.multiply(a_flat, factor, out=a_flat, casting="unsafe")


def add(dst, src):
    sizes_match(src, dst)
    if dst.dtype == np.float16 and src.dtype == np.float16:
        half.REDUCE["sum"](flat(dst, "dst").view(np.uint16), flat(src, "src").view(np.uint16))
    elif dst.dtype == np.float16 or src.dtype == np.float16:
        np.add(flat(dst, "dst"), flat(src, "src"), out=flat(dst, "dst"), casting="unsafe")
    else:
        add_flat(flat(dst, "dst"), flat(src, "src"))


def cast(dst, src):
    """dst[...] = src in dst's dtype; float32 <-> float16 (the fp16 compression) and float32 <->
    bfloat16.BFLOAT16 (the bf16 one) in Numba."""
    sizes_match(src, dst)
    d, s = flat(dst, "dst"), flat(src, "src")
    if d.dtype == bfloat16.BFLOAT16 or s.dtype == bfloat16.BFLOAT16:
        _cast_bfloat16(d, s)
        return
    if d.dtype == np.float16 and s.dtype == np.float32:
        half.from_float32(d.view(np.uint16), s.view(np.uint32))
    elif d.dtype == np.float32 and s.dtype == np.float16:
        half.to_float32(d, s.view(np.uint16))
    elif d.dtype == np.float16 and s.dtype == np.float16:
        _copy(d.view(np.uint16), s.view(np.uint16))
    else:
        np.copyto(d, s, casting="unsafe")


def _cast_bfloat16(d, s):
    if d.dtype == s.dtype:
        _copy(d.view(np.uint16), s.view(np.uint16))
    elif s.dtype == np.float32:
        bfloat16.from_float32(d.view(np.uint16), s.view(np.uint32))
    elif d.dtype == np.float32:
        bfloat16.to_float32(d.view(np.uint32), s.view(np.uint16))
    else:
        raise TypeError(f"cast: bfloat16 converts to and from float32 only, not {d.dtype} <- "
                        f"{s.dtype}")


def total(a):
    if a.dtype == np.float16:
        chunk = np.getbufsize()
        if chunk > half.EXACT_BLOCK:        # blocks no longer sum exactly: NumPy's own order
            return float(flat(a).sum(dtype=np.float64))
        return float(half.sum_float64(flat(a).view(np.uint16), chunk))
    return float(_total(flat(a)))


# Collective reductions (comm): the ring reduces every received sub-chunk into the caller's buffer
# with these: one pass over memory, in place, SIMD-vectorised by LLVM. Integer overflow wraps, as in
# MPI_Allreduce.

@njit(cache=True, nogil=True)
def _reduce_prod(dst, src):
    for i in range(dst.shape[0]):
        dst[i] *= src[i]


@njit(cache=True, nogil=True)
def _reduce_min(dst, src):
    for i in range(dst.shape[0]):
        if src[i] < dst[i]:
            dst[i] = src[i]


@njit(cache=True, nogil=True)
def _reduce_max(dst, src):
    for i in range(dst.shape[0]):
        if src[i] > dst[i]:
            dst[i] = src[i]


_REDUCE_NUMBA = {"sum": add_flat, "prod": _reduce_prod, "min": _reduce_min, "max": _reduce_max}


def reduce_into(dst, src, op):
    """dst = op(dst, src) elementwise; dst, src 1-D, same length and dtype; op in sum/prod/min/max.

    NaN follows NumPy's minimum/maximum only on the float16 path; the numba min/max keep dst when
    the comparison with NaN is false (MPI makes no promise about NaN either).
    """
    if dst.dtype == np.float16:
        half.REDUCE[op](dst.view(np.uint16), src.view(np.uint16))
    elif dst.dtype == bfloat16.BFLOAT16:
        bfloat16.reduce_into(dst, src, op)
    else:
        _REDUCE_NUMBA[op](dst, src)
