"""The CPU's max and average pooling and dropout."""
import numpy as np
from numba import njit, prange

from mpitrain.kernels import checks, dropout_hash
from mpitrain.kernels.checks import flat, sizes_match


@njit(cache=True, nogil=True, parallel=True)
def maxpool_forward(x, y, argmax, k, stride):
    n_img, chans, h, w = x.shape                # (N, C, H, W)
    oh, ow = y.shape[2], y.shape[3]             # (N, C, OH, OW)
    for n in prange(n_img):
        for c in range(chans):
            plane = x[n, c]
            for i in range(oh):
                h0 = i * stride
                for j in range(ow):
                    w0 = j * stride
                    best = plane[h0, w0]
                    at = h0 * w + w0
                    if k == 2:
                        # The common 2x2 window unrolled (same first-max tie rule as the loop).
                        if plane[h0, w0 + 1] > best:
                            best = plane[h0, w0 + 1]
                            at = h0 * w + w0 + 1
                        if plane[h0 + 1, w0] > best:
                            best = plane[h0 + 1, w0]
                            at = (h0 + 1) * w + w0
                        if plane[h0 + 1, w0 + 1] > best:
                            best = plane[h0 + 1, w0 + 1]
                            at = (h0 + 1) * w + w0 + 1
                    else:
                        for ki in range(k):
                            for kj in range(k):
                                v = plane[h0 + ki, w0 + kj]
                                if v > best:
                                    best = v
                                    at = (h0 + ki) * w + w0 + kj
                    y[n, c, i, j] = best
                    argmax[n, c, i, j] = at


@njit(cache=True, nogil=True, parallel=True)
def maxpool_backward(grad_y, argmax, grad_x):
    n_img, chans, oh, ow = grad_y.shape         # (N, C, OH, OW)
    w = grad_x.shape[3]
    for n in prange(n_img):
        grad_x[n] = 0
        for c in range(chans):
            for i in range(oh):
                for j in range(ow):
                    at = argmax[n, c, i, j]
                    hi = at // w
                    grad_x[n, c, hi, at - hi * w] += grad_y[n, c, i, j]


@njit(cache=True, nogil=True, parallel=True)
def _avgpool_forward(x, y, k, stride):
    n_img, chans = x.shape[0], x.shape[1]       # (N, C, H, W)
    oh, ow = y.shape[2], y.shape[3]             # (N, C, OH, OW)
    area = k * k
    for n in prange(n_img):
        for c in range(chans):
            for i in range(oh):
                for j in range(ow):
                    s = 0.0
                    for ki in range(k):
                        for kj in range(k):
                            s += x[n, c, i * stride + ki, j * stride + kj]
                    y[n, c, i, j] = s / area


@njit(cache=True, nogil=True, parallel=True)
def _avgpool_backward(grad_y, grad_x, k, stride):
    # gather: input pixel (h, w) sums the windows i, j with i*stride <= h < i*stride + k
    n_img, chans, h_n, w_n = grad_x.shape       # (N, C, H, W)
    oh, ow = grad_y.shape[2], grad_y.shape[3]   # (N, C, OH, OW)
    area = k * k
    for n in prange(n_img):
        for c in range(chans):
            for h in range(h_n):
                i_lo = max(0, (h - k + stride) // stride)
                i_hi = min(oh - 1, h // stride)
                for w in range(w_n):
                    j_lo = max(0, (w - k + stride) // stride)
                    j_hi = min(ow - 1, w // stride)
                    s = 0.0
                    for i in range(i_lo, i_hi + 1):
                        for j in range(j_lo, j_hi + 1):
                            s += grad_y[n, c, i, j]
                    grad_x[n, c, h, w] = s / area


def avgpool_forward(x, y, k, stride):
    checks.pool("avgpool_forward", x.shape, y.shape, k, stride)
    _avgpool_forward(x, y, int(k), int(stride))


def avgpool_backward(grad_y, grad_x, k, stride):
    checks.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    _avgpool_backward(grad_y, grad_x, int(k), int(stride))


_mix32 = njit(cache=True, nogil=True)(dropout_hash.mix32_lanes)


@njit(cache=True, nogil=True)
def _dropout_forward(x, y, mask, threshold, keep_scale, seed_hash):
    for i in range(x.size):
        h = _mix32(_mix32(np.uint64(i)) ^ seed_hash)
        mask[i] = keep_scale if (h >> np.uint64(8)) >= threshold else 0.0
        y[i] = x[i] * mask[i]


@njit(cache=True, nogil=True)
def _mul(a, b, out):
    for i in range(a.size):
        out[i] = a[i] * b[i]


def dropout_forward(x, y, mask, p, seed):
    sizes_match(x, y, mask)
    seed_hash = np.uint64(dropout_hash.mix32(int(seed)))
    _dropout_forward(flat(x, "x"), flat(y, "y"), flat(mask, "mask"),
                     np.uint64(dropout_hash.keep_threshold(p)), 1.0 / (1.0 - p), seed_hash)


def dropout_backward(grad_y, mask, grad_x):
    sizes_match(grad_y, mask, grad_x)
    _mul(flat(grad_y, "grad_y"), flat(mask, "mask"), flat(grad_x, "grad_x"))
