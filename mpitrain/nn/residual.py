"""Residual building blocks: the option-A shortcut, the residual Add and the basic block.

BasicBlock (He et al. 2016, the CIFAR variant)::

    x -> conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN --(+)--> ReLU -> out
    |                                                    |
    +------------------- shortcut(x) --------------------+

The shortcut is the identity, or, where the block changes the shape, option A of the paper: no
parameters, every ``stride``-th pixel, the new channels zero (``offset`` = (C2 - C) // 2 zero
channels on each side, as PyTorch's reference CIFAR ResNet pads them). Backward sends the
gradient of the sum unchanged into both paths and adds the two input gradients.
"""
import numpy as np

from mpitrain.nn.batchnorm import BatchNorm2d
from mpitrain.nn.layers import Conv2D, Layer, ReLU
from mpitrain.nn.module import Module, chain_backward, chain_forward


class ShortcutA(Layer):
    """(N, C, H, W) -> (N, C2, ceil(H/s), ceil(W/s)): subsample, zero-pad the channels."""

    def __init__(self, in_channels, out_channels, stride=2, kernels=None, dtype=np.float32):
        super().__init__(kernels, dtype)
        if out_channels < in_channels:
            raise ValueError(f"option-A shortcut cannot drop channels ({in_channels} -> "
                             f"{out_channels})")
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride
        self.offset = (out_channels - in_channels) // 2

    def forward(self, x):
        self._check_input(x, 4, f"(N, {self.in_channels}, H, W)")
        n, _, h, w = x.shape
        s = self.stride
        y = self.workspace("y", (n, self.out_channels, -(-h // s), -(-w // s)))  # (N, C2, OH, OW)
        self.kernels.shortcut_forward(x, y, s, self.offset)
        self._x_shape = tuple(x.shape)
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_x = self._grad_input(self._x_shape, need_input_grad)         # (N, C, H, W)
        if grad_x is not None:
            self.kernels.shortcut_backward(grad_y, grad_x, self.stride, self.offset)
        return grad_x

    def __repr__(self):
        return (f"ShortcutA({self.in_channels}, {self.out_channels}, stride={self.stride})")


class Add(Layer):
    """The residual sum: ``forward(a, b)`` = a + b; ``backward(grad_y)`` passes grad_y to both
    inputs; ``sum_grads(ga, gb)`` adds the two paths' input gradients."""

    def forward(self, a, b):
        y = self.workspace("y", a.shape)                                    # like a
        self.kernels.copy(y, a)
        self.kernels.add(y, b)
        return y

    def backward(self, grad_y, need_input_grad=True):
        return grad_y if need_input_grad else None

    def sum_grads(self, ga, gb):
        g = self.workspace("g", ga.shape)                                   # like ga
        self.kernels.copy(g, ga)
        self.kernels.add(g, gb)
        return g

    def __repr__(self):
        return "Add()"


class BasicBlock(Module):
    """Two 3x3 conv-BN pairs and a shortcut; children conv1, bn1, relu1, conv2, bn2,
    [shortcut], add, relu (names as in ``stage1.0.conv1.weight``)."""

    def __init__(self, in_channels, out_channels, stride=1, seed=0, dtype=np.float32,
                 kernels=None):
        super().__init__()
        conv = dict(kernel_size=3, padding=1, bias=False, init="he", seed=seed, dtype=dtype,
                    kernels=kernels)
        dk = dict(dtype=dtype, kernels=kernels)
        self.add_child("conv1", Conv2D(in_channels, out_channels, stride=stride, **conv))
        self.kernels = self.conv1.kernels
        self.add_child("bn1", BatchNorm2d(out_channels, **dk))
        self.add_child("relu1", ReLU(**dk))
        self.add_child("conv2", Conv2D(out_channels, out_channels, **conv))
        self.add_child("bn2", BatchNorm2d(out_channels, **dk))
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.add_child("shortcut", ShortcutA(in_channels, out_channels, stride, **dk))
        self.add_child("add", Add(**dk))
        self.add_child("relu", ReLU(**dk))
        self._branch = ["conv1", "bn1", "relu1", "conv2", "bn2"]

    def forward_through(self, x):
        h = chain_forward([self._children[n] for n in self._branch], x)
        s = x if self.shortcut is None else self.shortcut.forward_through(x)
        return self.relu.forward_through(self.add.forward(h, s))

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        g = self.add.backward(self.relu.backward_through(grad_y, True, on_layer_done))
        gb = chain_backward([self._children[n] for n in self._branch], g, need_input_grad,
                            on_layer_done)
        if not need_input_grad:
            return None
        gs = g if self.shortcut is None else self.shortcut.backward_through(g, True,
                                                                            on_layer_done)
        return self.add.sum_grads(gb, gs)

    def extra_repr(self):
        return f"{self.conv1.in_channels}, {self.conv1.out_channels}, stride={self.conv1.stride}"
