"""mt.nn.clip_grad_norm_ against a NumPy reference of PyTorch's clip_grad_norm_ (one process;
tests/mpi/test_clip_grad_norm.py: the synchronize -> clip -> step idiom on several ranks)."""
import math

import numpy as np
import pytest

import mpitrain as mt


def _params(shapes, scale, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    params = []
    for shape in shapes:
        p = mt.nn.Parameter(rng.standard_normal(shape).astype(dtype))
        p.grad[...] = (rng.standard_normal(shape) * scale).astype(dtype)
        params.append(p)
    return params


def _reference(grads, max_norm, norm_type):
    """PyTorch's clip_grad_norm_ in float64: (total norm, the clipped gradients)."""
    flat = np.concatenate([g.astype(np.float64).ravel() for g in grads])
    if norm_type == math.inf:
        total = np.abs(flat).max(initial=0.0)
    else:
        total = (np.abs(flat) ** norm_type).sum() ** (1.0 / norm_type)
    factor = min(max_norm / (total + 1e-6), 1.0)
    return total, [g * factor for g in grads]


SHAPES = [(7, 5), (5,), (3, 2, 2, 2), (1,), (0, 4)]      # an empty one too


@pytest.mark.parametrize("norm_type", [2.0, 2, math.inf, 1.0, 3.0, 0.5])
@pytest.mark.parametrize("scale", [10.0, 1e-4])           # clipped / left alone (but p=0.5)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_the_numpy_reference(norm_type, scale, dtype):
    params = _params(SHAPES, scale, dtype)
    before = [p.grad.copy() for p in params]
    total = mt.nn.clip_grad_norm_(params, 1.0, norm_type=norm_type)
    want_total, want = _reference(before, 1.0, norm_type)
    assert isinstance(total, float)
    np.testing.assert_allclose(total, want_total, rtol=1e-6 if dtype == np.float32 else 1e-12)
    for p, g, w in zip(params, before, want):
        assert p.grad.dtype == dtype and p.grad.shape == g.shape
        if want_total < 1.0:
            np.testing.assert_array_equal(p.grad, g)          # untouched, not scaled by 1
        else:
            np.testing.assert_allclose(p.grad, w, rtol=1e-6, atol=1e-7)
    if want_total > 1.0:
        clipped = _reference([p.grad for p in params], 1.0, norm_type)[0]
        assert clipped == pytest.approx(1.0, rel=1e-5)


def test_a_models_gradients_and_a_single_parameter():
    model = mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=1)
    data = mt.data.synthetic(16, shape=(12,), classes=3, seed=1)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    loss_fn(model(data.images), data.labels)
    model.backward(loss_fn.backward())
    grads = [p.grad.copy() for p in model.parameters()]
    want_total, want = _reference(grads, 0.01, 2.0)
    assert mt.nn.clip_grad_norm_(model.parameters(), 0.01) == pytest.approx(want_total, rel=1e-6)
    for p, w in zip(model.parameters(), want):
        np.testing.assert_allclose(p.grad, w, rtol=1e-6, atol=1e-9)
    one = _params([(4,)], 3.0)[0]
    total = mt.nn.clip_grad_norm_(one, 0.5, norm_type=math.inf)
    assert total == pytest.approx(np.abs(one.grad).max() * (total + 1e-6) / 0.5, rel=1e-6)
    assert np.abs(one.grad).max() == pytest.approx(0.5, rel=1e-5)


def test_zero_and_stale_gradients_and_no_parameters():
    params = _params([(3, 3)], 1.0)
    params[0].zero_grad()                                      # stale: reads as zeros
    assert mt.nn.clip_grad_norm_(params, 1.0) == 0.0
    np.testing.assert_array_equal(params[0].grad, np.zeros((3, 3), np.float32))
    assert mt.nn.clip_grad_norm_([], 1.0) == 0.0


def test_non_finite_gradients():
    params = _params([(4,)], 1.0)
    params[0].grad[1] = np.inf
    with pytest.raises(RuntimeError, match="2-norm of the gradients is inf"):
        mt.nn.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert math.isinf(mt.nn.clip_grad_norm_(params, 1.0))     # PyTorch: inf * 0 = NaN
    assert np.isnan(params[0].grad[1])
    params = _params([(4,)], 1.0)
    params[0].grad[0] = np.nan
    assert math.isnan(mt.nn.clip_grad_norm_(params, 1.0))
    assert np.isnan(params[0].grad).all()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_norm=-1.0), "max_norm -1.0 must be >= 0"),
    (dict(max_norm=float("nan")), "max_norm nan must be >= 0"),
    (dict(max_norm=1.0, norm_type=0), "norm_type 0.0 must be > 0 or inf"),
])
def test_bad_arguments(kwargs, needle):
    params = _params([(2,)], 1.0)
    before = params[0].grad.copy()
    with pytest.raises(ValueError, match=needle):
        mt.nn.clip_grad_norm_(params, **kwargs)
    np.testing.assert_array_equal(params[0].grad, before)
