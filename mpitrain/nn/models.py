"""Model zoo: mlp (the PNNL DNN), lenet (TensorFlow's "deep MNIST" network), cifar_cnn (Keras's),
the CIFAR ResNets resnet20 / resnet32 / resnet56 (resnet.py), and gpt, nanoGPT's character-level
transformer (transformer.py; token ids (B, block_size) in, logits (B, block_size, vocab) out,
GPT-2's own initialisation, not the ``init`` schemes below).

Each builder draws all weights from one ``np.random.default_rng(seed)`` in layer order, so the same
seed gives the same model on every process. ``init="glorot"`` (default): Glorot uniform everywhere;
``init=None``: He normal for the layers that feed a ReLU (fused into the layer), Glorot for the
output. Convolutions use "same" padding, as in the originals. ``dropout=p`` > 0 puts a Dropout
before the output layer of any zoo model (the ResNets: after the global average pool).
"""
import numpy as np

from mpitrain.nn.layers import Conv2D, Dropout, Flatten, Linear, MaxPool2D
from mpitrain.nn.resnet import resnet
from mpitrain.nn.sequential import Sequential
from mpitrain.nn.transformer import GPT

# Glorot uniform for every layer (Keras's default). He normal on the ReLU layers (init=None, the
# Layer default) made LeNet diverge at step 1 with the reference recipe (SGD lr 0.05, momentum 0.9:
# initial loss 3.3, then 42, then a dead network), and trained the MLP to 84.0% vs 85.1% after one
# epoch; Glorot trains all three.
INIT = "glorot"
# The input each convnet is built for (the MLP and the ResNets adapt to the data).
FIXED_INPUT_SHAPES = {"lenet": (1, 28, 28), "cifar_cnn": (3, 32, 32)}


def _kw(seed, dtype, kernels, init):
    return dict(seed=np.random.default_rng(seed), dtype=dtype, kernels=kernels, init=init)


def _head(layers, dropout, kw, dtype, kernels):
    """``layers`` with a Dropout before the last one when ``dropout`` > 0."""
    if dropout:
        layers.insert(len(layers) - 1, Dropout(dropout, seed=kw["seed"], dtype=dtype,
                                               kernels=kernels))
    return layers


def mlp(in_features=784, hidden=(1024, 1024), classes=10, seed=0, dtype=np.float32, kernels=None,
        init=INIT, dropout=0.0):
    """Linear+ReLU for each width in ``hidden``, then Linear to ``classes``; input (B, in)."""
    kw = _kw(seed, dtype, kernels, init)
    sizes = [in_features] + list(hidden)
    layers = [Linear(a, b, relu=True, **kw) for a, b in zip(sizes, sizes[1:])]
    layers.append(Linear(sizes[-1], classes, **kw))
    return Sequential(*_head(layers, dropout, kw, dtype, kernels), input_shape=(in_features,))


def lenet(classes=10, seed=0, dtype=np.float32, kernels=None, init=INIT, dropout=0.0):
    """conv5x5-32, pool2, conv5x5-64, pool2, fc1024, fc classes on (B, 1, 28, 28)."""
    kw = _kw(seed, dtype, kernels, init)
    dk = dict(dtype=dtype, kernels=kernels)
    return Sequential(*_head([
        Conv2D(1, 32, 5, padding=2, relu=True, **kw),        # (B, 32, 28, 28)
        MaxPool2D(2, **dk),                                  # (B, 32, 14, 14)
        Conv2D(32, 64, 5, padding=2, relu=True, **kw),       # (B, 64, 14, 14)
        MaxPool2D(2, **dk),                                  # (B, 64, 7, 7)
        Flatten(**dk),                                       # (B, 3136)
        Linear(64 * 7 * 7, 1024, relu=True, **kw),
        Linear(1024, classes, **kw)], dropout, kw, dtype, kernels),
        input_shape=FIXED_INPUT_SHAPES["lenet"])


def cifar_cnn(classes=10, seed=0, dtype=np.float32, kernels=None, init=INIT, dropout=0.0):
    """conv3x3-32 x2, pool2, conv3x3-64 x2, pool2, fc512, fc classes on (B, 3, 32, 32)."""
    kw = _kw(seed, dtype, kernels, init)
    dk = dict(dtype=dtype, kernels=kernels)
    return Sequential(*_head([
        Conv2D(3, 32, 3, padding=1, relu=True, **kw),        # (B, 32, 32, 32)
        Conv2D(32, 32, 3, padding=1, relu=True, **kw),
        MaxPool2D(2, **dk),                                  # (B, 32, 16, 16)
        Conv2D(32, 64, 3, padding=1, relu=True, **kw),       # (B, 64, 16, 16)
        Conv2D(64, 64, 3, padding=1, relu=True, **kw),
        MaxPool2D(2, **dk),                                  # (B, 64, 8, 8)
        Flatten(**dk),                                       # (B, 4096)
        Linear(64 * 8 * 8, 512, relu=True, **kw),
        Linear(512, classes, **kw)], dropout, kw, dtype, kernels),
        input_shape=FIXED_INPUT_SHAPES["cifar_cnn"])


def resnet20(**kwargs):
    """ResNet-20 (0.27M parameters): ``resnet(20, ...)``, see resnet.py."""
    return resnet(20, **kwargs)


def resnet32(**kwargs):
    """ResNet-32: ``resnet(32, ...)``."""
    return resnet(32, **kwargs)


def resnet56(**kwargs):
    """ResNet-56: ``resnet(56, ...)``."""
    return resnet(56, **kwargs)


def gpt(vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=True,
        seed=0, dtype=np.float32, kernels=None):
    """nanoGPT's GPT (transformer.py); the defaults are its "baby" shakespeare_char model
    scaled down (4 layers, 4 heads, 128 channels, 64 tokens of context)."""
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout=dropout, bias=bias,
               seed=seed, dtype=dtype, kernels=kernels)


_ZOO = {"mlp": mlp, "lenet": lenet, "cifar_cnn": cifar_cnn, "resnet20": resnet20,
        "resnet32": resnet32, "resnet56": resnet56, "gpt": gpt}


def get(name, **kwargs):
    """Build a zoo model by name: ``get("mlp", seed=42)`` is ``mlp(seed=42)`` (a model, not a
    builder; the builders themselves are ``mt.models.mlp``, ``.lenet``, ``.cifar_cnn``,
    ``.resnet20``, ...; the ResNets take ``input_shape=(C, H, W)``, default (3, 32, 32); ``gpt``
    needs ``vocab_size``)."""
    if name not in _ZOO:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(_ZOO)}")
    return _ZOO[name](**kwargs)


names = tuple(_ZOO)
