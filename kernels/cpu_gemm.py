"""Skinny float32 GEMMs for the CPU convolution, register-blocked on 8-float vectors, reading
the padded image in place.

OpenBLAS is tuned for large square-ish products; the GEMMs of a 16- to 64-channel convolution
have one side of 16-64 (the channels) against ~150-800 (C*KH*KW) and ~200-800 (pixels of an
image), and run there at 55-85% of its large-GEMM speed (16 channels: 55-65%), after an im2col
copy of the image that BLAS then packs again. These kernels keep a 4 x 24 block of the output
(or 4 x 3 dot products) in 12 vector registers through the whole contraction (kernels/simd.py)
and take the "B" operand as *gathered rows*: row k of image i is the run
src[i*image_stride + starts[k]:][:run] of one flat array. For a stride-1 convolution ``src`` is
the zero-padded image and ``starts`` the offsets of the KH*KW*C taps (kernels/cpu_conv.py,
"Gathered"), so no column matrix is written or packed:

    gathered     out (M, images*run)  = a (M, K) @ [B_0 | B_1 | ...]     forward: W @ x's taps
                                                                         input grad: W^T @ g's
    gathered_nt  out (M, P) (+)= sum_i g[:, image i] @ B_i^T             weight grad: g @ taps^T

A plain C-contiguous matrix is the special case starts = arange(K) * N, image_stride = 0.
With more than 64 channels, or on a 7x7 image (56 columns: the last 24-wide strip overlaps
the one before by 16), OpenBLAS on columns is as fast or faster (docs/benchmarks.md), so
``covers`` / ``covers_nt`` say where the caller should use these. The loads are unchecked:
the kernels check every run's bounds once per call and raise ValueError.

Each output element is one chain of fused multiply-adds in k order (``gathered``), or eight
lane chains added as a fixed tree (``gathered_nt``): deterministic, rounded differently from BLAS
within float32 precision.
"""
import numpy as np
from numba import njit

from mpitrain.kernels.simd import vbroadcast, vfma, vload, vstore, vsum, vzero

# The kernels beat OpenBLAS when the short side of the product (the channels) is at most this.
SKINNY_MAX = 64
STRIP = 24                     # output columns per block of ``gathered``: three vectors


def covers(m, k, dtype, run):
    """Whether ``gathered`` runs an (M, K) weight operand of ``dtype`` in runs of ``run`` and
    beats BLAS there: a short side of at most SKINNY_MAX, and runs that 24-wide strips cover
    with at most 1/8 of their work wasted (the last strip overlaps the one before: a 7x7 image's
    56 columns would waste 2/7)."""
    strips = -(-run // STRIP)
    return (_runs(m, dtype, run) and min(m, k) <= SKINNY_MAX
            and 8 * (strips * STRIP - run) <= run)


def covers_nt(m, p, dtype):
    """Whether ``gathered_nt`` runs an (M, P) output of ``dtype`` and beats BLAS there."""
    return _runs_nt(m, dtype) and min(m, p) <= SKINNY_MAX


def _runs(m, dtype, run):
    """What ``gathered`` can run at all."""
    return np.dtype(dtype) == np.float32 and m % 4 == 0 and run >= STRIP


def _runs_nt(m, dtype):
    return np.dtype(dtype) == np.float32 and m % 4 == 0


def quads(a):
    """The weight operand as ``gathered`` reads it: a (M, K) as (M/4, K, 4), contiguous, the four
    values of a[i:i + 4, k] side by side (one pointer walks the k loop). Once per call of the
    caller: it copies ``a``."""
    m, k = a.shape
    return np.ascontiguousarray(a.reshape((m // 4, 4, k)).transpose(0, 2, 1))


def gathered(quads_a, src, starts, image_stride, run, out):
    """out[:, i*run:(i+1)*run] = a (M, K) @ B_i for each image i, where row k of B_i is the run
    src[i*image_stride + starts[k]:][:run] of the flat ``src``; ``quads_a`` = quads(a)."""
    m = quads_a.shape[0] * 4
    _check(src, starts, image_stride, run, out.shape[1])
    if not (_runs(m, out.dtype, run) and out.shape[0] == m and out.strides[1] == 4
            and len(starts) == quads_a.shape[1]):
        raise ValueError(f"gathered does not cover ({m}, {quads_a.shape[1]}) -> {out.shape} "
                         f"in runs of {run}")
    _gathered(quads_a, src.reshape((1, -1)), starts, image_stride, run, out)


def gathered_nt(g, src, starts, image_stride, run, out, accumulate):
    """out (M, P) = (or += if ``accumulate``) the sum over images i of
    g[:, i*run:(i+1)*run] @ B_i^T, B_i's rows as in ``gathered``."""
    _check(src, starts, image_stride, run, g.shape[1])
    if not (_runs_nt(out.shape[0], out.dtype) and g.dtype == np.float32 and g.strides[1] == 4
            and g.shape[0] == out.shape[0] and out.flags.c_contiguous
            and len(starts) == out.shape[1]):
        raise ValueError(f"gathered_nt does not cover {g.shape} -> {out.shape}")
    _gathered_nt(g, src.reshape((1, -1)), starts, image_stride, run, out, accumulate)


def _check(src, starts, image_stride, run, columns):
    """What the caller must hold to; the runs' bounds are checked in the kernels (_inside)."""
    if not (src.dtype == np.float32 and src.flags.c_contiguous and starts.dtype == np.intp
            and starts.ndim == 1 and len(starts) and run > 0 and columns % run == 0):
        raise ValueError(f"gathered operands: a float32 C-contiguous source, intp starts, "
                         f"{columns} columns in whole runs of {run}")


@njit(cache=True, nogil=True, inline="always")
def _inside(src, starts, image_stride, images, run):
    """Raises unless every image's every run lies inside ``src`` (the loads are unchecked)."""
    low, high = starts[0], starts[0]
    for s in starts:
        low, high = min(low, s), max(high, s)
    if low < 0 or (images - 1) * image_stride + high + run > src.shape[1]:
        raise ValueError("gathered: a run leaves the source")


@njit(cache=True, nogil=True)
def _gathered(quads, src, starts, image_stride, run, out):
    """out (M, images*run) = a (M, K) @ B_i per image i, B_i[k, j] = src[0, i*image_stride +
    starts[k] + j]; ``quads`` = quads(a), run >= 24, out's rows contiguous."""
    m = out.shape[0]
    depth = quads.shape[1]
    _inside(src, starts, image_stride, out.shape[1] // run, run)
    for image in range(out.shape[1] // run):
        base, col = image * image_stride, image * run
        for strip in range(0, run, STRIP):
            j = min(strip, run - STRIP)     # the last strip overlaps the one before: same values
            for i in range(0, m, 4):
                c00, c01, c02 = vzero(), vzero(), vzero()
                c10, c11, c12 = vzero(), vzero(), vzero()
                c20, c21, c22 = vzero(), vzero(), vzero()
                c30, c31, c32 = vzero(), vzero(), vzero()
                rows = quads[i // 4]                    # (K, 4): a[i:i + 4, k] at rows[k]
                for k in range(depth):
                    at = base + starts[k] + j
                    b0, b1, b2 = vload(src, 0, at), vload(src, 0, at + 8), vload(src, 0, at + 16)
                    a0 = vbroadcast(rows[k, 0])
                    c00, c01, c02 = vfma(a0, b0, c00), vfma(a0, b1, c01), vfma(a0, b2, c02)
                    a1 = vbroadcast(rows[k, 1])
                    c10, c11, c12 = vfma(a1, b0, c10), vfma(a1, b1, c11), vfma(a1, b2, c12)
                    a2 = vbroadcast(rows[k, 2])
                    c20, c21, c22 = vfma(a2, b0, c20), vfma(a2, b1, c21), vfma(a2, b2, c22)
                    a3 = vbroadcast(rows[k, 3])
                    c30, c31, c32 = vfma(a3, b0, c30), vfma(a3, b1, c31), vfma(a3, b2, c32)
                q = col + j
                vstore(out, i, q, c00), vstore(out, i, q + 8, c01), vstore(out, i, q + 16, c02)
                vstore(out, i + 1, q, c10), vstore(out, i + 1, q + 8, c11)
                vstore(out, i + 1, q + 16, c12)
                vstore(out, i + 2, q, c20), vstore(out, i + 2, q + 8, c21)
                vstore(out, i + 2, q + 16, c22)
                vstore(out, i + 3, q, c30), vstore(out, i + 3, q + 8, c31)
                vstore(out, i + 3, q + 16, c32)


@njit(cache=True, nogil=True, inline="always")
def _finish(out, i, p, lanes, g, src, start, image_stride, run, accumulate):
    """out[i, p] (+)= the lanes' sum + each image's last run % 8 products."""
    total = vsum(lanes)
    for image in range(g.shape[1] // run):
        for q in range(run - run % 8, run):
            total += g[i, image * run + q] * src[0, image * image_stride + start + q]
    out[i, p] = out[i, p] + total if accumulate else total


@njit(cache=True, nogil=True)
def _gathered_nt(g, src, starts, image_stride, run, out, accumulate):
    """out (M, P) (+)= sum over images i of g[:, i*run:(i+1)*run] @ B_i^T, B_i[p, q] =
    src[0, i*image_stride + starts[p] + q]; M % 4 == 0, g's rows contiguous."""
    m = g.shape[0]
    cols = out.shape[1]
    whole = run - run % 8
    _inside(src, starts, image_stride, g.shape[1] // run, run)
    for i in range(0, m, 4):
        for p in range(cols - cols % 3, cols):                  # the last P % 3 columns alone
            s0, s1, s2, s3 = vzero(), vzero(), vzero(), vzero()
            for image in range(g.shape[1] // run):
                x0 = image * image_stride + starts[p]
                for q in range(0, whole, 8):
                    b0, gq = vload(src, 0, x0 + q), image * run + q
                    s0, s1 = vfma(vload(g, i, gq), b0, s0), vfma(vload(g, i + 1, gq), b0, s1)
                    s2, s3 = vfma(vload(g, i + 2, gq), b0, s2), vfma(vload(g, i + 3, gq), b0, s3)
            _finish(out, i, p, s0, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 1, p, s1, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 2, p, s2, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 3, p, s3, g, src, starts[p], image_stride, run, accumulate)
        for p in range(0, cols - cols % 3, 3):
            s00, s01, s02 = vzero(), vzero(), vzero()
            s10, s11, s12 = vzero(), vzero(), vzero()
            s20, s21, s22 = vzero(), vzero(), vzero()
            s30, s31, s32 = vzero(), vzero(), vzero()
            for image in range(g.shape[1] // run):
                x0 = image * image_stride + starts[p]
                x1 = image * image_stride + starts[p + 1]
                x2 = image * image_stride + starts[p + 2]
                for q in range(0, whole, 8):
                    b0, b1, b2 = vload(src, 0, x0 + q), vload(src, 0, x1 + q), vload(src, 0, x2 + q)
                    gq = image * run + q
                    g0 = vload(g, i, gq)
                    s00, s01, s02 = vfma(g0, b0, s00), vfma(g0, b1, s01), vfma(g0, b2, s02)
                    g1 = vload(g, i + 1, gq)
                    s10, s11, s12 = vfma(g1, b0, s10), vfma(g1, b1, s11), vfma(g1, b2, s12)
                    g2 = vload(g, i + 2, gq)
                    s20, s21, s22 = vfma(g2, b0, s20), vfma(g2, b1, s21), vfma(g2, b2, s22)
                    g3 = vload(g, i + 3, gq)
                    s30, s31, s32 = vfma(g3, b0, s30), vfma(g3, b1, s31), vfma(g3, b2, s32)
            _finish(out, i, p, s00, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i, p + 1, s01, g, src, starts[p + 1], image_stride, run, accumulate)
            _finish(out, i, p + 2, s02, g, src, starts[p + 2], image_stride, run, accumulate)
            _finish(out, i + 1, p, s10, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 1, p + 1, s11, g, src, starts[p + 1], image_stride, run, accumulate)
            _finish(out, i + 1, p + 2, s12, g, src, starts[p + 2], image_stride, run, accumulate)
            _finish(out, i + 2, p, s20, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 2, p + 1, s21, g, src, starts[p + 1], image_stride, run, accumulate)
            _finish(out, i + 2, p + 2, s22, g, src, starts[p + 2], image_stride, run, accumulate)
            _finish(out, i + 3, p, s30, g, src, starts[p], image_stride, run, accumulate)
            _finish(out, i + 3, p + 1, s31, g, src, starts[p + 1], image_stride, run, accumulate)
            _finish(out, i + 3, p + 2, s32, g, src, starts[p + 2], image_stride, run, accumulate)
