"""Parameter: a backend array and its gradient, nothing else.

Layers add into ``.grad`` during backward; only optimizers write ``.data`` (so a distributed wrapper
can average gradients between the two). ``zero_grad()`` is lazy: it marks the gradient stale instead
of writing zeros, and the first layer to produce a gradient overwrites it (a GEMM with beta=0)
instead of adding to zeros. Reading ``.grad`` while stale zero-fills it first, so a stale gradient
is never observable -- it is only a saving of one pass over every weight per step.
"""
import numpy as np

from mpitrain import kernels as _kernels


class Parameter:
    """``Parameter(data, kernels=None)``: ``.data`` (backend array), ``.grad`` (same shape, zeros).

    A NumPy ``data`` is moved onto the backend with ``kernels.to_device`` (on the CPU a C-contiguous
    array is used as is, without a copy).
    """

    def __init__(self, data, kernels=None):
        self.kernels = kernels if kernels is not None else _kernels.get("cpu")
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            data = np.asarray(data)
        if isinstance(data, np.ndarray):
            if data.dtype.kind != "f":
                raise ValueError(f"Parameter data must be floating point, got dtype {data.dtype}")
            if self.kernels.name != "cpu" or not data.flags.c_contiguous:
                data = self.kernels.to_device(data)
        self.data = data
        self._grad = self.kernels.zeros(data.shape, data.dtype)
        self._stale = False

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self):
        return self.data.size

    @property
    def grad(self):
        if self._grad is None:                  # released: zeros anew
            self._grad = self.kernels.zeros(self.data.shape, self.data.dtype)
            self._stale = False
        if self._stale:
            self.kernels.fill(self._grad, 0)
            self._stale = False
        return self._grad

    @grad.setter
    def grad(self, value):
        if tuple(value.shape) != tuple(self.data.shape):
            raise ValueError(f"grad shape {tuple(value.shape)} != parameter shape "
                             f"{tuple(self.data.shape)}")
        self._grad = value
        self._stale = False

    def zero_grad(self):
        self._stale = True

    def release_grad(self):
        """Free the gradient's memory (sharded gradients keep only their slice after the
        average: parallel/sharded.py); the next layer to produce it, or a read, allocates it
        anew (zeros)."""
        self._grad = None
        self._stale = True

    @property
    def holds_grad(self):
        """Whether the gradient's memory is allocated (False after ``release_grad``)."""
        return self._grad is not None

    def grad_target(self):
        """``(grad, accumulate)`` for a layer about to produce this gradient.

        ``accumulate`` is False when the gradient was zeroed since the last write: the layer may
        then overwrite it. Either way the gradient counts as written afterwards.
        """
        accumulate = not self._stale
        self._stale = False
        if self._grad is None:                  # released: overwritten, never accumulated
            self._grad = self.kernels.empty(self.data.shape, self.data.dtype)
        return self._grad, accumulate

    def __repr__(self):
        return f"Parameter(shape={tuple(self.data.shape)}, dtype={self.data.dtype})"
