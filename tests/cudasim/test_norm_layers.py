"""The BatchNorm layers on both GPU backends against the same layers on the CPU kernels.

tests/support/training_cases.py trains a tiny ResNet two steps in training mode; this covers
what that does not: eval mode (running statistics normalise, backward through constants) and
SyncBatchNorm's global count, with an injected reduction standing in for a second rank.
"""
import numpy as np
import pytest

import mpitrain.nn as nn


@pytest.fixture(params=["numba", "cupy"])
def k(request):
    """The backend under test: Numba CUDA (simulated) or CuPy (emulated)."""
    return request.getfixturevalue({"numba": "dev", "cupy": "emulated"}[request.param])


def _layer_step(kernels, layer, x, g):
    """forward then backward of one layer; host (y, grad_x, grad_weight, grad_bias)."""
    y = layer.forward(kernels.to_device(x))
    gx = layer.backward(kernels.to_device(g))
    return [kernels.to_host(a) for a in (y, gx, layer.weight.grad, layer.bias.grad)]


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (6, 5)])
def test_eval_mode_matches_cpu(cpu, k, shape):
    """After a training forward moved the running statistics, eval forward and backward."""
    rng = np.random.default_rng(12)
    x, x2, g = (rng.standard_normal(shape).astype(np.float32) * 2 + 1 for _ in range(3))
    w, b = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
    layer_type = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
    results = []
    for kernels in (cpu, k):
        layer = layer_type(shape[1], kernels=kernels)
        kernels.copy(layer.weight.data, kernels.to_device(w))
        kernels.copy(layer.bias.data, kernels.to_device(b))
        layer.forward(kernels.to_device(x))                  # training: running stats move
        layer.eval()
        results.append(_layer_step(kernels, layer, x2, g)
                       + [kernels.to_host(b) for b in layer.buffers()])
    for got, want in zip(*reversed(results)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    assert not np.allclose(results[0][-1], 1.0)             # running_var moved off its start


def test_sync_batchnorm_global_count(cpu, k):
    """A SyncBatchNorm on half a batch, whose reduction adds the other half's sums (what a
    second rank would contribute), gives that half of one BatchNorm2d over the whole batch."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((6, 3, 4, 4)).astype(np.float32) * 2 + 1   # the global batch
    g = rng.standard_normal(x.shape).astype(np.float32)
    full = nn.BatchNorm2d(3, kernels=cpu)
    want_y, want_gx = full.forward(x).copy(), full.backward(g).copy()
    total = np.zeros((2, 3))
    cpu.bn_stats(x, total)
    mean, invstd = np.zeros(3, np.float32), np.zeros(3, np.float32)     # of the global batch
    cpu.bn_moments(total, x.size / 3, 1e-5, 0.1, mean, invstd, np.zeros(3, np.float32),
                   np.ones(3, np.float32))
    xo, go = x[3:].copy(), g[3:].copy()                    # the "other rank's" half
    fwd, bwd = np.zeros((2, 3)), np.zeros((2, 3))
    cpu.bn_stats(xo, fwd)
    cpu.bn_backward_stats(go, xo, mean, invstd, bwd)
    adds = [np.concatenate([fwd.ravel(), [xo.size / 3]]), bwd]          # forward, backward

    def reduce(array):                                      # array: device float64, in place
        k.add(array, k.to_device(adds.pop(0).reshape(array.shape)))
    layer = nn.SyncBatchNorm(3, kernels=k, reduce=reduce)
    y, gx, _, _ = _layer_step(k, layer, x[:3].copy(), g[:3].copy())
    assert not adds                                         # one forward, one backward reduce
    np.testing.assert_allclose(y, want_y[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, want_gx[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(k.to_host(layer.running_mean), full.running_mean, rtol=1e-5,
                               atol=1e-7)
