"""Finite-difference gradient checks, in float64, for every layer, the loss and a small model
(the checker: tests/support/gradcheck.py)."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.nn import Conv2D, Dropout, Flatten, Linear, MaxPool2D, ReLU, SoftmaxCrossEntropy
from tests.support.gradcheck import assert_close, check_layer, numeric_grad

@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("relu", [False, True])
def test_linear(rng, relu):
    layer = Linear(5, 4, relu=relu, seed=1, dtype=np.float64)
    layer.bias.data[:] = rng.standard_normal(4)      # nonzero bias: exercises bias_act
    check_layer(layer, rng.standard_normal((3, 5)), rng)


def test_relu(rng):
    check_layer(ReLU(dtype=np.float64), rng.standard_normal((3, 7)), rng)


def test_flatten(rng):
    check_layer(Flatten(dtype=np.float64), rng.standard_normal((2, 2, 3, 3)), rng)


@pytest.mark.parametrize("stride,padding,relu", [(1, 0, False), (1, 1, True), (2, 1, False),
                                                 (2, 2, True)])
def test_conv2d(rng, stride, padding, relu):
    layer = Conv2D(2, 3, 3, stride=stride, padding=padding, relu=relu, seed=2, dtype=np.float64)
    layer.bias.data[:] = rng.standard_normal(3)
    check_layer(layer, rng.standard_normal((2, 2, 5, 6)), rng)


@pytest.mark.parametrize("k,stride", [(2, 2), (3, 2), (2, 1)])
def test_maxpool(rng, k, stride):
    # Distinct values keep every window's max unique (no kinks within +-h).
    x = rng.permutation(2 * 3 * 6 * 7).reshape(2, 3, 6, 7) * 0.01
    check_layer(MaxPool2D(k, stride, dtype=np.float64), x.astype(np.float64), rng)


def test_dropout_fixed_mask(rng):
    layer = Dropout(0.4, seed=5, dtype=np.float64)
    x = rng.standard_normal((4, 6))
    y = layer.forward(x)
    r = rng.standard_normal(y.shape)

    def loss():
        layer.calls = 0                                 # same seed -> same mask every call
        return float(np.sum(layer.forward(x) * r))

    loss()
    grad_x = np.array(layer.backward(r, need_input_grad=True))
    assert_close(grad_x, numeric_grad(loss, x), "dropout d/dx")


def test_softmax_cross_entropy(rng):
    loss = SoftmaxCrossEntropy()
    logits = rng.standard_normal((4, 5)) * 3
    labels = np.array([0, 4, 2, 2], dtype=np.int64)
    loss.forward(logits, labels)
    analytic = np.array(loss.backward())
    assert_close(analytic, numeric_grad(lambda: loss.forward(logits, labels), logits), "xent")


def test_small_model_end_to_end(rng):
    """Conv -> pool -> flatten -> linear(relu) -> linear, through the loss, all parameters."""
    kw = dict(dtype=np.float64, seed=np.random.default_rng(7))
    model = mt.nn.Sequential(
        Conv2D(1, 2, 3, padding=1, relu=True, **kw),     # (B, 2, 6, 6)
        MaxPool2D(2, dtype=np.float64),                  # (B, 2, 3, 3)
        Flatten(dtype=np.float64),                       # (B, 18)
        Linear(18, 5, relu=True, **kw),
        Linear(5, 3, **kw))
    x = rng.standard_normal((3, 1, 6, 6))
    labels = np.array([0, 2, 1], dtype=np.int64)
    loss = SoftmaxCrossEntropy()

    def f():
        return loss.forward(model.forward(x), labels)

    f()
    model.zero_grad()
    model.backward(loss.backward())
    for name, p in model.named_parameters():
        assert_close(np.array(p.grad), numeric_grad(f, p.data), f"model d/d{name}")


def test_gradients_accumulate_until_zero_grad(rng):
    layer = Linear(3, 2, seed=0, dtype=np.float64)
    x = rng.standard_normal((4, 3))
    r = rng.standard_normal((4, 2))
    layer.forward(x)
    layer.backward(r)
    once = np.array(layer.weight.grad)
    layer.forward(x)
    layer.backward(r)
    np.testing.assert_allclose(layer.weight.grad, 2 * once, rtol=1e-12)
    layer.weight.zero_grad()
    np.testing.assert_array_equal(layer.weight.grad, 0)   # a stale gradient reads as zeros
    layer.forward(x)
    layer.backward(r)
    np.testing.assert_allclose(layer.weight.grad, once, rtol=1e-12)
