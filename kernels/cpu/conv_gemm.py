"""Float32 GEMMs for the CPU convolution, register-blocked on 8-float vectors, reading the padded
image in place.

A convolution is a GEMM whose "A" operand is the im2col matrix X (pixels x taps): X[p, k] is one
element of the zero-padded image, at src[bases[p] + offs[k]] (bases: where output pixel p's
window starts; offs: where tap k = (c, ki, kj) sits in a window; kernels/cpu/conv.py,
"Gathered"). These kernels read X there instead of from a copy, so neither im2col nor BLAS's
own packing copy runs:

    gathered     out (P, N)    = X (P, K) @ a (K, N)       forward: a = W^T, N = output channels
                                                           input grad: the same on g's planes
    gathered_t   out (K, N)  (+)= X^T (K, P) @ b (P, N)    weight grad: b = g, pixel-major

Both keep a 6 x 16 block of the output in 12 AVX2 registers (kernels/cpu/simd.py) for the whole
contraction: per step six X values broadcast from memory, one 16-wide row of the other
operand, 12 fused multiply-adds (the classic AVX2 SGEMM micro-kernel's shape). Six rows of X
are six pixels (or six taps), so nothing is computed for padding columns and a 7x7 image wastes
nothing. In place in ResNet-20's layers they run at 81-95 GFLOP/s (a 1024^3 OpenBLAS sgemm:
88-92), where OpenBLAS ran these skinny products on im2col columns at 55-79
(docs/benchmarks.md). The last six-row block of a ragged P (or K) overlaps the one before:
``gathered`` rewrites the same values, ``gathered_t`` stores only its new rows.

Each output element is one chain of fused multiply-adds in k (or p) order, continued from the
old value when accumulating: deterministic, rounded differently from BLAS within float32
precision. The loads are unchecked: the kernels check the operands' bounds once per call and
raise ValueError.
"""
import numpy as np
from numba import njit

from mpitrain.kernels.cpu.simd import vbroadcast, vfma, vload, vstore, vzero

ROWS = 6                # rows of X per register block
COLS = 16               # output columns per register block: two vectors


def covers(n, dtype):
    """Whether these kernels run an output of ``n`` columns (channels) of ``dtype``."""
    return np.dtype(dtype) == np.float32 and n % COLS == 0 and n > 0


def gathered(a, src, bases, offs, out):
    """out (P, N) = X (P, K) @ a (K, N), X[p, k] = src[bases[p] + offs[k]] of the flat ``src``."""
    _check(src, bases, offs, "gathered", bases)
    if not (covers(a.shape[1], a.dtype) and a.flags.c_contiguous and out.dtype == np.float32
            and out.shape == (len(bases), a.shape[1]) and out.strides[1] == 4
            and len(offs) == a.shape[0]):
        raise ValueError(f"gathered does not cover ({len(bases)}, {len(offs)}) @ {a.shape} "
                         f"-> {out.shape}")
    _gathered(a, src.reshape((1, -1)), bases, offs, out)


def gathered_t(b, src, bases, offs, out, accumulate):
    """out (K, N) = (or += if ``accumulate``) X^T (K, P) @ b (P, N), X as in ``gathered``."""
    _check(src, bases, offs, "gathered_t", offs)
    if not (covers(b.shape[1], b.dtype) and b.strides[1] == 4 and out.dtype == np.float32
            and b.shape[0] == len(bases) and out.shape == (len(offs), b.shape[1])
            and out.flags.c_contiguous):
        raise ValueError(f"gathered_t does not cover ({len(offs)}, {len(bases)}) @ {b.shape} "
                         f"-> {out.shape}")
    _gathered_t(b, src.reshape((1, -1)), bases, offs, out, accumulate)


def _check(src, bases, offs, name, blocked):
    """What the caller must hold to; the bounds are checked in the kernels (_inside)."""
    if not (src.dtype == np.float32 and src.flags.c_contiguous
            and all(v.dtype == np.intp and v.ndim == 1 and len(v) for v in (bases, offs))
            and len(blocked) >= ROWS):
        raise ValueError(f"{name} operands: a float32 C-contiguous source, intp bases and "
                         f"offsets, at least {ROWS} rows of X{'^T' if blocked is offs else ''}")


@njit(cache=True, nogil=True, inline="always")
def _inside(src, bases, offs):
    """Raises unless every X[p, k] lies inside ``src`` (the loads are unchecked)."""
    if (bases.min() + offs.min() < 0
            or bases.max() + offs.max() >= src.shape[1]):
        raise ValueError("gathered: an element of X lies outside the source")


@njit(cache=True, nogil=True)
def _gathered(a, src, bases, offs, out):
    """out (P, N) = X @ a, X[p, k] = src[0, bases[p] + offs[k]]; N % 16 == 0, P >= 6."""
    pixels, depth, n = len(bases), len(offs), a.shape[1]
    _inside(src, bases, offs)
    for nb in range(0, n, COLS):                # a's 16-column panel stays in L1/L2
        for p0 in range(0, pixels, ROWS):
            p = min(p0, pixels - ROWS)          # the last block may overlap: same values
            q0, q1, q2 = bases[p], bases[p + 1], bases[p + 2]
            q3, q4, q5 = bases[p + 3], bases[p + 4], bases[p + 5]
            c00, c01, c10, c11 = vzero(), vzero(), vzero(), vzero()
            c20, c21, c30, c31 = vzero(), vzero(), vzero(), vzero()
            c40, c41, c50, c51 = vzero(), vzero(), vzero(), vzero()
            for k in range(depth):
                o = offs[k]
                w0, w1 = vload(a, k, nb), vload(a, k, nb + 8)
                x = vbroadcast(src, 0, q0 + o)
                c00, c01 = vfma(x, w0, c00), vfma(x, w1, c01)
                x = vbroadcast(src, 0, q1 + o)
                c10, c11 = vfma(x, w0, c10), vfma(x, w1, c11)
                x = vbroadcast(src, 0, q2 + o)
                c20, c21 = vfma(x, w0, c20), vfma(x, w1, c21)
                x = vbroadcast(src, 0, q3 + o)
                c30, c31 = vfma(x, w0, c30), vfma(x, w1, c31)
                x = vbroadcast(src, 0, q4 + o)
                c40, c41 = vfma(x, w0, c40), vfma(x, w1, c41)
                x = vbroadcast(src, 0, q5 + o)
                c50, c51 = vfma(x, w0, c50), vfma(x, w1, c51)
            vstore(out, p, nb, c00), vstore(out, p, nb + 8, c01)
            vstore(out, p + 1, nb, c10), vstore(out, p + 1, nb + 8, c11)
            vstore(out, p + 2, nb, c20), vstore(out, p + 2, nb + 8, c21)
            vstore(out, p + 3, nb, c30), vstore(out, p + 3, nb + 8, c31)
            vstore(out, p + 4, nb, c40), vstore(out, p + 4, nb + 8, c41)
            vstore(out, p + 5, nb, c50), vstore(out, p + 5, nb + 8, c51)


@njit(cache=True, nogil=True, inline="always")
def _start(out, k, nb, accumulate):
    """The accumulators of out[k, nb:nb + 16]: its old values, or zeros."""
    if accumulate:
        return vload(out, k, nb), vload(out, k, nb + 8)
    return vzero(), vzero()


@njit(cache=True, nogil=True, inline="always")
def _put(out, k, nb, c0, c1, new):
    if new:
        vstore(out, k, nb, c0), vstore(out, k, nb + 8, c1)


@njit(cache=True, nogil=True)
def _gathered_t(b, src, bases, offs, out, accumulate):
    """out (K, N) (+)= X^T @ b, X as in _gathered; N % 16 == 0, K >= 6."""
    pixels, depth, n = len(bases), len(offs), b.shape[1]
    _inside(src, bases, offs)
    for nb in range(0, n, COLS):
        for k0 in range(0, depth, ROWS):
            k = min(k0, depth - ROWS)           # the last block may overlap: only new rows stored
            o0, o1, o2 = offs[k], offs[k + 1], offs[k + 2]
            o3, o4, o5 = offs[k + 3], offs[k + 4], offs[k + 5]
            c00, c01 = _start(out, k, nb, accumulate)
            c10, c11 = _start(out, k + 1, nb, accumulate)
            c20, c21 = _start(out, k + 2, nb, accumulate)
            c30, c31 = _start(out, k + 3, nb, accumulate)
            c40, c41 = _start(out, k + 4, nb, accumulate)
            c50, c51 = _start(out, k + 5, nb, accumulate)
            for p in range(pixels):
                q = bases[p]
                g0, g1 = vload(b, p, nb), vload(b, p, nb + 8)
                x = vbroadcast(src, 0, q + o0)
                c00, c01 = vfma(x, g0, c00), vfma(x, g1, c01)
                x = vbroadcast(src, 0, q + o1)
                c10, c11 = vfma(x, g0, c10), vfma(x, g1, c11)
                x = vbroadcast(src, 0, q + o2)
                c20, c21 = vfma(x, g0, c20), vfma(x, g1, c21)
                x = vbroadcast(src, 0, q + o3)
                c30, c31 = vfma(x, g0, c30), vfma(x, g1, c31)
                x = vbroadcast(src, 0, q + o4)
                c40, c41 = vfma(x, g0, c40), vfma(x, g1, c41)
                x = vbroadcast(src, 0, q + o5)
                c50, c51 = vfma(x, g0, c50), vfma(x, g1, c51)
            _put(out, k, nb, c00, c01, k >= k0)
            _put(out, k + 1, nb, c10, c11, k + 1 >= k0)
            _put(out, k + 2, nb, c20, c21, k + 2 >= k0)
            _put(out, k + 3, nb, c30, c31, k + 3 >= k0)
            _put(out, k + 4, nb, c40, c41, k + 4 >= k0)
            _put(out, k + 5, nb, c50, c51, k + 5 >= k0)
