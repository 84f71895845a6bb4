"""The Numba flavour's loss kernels: softmax cross-entropy, label smoothing, MSE, BCE (accuracy:
count_correct in arrays.py)."""
import math

from numba import cuda, float64

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import dev, flat, launch, scalar


@cuda.jit(cache=True)
def _softmax_xent_k(logits, labels, grad, losses):
    rows, k = logits.shape
    inv_rows = 1.0 / rows
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        top = logits[r, 0]
        for j in range(1, k):
            if logits[r, j] > top:
                top = logits[r, j]
        s = 0.0
        for j in range(k):
            s += math.exp(logits[r, j] - top)
        label = labels[r]
        losses[r] = top + math.log(s) - logits[r, label]
        for j in range(k):
            p = math.exp(logits[r, j] - top) / s
            if j == label:
                p -= 1.0
            grad[r, j] = p * inv_rows


def softmax_xent(logits, labels, grad, losses):
    logits, labels, grad, losses = dev(logits), flat(labels), dev(grad), flat(losses)
    if logits.ndim != 2 or labels.size != logits.shape[0] or grad.shape != logits.shape:
        raise ValueError(f"softmax_xent: logits {logits.shape}, labels ({labels.size},), "
                         f"grad {grad.shape} do not match")
    launch(_softmax_xent_k, logits.shape[0], logits, labels, grad, losses)


@cuda.jit(cache=True)
def _label_smoothing_k(logits, labels, grad, losses, smoothing):
    rows, k = logits.shape
    inv_rows = 1.0 / rows
    off = smoothing * inv_rows / k
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        s = float64(0.0)
        for j in range(k):
            s += logits[r, j]
            grad[r, j] -= off
        label = labels[r]
        losses[r] += smoothing * (logits[r, label] - s / k)
        grad[r, label] += smoothing * inv_rows


def label_smoothing(logits, labels, grad, losses, smoothing):
    logits, labels, grad, losses = dev(logits), dev(labels), dev(grad), dev(losses)
    checks.xent("label_smoothing", logits, labels, grad, losses)
    if smoothing != 0:
        launch(_label_smoothing_k, logits.shape[0], logits, labels, grad, losses, float(smoothing))


@cuda.jit(cache=True)
def _mse_k(x, target, grad, losses, scale):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        d = x[i] - target[i]
        losses[i] = d * d
        grad[i] = d * scale


@cuda.jit(cache=True)
def _bce_logits_k(x, target, grad, losses, inv_n, zero, one):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        t = target[i]
        e = math.exp(-abs(v))                       # <= 1: no overflow for any logit
        losses[i] = (v if v > 0 else zero) - v * t + math.log1p(e)
        p = one / (one + e) if v >= 0 else e / (one + e)
        grad[i] = (p - t) * inv_n


def mse(x, target, grad, losses):
    x, target, grad, losses = checks.same_size("mse", *map(flat, (x, target, grad, losses)))
    if x.size:
        launch(_mse_k, x.size, x, target, grad, losses, scalar(x, 2.0 / x.size))


def bce_logits(x, target, grad, losses):
    x, target, grad, losses = checks.same_size("bce_logits", *map(flat, (x, target, grad, losses)))
    if x.size:
        launch(_bce_logits_k, x.size, x, target, grad, losses, scalar(x, 1.0 / x.size),
               scalar(x, 0), scalar(x, 1))
