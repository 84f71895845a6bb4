"""Activations: Tanh, Sigmoid, LeakyReLU, Softmax, and ``softmax(logits)`` for probabilities.

Leaves like ReLU (layers.py): no parameters, arithmetic through the backend kernels they hold,
outputs in workspaces valid until the layer's next call. Each backward uses what its forward
kept: the output for Tanh, Sigmoid and Softmax (their derivatives are functions of it), the
input for LeakyReLU (whose output's sign flips with a negative slope).

Softmax is over the last axis, as ``torch.nn.Softmax(dim=-1)``. To train a classifier, give the
logits to ``SoftmaxCrossEntropy`` instead (one fused, log-sum-exp-stable kernel); the layer is
for models whose output must be a distribution (attention weights, a mixture's coefficients).
For probabilities after training, ``softmax(model(x), kernels)`` (the function below).
"""
import numpy as np

from mpitrain import kernels as _kernels
from mpitrain.nn.layers import Layer


class _Elementwise(Layer):
    """An activation applied elementwise: ``forward`` keeps the tensor its backward reads.

    Where that is the output (Tanh, Sigmoid, Softmax), ``_kernel`` names the backend's pair:
    ``kernels.<_kernel>(x, y)`` and ``kernels.<_kernel>_backward(y, grad_y, grad_x)``.
    """

    _kernel = None

    def _output(self, x):
        self._check_dtype(x)
        return self.workspace("y", tuple(x.shape))

    def forward(self, x):
        self._y = self._output(x)
        getattr(self.kernels, self._kernel)(x, self._y)
        return self._y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(tuple(grad_y.shape), need_input_grad)
        if grad_x is not None:
            getattr(self.kernels, self._kernel + "_backward")(self._y, grad_y, grad_x)
        return grad_x

    def __repr__(self):
        return f"{type(self).__name__}()"


class Tanh(_Elementwise):
    """y = tanh(x); dy/dx = 1 - y**2."""

    _kernel = "tanh"


class Sigmoid(_Elementwise):
    """y = 1 / (1 + exp(-x)), without overflow for any x; dy/dx = y * (1 - y)."""

    _kernel = "sigmoid"


class LeakyReLU(_Elementwise):
    """y = x for x > 0, else negative_slope * x (PyTorch's default slope 0.01)."""

    def __init__(self, negative_slope=0.01, kernels=None, dtype=np.float32):
        super().__init__(kernels, dtype)
        if not isinstance(negative_slope, (int, float, np.floating, np.integer)) \
                or not np.isfinite(negative_slope):
            raise ValueError(f"negative_slope must be a finite number, got {negative_slope!r}")
        self.negative_slope = float(negative_slope)

    def forward(self, x):
        y = self._output(x)
        self.kernels.leaky_relu(x, y, self.negative_slope)
        self._x = x
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(tuple(grad_y.shape), need_input_grad)
        if grad_x is not None:
            self.kernels.leaky_relu_backward(self._x, grad_y, grad_x, self.negative_slope)
        return grad_x

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class Softmax(_Elementwise):
    """y = exp(x - max) / sum(exp(x - max)) over the last axis (any leading shape);
    grad_x = y * (grad_y - sum(grad_y * y)) row by row."""

    _kernel = "softmax"


def softmax(logits, kernels=None):
    """Probabilities over the last axis of ``logits`` (e.g. a model's (B, K) output), as a new
    array on the same backend: ``mt.nn.softmax(model(x), kernels=k)`` with the kernels the model
    was built with (the CPU's by default)."""
    kernels = kernels if kernels is not None else _kernels.get("cpu")
    if np.dtype(logits.dtype).kind != "f":
        raise ValueError(f"softmax needs floating-point logits, got dtype {logits.dtype}")
    probs = kernels.empty(tuple(logits.shape), logits.dtype)             # (..., K)
    kernels.softmax(logits, probs)
    return probs
