"""Layers, losses, Sequential and the model zoo: model math on arrays, no MPI inside.

Layers fill ``Parameter.grad``; only optimizers (mpitrain.optim) write ``Parameter.data``.
"""
from mpitrain.nn import models
from mpitrain.nn.layers import Conv2D, Dropout, Flatten, Layer, Linear, MaxPool2D, ReLU
from mpitrain.nn.loss import SoftmaxCrossEntropy
from mpitrain.nn.parameter import Parameter
from mpitrain.nn.sequential import Sequential

__all__ = ["Parameter", "Layer", "Linear", "ReLU", "Conv2D", "MaxPool2D", "Flatten", "Dropout",
           "SoftmaxCrossEntropy", "Sequential", "models"]
