"""The CPU's loss kernels: softmax cross-entropy, accuracy, label smoothing, MSE, BCE."""
import numpy as np
from numba import njit

from mpitrain.kernels import checks
from mpitrain.kernels.checks import flat, sizes_match


@njit(cache=True, nogil=True)
def softmax_xent(logits, labels, grad, losses):
    """Per-sample -log softmax[label] (log-sum-exp with the row max subtracted) and its gradient."""
    rows, k = logits.shape                      # (B, K)
    inv_b = 1.0 / rows
    for i in range(rows):
        label = labels[i]
        if label < 0 or label >= k:
            raise ValueError("softmax_xent: label out of range [0, K)")
        m = logits[i, 0]
        for j in range(1, k):
            if logits[i, j] > m:
                m = logits[i, j]
        s = 0.0
        for j in range(k):
            e = np.exp(logits[i, j] - m)
            grad[i, j] = e
            s += e
        losses[i] = np.log(s) + m - logits[i, label]
        inv_s = 1.0 / s
        for j in range(k):
            grad[i, j] = grad[i, j] * inv_s * inv_b
        grad[i, label] -= inv_b


@njit(cache=True, nogil=True)
def count_correct(logits, labels):
    rows, k = logits.shape                      # (B, K)
    hits = 0
    for i in range(rows):
        best = 0
        for j in range(1, k):
            if logits[i, j] > logits[i, best]:
                best = j
        if best == labels[i]:
            hits += 1
    return hits


@njit(cache=True, nogil=True)
def _label_smoothing(logits, labels, grad, losses, smoothing):
    rows, k = logits.shape                      # (B, K)
    inv_b = 1.0 / rows
    off = smoothing * inv_b / k
    for i in range(rows):
        label = labels[i]
        if label < 0 or label >= k:
            raise ValueError("label_smoothing: label out of range [0, K)")
        s = 0.0
        for j in range(k):
            s += logits[i, j]
            grad[i, j] -= off
        losses[i] += smoothing * (logits[i, label] - s / k)
        grad[i, label] += smoothing * inv_b


def label_smoothing(logits, labels, grad, losses, smoothing):
    checks.xent("label_smoothing", logits, labels, grad, losses)
    if logits.shape[0] and smoothing != 0:
        _label_smoothing(logits, labels, grad, losses, float(smoothing))


@njit(cache=True, nogil=True)
def _mse(x, target, grad, losses, scale):
    for i in range(x.size):
        d = x[i] - target[i]
        losses[i] = d * d
        grad[i] = d * scale


@njit(cache=True, nogil=True)
def _bce_logits(x, target, grad, losses, inv_n):
    for i in range(x.size):
        v = x[i]
        t = target[i]
        e = np.exp(-abs(v))                     # <= 1: no overflow for any logit
        losses[i] = (v if v > 0 else 0.0) - v * t + np.log1p(e)
        p = 1.0 / (1.0 + e) if v >= 0 else e / (1.0 + e)
        grad[i] = (p - t) * inv_n


def mse(x, target, grad, losses):
    sizes_match(x, target, grad, losses)
    if x.size:
        _mse(flat(x, "x"), flat(target, "target"), flat(grad, "grad"),
             flat(losses, "losses"), 2.0 / x.size)


def bce_logits(x, target, grad, losses):
    sizes_match(x, target, grad, losses)
    if x.size:
        _bce_logits(flat(x, "x"), flat(target, "target"), flat(grad, "grad"),
                    flat(losses, "losses"), 1.0 / x.size)
