"""CPU BatchNorm, global-average-pool and shortcut kernels against NumPy references."""
import numpy as np
import pytest

from mpitrain import kernels

k = kernels.get("cpu")
DTYPES = [np.float32, np.float64]
SHAPES = [(5, 3), (4, 3, 5, 6), (1, 2, 1, 1)]


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-11)


def _axes(x):
    return (0,) if x.ndim == 2 else (0, 2, 3)


def _bc(v, x):
    """(C,) -> broadcastable against x (N, C[, H, W])."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_training_forward_and_running_stats(shape, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    c = shape[1]
    count = x.size // c
    stats = np.full((2, c), np.nan)
    k.bn_stats(x, stats)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(stats[0], x64.sum(axis=_axes(x)), rtol=1e-12)
    np.testing.assert_allclose(stats[1], (x64 ** 2).sum(axis=_axes(x)), rtol=1e-12)
    mean, invstd = np.empty(c, dtype), np.empty(c, dtype)
    rm, rv = rng.standard_normal(c).astype(dtype), rng.uniform(0.5, 2, c).astype(dtype)
    rm0, rv0 = rm.astype(np.float64), rv.astype(np.float64)
    k.bn_moments(stats, count, 1e-5, 0.1, mean, invstd, rm, rv)
    m, var = x64.mean(axis=_axes(x)), x64.var(axis=_axes(x))
    np.testing.assert_allclose(mean, m, **tol(dtype))
    np.testing.assert_allclose(invstd, 1 / np.sqrt(var + 1e-5), **tol(dtype))
    # PyTorch: running_var uses the unbiased variance (the biased one when count == 1)
    unbiased = var * count / (count - 1) if count > 1 else var
    np.testing.assert_allclose(rm, 0.9 * rm0 + 0.1 * m, **tol(dtype))
    np.testing.assert_allclose(rv, 0.9 * rv0 + 0.1 * unbiased, **tol(dtype))
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    y = np.empty_like(x)
    k.bn_forward(x, mean, invstd, w, b, y)
    ref = (x64 - _bc(m, x)) / np.sqrt(_bc(var, x) + 1e-5) * _bc(w, x) + _bc(b, x)
    np.testing.assert_allclose(y, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_eval_moments(dtype):
    rm, rv = np.array([1.0, -2.0], dtype), np.array([4.0, 0.25], dtype)
    mean, invstd = np.empty(2, dtype), np.empty(2, dtype)
    k.bn_eval_moments(rm, rv, 1e-5, mean, invstd)
    np.testing.assert_array_equal(mean, rm)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(rv.astype(np.float64) + 1e-5), **tol(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_backward(shape, dtype):
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    c = shape[1]
    count = x.size // c
    mean = rng.standard_normal(c).astype(dtype)
    invstd = rng.uniform(0.5, 2, c).astype(dtype)
    w = rng.standard_normal(c).astype(dtype)
    stats = np.full((2, c), np.nan)
    k.bn_backward_stats(g, x, mean, invstd, stats)
    g64, x64 = g.astype(np.float64), x.astype(np.float64)
    xhat = (x64 - _bc(mean, x)) * _bc(invstd.astype(np.float64), x)
    s0, s1 = g64.sum(axis=_axes(x)), (g64 * xhat).sum(axis=_axes(x))
    np.testing.assert_allclose(stats[0], s0, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(stats[1], s1, rtol=1e-6 if dtype == np.float32 else 1e-11,
                               atol=1e-6 if dtype == np.float32 else 1e-11)
    gw, gb = np.full(c, 1.0, dtype), np.full(c, 2.0, dtype)
    k.bn_param_grads(stats, gw, gb, False)
    np.testing.assert_allclose(gw, stats[1], **tol(dtype))
    np.testing.assert_allclose(gb, stats[0], **tol(dtype))
    k.bn_param_grads(stats, gw, gb, True)
    np.testing.assert_allclose(gw, 2 * stats[1], **tol(dtype))
    np.testing.assert_allclose(gb, 2 * stats[0], **tol(dtype))
    gx = np.empty_like(x)
    k.bn_backward_input(g, x, mean, invstd, w, stats, count, gx)
    ref = _bc(w * invstd.astype(np.float64), x) * (g64 - _bc(s0, x) / count
                                                   - xhat * _bc(s1, x) / count)
    np.testing.assert_allclose(gx, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_avgpool(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 5, 2)).astype(dtype)
    y = np.empty((3, 4), dtype)
    k.global_avgpool_forward(x, y)
    np.testing.assert_allclose(y, x.astype(np.float64).mean(axis=(2, 3)), **tol(dtype))
    gy = rng.standard_normal((3, 4)).astype(dtype)
    gx = np.full_like(x, np.nan)
    k.global_avgpool_backward(gy, gx)
    np.testing.assert_allclose(gx, np.broadcast_to(gy[:, :, None, None] / 10, x.shape),
                               **tol(dtype))
    with pytest.raises(ValueError, match="global_avgpool_forward"):
        k.global_avgpool_forward(x, np.empty((3, 5), dtype))


@pytest.mark.parametrize("stride,offset,c2,hw", [(2, 4, 16, (8, 8)), (2, 1, 5, (5, 7)),
                                                 (1, 0, 4, (3, 3)), (3, 2, 9, (7, 6))])
def test_shortcut(stride, offset, c2, hw):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3) + hw).astype(np.float32)
    oh, ow = -(-hw[0] // stride), -(-hw[1] // stride)
    y = np.full((2, c2, oh, ow), np.nan, np.float32)
    k.shortcut_forward(x, y, stride, offset)
    ref = np.zeros_like(y)
    ref[:, offset:offset + 3] = x[:, :, ::stride, ::stride]
    np.testing.assert_array_equal(y, ref)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx = np.full_like(x, np.nan)
    k.shortcut_backward(gy, gx, stride, offset)
    ref_gx = np.zeros_like(x)
    ref_gx[:, :, ::stride, ::stride] = gy[:, offset:offset + 3]
    np.testing.assert_array_equal(gx, ref_gx)
    # adjoint: <shortcut(x), gy> == <x, shortcut_backward(gy)>
    np.testing.assert_allclose((y * gy).sum(), (x * gx).sum(), rtol=1e-5)


def test_shortcut_rejects_bad_shapes():
    x = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match="shortcut"):
        k.shortcut_forward(x, np.zeros((2, 4, 4, 4), np.float32), 2, 2)   # C2 < C + offset
    with pytest.raises(ValueError, match="shortcut"):
        k.shortcut_forward(x, np.zeros((2, 8, 3, 4), np.float32), 2, 2)   # wrong OH


def test_bn_kernels_reject_bad_stats():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="float64"):
        k.bn_stats(x, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="count"):
        k.bn_moments(np.zeros((2, 3)), 0, 1e-5, 0.1, *[np.zeros(3, np.float32)] * 4)
