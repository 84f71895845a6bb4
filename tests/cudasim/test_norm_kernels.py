"""BatchNorm, global average pooling and shortcut kernels of both GPU backends, against NumPy.

tests/support/kernel_cases.py compares these kernels with kernels/cpu/; this file checks them
against references written from the contract (kernels/__init__.py), so that a mistake shared by
the CPU and a device kernel still fails: every kernel on Numba CUDA (simulator) and on the CuPy
sources (emulated, tests/support/fake_cupy.py), float32 and float64, (N, C) and (N, C, H, W),
shapes whose per-channel counts cross the simulated chunk size (2 x 32 values), then the
training-mode pipeline against a finite-difference gradient.
"""
import numpy as np
import pytest

SHAPES = [(3, 4, 5, 5), (7, 3), (2, 3, 8, 8), (1, 2, 3, 1)]   # 75, 7, 128 (2 full chunks), 3
DTYPES = [np.float32, np.float64]


@pytest.fixture(params=["numba", "cupy"])
def k(request):
    """The backend under test: Numba CUDA (simulated) or CuPy (emulated)."""
    return request.getfixturevalue({"numba": "dev", "cupy": "emulated"}[request.param])


def _tol(dt):
    return dict(rtol=2e-5, atol=1e-5) if dt == np.float32 else dict(rtol=1e-11, atol=1e-11)


def _ncl(x):
    return x.reshape(x.shape[0], x.shape[1], -1)                 # (N, C, L)


def _xhat(x, mean, invstd):
    return (_ncl(x).astype(np.float64) - mean[:, None]) * invstd[:, None]   # (N, C, L)


def _run(k, name, *args):
    """Call kernel ``name`` with device copies of the array arguments; host copies back."""
    dev = [k.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    assert getattr(k, name)(*dev) is None
    k.synchronize()
    return [k.to_host(d) if isinstance(a, np.ndarray) else None for a, d in zip(args, dev)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_stats(k, shape, dt):
    x = (np.random.default_rng(1).standard_normal(shape) * 3 + 2).astype(dt)
    _, stats = _run(k, "bn_stats", x, np.full((2, shape[1]), np.nan))   # overwrites
    x64 = _ncl(x).astype(np.float64)
    want = np.stack([x64.sum(axis=(0, 2)), (x64 ** 2).sum(axis=(0, 2))])  # (2, C)
    np.testing.assert_allclose(stats, want, rtol=1e-12)


def test_bn_stats_is_deterministic(k):
    x = np.random.default_rng(2).standard_normal((3, 4, 5, 5)).astype(np.float32)
    runs = [_run(k, "bn_stats", x, np.zeros((2, 4)))[1] for _ in range(3)]
    assert all(np.array_equal(r, runs[0]) for r in runs)


@pytest.mark.parametrize("count", [75, 2, 1])
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_moments(k, count, dt):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((count, 5)) * 2 + 1                   # (count, C)
    stats = np.stack([x.sum(0), (x ** 2).sum(0)])
    stats[:, 0] = [2.0 * count, 4.0 * count * (1 - 1e-12)]        # var < 0 by rounding: 0
    rm, rv = rng.standard_normal(5).astype(dt), rng.random(5).astype(dt)
    eps, mom = 1e-5, 0.1
    out = _run(k, "bn_moments", stats, count, eps, mom, np.zeros(5, dt), np.zeros(5, dt),
               rm.copy(), rv.copy())
    mean = stats[0] / count
    var = np.maximum(stats[1] / count - mean ** 2, 0)
    unbiased = var * count / (count - 1) if count > 1 else var
    want = [mean, 1 / np.sqrt(var + eps), (1 - mom) * rm + mom * mean,
            (1 - mom) * rv + mom * unbiased]
    for got, w in zip(out[4:], want):
        assert got.dtype == dt
        np.testing.assert_allclose(got, w, **_tol(dt))
    np.testing.assert_allclose(out[5][0], 1 / np.sqrt(eps), rtol=1e-6)   # clamped variance


@pytest.mark.parametrize("dt", DTYPES)
def test_bn_eval_moments(k, dt):
    rng = np.random.default_rng(4)
    rm, rv = rng.standard_normal(6).astype(dt), rng.random(6).astype(dt)
    *_, mean, invstd = _run(k, "bn_eval_moments", rm, rv, 1e-3, np.zeros(6, dt),
                            np.zeros(6, dt))
    np.testing.assert_array_equal(mean, rm)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(rv.astype(np.float64) + 1e-3), **_tol(dt))


def _batch(shape, dt, seed=5):
    """x, its per-channel mean and 1/std, weight, bias and an upstream gradient."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 1).astype(dt)
    c = shape[1]
    mean = _ncl(x).astype(np.float64).mean(axis=(0, 2)).astype(dt)         # (C,)
    invstd = (1 / _ncl(x).astype(np.float64).std(axis=(0, 2))).astype(dt)  # (C,)
    weight, bias = rng.standard_normal(c).astype(dt), rng.standard_normal(c).astype(dt)
    return x, mean, invstd, weight, bias, rng.standard_normal(shape).astype(dt)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_forward(k, shape, dt):
    x, mean, invstd, weight, bias, _ = _batch(shape, dt)
    y = _run(k, "bn_forward", x, mean, invstd, weight, bias, np.full_like(x, np.nan))[-1]
    want = _xhat(x, mean, invstd) * weight[:, None] + bias[:, None]
    np.testing.assert_allclose(_ncl(y), want, **_tol(dt))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_backward_stats(k, shape, dt):
    x, mean, invstd, _, _, g = _batch(shape, dt)
    stats = _run(k, "bn_backward_stats", g, x, mean, invstd, np.full((2, shape[1]), np.nan))[-1]
    g64 = _ncl(g).astype(np.float64)
    want = np.stack([g64.sum(axis=(0, 2)), (g64 * _xhat(x, mean, invstd)).sum(axis=(0, 2))])
    np.testing.assert_allclose(stats, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_param_grads(k, accumulate, dt):
    rng = np.random.default_rng(6)
    stats = rng.standard_normal((2, 5))
    gw, gb = rng.standard_normal(5).astype(dt), rng.standard_normal(5).astype(dt)
    _, got_w, got_b, _ = _run(k, "bn_param_grads", stats, gw.copy(), gb.copy(), accumulate)
    np.testing.assert_allclose(got_w, stats[1] + (gw if accumulate else 0), **_tol(dt))
    np.testing.assert_allclose(got_b, stats[0] + (gb if accumulate else 0), **_tol(dt))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_bn_backward_input(k, shape, dt):
    x, mean, invstd, weight, _, g = _batch(shape, dt)
    stats = np.random.default_rng(7).standard_normal((2, shape[1])) * 5
    count = x.size // shape[1] * 3                    # e.g. the global count of 3 ranks
    gx = _run(k, "bn_backward_input", g, x, mean, invstd, weight, stats, count,
              np.full_like(x, np.nan))[-1]
    want = (weight * invstd)[:, None].astype(np.float64) * (
        _ncl(g) - stats[0][:, None] / count
        - _xhat(x, mean, invstd) * stats[1][:, None] / count)
    np.testing.assert_allclose(_ncl(gx), want, **(_tol(dt) if dt == np.float64
                                                    else dict(rtol=1e-4, atol=1e-5)))


def _bn_train_step(k, x, weight, bias, g, eps=1e-5):
    """Training-mode forward and backward through the kernels: (y, grad_x, grad_w, grad_b)."""
    c = x.shape[1]
    count = x.size // c
    d = {n: k.to_device(a) for n, a in dict(x=x, weight=weight, bias=bias, g=g).items()}
    stats = k.zeros((2, c), np.float64)
    mean, invstd = k.zeros((c,), x.dtype), k.zeros((c,), x.dtype)
    rm, rv = k.zeros((c,), x.dtype), k.zeros((c,), x.dtype)
    y, gx = k.zeros(x.shape, x.dtype), k.zeros(x.shape, x.dtype)
    gw, gb = k.zeros((c,), x.dtype), k.zeros((c,), x.dtype)
    k.bn_stats(d["x"], stats)
    k.bn_moments(stats, count, eps, 0.1, mean, invstd, rm, rv)
    k.bn_forward(d["x"], mean, invstd, d["weight"], d["bias"], y)
    k.bn_backward_stats(d["g"], d["x"], mean, invstd, stats)
    k.bn_param_grads(stats, gw, gb, False)
    k.bn_backward_input(d["g"], d["x"], mean, invstd, d["weight"], stats, count, gx)
    return [k.to_host(a) for a in (y, gx, gw, gb)]


@pytest.mark.parametrize("shape", [(3, 2, 2, 2), (5, 3)])
def test_training_pipeline_matches_finite_differences(k, shape):
    """bn_stats -> bn_moments -> bn_forward, then the three backward kernels, give the gradient
    of sum(g * y) with the batch statistics differentiated too (what a layer relies on)."""
    x, _, _, weight, bias, g = _batch(shape, np.float64, seed=8)
    y, gx, gw, gb = _bn_train_step(k, x, weight, bias, g)

    def loss(x, weight, bias):
        xhat = (_ncl(x) - _ncl(x).mean(axis=(0, 2), keepdims=True)) / np.sqrt(
            _ncl(x).var(axis=(0, 2), keepdims=True) + 1e-5)
        return float((_ncl(g) * (xhat * weight[:, None] + bias[:, None])).sum())

    def numeric(a, f, h=1e-6):
        out = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            up, down = a.copy(), a.copy()
            up[i] += h
            down[i] -= h
            out[i] = (f(up) - f(down)) / (2 * h)
        return out
    np.testing.assert_allclose(gx, numeric(x, lambda v: loss(v, weight, bias)), atol=1e-6)
    np.testing.assert_allclose(gw, numeric(weight, lambda v: loss(x, v, bias)), atol=1e-6)
    np.testing.assert_allclose(gb, numeric(bias, lambda v: loss(x, weight, v)), atol=1e-6)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("hw", [(5, 5), (1, 1), (4, 7)])
def test_global_avgpool(k, dt, hw):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 4, *hw)).astype(dt)
    y = _run(k, "global_avgpool_forward", x, np.full((3, 4), np.nan, dt))[-1]
    np.testing.assert_allclose(y, x.astype(np.float64).mean(axis=(2, 3)), **_tol(dt))
    gy = rng.standard_normal((3, 4)).astype(dt)
    gx = _run(k, "global_avgpool_backward", gy, np.full(x.shape, np.nan, dt))[-1]
    want = np.broadcast_to((gy / np.asarray(hw[0] * hw[1], dt))[:, :, None, None], x.shape)
    np.testing.assert_allclose(gx, want, **_tol(dt))


@pytest.mark.parametrize("stride, offset, c2", [(1, 0, 4), (2, 2, 8), (2, 0, 6), (3, 1, 5),
                                                (2, 4, 8)])
@pytest.mark.parametrize("hw", [(5, 6), (4, 4)])
def test_shortcut(k, stride, offset, c2, hw):
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 4, *hw)).astype(np.float32)
    oh, ow = -(-hw[0] // stride), -(-hw[1] // stride)
    y = _run(k, "shortcut_forward", x, np.full((2, c2, oh, ow), np.nan, np.float32), stride,
             offset)[1]
    want = np.zeros_like(y)
    want[:, offset:offset + 4] = x[:, :, ::stride, ::stride]
    np.testing.assert_array_equal(y, want)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx = _run(k, "shortcut_backward", gy, np.full_like(x, np.nan), stride, offset)[1]
    want = np.zeros_like(x)
    want[:, :, ::stride, ::stride] = gy[:, offset:offset + 4]
    np.testing.assert_array_equal(gx, want)


@pytest.mark.parametrize("call, match", [
    (lambda k: k.bn_stats(k.zeros((3, 4)), k.zeros((2, 4), np.float32)), r"\(2, 4\) float64"),
    (lambda k: k.bn_stats(k.zeros((3, 4, 5)), k.zeros((2, 4), np.float64)), r"\(3, 4, 5\)"),
    (lambda k: k.bn_moments(k.zeros((2, 3), np.float64), 0, 1e-5, 0.1,
                            *[k.zeros((3,))] * 4), "count 0"),
    (lambda k: k.bn_forward(k.zeros((2, 3)), k.zeros((4,)), *[k.zeros((3,))] * 3,
                            k.zeros((2, 3))), r"mean \(4,\) != \(3,\)"),
    (lambda k: k.global_avgpool_forward(k.zeros((2, 3, 4, 4)), k.zeros((2, 4))),
     r"\(2, 3, 4, 4\) -> \(2, 4\)"),
    (lambda k: k.shortcut_forward(k.zeros((2, 4, 5, 5)), k.zeros((2, 5, 3, 3)), 2, 2),
     r"C2 >= 6"),
    (lambda k: k.shortcut_backward(k.zeros((2, 4, 2, 2)), k.zeros((2, 4, 5, 5)), 2, 0),
     r"grad_y \(2, 4, 2, 2\), .*expected grad_y \(N, C2 >= 4, 3, 3\)"),
])
def test_bad_input_is_one_line_naming_the_value(k, call, match):
    with pytest.raises(ValueError, match=match) as info:
        call(k)
    assert "\n" not in str(info.value)


def test_host_arrays_are_refused(dev):
    # (only on Numba: the CuPy emulation's device arrays are NumPy arrays)
    with pytest.raises(TypeError, match="to_device"):
        dev.bn_stats(np.zeros((2, 3), np.float32), np.zeros((2, 3)))
