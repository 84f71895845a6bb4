"""The CPU's im2col, col2im and layout transposes: the contract's convolution pieces, which Conv2D
uses on a backend without its own convolution (this one has it: kernels/cpu/conv.py)."""
from numba import njit, prange


@njit(cache=True, nogil=True, parallel=True)
def im2col(x, cols, kh, kw, stride, pad):
    n_img, chans, h, w = x.shape                # (N, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for n in prange(n_img):
        for i in range(oh):
            h0 = i * stride - pad
            for j in range(ow):
                w0 = j * stride - pad
                # The kernel columns that fall inside the image: [lo, hi); padding elsewhere.
                lo = max(0, -w0)
                hi = min(kw, w - w0)
                row = (n * oh + i) * ow + j     # cols: (N*OH*OW, C*KH*KW)
                col = 0
                for c in range(chans):
                    for ki in range(kh):
                        hh = h0 + ki
                        if hh < 0 or hh >= h:
                            for kj in range(kw):
                                cols[row, col + kj] = 0
                        else:
                            for kj in range(lo):
                                cols[row, col + kj] = 0
                            for kj in range(lo, hi):
                                cols[row, col + kj] = x[n, c, hh, w0 + kj]
                            for kj in range(max(hi, lo), kw):
                                cols[row, col + kj] = 0
                        col += kw


@njit(cache=True, nogil=True, parallel=True)
def col2im(cols, dx, kh, kw, stride, pad):
    n_img, chans, h, w = dx.shape               # (N, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for n in prange(n_img):
        dx[n] = 0
        for i in range(oh):
            h0 = i * stride - pad
            for j in range(ow):
                w0 = j * stride - pad
                lo = max(0, -w0)
                hi = min(kw, w - w0)
                row = (n * oh + i) * ow + j
                col = 0
                for c in range(chans):
                    for ki in range(kh):
                        hh = h0 + ki
                        if 0 <= hh < h:
                            for kj in range(lo, hi):
                                dx[n, c, hh, w0 + kj] += cols[row, col + kj]
                        col += kw


# The layout transposes view the NCHW side as (N, C, OH*OW) (no index division) and walk one pixel
# row of the (N*OH*OW, C) side at a time: measured 1.7x faster than 4-D indexing or tiling.
@njit(cache=True, nogil=True, parallel=True)
def nhwc_to_nchw(src, dst):
    n_img, chans, oh, ow = dst.shape            # src: (N*OH*OW, C)
    plane = oh * ow
    out = dst.reshape((n_img, chans, plane))    # (N, C, OH*OW), a view
    for n in prange(n_img):
        for p in range(plane):
            row = src[n * plane + p]            # (C,)
            for c in range(chans):
                out[n, c, p] = row[c]


@njit(cache=True, nogil=True, parallel=True)
def nchw_to_nhwc(src, dst):
    n_img, chans, oh, ow = src.shape            # dst: (N*OH*OW, C)
    plane = oh * ow
    inp = src.reshape((n_img, chans, plane))    # (N, C, OH*OW), a view
    for n in prange(n_img):
        for p in range(plane):
            row = dst[n * plane + p]            # (C,)
            for c in range(chans):
                row[c] = inp[n, c, p]
