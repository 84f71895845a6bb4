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

    Sequence logits (B, T, K) with labels (B, T) (a language model's) are B*T rows of K: the
    mean is over the B*T tokens, the gradient has the logits' shape and ``.correct`` counts
    tokens.

    After ``forward``, ``.correct`` holds the number of rows whose argmax equals the label. The
    gradient is already divided by the number of rows, matching the mean loss.

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
        shape = tuple(logits.shape)  # a tuple: device arrays' shapes may not index from the end
        if len(shape) < 2 or shape[0] == 0:
            raise ValueError(f"logits must be (B, K) or (B, T, K) with B > 0, got shape "
                             f"{shape}")
        if tuple(labels.shape) != shape[:-1]:
            raise ValueError(f"labels must have shape {shape[:-1]}, got "
                             f"{tuple(labels.shape)}")
        if np.dtype(labels.dtype).kind not in "iu":
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        k = self.kernels
        rows, classes = labels.size, shape[-1]              # rows: B, or B*T tokens
        grad, losses = self._buffers(shape, (rows,), logits.dtype)   # like logits
        logits2, labels1 = logits.reshape((rows, classes)), labels.reshape(rows)   # (rows, K)
        grad2 = grad.reshape((rows, classes))
        k.softmax_xent(logits2, labels1, grad2, losses)
        if self.label_smoothing:
            k.label_smoothing(logits2, labels1, grad2, losses, self.label_smoothing)
        self.correct = k.count_correct(logits2, labels1)
        return k.total(losses) / rows

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
