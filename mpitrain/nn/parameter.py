"""Parameter: a backend array and its gradient, nothing else.

Layers add into ``.grad`` during backward; only optimizers write ``.data`` (so a distributed wrapper
can average gradients between the two). ``zero_grad()`` is lazy: it marks the gradient stale instead
of writing zeros, and the first layer to produce a gradient overwrites it (a GEMM with beta=0)
instead of adding to zeros. Reading ``.grad`` while stale zero-fills it first, so a stale gradient
is never observable -- it is only a saving of one pass over every weight per step.

Sharded parameters (parallel/parameter_sharding.py) release ``.data`` between uses: ``gate`` is
then the object that gathers it (a layer asks it before its forward and its backward: see
``Layer.forward_through``), and reading a released ``.data`` is a RuntimeError naming the way
to the whole values (``with opt.full_parameters():``). ``shape``, ``dtype`` and ``size`` stay.
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
        self.gate = None        # what gathers a released .data (sharded parameters)
        self.data = data
        self._grad = self.kernels.zeros(data.shape, data.dtype)
        self._stale = False

    @property
    def data(self):
        if self._data is None:
            raise RuntimeError(f"this {self!r} is sharded across ranks (sharding='parameters'): "
                               f"its values exist inside its layer's forward and backward, or "
                               f"in `with opt.full_parameters():` on every rank")
        return self._data

    @data.setter
    def data(self, value):
        self._data = value
        self._shape, self._dtype = tuple(value.shape), value.dtype
        self._size = int(value.size)

    def release_data(self):
        """Free ``.data`` (sharded parameters: this rank keeps its slice elsewhere); shape and
        dtype stay, and setting ``.data`` holds it again."""
        self._data = None

    @property
    def holds_data(self):
        """Whether ``.data`` is allocated (False after ``release_data``)."""
        return self._data is not None

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    @property
    def size(self):
        return self._size

    @property
    def grad(self):
        if self._grad is None:                  # released: zeros anew
            self._grad = self.kernels.zeros(self._shape, self._dtype)
            self._stale = False
        if self._stale:
            self.kernels.fill(self._grad, 0)
            self._stale = False
        return self._grad

    @grad.setter
    def grad(self, value):
        if tuple(value.shape) != self._shape:
            raise ValueError(f"grad shape {tuple(value.shape)} != parameter shape "
                             f"{self._shape}")
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
            self._grad = self.kernels.empty(self._shape, self._dtype)
        return self._grad, accumulate

    def __repr__(self):
        return f"Parameter(shape={self._shape}, dtype={self._dtype})"
