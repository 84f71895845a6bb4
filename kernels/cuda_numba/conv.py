"""The Numba flavour's im2col, col2im and layout transposes (one thread per output element)."""
from numba import cuda

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import dev, launch, scalar


@cuda.jit(cache=True)
def _im2col_k(x, cols, kh, kw, stride, pad, oh_n, ow_n):
    n_, c_n, h_n, w_n = x.shape
    ck = cols.shape[1]
    total_ = cols.shape[0] * ck
    for i in range(cuda.grid(1), total_, cuda.gridsize(1)):
        row = i // ck
        col = i - row * ck
        n = row // (oh_n * ow_n)
        rem = row - n * (oh_n * ow_n)
        oh = rem // ow_n
        ow = rem - oh * ow_n
        c = col // (kh * kw)
        rem = col - c * (kh * kw)
        ki = rem // kw
        kj = rem - ki * kw
        h = oh * stride - pad + ki
        w = ow * stride - pad + kj
        if 0 <= h < h_n and 0 <= w < w_n:
            cols[row, col] = x[n, c, h, w]
        else:
            cols[row, col] = 0


def im2col(x, cols, kh, kw, stride, pad):
    x, cols = dev(x), dev(cols)
    *_, oh, ow = checks.dims("im2col", x.shape, cols.shape, kh, kw, stride, pad)
    launch(_im2col_k, cols.size, x, cols, kh, kw, stride, pad, oh, ow)


@cuda.jit(cache=True)
def _col2im_k(cols, dx, kh, kw, stride, pad, oh_n, ow_n, zero):
    # gather (one thread per input pixel) instead of scatter: no atomics, deterministic sums;
    # zero: dx's dtype (dx[...] * 0 would be NaN where dx is NaN, and dx is an output)
    n_n, c_n, h_n, w_n = dx.shape
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        acc = zero
        for ki in range(kh):
            th = h + pad - ki
            if th < 0 or th % stride != 0:
                continue
            oh = th // stride
            if oh >= oh_n:
                continue
            for kj in range(kw):
                tw = w + pad - kj
                if tw < 0 or tw % stride != 0:
                    continue
                ow = tw // stride
                if ow >= ow_n:
                    continue
                acc += cols[(n * oh_n + oh) * ow_n + ow, (c * kh + ki) * kw + kj]
        dx[n, c, h, w] = acc


def col2im(cols, dx, kh, kw, stride, pad):
    cols, dx = dev(cols), dev(dx)
    *_, oh, ow = checks.dims("col2im", dx.shape, cols.shape, kh, kw, stride, pad)
    launch(_col2im_k, dx.size, cols, dx, kh, kw, stride, pad, oh, ow, scalar(dx, 0))


@cuda.jit(cache=True)
def _nhwc_to_nchw_k(src, dst):
    n_n, c_n, h_n, w_n = dst.shape
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        dst[n, c, h, w] = src[(n * h_n + h) * w_n + w, c]


@cuda.jit(cache=True)
def _nchw_to_nhwc_k(src, dst):
    n_n, c_n, h_n, w_n = src.shape
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        c = i % c_n
        pix = i // c_n
        w = pix % w_n
        h = (pix // w_n) % h_n
        n = pix // (w_n * h_n)
        dst[pix, c] = src[n, c, h, w]


def nhwc_to_nchw(src, dst):
    src, dst = dev(src), dev(dst)
    checks.layout("nhwc_to_nchw", dst.shape, src, "src")
    launch(_nhwc_to_nchw_k, dst.size, src, dst)


def nchw_to_nhwc(src, dst):
    src, dst = dev(src), dev(dst)
    checks.layout("nchw_to_nhwc", src.shape, dst, "dst")
    launch(_nchw_to_nhwc_k, dst.size, src, dst)
