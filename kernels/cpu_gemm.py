"""Skinny float32 GEMMs for the CPU convolution, register-blocked on 8-float vectors.

OpenBLAS is tuned for large square-ish products; the per-group GEMMs of a 16- or 32-channel
convolution have one dimension of 16-32 (the output channels) against ~150-300 (C*KH*KW) and
~800-3000 (pixels), and run there at 55-70% of its large-GEMM speed (docs/benchmarks.md). These two
kernels keep a 4 x 24 (or 4 x 3 dot-product) block of the output in 12 vector registers through
the whole contraction (kernels/simd.py), read each operand straight from the caller's arrays (no
packing copy) and are 1.2-1.35x faster than OpenBLAS on those shapes; with 64 or more channels
OpenBLAS is as fast or faster: ``matmul`` hands such shapes, float64 and layouts the kernels do
not cover to NumPy, and ``covers_nt`` tells the caller when to use BLAS instead of ``matmul_nt``.

    matmul     out (M, N)  = a (M, K) @ b (K, N)       forward W @ cols; input grad W^T @ g
    matmul_nt  out (M, P) (+)= g (M, N) @ c (P, N)^T   weight grad g @ cols^T

Each output element is one chain of fused multiply-adds in k (or lane) order: deterministic, a
different rounding from BLAS's within float32 precision.
"""
import numpy as np
from numba import njit

from mpitrain.kernels.simd import vbroadcast, vfma, vload, vstore, vsum, vzero

# Kernels run when the short side of the product (output channels) is at most this.
SKINNY_MAX = 32
_STRIP = 24                     # output columns per block of matmul: three vectors


def _rows_contiguous(a):
    return a.ndim == 2 and a.dtype == np.float32 and a.strides[1] == 4


def _skinny(a, b, out, short):
    return (_rows_contiguous(b) and out.flags.c_contiguous and out.dtype == np.float32
            and a.dtype == np.float32 and short <= SKINNY_MAX)


def matmul(a, b, out):
    """out = a @ b; ``a`` may be a transposed view (the input gradient's W^T)."""
    m, n = out.shape
    if _skinny(a, b, out, min(m, a.shape[1])) and m % 4 == 0 and n >= _STRIP:
        _matmul(a, b, out)
    else:
        np.matmul(a, b, out=out)


def covers_nt(m, p, dtype):
    """Whether ``matmul_nt`` runs an (M, P) output of ``dtype`` (else the caller uses BLAS)."""
    return np.dtype(dtype) == np.float32 and min(m, p) <= SKINNY_MAX and m % 4 == 0 and p % 3 == 0


def matmul_nt(g, c, out, accumulate):
    """out = g @ c.T, or out += g @ c.T if ``accumulate``; only where ``covers_nt``."""
    if not (covers_nt(*out.shape, out.dtype) and _rows_contiguous(g) and _rows_contiguous(c)
            and out.flags.c_contiguous):
        raise ValueError(f"matmul_nt does not cover {g.shape} x {c.shape}.T -> {out.shape} "
                         f"({g.dtype}, {c.dtype}, {out.dtype})")
    _matmul_nt(g, c, out, accumulate)


@njit(cache=True, nogil=True)
def _matmul(a, b, out):
    """out (M, N) = a (M, K) @ b (K, N); M % 4 == 0, N >= 24, rows of b and out contiguous."""
    m, n = out.shape
    depth = b.shape[0]
    for strip in range(0, n, _STRIP):
        j = min(strip, n - _STRIP)      # the last strip overlaps the one before: same values
        for i in range(0, m, 4):
            c00, c01, c02 = vzero(), vzero(), vzero()
            c10, c11, c12 = vzero(), vzero(), vzero()
            c20, c21, c22 = vzero(), vzero(), vzero()
            c30, c31, c32 = vzero(), vzero(), vzero()
            for k in range(depth):
                b0, b1, b2 = vload(b, k, j), vload(b, k, j + 8), vload(b, k, j + 16)
                a0 = vbroadcast(a[i, k])
                c00, c01, c02 = vfma(a0, b0, c00), vfma(a0, b1, c01), vfma(a0, b2, c02)
                a1 = vbroadcast(a[i + 1, k])
                c10, c11, c12 = vfma(a1, b0, c10), vfma(a1, b1, c11), vfma(a1, b2, c12)
                a2 = vbroadcast(a[i + 2, k])
                c20, c21, c22 = vfma(a2, b0, c20), vfma(a2, b1, c21), vfma(a2, b2, c22)
                a3 = vbroadcast(a[i + 3, k])
                c30, c31, c32 = vfma(a3, b0, c30), vfma(a3, b1, c31), vfma(a3, b2, c32)
            vstore(out, i, j, c00), vstore(out, i, j + 8, c01), vstore(out, i, j + 16, c02)
            vstore(out, i + 1, j, c10), vstore(out, i + 1, j + 8, c11)
            vstore(out, i + 1, j + 16, c12)
            vstore(out, i + 2, j, c20), vstore(out, i + 2, j + 8, c21)
            vstore(out, i + 2, j + 16, c22)
            vstore(out, i + 3, j, c30), vstore(out, i + 3, j + 8, c31)
            vstore(out, i + 3, j + 16, c32)


@njit(cache=True, nogil=True, inline="always")
def _finish(out, i, p, lanes, g, c, tail, accumulate):
    """out[i, p] (+)= the lanes' sum + the dot product of the last N % 8 columns."""
    total = vsum(lanes)
    for q in range(tail, g.shape[1]):
        total += g[i, q] * c[p, q]
    out[i, p] = out[i, p] + total if accumulate else total


@njit(cache=True, nogil=True)
def _matmul_nt(g, c, out, accumulate):
    """out (M, P) (+)= g (M, N) @ c (P, N)^T; M % 4 == 0, P % 3 == 0, all rows contiguous."""
    m, n = g.shape
    cols = c.shape[0]
    tail = n - n % 8
    for i in range(0, m, 4):
        for p in range(0, cols, 3):
            s00, s01, s02 = vzero(), vzero(), vzero()
            s10, s11, s12 = vzero(), vzero(), vzero()
            s20, s21, s22 = vzero(), vzero(), vzero()
            s30, s31, s32 = vzero(), vzero(), vzero()
            for q in range(0, tail, 8):
                x0, x1, x2 = vload(c, p, q), vload(c, p + 1, q), vload(c, p + 2, q)
                g0 = vload(g, i, q)
                s00, s01, s02 = vfma(g0, x0, s00), vfma(g0, x1, s01), vfma(g0, x2, s02)
                g1 = vload(g, i + 1, q)
                s10, s11, s12 = vfma(g1, x0, s10), vfma(g1, x1, s11), vfma(g1, x2, s12)
                g2 = vload(g, i + 2, q)
                s20, s21, s22 = vfma(g2, x0, s20), vfma(g2, x1, s21), vfma(g2, x2, s22)
                g3 = vload(g, i + 3, q)
                s30, s31, s32 = vfma(g3, x0, s30), vfma(g3, x1, s31), vfma(g3, x2, s32)
            _finish(out, i, p, s00, g, c, tail, accumulate)
            _finish(out, i, p + 1, s01, g, c, tail, accumulate)
            _finish(out, i, p + 2, s02, g, c, tail, accumulate)
            _finish(out, i + 1, p, s10, g, c, tail, accumulate)
            _finish(out, i + 1, p + 1, s11, g, c, tail, accumulate)
            _finish(out, i + 1, p + 2, s12, g, c, tail, accumulate)
            _finish(out, i + 2, p, s20, g, c, tail, accumulate)
            _finish(out, i + 2, p + 1, s21, g, c, tail, accumulate)
            _finish(out, i + 2, p + 2, s22, g, c, tail, accumulate)
            _finish(out, i + 3, p, s30, g, c, tail, accumulate)
            _finish(out, i + 3, p + 1, s31, g, c, tail, accumulate)
            _finish(out, i + 3, p + 2, s32, g, c, tail, accumulate)
