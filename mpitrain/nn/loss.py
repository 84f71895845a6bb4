"""Losses: softmax cross-entropy (optionally label-smoothed), mean squared error, and binary
cross-entropy on logits. Each is one fused kernel that gives the per-element losses and the
gradient of their mean at once.

The interface of all three (PyTorch's ``reduction="mean"``): ``loss_fn(x, y)`` (or
``forward``) returns the mean loss as a Python float; ``backward()`` returns d(mean loss)/dx, an
array on the backend, valid until the next ``forward``, which the model's ``backward`` takes.

Numerics. The cross-entropy subtracts the row maximum before exponentiating (log-sum-exp), so
large logits neither overflow nor lose the loss to cancellation. BCEWithLogitsLoss evaluates
``max(x, 0) - x*t + log1p(exp(-|x|))``: exp of a non-positive number only.
"""
import numpy as np

from mpitrain import kernels as _kernels


class _Loss:
    """Kernels and per-shape buffers (the gradient and the per-element losses)."""

    def __init__(self, kernels=None):
        self.kernels = kernels if kernels is not None else _kernels.get("cpu")
        self._grad = None
        self._losses = None

    def _buffers(self, shape, loss_shape, dtype):
        if self._grad is None or self._grad.shape != shape or self._grad.dtype != dtype:
            self._grad = self.kernels.empty(shape, dtype)
            self._losses = self.kernels.empty(loss_shape, dtype)
        return self._grad, self._losses

    def backward(self):
        """d(mean loss)/d(input) of the last ``forward``."""
        if self._grad is None:
            raise RuntimeError(f"{type(self).__name__}.backward() called before forward()")
        return self._grad


class SoftmaxCrossEntropy(_Loss):
    """``forward(logits (B, K), labels (B,) int64) -> mean loss``; ``backward() -> grad (B, K)``.

    After ``forward``, ``.correct`` holds the number of rows whose argmax equals the label. The
    gradient is already divided by B, matching the mean loss.

    ``label_smoothing=e`` (0 <= e <= 1) is PyTorch's ``CrossEntropyLoss(label_smoothing=e)``:
    the target is (1 - e) * onehot(label) + e / K, so a sample's loss is
    (1 - e) * (-log p[label]) + e * mean_k(-log p[k]) and the gradient softmax - target. The
    fused kernel runs as without smoothing and ``label_smoothing`` adjusts its results; with
    e = 0 (the default) that second kernel is not called, so the results are bit for bit the
    unsmoothed ones.
    """

    def __init__(self, kernels=None, *, label_smoothing=0.0):
        super().__init__(kernels)
        if not isinstance(label_smoothing, (int, float, np.floating, np.integer)) \
                or not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self.correct = 0

    def forward(self, logits, labels):
        if logits.ndim != 2 or logits.shape[0] == 0:
            raise ValueError(f"logits must be (B, K) with B > 0, got shape {tuple(logits.shape)}")
        if tuple(labels.shape) != (logits.shape[0],):
            raise ValueError(f"labels must have shape ({logits.shape[0]},), got "
                             f"{tuple(labels.shape)}")
        if np.dtype(labels.dtype).kind not in "iu":
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        k = self.kernels
        grad, losses = self._buffers(tuple(logits.shape), (logits.shape[0],),    # (B, K), (B,)
                                     logits.dtype)
        k.softmax_xent(logits, labels, grad, losses)
        if self.label_smoothing:
            k.label_smoothing(logits, labels, grad, losses, self.label_smoothing)
        self.correct = k.count_correct(logits, labels)
        return k.total(losses) / logits.shape[0]

    __call__ = forward

    def __repr__(self):
        return f"SoftmaxCrossEntropy(label_smoothing={self.label_smoothing})"


class _Elementwise(_Loss):
    """A loss of an input and a target of the same shape and dtype, averaged over elements."""

    def _check(self, x, target):
        name = type(self).__name__
        if x.size == 0:
            raise ValueError(f"{name}: the input is empty (shape {tuple(x.shape)})")
        if tuple(target.shape) != tuple(x.shape):
            raise ValueError(f"{name}: target shape {tuple(target.shape)} != input shape "
                             f"{tuple(x.shape)}")
        if np.dtype(x.dtype).kind != "f" or target.dtype != x.dtype:
            raise ValueError(f"{name}: input and target must have the same floating dtype, got "
                             f"{x.dtype} and {target.dtype}")
        return self._buffers(tuple(x.shape), tuple(x.shape), x.dtype)

    def __repr__(self):
        return f"{type(self).__name__}()"


class MSELoss(_Elementwise):
    """``forward(x, target) -> mean((x - target)**2)`` over every element (any shape, target
    of x's shape and dtype); ``backward() -> 2 * (x - target) / x.size``."""

    def forward(self, x, target):
        grad, losses = self._check(x, target)
        self.kernels.mse(x, target, grad, losses)
        return self.kernels.total(losses) / x.size

    __call__ = forward


class BCEWithLogitsLoss(_Elementwise):
    """``forward(logits, target) -> mean`` of -[t*log(sigmoid(x)) + (1-t)*log(1-sigmoid(x))]
    over every element, computed as max(x, 0) - x*t + log1p(exp(-|x|)) (no overflow, no log of
    0); targets are probabilities in [0, 1] of the logits' shape and dtype.
    ``backward() -> (sigmoid(x) - t) / x.size``."""

    def forward(self, logits, target):
        grad, losses = self._check(logits, target)
        self.kernels.bce_logits(logits, target, grad, losses)
        return self.kernels.total(losses) / logits.size

    __call__ = forward
