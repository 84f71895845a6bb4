"""CIFAR-style ResNet (He et al. 2016, section 4.2): resnet(depth); the zoo names resnet20/32/56.

    conv3x3 16 -> BN -> ReLU                                   (N, 16, H, W)
    stage1: n BasicBlocks, 16 channels                          (N, 16, H, W)
    stage2: n BasicBlocks, 32 channels, the first with stride 2 (N, 32, H/2, W/2)
    stage3: n BasicBlocks, 64 channels, the first with stride 2 (N, 64, H/4, W/4)
    global average pool -> [Dropout] -> Linear(64, classes)

depth = 6n + 2 (20, 32, 44, 56, 110, ...). Downsampling uses the parameter-free option-A shortcut
(residual.py), so resnet20 has 0.27M parameters (269,722 on 3x32x32 input). Convolutions have no
bias (BatchNorm's shift follows) and He-normal weights (std sqrt(2/fan_in)), as PyTorch's
reference CIFAR ResNet draws them with kaiming_normal_; so is the head. BatchNorm starts at
weight 1, bias 0. Every weight comes from one ``np.random.default_rng(seed)`` in layer order.
Works on (1, 28, 28) (stages at 28, 14, 7) as well as (3, 32, 32).
"""
import numpy as np

from mpitrain.nn.batchnorm import BatchNorm2d
from mpitrain.nn.layers import Conv2D, Dropout, GlobalAvgPool2d, Linear, ReLU
from mpitrain.nn.module import Module, chain_backward, chain_forward
from mpitrain.nn.residual import BasicBlock
from mpitrain.nn.sequential import Sequential

WIDTHS = (16, 32, 64)


class ResNet(Module):
    """Children run in order: conv1, bn1, relu, stage1..3, pool, [dropout], fc."""

    def __init__(self, depth, input_shape=(3, 32, 32), classes=10, dropout=0.0, seed=0,
                 dtype=np.float32, kernels=None):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) \
                or depth < 8 or (depth - 2) % 6:
            raise ValueError(f"ResNet depth must be 6n+2 with n >= 1 (20, 32, 56, ...), "
                             f"got {depth!r}")
        self.depth, self.input_shape = int(depth), tuple(input_shape)
        n = (self.depth - 2) // 6
        rng = np.random.default_rng(seed)
        dk = dict(dtype=dtype, kernels=kernels)
        self.add_child("conv1", Conv2D(self.input_shape[0], WIDTHS[0], 3, padding=1, bias=False,
                                       init="he", seed=rng, **dk))
        self.kernels = self.conv1.kernels
        self.add_child("bn1", BatchNorm2d(WIDTHS[0], **dk))
        self.add_child("relu", ReLU(**dk))
        c = WIDTHS[0]
        for s, width in enumerate(WIDTHS):
            blocks = [BasicBlock(c if b == 0 else width, width, 2 if s > 0 and b == 0 else 1,
                                 seed=rng, **dk) for b in range(n)]
            self.add_child(f"stage{s + 1}", Sequential(*blocks))
            c = width
        self.add_child("pool", GlobalAvgPool2d(**dk))
        if dropout:
            self.add_child("dropout", Dropout(dropout, seed=rng, **dk))
        self.add_child("fc", Linear(c, classes, init="he", seed=rng, **dk))

    def forward_through(self, x):
        return chain_forward(self.children(), x)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        return chain_backward(self.children(), grad_y, need_input_grad, on_layer_done)

    def extra_repr(self):
        return f"depth={self.depth}, input_shape={self.input_shape}"


def resnet(depth, input_shape=(3, 32, 32), classes=10, dropout=0.0, seed=0, dtype=np.float32,
           kernels=None):
    """A CIFAR ResNet of ``depth`` = 6n+2 layers (see the module docstring)."""
    return ResNet(depth, input_shape, classes, dropout, seed, dtype, kernels)

