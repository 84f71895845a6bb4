"""The activations, AvgPool2D, the extra losses and RMSprop on both GPU backends (Numba CUDA
simulated, CuPy emulated) against the same code on the CPU kernels: two training steps of tiny
models, unchanged layer and optimizer code, only the kernels module differs. (The kernels one
by one: tests/support/kernel_cases.py.)"""
import numpy as np
import pytest

import mpitrain.nn as nn
from mpitrain.optim import RMSprop


@pytest.fixture(params=["numba", "cupy"])
def k(request):
    """The backend under test: Numba CUDA (simulated) or CuPy (emulated)."""
    return request.getfixturevalue({"numba": "dev", "cupy": "emulated"}[request.param])


def conv_tanh_avgpool(kernels):
    kw = dict(seed=np.random.default_rng(3), kernels=kernels)
    return nn.Sequential(
        nn.Conv2D(2, 3, 3, padding=1, **kw),                   # (B, 3, 5, 5)
        nn.Tanh(kernels=kernels),
        nn.AvgPool2D(2, stride=1, kernels=kernels),            # (B, 3, 4, 4)
        nn.Flatten(kernels=kernels),                           # (B, 48)
        nn.Linear(48, 6, **kw),
        nn.LeakyReLU(0.1, kernels=kernels),
        nn.Linear(6, 4, **kw),
        input_shape=(2, 5, 5))


def mlp_sigmoid_softmax(kernels):
    kw = dict(seed=np.random.default_rng(4), kernels=kernels)
    return nn.Sequential(
        nn.Linear(7, 5, **kw),
        nn.Sigmoid(kernels=kernels),
        nn.Linear(5, 4, **kw),
        nn.Softmax(kernels=kernels),                           # (B, 4): a distribution
        input_shape=(7,))


CASES = {
    # model, input shape, loss, target kind, RMSprop settings
    "cnn-smoothed-xent-centered": (conv_tanh_avgpool, (5, 2, 5, 5),
                                   lambda k: nn.SoftmaxCrossEntropy(k, label_smoothing=0.1),
                                   "labels", dict(centered=True, momentum=0.9)),
    "cnn-bce": (conv_tanh_avgpool, (5, 2, 5, 5), lambda k: nn.BCEWithLogitsLoss(k), "probs",
                dict(weight_decay=0.01)),
    "softmax-mse-momentum": (mlp_sigmoid_softmax, (6, 7), lambda k: nn.MSELoss(k), "probs",
                             dict(momentum=0.5)),
}


def _train(kernels, build, make_loss, x, y, hyper, steps=2):
    model, loss_fn = build(kernels), make_loss(kernels)
    opt = RMSprop(model.parameters(), lr=0.01, **hyper)
    xd, yd = kernels.to_device(x), kernels.to_device(y)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(loss_fn(model.forward(xd), yd))
        model.backward(loss_fn.backward())
        opt.step()
    return model.state_dict(copy=True), losses, opt.state_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_rmsprop_steps_match_cpu(cpu, k, case):
    build, shape, make_loss, target, hyper = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    y = (rng.integers(0, 4, size=shape[0]).astype(np.int64) if target == "labels"
         else rng.random((shape[0], 4)).astype(np.float32))
    want, want_losses, want_opt = _train(cpu, build, make_loss, x, y, hyper)
    got, got_losses, got_opt = _train(k, build, make_loss, x, y, hyper)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    start = build(cpu).state_dict()
    for name in want:
        assert not np.array_equal(want[name], start[name]), f"{name} did not train"
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert sorted(got_opt) == sorted(want_opt)
    for key in want_opt:
        # g / sqrt(square_avg) is O(10) wherever g is not ~eps: where it is (a gradient that is
        # rounding noise), float32 orders differ in the noise; compare to the array's scale
        want_key = np.asarray(want_opt[key], dtype=np.float64)
        np.testing.assert_allclose(np.asarray(got_opt[key], dtype=np.float64), want_key,
                                   rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want_key).max()),
                                   err_msg=key)


def test_softmax_function_stays_on_the_device(cpu, k):
    logits = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    on_device = k.to_device(logits)
    probs = nn.softmax(on_device, kernels=k)
    assert type(probs) is type(on_device) and probs is not on_device
    np.testing.assert_allclose(k.to_host(probs), nn.softmax(logits), rtol=1e-6)
