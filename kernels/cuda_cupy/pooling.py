"""The CuPy flavour's max and average pooling and dropout."""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks, dropout_hash
from mpitrain.kernels.cuda_cupy.arrays import dev, flat, scalar

_maxpool_forward = cp.ElementwiseKernel(
    "raw T x, int32 c_n, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n",
    "T y, int32 argmax",
    """
    int ow = i % ow_n, oh = (i / ow_n) % oh_n;
    long long plane = i / ((long long)ow_n * oh_n);         // n * C + c
    const long long base = plane * h_n * w_n;
    int h0 = oh * stride, w0 = ow * stride;
    T best = x[base + h0 * w_n + w0];
    int at = h0 * w_n + w0;
    for (int h = h0; h < h0 + k; ++h)
        for (int w = w0; w < w0 + k; ++w) {
            T v = x[base + h * w_n + w];
            if (v > best) { best = v; at = h * w_n + w; }  // first maximum wins
        }
    y = best;
    argmax = at;
    """, "mpitrain_maxpool_forward")

_maxpool_backward = cp.ElementwiseKernel(
    "T gy, int32 arg, int64 hw_in, int64 hw_out", "raw T gx",
    "atomicAdd(&gx[(i / hw_out) * hw_in + arg], gy)", "mpitrain_maxpool_backward")


def maxpool_forward(x, y, argmax, k, stride):
    x, y, argmax = dev(x), dev(y), dev(argmax)
    n, c, h, w = x.shape
    expect = (n, c, (h - k) // stride + 1, (w - k) // stride + 1)
    if y.shape != expect or argmax.shape != expect or argmax.dtype != np.int32:
        raise ValueError(f"maxpool_forward: y {y.shape} / argmax {argmax.shape} "
                         f"{argmax.dtype} != {expect} int32")
    _maxpool_forward(x, c, h, w, k, stride, expect[2], expect[3], y, argmax)


def maxpool_backward(grad_y, argmax, grad_x):
    grad_y, argmax, grad_x = dev(grad_y), dev(argmax), dev(grad_x)
    checks.maxpool_backward(grad_y, argmax, grad_x)
    grad_x.fill(0)
    hw_in = grad_x.shape[2] * grad_x.shape[3]
    hw_out = grad_y.shape[2] * grad_y.shape[3]
    _maxpool_backward(grad_y, argmax, hw_in, hw_out, grad_x)


# gather over y (N, C, OH, OW), summed in double
_avgpool_forward = cp.ElementwiseKernel(
    "raw T x, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n", "T y",
    """
    int ow = i % ow_n, oh = (i / ow_n) % oh_n;
    long long base = (i / ((long long)ow_n * oh_n)) * h_n * w_n;   // plane n * C + c
    double s = 0.0;
    for (int ki = 0; ki < k; ++ki)
        for (int kj = 0; kj < k; ++kj)
            s += (double)x[base + (long long)(oh * stride + ki) * w_n + ow * stride + kj];
    y = (T)(s / (k * k));
    """, "mpitrain_avgpool_forward")

# gather over gx (N, C, H, W): the windows oh with oh*stride <= h < oh*stride + k
_avgpool_backward = cp.ElementwiseKernel(
    "raw T gy, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n", "T gx",
    """
    int w = i % w_n, h = (i / w_n) % h_n;
    long long base = (i / ((long long)w_n * h_n)) * oh_n * ow_n;   // plane n * C + c
    int i_lo = h - k + 1, j_lo = w - k + 1;
    i_lo = i_lo <= 0 ? 0 : (i_lo + stride - 1) / stride;
    j_lo = j_lo <= 0 ? 0 : (j_lo + stride - 1) / stride;
    int i_hi = h / stride < oh_n - 1 ? h / stride : oh_n - 1;
    int j_hi = w / stride < ow_n - 1 ? w / stride : ow_n - 1;
    double s = 0.0;
    for (int a = i_lo; a <= i_hi; ++a)
        for (int b = j_lo; b <= j_hi; ++b)
            s += (double)gy[base + (long long)a * ow_n + b];
    gx = (T)(s / (k * k));
    """, "mpitrain_avgpool_backward")


def avgpool_forward(x, y, k, stride):
    x, y = dev(x), dev(y)
    oh, ow = checks.pool("avgpool_forward", x.shape, y.shape, k, stride)
    _avgpool_forward(flat(x), x.shape[2], x.shape[3], int(k), int(stride), oh, ow, flat(y))


def avgpool_backward(grad_y, grad_x, k, stride):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    oh, ow = checks.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    _avgpool_backward(flat(grad_y), grad_x.shape[2], grad_x.shape[3], int(k), int(stride),
                      oh, ow, flat(grad_x))


_dropout_forward = cp.ElementwiseKernel(
    "T x, uint32 threshold, T keep_scale, uint32 seed_hash", "T y, T mask",
    """
    unsigned int h = mpitrain_mix32(mpitrain_mix32((unsigned int)i) ^ seed_hash);
    T m = (h >> 8) >= threshold ? keep_scale : (T)0;
    mask = m;
    y = x * m;
    """, "mpitrain_dropout_forward", preamble=r"""
    __device__ unsigned int mpitrain_mix32(unsigned int x) {   // lowbias32, the contract's hash
        x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
        return x;
    }
    """)


def dropout_forward(x, y, mask, p, seed):
    x, y, mask = checks.same_size("dropout_forward", flat(x), flat(y), flat(mask))
    threshold = np.uint32(dropout_hash.keep_threshold(p))
    _dropout_forward(x, threshold, scalar(mask, 1.0 / (1.0 - p)),
                     np.uint32(dropout_hash.mix32(int(seed))), y, mask)


def dropout_backward(grad_y, mask, grad_x):
    grad_y, mask, grad_x = checks.same_size("dropout_backward", *map(flat, (grad_y, mask, grad_x)))
    cp.multiply(grad_y, mask, out=grad_x)
