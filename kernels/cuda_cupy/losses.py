"""The CuPy flavour's loss kernels: softmax cross-entropy, accuracy, label smoothing, MSE, BCE."""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import dev, flat, launch_rows, scalar

_XENT_SRC = r"""
extern "C" __global__ void mpitrain_softmax_xent(const T* logits, const long long* labels,
                                                 T* grad, T* losses, int rows, int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* z = logits + (long long)r * k;
    T* g = grad + (long long)r * k;
    T top = z[0];
    for (int j = 1; j < k; ++j) top = z[j] > top ? z[j] : top;
    double s = 0.0;
    for (int j = 0; j < k; ++j) { T e = exp(z[j] - top); g[j] = e; s += (double)e; }
    long long label = labels[r];
    losses[r] = (T)(log(s) + (double)top - (double)z[label]);
    double inv = 1.0 / (s * rows);
    for (int j = 0; j < k; ++j) g[j] = (T)((double)g[j] * inv);
    g[label] -= (T)(1.0 / rows);
}
"""
_LABEL_SMOOTHING_SRC = r"""
extern "C" __global__ void mpitrain_label_smoothing(const T* logits, const long long* labels,
                                                    T* grad, T* losses, double smoothing,
                                                    int rows, int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* z = logits + (long long)r * k;
    T* g = grad + (long long)r * k;
    double off = smoothing / ((double)rows * k);
    double s = 0.0;
    for (int j = 0; j < k; ++j) { s += (double)z[j]; g[j] = (T)((double)g[j] - off); }
    long long label = labels[r];
    losses[r] = (T)((double)losses[r] + smoothing * ((double)z[label] - s / k));
    g[label] = (T)((double)g[label] + smoothing / rows);
}
"""


def softmax_xent(logits, labels, grad, losses):
    logits, labels, grad, losses = dev(logits), dev(labels), dev(grad), dev(losses)
    checks.xent("softmax_xent", logits, labels, grad, losses, int64=True)
    rows = logits.shape[0]
    launch_rows(_XENT_SRC, "mpitrain_softmax_xent", logits.dtype, rows,
                (logits, labels, grad, losses, np.int32(rows), np.int32(logits.shape[1])))


def count_correct(logits, labels):
    logits, labels = dev(logits), dev(labels)
    if logits.shape[0] == 0:
        return 0
    return int((logits.argmax(axis=1) == labels).sum())  # argmax: first maximum, like NumPy


def label_smoothing(logits, labels, grad, losses, smoothing):
    logits, labels, grad, losses = dev(logits), dev(labels), dev(grad), dev(losses)
    checks.xent("label_smoothing", logits, labels, grad, losses, int64=True)
    if smoothing != 0:
        launch_rows(_LABEL_SMOOTHING_SRC, "mpitrain_label_smoothing", logits.dtype,
                    logits.shape[0], (logits, labels, grad, losses, np.float64(smoothing),
                                      np.int32(logits.shape[0]), np.int32(logits.shape[1])))


_mse = cp.ElementwiseKernel(
    "T x, T t, T scale", "T grad, T losses",
    "T d = x - t; losses = d * d; grad = d * scale", "mpitrain_mse")
# exp(-|x|) <= 1: no overflow for any logit; log1p keeps the small terms
_bce_logits = cp.ElementwiseKernel(
    "T x, T t, T inv_n", "T grad, T losses",
    """
    T e = exp(x >= (T)0 ? -x : x);
    losses = (x > (T)0 ? x : (T)0) - x * t + (T)log1p((double)e);
    T p = x >= (T)0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
    grad = (p - t) * inv_n;
    """, "mpitrain_bce_logits")


def mse(x, target, grad, losses):
    x, target, grad, losses = checks.same_size("mse", *map(flat, (x, target, grad, losses)))
    if x.size:
        _mse(x, target, scalar(x, 2.0 / x.size), grad, losses)


def bce_logits(x, target, grad, losses):
    x, target, grad, losses = checks.same_size("bce_logits", *map(flat, (x, target, grad, losses)))
    if x.size:
        _bce_logits(x, target, scalar(x, 1.0 / x.size), grad, losses)
