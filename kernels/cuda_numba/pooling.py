"""The Numba flavour's max and average pooling and dropout."""
import numpy as np
from numba import cuda, float64

from mpitrain.kernels import checks, dropout_hash
from mpitrain.kernels.cuda_numba.arrays import dev, fill, flat, grid, half_safe, launch, scalar


@cuda.jit(cache=True)
def _maxpool_forward_k(x, y, argmax, k, stride):
    n_n, c_n, h_n, w_n = x.shape
    oh_n, ow_n = y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c = (i // (ow_n * oh_n)) % c_n
        n = i // (ow_n * oh_n * c_n)
        h0 = oh * stride
        w0 = ow * stride
        best = x[n, c, h0, w0]
        where = h0 * w_n + w0
        for h in range(h0, h0 + k):
            for w in range(w0, w0 + k):
                v = x[n, c, h, w]
                if v > best:                          # first maximum wins (row-major)
                    best = v
                    where = h * w_n + w
        y[n, c, oh, ow] = best
        argmax[n, c, oh, ow] = where


def maxpool_forward(x, y, argmax, k, stride):
    x, y, argmax = dev(x), dev(y), dev(argmax)
    n, c, h, w = x.shape
    expect = (n, c, (h - k) // stride + 1, (w - k) // stride + 1)
    if y.shape != expect or argmax.shape != expect:
        raise ValueError(f"maxpool_forward: y {y.shape} / argmax {argmax.shape} != {expect}")
    launch(_maxpool_forward_k, y.size, x, y, argmax, k, stride)


@cuda.jit(cache=True)
def _maxpool_backward_k(grad_y, argmax, grad_x, hw_in, hw_out):
    # windows may overlap (stride < k), so routed gradients are added atomically
    for i in range(cuda.grid(1), grad_y.size, cuda.gridsize(1)):
        plane = i // hw_out
        cuda.atomic.add(grad_x, plane * hw_in + argmax[i], grad_y[i])


def maxpool_backward(grad_y, argmax, grad_x):
    grad_y, argmax, grad_x = dev(grad_y), dev(argmax), dev(grad_x)
    checks.maxpool_backward(grad_y, argmax, grad_x)
    fill(grad_x, 0)
    if grad_y.size:
        hw_in = grad_x.shape[2] * grad_x.shape[3]
        hw_out = grad_y.shape[2] * grad_y.shape[3]
        _maxpool_backward_k[grid(grad_y.size)](flat(grad_y), flat(argmax), flat(grad_x),
                                               hw_in, hw_out)


@cuda.jit(cache=True)
def _avgpool_forward_k(x, y, k, stride):
    # gather over y (N, C, OH, OW), summed in float64
    c_n = x.shape[1]
    oh_n, ow_n = y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c = (i // (ow_n * oh_n)) % c_n
        n = i // (ow_n * oh_n * c_n)
        s = float64(0.0)
        for ki in range(k):
            for kj in range(k):
                s += x[n, c, oh * stride + ki, ow * stride + kj]
        y[n, c, oh, ow] = s / (k * k)


@cuda.jit(cache=True)
def _avgpool_backward_k(grad_y, grad_x, k, stride):
    # gather over grad_x (N, C, H, W): the windows oh with oh*stride <= h < oh*stride + k
    c_n, h_n, w_n = grad_x.shape[1], grad_x.shape[2], grad_x.shape[3]
    oh_n, ow_n = grad_y.shape[2], grad_y.shape[3]
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        i_lo = h - k + 1
        i_lo = 0 if i_lo <= 0 else (i_lo + stride - 1) // stride
        i_hi = h // stride
        if i_hi > oh_n - 1:
            i_hi = oh_n - 1
        j_lo = w - k + 1
        j_lo = 0 if j_lo <= 0 else (j_lo + stride - 1) // stride
        j_hi = w // stride
        if j_hi > ow_n - 1:
            j_hi = ow_n - 1
        s = float64(0.0)
        for a in range(i_lo, i_hi + 1):
            for b in range(j_lo, j_hi + 1):
                s += grad_y[n, c, a, b]
        grad_x[n, c, h, w] = s / (k * k)


def avgpool_forward(x, y, k, stride):
    x, y = dev(x), dev(y)
    checks.pool("avgpool_forward", x.shape, y.shape, k, stride)
    launch(_avgpool_forward_k, y.size, x, y, int(k), int(stride))


def avgpool_backward(grad_y, grad_x, k, stride):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    checks.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    launch(_avgpool_backward_k, grad_x.size, grad_y, grad_x, int(k), int(stride))


_mix32 = cuda.jit(device=True)(dropout_hash.mix32_lanes)


@cuda.jit(cache=True)
def _dropout_forward_k(x, y, mask, threshold, keep_scale, seed_hash):
    zero = mask.dtype.type(0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        h = _mix32(_mix32(np.uint64(i)) ^ seed_hash)
        m = keep_scale if (h >> np.uint64(8)) >= threshold else zero
        mask[i] = m
        y[i] = x[i] * m


def dropout_forward(x, y, mask, p, seed):
    x, y, mask = checks.same_size("dropout_forward", flat(x), flat(y), flat(mask))
    threshold = np.uint64(dropout_hash.keep_threshold(p))
    seed_hash = np.uint64(dropout_hash.mix32(int(seed)))
    launch(_dropout_forward_k, x.size, x, y, mask, threshold, scalar(mask, 1.0 / (1.0 - p)),
           seed_hash)


@half_safe
def _mul_k(a, b, out):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        out[i] = a[i] * b[i]


def dropout_backward(grad_y, mask, grad_x):
    grad_y, mask, grad_x = checks.same_size("dropout_backward", *map(flat, (grad_y, mask, grad_x)))
    launch(_mul_k.pick(grad_y, mask, grad_x), grad_y.size, grad_y, mask, grad_x)
