"""Layers: Linear, ReLU, Conv2D, MaxPool2D, AvgPool2D, GlobalAvgPool2d, Flatten, Dropout (leaves
of a Module; the other activations are in activations.py).

Every layer does its arithmetic through the backend kernels it holds (``self.kernels``), never with
NumPy on its arrays, so the same code runs on the CPU, on CuPy and on Numba CUDA. Weights are drawn
on the host from a seed (float64, then cast), so a model is identical on every process and in every
dtype up to rounding.

Workspaces: each layer keeps its outputs and scratch arrays between steps and reallocates them only
when a larger batch arrives; a smaller batch (the last one of an epoch) uses the leading rows
(``buf[:n]``). Consequently an array returned by ``forward``/``backward`` is valid until that
layer's next call -- ``Sequential.forward`` copies the final logits out.

``backward(grad_y, need_input_grad=True)`` adds the parameter gradients into ``Parameter.grad`` and
returns the gradient with respect to the input (or None when not needed: the first layer of a model
skips that GEMM and the col2im).
"""
import math

import numpy as np

from mpitrain import kernels as _kernels
from mpitrain.nn.module import Module
from mpitrain.nn.parameter import Parameter


def generator(seed):
    """``seed`` itself when it is a Generator, else ``np.random.default_rng(seed)``."""
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def check_positive(**values):
    """ValueError naming the first of ``values`` that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def zeroed_grad(param):
    """``param.grad`` for a kernel that adds into it: zero-filled first when it was stale."""
    grad, accumulate = param.grad_target()
    if not accumulate:
        param.kernels.fill(grad, 0)
    return grad


def init_weight(rng, shape, fan_in, fan_out, scheme):
    """He normal (std sqrt(2/fan_in), for layers feeding a ReLU) or Glorot uniform; float64."""
    if scheme == "he":
        return rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)
    if scheme == "glorot":
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, size=shape)
    raise ValueError(f"unknown init scheme {scheme!r}; expected 'he' or 'glorot'")


class Layer(Module):
    """Base class of the leaves: kernels, dtype and batch-sized workspaces (mode, parameters
    and buffers come from Module).

    ``forward(x)`` returns a workspace; ``backward(grad_y, need_input_grad=True)`` fills the
    parameter gradients and returns the input gradient (or None).
    """

    def __init__(self, kernels=None, dtype=np.float32):
        super().__init__()
        self.kernels = kernels if kernels is not None else _kernels.get("cpu")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise ValueError(f"layer dtype must be floating point, got {self.dtype}")
        self._ws = {}

    def used_parameters(self):
        """The Parameters this layer's arithmetic reads: its own (a tied layer: another's)."""
        return list(self._params.values())

    def forward_through(self, x):
        gate = self._gate()
        if gate is None:
            return self.forward(x)
        params = self.used_parameters()
        gate.gather(params, "forward")      # sharded parameters: whole for this call only
        try:
            return self.forward(x)
        finally:
            gate.release(params)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        gate = self._gate()
        if gate is None:
            grad_x = self.backward(grad_y, need_input_grad=need_input_grad)
        else:
            params = self.used_parameters()
            gate.gather(params, "backward")
            try:
                grad_x = self.backward(grad_y, need_input_grad=need_input_grad)
            finally:
                gate.release(params)
        if on_layer_done is not None and self._params:
            on_layer_done(list(self._params.values()))
        return grad_x

    def _gate(self):
        """What gathers this layer's sharded parameters (Parameter.gate), or None."""
        for p in self.used_parameters():
            return p.gate
        return None

    def workspace(self, key, shape, dtype=None):
        """A reusable array of ``shape``; regrown only when axis 0 outgrows it."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        buf = self._ws.get(key)
        if (buf is None or buf.dtype != dtype or tuple(buf.shape[1:]) != tuple(shape[1:])
                or buf.shape[0] < shape[0]):
            buf = self.kernels.empty(tuple(shape), dtype)
            self._ws[key] = buf
        return buf if buf.shape[0] == shape[0] else buf[:shape[0]]

    def flat_workspace(self, key, shape, dtype=None):
        """A reusable array of ``shape``, kept flat (by element count) so that any shape of
        at most as many elements -- a shorter sequence, a smaller batch -- reuses it."""
        return self.workspace(key, (math.prod(shape),), dtype).reshape(shape)

    def _grad_input(self, shape, need_input_grad):
        """The "grad_x" workspace of ``shape`` (the input's), or None when it is not needed."""
        return self.workspace("grad_x", shape) if need_input_grad else None

    def _check_input(self, x, ndim, what):
        if x.ndim != ndim:
            raise ValueError(f"{type(self).__name__} expects {what}, got shape {tuple(x.shape)}")
        self._check_dtype(x)

    def _check_dtype(self, x):
        if x.dtype != self.dtype:
            raise ValueError(f"{type(self).__name__} has dtype {self.dtype}, input has {x.dtype}")


class Linear(Layer):
    """y = x @ W.T + b, W (out, in); ``relu=True`` fuses the activation into the bias kernel;
    ``bias=False`` leaves b out.

    x is (B, in) or (B, T, in): the leading axes are rows of one GEMM (B*T rows), and y has x's
    leading axes, (B, out) or (B, T, out).
    """

    def __init__(self, in_features, out_features, relu=False, seed=0, dtype=np.float32,
                 kernels=None, init=None, bias=True):
        super().__init__(kernels, dtype)
        check_positive(in_features=in_features, out_features=out_features)
        self.in_features, self.out_features, self.relu = in_features, out_features, bool(relu)
        scheme = init or ("he" if relu else "glorot")
        w = init_weight(generator(seed), (out_features, in_features), in_features, out_features,
                        scheme)
        self.weight = self._params["weight"] = Parameter(w.astype(self.dtype), self.kernels)
        self.bias = None
        if bias:
            self.bias = self._params["bias"] = Parameter(np.zeros(out_features, self.dtype),
                                                         self.kernels)

    def forward(self, x):
        shape = tuple(x.shape)      # a tuple: device arrays' shapes may not index from the end
        if len(shape) not in (2, 3):
            raise ValueError(f"Linear expects (B, {self.in_features}) or (B, T, "
                             f"{self.in_features}), got shape {shape}")
        self._check_dtype(x)
        if shape[-1] != self.in_features:
            raise ValueError(f"Linear expects {self.in_features} input features, got "
                             f"{shape[-1]} (input shape {shape})")
        k = self.kernels
        lead = shape[:-1]
        x2 = x if len(shape) == 2 else x.reshape((lead[0] * lead[1], self.in_features))
        y = self.workspace("y", (x2.shape[0], self.out_features))      # (rows, out)
        k.gemm(x2, self.weight.data, y, trans_b=True)
        if self.bias is not None:
            k.bias_act(y, self.bias.data, self.relu)
        elif self.relu:
            k.relu(y, y)
        self._x, self._y, self._x_shape = x2, y, shape
        return y if len(shape) == 2 else y.reshape(lead + (self.out_features,))

    def backward(self, grad_y, need_input_grad=True):
        k, x = self.kernels, self._x
        g = grad_y if len(grad_y.shape) == 2 else grad_y.reshape(self._y.shape)  # (rows, out)
        if self.relu:
            pre = self.workspace("g", self._y.shape)
            k.relu_backward(self._y, g, pre)
            g = pre
        grad_w, acc = self.weight.grad_target()                         # (out, in)
        k.gemm(g, x, grad_w, trans_a=True, accumulate=acc)
        if self.bias is not None:
            k.bias_grad(g, zeroed_grad(self.bias))                     # (out,)
        if not need_input_grad:
            return None
        grad_x = self.workspace("grad_x", x.shape)                      # (rows, in)
        k.gemm(g, self.weight.data, grad_x)
        return grad_x if len(self._x_shape) == 2 else grad_x.reshape(self._x_shape)

    def __repr__(self):
        return (f"Linear({self.in_features}, {self.out_features}, relu={self.relu}"
                f"{'' if self.bias is not None else ', bias=False'})")


class ReLU(Layer):
    def forward(self, x):
        self._y = self.workspace("y", x.shape)
        self.kernels.relu(x, self._y)
        return self._y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(grad_y.shape, need_input_grad)
        if grad_x is not None:
            self.kernels.relu_backward(self._y, grad_y, grad_x)
        return grad_x

    def __repr__(self):
        return "ReLU()"


class Flatten(Layer):
    """(B, C, H, W) -> (B, C*H*W): a reshape of the contiguous input, no copy."""

    def forward(self, x):
        self._shape = tuple(x.shape)
        return x.reshape((self._shape[0], math.prod(self._shape[1:])))

    def backward(self, grad_y, need_input_grad=True):
        return grad_y.reshape(self._shape) if need_input_grad else None

    def __repr__(self):
        return "Flatten()"


class Conv2D(Layer):
    """2-D convolution as im2col + one GEMM; W (out_c, in_c, k, k), square kernel; ``bias=False``
    leaves the bias out (a convolution followed by BatchNorm, whose shift makes it redundant).

    Forward: cols (N*OH*OW, C*K*K) = im2col(x); rows (N*OH*OW, OC) = cols @ W.T (+b, ReLU);
    y (N, OC, OH, OW) = transpose of rows. Backward runs the same path in reverse, reusing the cols
    buffer for d(cols) once the weight gradient has consumed it.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, relu=False,
                 seed=0, dtype=np.float32, kernels=None, init=None, bias=True):
        super().__init__(kernels, dtype)
        check_positive(in_channels=in_channels, out_channels=out_channels,
                        kernel_size=kernel_size, stride=stride)
        if not isinstance(padding, (int, np.integer)) or padding < 0:
            raise ValueError(f"padding must be a non-negative integer, got {padding!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.relu = bool(relu)
        fan_in = in_channels * kernel_size * kernel_size
        fan_out = out_channels * kernel_size * kernel_size
        scheme = init or ("he" if relu else "glorot")
        w = init_weight(generator(seed), (out_channels, in_channels, kernel_size, kernel_size),
                        fan_in, fan_out, scheme)
        self.weight = self._params["weight"] = Parameter(w.astype(self.dtype), self.kernels)
        self.bias = None
        if bias:
            self.bias = self._params["bias"] = Parameter(np.zeros(out_channels, self.dtype),
                                                         self.kernels)
        elif self.relu:
            # ReLU without a bias: bias_act with zeros keeps the fused, out-of-place path
            self._zero_bias = self.kernels.zeros((out_channels,), self.dtype)

    def output_hw(self, h, w):
        k, s, p = self.kernel_size, self.stride, self.padding
        oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        if oh <= 0 or ow <= 0:
            raise ValueError(f"Conv2D kernel {k} (padding {p}) does not fit input {h}x{w}")
        return oh, ow

    def forward(self, x):
        self._check_input(x, 4, f"(N, {self.in_channels}, H, W)")
        n, c, h, w = x.shape
        if c != self.in_channels:
            raise ValueError(f"Conv2D expects {self.in_channels} input channels, got {c} "
                             f"(input shape {tuple(x.shape)})")
        k, ks = self.kernels, self.kernel_size
        oh, ow = self.output_hw(h, w)
        self._fused = getattr(k, "conv2d_forward", None) is not None
        if self._fused:
            # The backend's own convolution (the CPU's: one image at a time, kernels/cpu/conv.py)
            y = self.workspace("y", (n, self.out_channels, oh, ow))    # (N, OC, OH, OW)
            k.conv2d_forward(x, self.weight.data, None if self.bias is None else self.bias.data,
                             y, self.stride, self.padding, self.relu)
            self._x, self._y = x, y
            return y
        rows = n * oh * ow
        cols = self.workspace("cols", (rows, c * ks * ks))              # (N*OH*OW, C*K*K)
        k.im2col(x, cols, ks, ks, self.stride, self.padding)
        y_rows = self.workspace("y_rows", (rows, self.out_channels))    # (N*OH*OW, OC)
        k.gemm(cols, self._w2d(self.weight.data), y_rows, trans_b=True)
        if self.bias is not None or self.relu:
            k.bias_act(y_rows, self._zero_bias if self.bias is None else self.bias.data,
                       self.relu)
        y = self.workspace("y", (n, self.out_channels, oh, ow))        # (N, OC, OH, OW)
        k.nhwc_to_nchw(y_rows, y)
        self._x_shape, self._cols, self._y_rows = tuple(x.shape), cols, y_rows
        return y

    def _w2d(self, w):
        return w.reshape((self.out_channels, self.in_channels * self.kernel_size ** 2))

    def backward(self, grad_y, need_input_grad=True):
        k, ks = self.kernels, self.kernel_size
        if self._fused:
            return self._fused_backward(grad_y, need_input_grad)
        g = self.workspace("g_rows", self._y_rows.shape)               # (N*OH*OW, OC)
        k.nchw_to_nhwc(grad_y, g)
        if self.relu:
            # Out of place: an aliased elementwise kernel defeats vectorisation (20x slower).
            pre = self.workspace("g_pre", self._y_rows.shape)
            k.relu_backward(self._y_rows, g, pre)
            g = pre
        grad_w, acc = self.weight.grad_target()                         # (OC, C, K, K)
        k.gemm(g, self._cols, self._w2d(grad_w), trans_a=True, accumulate=acc)
        if self.bias is not None:
            k.bias_grad(g, zeroed_grad(self.bias))
        if not need_input_grad:
            return None
        d_cols = self._cols                                             # (N*OH*OW, C*K*K)
        k.gemm(g, self._w2d(self.weight.data), d_cols)
        grad_x = self.workspace("grad_x", self._x_shape)                # (N, C, H, W)
        k.col2im(d_cols, grad_x, ks, ks, self.stride, self.padding)
        return grad_x

    def _fused_backward(self, grad_y, need_input_grad):
        grad_w, acc = self.weight.grad_target()                         # (OC, C, K, K)
        grad_b = None if self.bias is None else zeroed_grad(self.bias)   # (OC,)
        grad_x = self.workspace("grad_x", self._x.shape) if need_input_grad else None
        self.kernels.conv2d_backward(self._x, self.weight.data, self._y, grad_y, self.stride,
                                     self.padding, self.relu, grad_w, acc, grad_b, grad_x)
        return grad_x

    def __repr__(self):
        return (f"Conv2D({self.in_channels}, {self.out_channels}, {self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, relu={self.relu}"
                f"{'' if self.bias is not None else ', bias=False'})")


class _Pool2D(Layer):
    """k x k windows without padding, stride defaulting to k (PyTorch's pooling signature)."""

    def __init__(self, kernel_size, stride=None, kernels=None, dtype=np.float32):
        super().__init__(kernels, dtype)
        stride = kernel_size if stride is None else stride
        check_positive(kernel_size=kernel_size, stride=stride)
        self.kernel_size, self.stride = kernel_size, stride

    def _output_shape(self, x):
        """(N, C, OH, OW) of an (N, C, H, W) input; ValueError when the window does not fit."""
        self._check_input(x, 4, "(N, C, H, W)")
        n, c, h, w = x.shape
        ks, s = self.kernel_size, self.stride
        if h < ks or w < ks:
            raise ValueError(f"{type(self).__name__} window {ks} does not fit input {h}x{w}")
        return n, c, (h - ks) // s + 1, (w - ks) // s + 1

    def __repr__(self):
        return f"{type(self).__name__}({self.kernel_size}, stride={self.stride})"


class MaxPool2D(_Pool2D):
    """Max over k x k windows (stride defaults to k); remembers the argmax for backward."""

    def forward(self, x):
        ks, s = self.kernel_size, self.stride
        n, c, oh, ow = self._output_shape(x)
        y = self.workspace("y", (n, c, oh, ow))                         # (N, C, OH, OW)
        self._argmax = self.workspace("argmax", (n, c, oh, ow), np.int32)
        self.kernels.maxpool_forward(x, y, self._argmax, ks, s)
        self._x_shape = tuple(x.shape)
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(self._x_shape, need_input_grad)       # (N, C, H, W)
        if grad_x is not None:
            self.kernels.maxpool_backward(grad_y, self._argmax, grad_x)
        return grad_x


class AvgPool2D(_Pool2D):
    """Mean over k x k windows (stride defaults to k), as ``torch.nn.AvgPool2d(k, stride)``;
    backward gives every pixel grad_y / k**2 of each window that holds it."""

    def forward(self, x):
        y = self.workspace("y", self._output_shape(x))                  # (N, C, OH, OW)
        self.kernels.avgpool_forward(x, y, self.kernel_size, self.stride)
        self._x_shape = tuple(x.shape)
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(self._x_shape, need_input_grad)       # (N, C, H, W)
        if grad_x is not None:
            self.kernels.avgpool_backward(grad_y, grad_x, self.kernel_size, self.stride)
        return grad_x


class GlobalAvgPool2d(Layer):
    """(N, C, H, W) -> (N, C): the mean of each channel over its H*W positions."""

    def forward(self, x):
        self._check_input(x, 4, "(N, C, H, W)")
        y = self.workspace("y", tuple(x.shape[:2]))                     # (N, C)
        self.kernels.global_avgpool_forward(x, y)
        self._x_shape = tuple(x.shape)
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(self._x_shape, need_input_grad)       # (N, C, H, W)
        if grad_x is not None:
            self.kernels.global_avgpool_backward(grad_y, grad_x)
        return grad_x

    def __repr__(self):
        return "GlobalAvgPool2d()"


class Dropout(Layer):
    """Inverted dropout: keep with probability 1-p and scale by 1/(1-p); identity in eval mode.

    The mask comes from the backend's counter-based hash of (seed, index), with a fresh seed per
    forward call drawn from this layer's own stream, so it is reproducible and the same on CPU/GPU.
    """

    def __init__(self, p=0.5, seed=0, kernels=None, dtype=np.float32):
        super().__init__(kernels, dtype)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p = float(p)
        self._base = int(generator(seed).integers(0, 2 ** 32))
        self.calls = 0

    def next_seed(self):
        seed = (self._base + self.calls * 0x9E3779B9) & 0xFFFFFFFF
        self.calls += 1
        return seed

    def forward(self, x):
        self._active = self.training and self.p > 0.0
        if not self._active:
            return x
        y = self.workspace("y", x.shape)
        self._mask = self.workspace("mask", x.shape)
        self.kernels.dropout_forward(x, y, self._mask, self.p, self.next_seed())
        return y

    def backward(self, grad_y, need_input_grad=True):
        if not need_input_grad:
            return None
        if not self._active:
            return grad_y
        grad_x = self.workspace("grad_x", grad_y.shape)
        self.kernels.dropout_backward(grad_y, self._mask, grad_x)
        return grad_x

    def __repr__(self):
        return f"Dropout(p={self.p})"
