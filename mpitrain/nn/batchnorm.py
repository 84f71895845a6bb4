"""BatchNorm1d, BatchNorm2d and SyncBatchNorm, with PyTorch's semantics.

Training: per-channel batch mean and biased variance normalise x; the running mean and the
unbiased running variance move by ``momentum`` (0.1); ``eps`` = 1e-5; affine weight (ones) and
bias (zeros). Eval: the running statistics normalise x. The running statistics are buffers
(``named_buffers()``: ``running_mean``, ``running_var``), never parameters.

The arithmetic is the backend's bn_* kernels (kernels/__init__.py): per-channel sums in a (2, C)
float64 array, which is exactly what SyncBatchNorm allreduces, so the per-rank and the
synchronised layer share every line but the two reductions.

Backward in eval mode is supported (the statistics are then constants): grad_x =
grad_y * weight * invstd, computed with bn_forward on zero mean and bias; the parameter
gradients are the same sums as in training.
"""
import numpy as np

from mpitrain.nn.layers import Layer
from mpitrain.nn.parameter import Parameter


class BatchNormBase(Layer):
    """The body every BatchNorm shares (not a layer to use directly): subclasses fix the input
    rank (``_NDIM``) and may reduce the sums across ranks (SyncBatchNorm)."""

    _NDIM = None            # None: (N, C) or (N, C, H, W)
    _SHAPE = "(N, {c}) or (N, {c}, H, W)"

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, kernels=None,
                 dtype=np.float32):
        super().__init__(kernels, dtype)
        if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) \
                or num_features <= 0:
            raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        k, c = self.kernels, int(num_features)
        self.num_features, self.eps, self.momentum = c, float(eps), float(momentum)
        self.affine = bool(affine)
        self.weight = self.bias = None
        if self.affine:
            self.weight = self._params["weight"] = Parameter(np.ones(c, self.dtype), k)
            self.bias = self._params["bias"] = Parameter(np.zeros(c, self.dtype), k)
        else:
            self._ones = k.to_device(np.ones(c, self.dtype))                   # (C,)
        self._zeros = k.zeros((c,), self.dtype)                                # (C,)
        self.running_mean = self._buffers["running_mean"] = k.zeros((c,), self.dtype)
        self.running_var = self._buffers["running_var"] = k.to_device(np.ones(c, self.dtype))
        self._mean = k.empty((c,), self.dtype)                                 # (C,)
        self._invstd = k.empty((c,), self.dtype)                               # (C,)
        # forward sums and count in one flat array, so SyncBatchNorm sends one message
        self._fwd = k.empty((2 * c + 1,), np.float64)                          # (2C+1,)
        self._bwd = k.empty((2, c), np.float64)                                # (2, C)
        self._replay = None     # update_running's scratch: stats, mean, invstd

    def _weight(self):
        return self.weight.data if self.affine else self._ones

    def _reduce_forward(self, packed, count):
        """Hook for SyncBatchNorm: sum ``packed`` (sums, sums of squares, count) over ranks and
        return the global count. Per-rank BatchNorm keeps its own count, known on the host:
        reading it back from the device would be a synchronisation per layer and step."""
        return count

    def _reduce_backward(self, stats):
        """Hook for SyncBatchNorm: sum the two backward sums over ranks."""

    def forward(self, x):
        c = self.num_features
        ndim = self._NDIM or (x.ndim if x.ndim in (2, 4) else 4)
        self._check_input(x, ndim, self._SHAPE.format(c=c))
        if x.shape[1] != c:
            raise ValueError(f"{type(self).__name__} expects {c} channels, got {x.shape[1]} "
                             f"(input shape {tuple(x.shape)})")
        k = self.kernels
        self._trained = self.training
        if self.training:
            stats = self._fwd[:2 * c].reshape((2, c))                          # (2, C)
            k.bn_stats(x, stats)
            k.fill(self._fwd[2 * c:], x.size // c)
            self._count = float(self._reduce_forward(self._fwd, x.size // c))
            k.bn_moments(stats, self._count, self.eps, self.momentum, self._mean, self._invstd,
                         self.running_mean, self.running_var)
        else:
            k.bn_eval_moments(self.running_mean, self.running_var, self.eps, self._mean,
                              self._invstd)
        y = self.workspace("y", x.shape)                                       # like x
        k.bn_forward(x, self._mean, self._invstd, self._weight(),
                     self.bias.data if self.affine else self._zeros, y)
        self._x = x
        return y

    def backward(self, grad_y, need_input_grad=True):
        k, stats = self.kernels, self._bwd
        if self.affine or (self._trained and need_input_grad):
            k.bn_backward_stats(grad_y, self._x, self._mean, self._invstd, stats)
        if self.affine:
            # the local sums, as PyTorch: averaging across ranks is the optimizer's job
            grad_w, acc_w = self.weight.grad_target()
            grad_b, acc_b = self.bias.grad_target()
            if acc_w != acc_b:                  # one accumulate flag for both: zero the other
                k.fill(grad_w if not acc_w else grad_b, 0)
            k.bn_param_grads(stats, grad_w, grad_b, acc_w and acc_b)
        if not need_input_grad:
            return None
        grad_x = self.workspace("grad_x", grad_y.shape)                       # like x
        if not self._trained:
            # constant statistics: grad_x = grad_y * weight * invstd
            k.bn_forward(grad_y, self._zeros, self._invstd, self._weight(), self._zeros, grad_x)
            return grad_x
        self._reduce_backward(stats)
        k.bn_backward_input(grad_y, self._x, self._mean, self._invstd, self._weight(), stats,
                            self._count, grad_x)
        return grad_x

    def batch_sums(self):
        """The last training forward's per-channel sums, sums of squares and element count,
        (2C+1,) float64 on the host (a copy; SyncBatchNorm's: over every rank): what
        ``update_running`` takes."""
        return np.array(self.kernels.to_host(self._fwd), np.float64)                # (2C+1,)

    def update_running(self, sums):
        """Move the running statistics by one batch whose ``batch_sums()`` are ``sums``, as a
        training forward does, leaving the forward's batch moments alone. The deterministic mode
        replays every micro-shard's update in micro-shard order on every rank with it."""
        k, c = self.kernels, self.num_features
        if self._replay is None:
            self._replay = (k.empty((2, c), np.float64), k.empty((c,), self.dtype),
                            k.empty((c,), self.dtype))
        stats, mean, invstd = self._replay
        sums = np.asarray(sums, np.float64)
        k.copy(stats, k.to_device(np.ascontiguousarray(sums[:2 * c].reshape(2, c))))
        k.bn_moments(stats, float(sums[2 * c]), self.eps, self.momentum, mean, invstd,
                     self.running_mean, self.running_var)

    def __repr__(self):
        return (f"{type(self).__name__}({self.num_features}, eps={self.eps}, "
                f"momentum={self.momentum}, affine={self.affine})")


class BatchNorm1d(BatchNormBase):
    """BatchNorm over the batch of (N, C) features."""

    _NDIM = 2
    _SHAPE = "(N, {c})"


class BatchNorm2d(BatchNormBase):
    """BatchNorm over the batch and the positions of (N, C, H, W) feature maps."""

    _NDIM = 4
    _SHAPE = "(N, {c}, H, W)"
