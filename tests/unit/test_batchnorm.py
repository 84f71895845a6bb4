"""BatchNorm1d/2d: finite-difference gradients (float64, train and eval mode), PyTorch's running
statistics, eval semantics, buffers, and SyncBatchNorm's conversion and injected reduction."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.nn import BatchNorm1d, BatchNorm2d, SyncBatchNorm
from tests.support.gradcheck import assert_close, check_layer, numeric_grad


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _shifted(rng, shape):
    return rng.standard_normal(shape) * 1.5 + 0.7          # not already normalised


@pytest.mark.parametrize("cls,shape", [(BatchNorm1d, (6, 3)), (BatchNorm2d, (3, 2, 4, 3))])
@pytest.mark.parametrize("affine", [True, False])
def test_train_mode_gradients(rng, cls, shape, affine):
    layer = cls(shape[1], affine=affine, dtype=np.float64)
    if affine:        # non-trivial weight and bias, so their gradients are tested too
        layer.weight.data[...] = rng.uniform(0.5, 2.0, shape[1])
        layer.bias.data[...] = rng.standard_normal(shape[1])
    check_layer(layer, _shifted(rng, shape), rng)


@pytest.mark.parametrize("cls,shape", [(BatchNorm1d, (5, 4)), (BatchNorm2d, (2, 3, 3, 2))])
def test_eval_mode_gradients_use_running_stats(rng, cls, shape):
    layer = cls(shape[1], dtype=np.float64)
    layer.forward(_shifted(rng, shape))                    # move the running statistics
    layer.weight.data[...] = rng.uniform(0.5, 2.0, shape[1])
    layer.eval()
    check_layer(layer, _shifted(rng, shape), rng)


def _bc(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5, 5)])
def test_running_stats_follow_pytorch_and_eval_uses_them(rng, shape):
    """torch.nn.BatchNorm: running = (1-m)*running + m*stat, the variance unbiased, eps 1e-5."""
    cls = BatchNorm1d if len(shape) == 2 else BatchNorm2d
    layer = cls(shape[1], dtype=np.float64)
    assert layer.momentum == 0.1 and layer.eps == 1e-5
    axes = (0,) if len(shape) == 2 else (0, 2, 3)
    rm, rv = np.zeros(shape[1]), np.ones(shape[1])
    for _ in range(3):
        x = _shifted(rng, shape)
        y = layer.forward(x)
        mean, var = x.mean(axis=axes), x.var(axis=axes)
        n = x.size // shape[1]
        rm = 0.9 * rm + 0.1 * mean
        rv = 0.9 * rv + 0.1 * var * n / (n - 1)
        ref = (x - _bc(mean, x.ndim)) / np.sqrt(_bc(var, x.ndim) + 1e-5)
        np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.running_mean, rm, rtol=1e-12)
    np.testing.assert_allclose(layer.running_var, rv, rtol=1e-12)
    layer.eval()
    x = _shifted(rng, shape)
    y = layer.forward(x)
    np.testing.assert_allclose(y, (x - _bc(rm, x.ndim)) / np.sqrt(_bc(rv, x.ndim) + 1e-5),
                               rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.running_mean, rm, rtol=1e-12)     # eval does not move them


def test_buffers_are_state_not_parameters():
    model = mt.nn.Sequential(mt.nn.Linear(4, 3, dtype=np.float64), BatchNorm1d(3, dtype=np.float64))
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight",
                                                       "1.bias"]
    assert [n for n, _ in model.named_buffers()] == ["1.running_mean", "1.running_var"]
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                           "1.running_var"]
    assert state["1.running_var"] is model[1].running_var              # live arrays
    snap = model.state_dict(copy=True)
    model.forward(np.random.default_rng(0).standard_normal((5, 4)))
    assert not np.array_equal(snap["1.running_mean"], model[1].running_mean)
    model.load_state_dict(snap)
    np.testing.assert_array_equal(model[1].running_mean, snap["1.running_mean"])
    opt = mt.optim.SGD(model.parameters(), lr=0.1)
    assert all(b is not p.data for p in opt.params for b in model.buffers())


def test_bad_input_and_arguments():
    with pytest.raises(ValueError, match="num_features"):
        BatchNorm2d(0)
    with pytest.raises(ValueError, match="momentum"):
        BatchNorm1d(3, momentum=2)
    with pytest.raises(ValueError, match="4 channels, got 3"):
        BatchNorm2d(4).forward(np.zeros((2, 3, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"expects \(N, 3\)"):
        BatchNorm1d(3).forward(np.zeros((2, 3, 2, 2), np.float32))


def test_sync_batchnorm_with_an_identity_reduction_is_batchnorm(rng):
    """One rank: SyncBatchNorm equals BatchNorm2d (the reduction is the only difference)."""
    x = _shifted(rng, (3, 2, 4, 4))
    calls = []
    plain = BatchNorm2d(2, dtype=np.float64)
    sync = SyncBatchNorm(2, dtype=np.float64, reduce=lambda a: calls.append(a.shape))
    np.testing.assert_allclose(sync.forward(x), plain.forward(x), rtol=1e-13)
    g = rng.standard_normal(x.shape)
    np.testing.assert_allclose(sync.backward(g), plain.backward(g), rtol=1e-12)
    assert calls == [(5,), (2, 2)]        # forward: sums, squares, count; backward: two sums
    check_layer(SyncBatchNorm(2, dtype=np.float64, reduce=lambda a: None), x, rng)


def test_sync_batchnorm_scales_like_a_double_batch(rng):
    """A reduction that doubles the sums (a second rank with the same data) gives the
    statistics of the double batch: same mean and variance, count 2n."""
    x = _shifted(rng, (4, 3))
    sync = SyncBatchNorm(3, dtype=np.float64, reduce=lambda a: np.multiply(a, 2, out=a))
    plain = BatchNorm1d(3, dtype=np.float64)
    np.testing.assert_allclose(sync.forward(x), plain.forward(x), rtol=1e-12)
    np.testing.assert_allclose(sync._count, 8)
    n = 8      # unbiased with the global count: var * 8/7, not var * 4/3
    np.testing.assert_allclose(sync.running_var, 0.9 + 0.1 * x.var(axis=0) * n / (n - 1))


def test_convert_swaps_every_batchnorm_and_keeps_state(rng):
    model = mt.models.resnet20(input_shape=(1, 8, 8), dtype=np.float64)
    model.forward(rng.standard_normal((2, 1, 8, 8)))                  # non-default buffers
    before = model.state_dict(copy=True)
    params = model.parameters()
    opt = mt.optim.SGD(params, lr=0.1)
    assert SyncBatchNorm.convert(model, reduce=lambda a: None) is model
    kinds = [type(m).__name__ for m in model.modules()]
    assert "BatchNorm2d" not in kinds and kinds.count("SyncBatchNorm") == 19
    assert [n for n, _ in model.named_parameters()] == list(before)[:len(params)]
    assert all(a is b for a, b in zip(model.parameters(), opt.params))
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    assert model.stage2[0].bn1 is model.stage2[0]._children["bn1"]
    bn = BatchNorm1d(3)
    assert isinstance(SyncBatchNorm.convert(bn), SyncBatchNorm)


def test_numeric_grad_helper_is_sensitive():
    """The shared checker fails on a wrong gradient (guards the tests above)."""
    a = np.array([1.0, 2.0])
    numeric = numeric_grad(lambda: float((a ** 2).sum()), a)
    with pytest.raises(AssertionError):
        assert_close(numeric * 1.01, numeric, "deliberately wrong")
