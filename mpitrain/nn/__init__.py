"""Modules, layers, losses and the model zoo: model math on arrays, no MPI inside (SyncBatchNorm
reaches the collectives through an injected reduction, resolved lazily).

Layers fill ``Parameter.grad``; only optimizers (mpitrain.optim) write ``Parameter.data``.
"""
from mpitrain.nn import models
from mpitrain.nn.activations import LeakyReLU, Sigmoid, Softmax, Tanh, softmax
from mpitrain.nn.batchnorm import BatchNorm1d, BatchNorm2d, BatchNormBase
from mpitrain.nn.clip import clip_grad_norm_
from mpitrain.nn.layers import (AvgPool2D, Conv2D, Dropout, Flatten, GlobalAvgPool2d, Layer,
                                Linear, MaxPool2D, ReLU)
from mpitrain.nn.loss import BCEWithLogitsLoss, MSELoss, SoftmaxCrossEntropy
from mpitrain.nn.module import Module
from mpitrain.nn.parameter import Parameter
from mpitrain.nn.residual import Add, BasicBlock, ShortcutA
from mpitrain.nn.resnet import ResNet
from mpitrain.nn.sequential import Sequential
from mpitrain.nn.sync_batchnorm import SyncBatchNorm
from mpitrain.nn.transformer import (GELU, GPT, MLP, Block, CausalSelfAttention, Embedding,
                                     LayerNorm, PositionalEmbedding)

__all__ = ["Parameter", "Module", "Layer", "Linear", "ReLU", "Tanh", "Sigmoid", "LeakyReLU",
           "Softmax", "softmax", "Conv2D", "MaxPool2D", "AvgPool2D", "GlobalAvgPool2d", "Flatten",
           "Dropout", "BatchNorm1d", "BatchNorm2d", "BatchNormBase",
           "SyncBatchNorm",
           "Add", "ShortcutA", "BasicBlock", "ResNet", "SoftmaxCrossEntropy", "MSELoss",
           "BCEWithLogitsLoss", "Sequential",
           "Embedding", "PositionalEmbedding", "LayerNorm", "GELU", "CausalSelfAttention", "MLP",
           "Block", "GPT",
           "models", "clip_grad_norm_"]
