"""Tanh, Sigmoid, LeakyReLU, Softmax, AvgPool2D, MSELoss, BCEWithLogitsLoss and label smoothing:
finite-difference gradients (float64, tests/support/gradcheck.py) and values against NumPy
references of PyTorch's definitions, written out here."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.kernels import cpu
from mpitrain.nn import (AvgPool2D, BCEWithLogitsLoss, LeakyReLU, MSELoss, Sigmoid, Softmax,
                         SoftmaxCrossEntropy, Tanh)
from tests.support.gradcheck import assert_close, check_layer, numeric_grad


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def _ref_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _ref_avgpool(x, k, s):
    n, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    y = np.empty((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            y[:, :, i, j] = x[:, :, i * s:i * s + k, j * s:j * s + k].mean(axis=(2, 3))
    return y


# -- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [Tanh(dtype=np.float64), Sigmoid(dtype=np.float64),
                                   LeakyReLU(dtype=np.float64),
                                   LeakyReLU(0.3, dtype=np.float64),
                                   LeakyReLU(-0.5, dtype=np.float64)], ids=repr)
def test_elementwise_activation_gradients(rng, layer):
    x = rng.standard_normal((3, 7)) * 2
    x[np.abs(x) < 1e-3] = 0.5                           # no kink of LeakyReLU within +-h
    check_layer(layer, x, rng)


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 6)])
def test_softmax_gradient_over_the_last_axis(rng, shape):
    check_layer(Softmax(dtype=np.float64), rng.standard_normal(shape) * 3, rng)


@pytest.mark.parametrize("k,stride", [(2, 2), (3, 2), (2, 1), (3, 3)])
def test_avgpool_gradient(rng, k, stride):
    check_layer(AvgPool2D(k, stride, dtype=np.float64), rng.standard_normal((2, 3, 7, 6)), rng)


def _check_loss_gradient(loss, x, y):
    loss(x, y)
    analytic = np.array(loss.backward())
    assert_close(analytic, numeric_grad(lambda: loss(x, y), x), repr(loss))


def test_mse_gradient(rng):
    _check_loss_gradient(MSELoss(), rng.standard_normal((4, 3)), rng.standard_normal((4, 3)))


def test_bce_with_logits_gradient(rng):
    _check_loss_gradient(BCEWithLogitsLoss(), rng.standard_normal((5, 2)) * 3,
                         rng.random((5, 2)))


@pytest.mark.parametrize("smoothing", [0.1, 0.5, 1.0])
def test_label_smoothed_cross_entropy_gradient(rng, smoothing):
    loss = SoftmaxCrossEntropy(label_smoothing=smoothing)
    labels = np.array([0, 4, 2, 2], dtype=np.int64)
    _check_loss_gradient(loss, rng.standard_normal((4, 5)) * 3, labels)


# -- values -------------------------------------------------------------------------------------

def test_activation_values_match_their_definitions(rng):
    x = rng.standard_normal((4, 6)) * 3                                       # (4, 6)
    np.testing.assert_allclose(Tanh(dtype=np.float64).forward(x), np.tanh(x), rtol=1e-14)
    np.testing.assert_allclose(Sigmoid(dtype=np.float64).forward(x), 1 / (1 + np.exp(-x)),
                               rtol=1e-14)
    np.testing.assert_array_equal(LeakyReLU(0.2, dtype=np.float64).forward(x),
                                  np.where(x > 0, x, 0.2 * x))
    np.testing.assert_array_equal(LeakyReLU(dtype=np.float64).forward(np.array([-100.0])),
                                  [-1.0])                                     # slope 0.01


def test_sigmoid_saturates_without_overflow():
    x = np.array([-1000.0, -40.0, 0.0, 40.0, 1000.0], np.float32)
    y = Sigmoid().forward(x)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, [0.0, 4.248354e-18, 0.5, 1.0, 1.0], rtol=1e-6)


def test_softmax_rows_sum_to_one_and_match_the_reference(rng):
    z = rng.standard_normal((2, 3, 5)) * 4 + 800                  # (2, 3, 5); exp(800) = inf
    p = Softmax(dtype=np.float64).forward(z)
    np.testing.assert_allclose(p, _ref_softmax(z), rtol=1e-13)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-14)


def test_softmax_function_returns_probabilities_of_a_models_logits(rng):
    model = mt.models.mlp(in_features=6, hidden=(5,), classes=3, seed=1)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    logits = model(x)                                             # (4, 3)
    probs = mt.nn.softmax(logits, kernels=cpu)
    assert probs.shape == (4, 3) and probs.dtype == np.float32 and probs is not logits
    np.testing.assert_allclose(probs, _ref_softmax(logits.astype(np.float64)), rtol=1e-6)
    np.testing.assert_array_equal(probs.argmax(axis=1), logits.argmax(axis=1))
    with pytest.raises(ValueError, match="int64"):
        mt.nn.softmax(np.zeros((2, 3), np.int64))


@pytest.mark.parametrize("k,stride", [(2, None), (3, 2), (2, 1)])
def test_avgpool_values_and_shape(rng, k, stride):
    x = rng.standard_normal((2, 3, 7, 6))
    layer = AvgPool2D(k, stride, dtype=np.float64)
    np.testing.assert_allclose(layer.forward(x), _ref_avgpool(x, k, stride or k), rtol=1e-14)
    assert repr(layer) == f"AvgPool2D({k}, stride={stride or k})"


def test_avgpool_refuses_a_window_larger_than_the_input():
    with pytest.raises(ValueError, match="window 3 does not fit input 2x5"):
        AvgPool2D(3).forward(np.zeros((1, 1, 2, 5), np.float32))


def test_mse_is_the_mean_over_every_element(rng):
    x, t = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 4))
    loss = MSELoss()
    assert loss(x, t) == pytest.approx(np.mean((x - t) ** 2), rel=1e-14)
    np.testing.assert_allclose(loss.backward(), 2 * (x - t) / x.size, rtol=1e-14)


def test_bce_with_logits_matches_torchs_definition_and_stays_finite(rng):
    x, t = rng.standard_normal((6, 3)) * 3, rng.random((6, 3))
    sig = 1 / (1 + np.exp(-x))
    torch_def = -np.mean(t * np.log(sig) + (1 - t) * np.log(1 - sig))
    loss = BCEWithLogitsLoss()
    assert loss(x, t) == pytest.approx(torch_def, rel=1e-12)
    np.testing.assert_allclose(loss.backward(), (sig - t) / x.size, rtol=1e-12)
    # log(sigmoid(-800)) would be log(0): the stable form gives x*t - ... exactly
    big = np.array([[800.0, -800.0]])
    assert loss(big, np.array([[0.0, 1.0]])) == pytest.approx(800.0, rel=1e-15)
    np.testing.assert_array_equal(loss.backward(), [[0.5, -0.5]])


def test_elementwise_losses_check_their_target():
    with pytest.raises(ValueError, match=r"target shape \(3,\) != input shape \(2, 3\)"):
        MSELoss()(np.zeros((2, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="float32 and float64"):
        BCEWithLogitsLoss()(np.zeros(3, np.float32), np.zeros(3))
    with pytest.raises(RuntimeError, match="before forward"):
        MSELoss().backward()


def test_label_smoothing_is_pytorchs_definition(rng):
    """loss = -sum_k q_k log softmax(z)_k with q = (1 - e) onehot(label) + e / K, mean over B;
    gradient (softmax - q) / B."""
    z = rng.standard_normal((6, 5)) * 3                                       # (B, K)
    labels = rng.integers(0, 5, size=6)
    e = 0.2
    q = (1 - e) * np.eye(5)[labels] + e / 5                                   # (B, K)
    log_p = z - z.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    loss = SoftmaxCrossEntropy(label_smoothing=e)
    assert loss(z, labels) == pytest.approx(-np.mean((q * log_p).sum(axis=1)), rel=1e-13)
    np.testing.assert_allclose(loss.backward(), (np.exp(log_p) - q) / 6, rtol=1e-12,
                               atol=1e-15)
    assert loss.correct == int((z.argmax(axis=1) == labels).sum())


def test_label_smoothing_zero_is_the_unsmoothed_kernel_bit_for_bit(rng):
    z = (rng.standard_normal((8, 10)) * 4).astype(np.float32)
    labels = rng.integers(0, 10, size=8).astype(np.int64)
    grad, losses = np.empty_like(z), np.empty(8, np.float32)
    cpu.softmax_xent(z, labels, grad, losses)                     # what the loss always did
    for loss in (SoftmaxCrossEntropy(), SoftmaxCrossEntropy(label_smoothing=0.0)):
        assert loss(z, labels) == cpu.total(losses) / 8
        np.testing.assert_array_equal(loss.backward(), grad)
    smoothed = SoftmaxCrossEntropy(label_smoothing=0.1)
    assert smoothed(z, labels) != cpu.total(losses) / 8


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1"])
def test_label_smoothing_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        SoftmaxCrossEntropy(label_smoothing=bad)


def test_a_small_model_of_the_new_layers_end_to_end(rng):
    """Conv -> Tanh -> AvgPool -> Flatten -> Linear -> LeakyReLU -> Linear -> Sigmoid -> MSE:
    every parameter's gradient by finite differences."""
    kw = dict(dtype=np.float64, seed=np.random.default_rng(3))
    model = mt.nn.Sequential(
        mt.nn.Conv2D(1, 2, 3, padding=1, **kw),                   # (B, 2, 6, 6)
        Tanh(dtype=np.float64),
        AvgPool2D(2, dtype=np.float64),                           # (B, 2, 3, 3)
        mt.nn.Flatten(dtype=np.float64),                          # (B, 18)
        mt.nn.Linear(18, 5, **kw),
        LeakyReLU(0.1, dtype=np.float64),
        mt.nn.Linear(5, 3, **kw),
        Sigmoid(dtype=np.float64))                                # (B, 3)
    x = rng.standard_normal((3, 1, 6, 6))
    target = rng.random((3, 3))
    loss = MSELoss()

    def f():
        return loss(model.forward(x), target)

    f()
    model.zero_grad()
    model.backward(loss.backward())
    for name, p in model.named_parameters():
        assert_close(np.array(p.grad), numeric_grad(f, p.data), f"model d/d{name}")
