"""Softmax cross-entropy, fused: one kernel gives the per-sample losses and d(mean loss)/d(logits).

The kernel subtracts the row maximum before exponentiating (log-sum-exp), so large logits neither
overflow nor lose the loss to cancellation.
"""
import numpy as np

from mpitrain import kernels as _kernels


class SoftmaxCrossEntropy:
    """``forward(logits (B, K), labels (B,) int64) -> mean loss``; ``backward() -> grad (B, K)``.

    After ``forward``, ``.correct`` holds the number of rows whose argmax equals the label. The
    gradient is already divided by B, matching the mean loss.
    """

    def __init__(self, kernels=None):
        self.kernels = kernels if kernels is not None else _kernels.get("cpu")
        self._grad = None
        self._losses = None
        self.correct = 0

    def _buffers(self, shape, dtype):
        if self._grad is None or self._grad.shape != shape or self._grad.dtype != dtype:
            self._grad = self.kernels.empty(shape, dtype)                      # (B, K)
            self._losses = self.kernels.empty((shape[0],), dtype)              # (B,)
        return self._grad, self._losses

    def forward(self, logits, labels):
        if logits.ndim != 2 or logits.shape[0] == 0:
            raise ValueError(f"logits must be (B, K) with B > 0, got shape {tuple(logits.shape)}")
        if tuple(labels.shape) != (logits.shape[0],):
            raise ValueError(f"labels must have shape ({logits.shape[0]},), got "
                             f"{tuple(labels.shape)}")
        if np.dtype(labels.dtype).kind not in "iu":
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        k = self.kernels
        grad, losses = self._buffers(tuple(logits.shape), logits.dtype)
        k.softmax_xent(logits, labels, grad, losses)
        self.correct = k.count_correct(logits, labels)
        return k.total(losses) / logits.shape[0]

    __call__ = forward

    def backward(self):
        if self._grad is None:
            raise RuntimeError("SoftmaxCrossEntropy.backward() called before forward()")
        return self._grad
