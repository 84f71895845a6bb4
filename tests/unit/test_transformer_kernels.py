"""CPU transformer kernels (embedding, LayerNorm, GELU, head permutations, batched GEMM, causal
softmax) against NumPy references in float64."""
import inspect

import numba
import numpy as np
import pytest

from mpitrain import kernels
from mpitrain.kernels import contract

k = kernels.get("cpu")
DTYPES = [np.float32, np.float64]
NAMES = ("embedding_forward", "embedding_backward", "layernorm_forward", "layernorm_backward",
         "gelu", "gelu_backward", "to_heads", "from_heads", "batched_gemm", "causal_softmax",
         "causal_softmax_backward")


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)


def test_signatures_follow_the_contract():
    for name in NAMES:
        fn = getattr(k, name)
        assert tuple(inspect.signature(getattr(fn, "py_func", fn)).parameters) == \
            contract.KERNELS[name], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_embedding_forward_and_deterministic_scatter_add(dtype, id_dtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 5)).astype(dtype)
    ids = np.array([[3, 0, 3], [6, 3, 1]], dtype=id_dtype)          # repeats: scatter-add
    out = np.full((2, 3, 5), np.nan, dtype)
    k.embedding_forward(ids, w, out)
    np.testing.assert_array_equal(out, w[ids])
    grad_out = rng.standard_normal((2, 3, 5)).astype(dtype)
    grad_w = rng.standard_normal((7, 5)).astype(dtype)
    want = grad_w.astype(np.float64)
    np.add.at(want, ids.reshape(-1), grad_out.reshape(-1, 5).astype(np.float64))
    k.embedding_backward(ids, grad_out, grad_w)                     # adds
    np.testing.assert_allclose(grad_w, want, **tol(dtype))


def test_embedding_rejects_bad_ids():
    w, out = np.zeros((4, 2), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        k.embedding_forward(np.array([0, 4, 1]), w, out)
    with pytest.raises(ValueError, match="out of range"):
        k.embedding_backward(np.array([0, -1, 1]), out, w)
    with pytest.raises(ValueError, match="integers"):
        k.embedding_forward(np.array([0.0, 1.0, 2.0]), w, out)
    with pytest.raises(ValueError, match="shape"):
        k.embedding_forward(np.array([0, 1]), w, out)


def _ln_ref(x, w, b, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mean) * rstd * w + b, mean[..., 0], rstd[..., 0]


def _ln_backward_ref(gy, x, w, eps):
    x, gy = x.astype(np.float64), gy.astype(np.float64)
    c = x.shape[-1]
    xhat = _ln_ref(x, np.ones(c), np.zeros(c), eps)[0]
    rstd = _ln_ref(x, w, 0, eps)[2][..., None]
    dxhat = gy * w
    gx = rstd * (dxhat - dxhat.mean(-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return gx, (gy * xhat).reshape(-1, c).sum(0), gy.reshape(-1, c).sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 7), (1, 1, 3)])
def test_layernorm_forward_backward(dtype, shape):
    rng = np.random.default_rng(1)
    c, n, eps = shape[-1], int(np.prod(shape[:-1])), 1e-5
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    y, mean, rstd = np.empty(shape, dtype), np.empty(n, dtype), np.empty(n, dtype)
    k.layernorm_forward(x, w, b, y, mean, rstd, eps)
    y_ref, mean_ref, rstd_ref = _ln_ref(x, w, b, eps)
    np.testing.assert_allclose(y, y_ref, **tol(dtype))
    np.testing.assert_allclose(mean, mean_ref.reshape(-1), **tol(dtype))
    np.testing.assert_allclose(rstd, rstd_ref.reshape(-1), **tol(dtype))
    gy = rng.standard_normal(shape).astype(dtype)
    gx, gw, gb = np.empty(shape, dtype), np.full(c, np.nan, dtype), np.full(c, np.nan, dtype)
    k.layernorm_backward(gy, x, mean, rstd, w, gx, gw, gb, False)   # overwrites
    gx_ref, gw_ref, gb_ref = _ln_backward_ref(gy, x, w, eps)
    t = dict(rtol=1e-4, atol=2e-5) if dtype == np.float32 else tol(dtype)
    np.testing.assert_allclose(gx, gx_ref, **t)
    np.testing.assert_allclose(gw, gw_ref, **t)
    np.testing.assert_allclose(gb, gb_ref, **t)
    k.layernorm_backward(gy, x, mean, rstd, w, gx, gw, gb, True)    # adds
    np.testing.assert_allclose(gw, 2 * gw_ref, **t)
    np.testing.assert_allclose(gb, 2 * gb_ref, **t)


def _gelu_ref(x):
    c = np.sqrt(2 / np.pi)
    th = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1 + th), 0.5 * (1 + th) + 0.5 * x * (1 - th ** 2) * c * (1 + 3 * 0.044715
                                                                               * x ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_backward(dtype):
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(997) * 3, [0.0, -1e-30, 1e-7, 30.0, -30.0, 5e3,
                                                        -5e3]]).astype(dtype).reshape(4, -1)
    y, g, gx = np.empty_like(x), rng.standard_normal(x.shape).astype(dtype), np.empty_like(x)
    k.gelu(x, y)
    k.gelu_backward(x, g, gx)
    y_ref, d_ref = _gelu_ref(x.astype(np.float64))
    # float32: within a few units in the last place of x (a rational tanh)
    bound = (1e-6 if dtype == np.float32 else 1e-13) * np.maximum(1.0, np.abs(x))
    assert np.all(np.abs(y - y_ref) <= bound)
    assert np.all(np.abs(gx - g * d_ref) <= bound * np.abs(g))
    assert np.all(y[np.abs(x) > 20] == np.where(x > 0, x, 0)[np.abs(x) > 20])   # saturated


@pytest.mark.parametrize("s", [3, 1])
def test_to_heads_from_heads(s):
    rng = np.random.default_rng(3)
    b, t, h, d = 2, 5, 3, 4
    x = rng.standard_normal((b, t, s, h, d)).astype(np.float32)
    heads = np.empty((s, b, h, t, d), np.float32)
    k.to_heads(x, heads)
    np.testing.assert_array_equal(heads, x.transpose(2, 0, 3, 1, 4))
    back = np.empty_like(x)
    k.from_heads(heads, back)
    np.testing.assert_array_equal(back, x)
    with pytest.raises(ValueError, match=rf"to_heads: out \({s}, {b}, {t}, {h}, {d}\) != "
                                         rf"\({s}, {b}, {h}, {t}, {d}\)"):
        k.to_heads(x, np.empty((s, b, t, h, d), np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_batched_gemm(dtype, trans_a, trans_b):
    rng = np.random.default_rng(4)
    g, m, n, kk = 3, 5, 7, 4
    a = rng.standard_normal((g, kk, m) if trans_a else (g, m, kk)).astype(dtype)
    b = rng.standard_normal((g, n, kk) if trans_b else (g, kk, n)).astype(dtype)
    op_a = a.transpose(0, 2, 1) if trans_a else a
    op_b = b.transpose(0, 2, 1) if trans_b else b
    want = np.einsum("gmk,gkn->gmn", op_a.astype(np.float64), op_b.astype(np.float64))
    out = np.full((g, m, n), np.nan, dtype)
    k.batched_gemm(a, b, out, trans_a=trans_a, trans_b=trans_b)
    np.testing.assert_allclose(out, want, **tol(dtype))
    k.batched_gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=True)
    np.testing.assert_allclose(out, 2 * want, **tol(dtype))
    with pytest.raises(ValueError, match="do not agree"):
        k.batched_gemm(a, b, np.empty((g, m, n + 1), dtype), trans_a=trans_a, trans_b=trans_b)


def _causal_softmax_ref(s, scale):
    t = s.shape[-1]
    z = np.where(np.tril(np.ones((t, t), bool)), s.astype(np.float64) * scale, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,t", [(3, 7), (2, 1), (1, 16)])
@pytest.mark.parametrize("alias", [False, True])
def test_causal_softmax_and_backward(dtype, g, t, alias):
    rng = np.random.default_rng(5)
    scale = 0.37
    s = (rng.standard_normal((g, t, t)) * 5).astype(dtype)
    s[:, :, -1] = 1e4                      # above the diagonal: must not matter
    want = _causal_softmax_ref(s, scale)
    probs = s.copy() if alias else np.full_like(s, np.nan)
    k.causal_softmax(probs if alias else s, probs, scale)
    np.testing.assert_allclose(probs, want, **tol(dtype))
    assert np.all(probs[:, np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] == 0)
    gp = rng.standard_normal((g, t, t)).astype(dtype)
    p64 = probs.astype(np.float64)
    dot = (gp * p64).sum(-1, keepdims=True)
    want_g = np.tril(scale * p64 * (gp - dot))
    gs = gp.copy() if alias else np.full_like(gp, np.nan)
    k.causal_softmax_backward(probs, gs if alias else gp, gs, scale)
    np.testing.assert_allclose(gs, want_g, **tol(dtype))


def test_causal_softmax_rejects_non_square():
    with pytest.raises(ValueError, match="G, T, T"):
        k.causal_softmax(np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), 1.0)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_results_do_not_depend_on_the_number_of_threads():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    gy = rng.standard_normal((64, 32)).astype(np.float32)
    w, b = rng.standard_normal(32).astype(np.float32), np.zeros(32, np.float32)
    ids = rng.integers(0, 5, 64)
    s = rng.standard_normal((8, 16, 16)).astype(np.float32)

    def run():
        y, mean, rstd = np.empty_like(x), np.empty(64, np.float32), np.empty(64, np.float32)
        k.layernorm_forward(x, w, b, y, mean, rstd, 1e-5)
        gx, gw, gb = np.empty_like(x), np.empty(32, np.float32), np.empty(32, np.float32)
        k.layernorm_backward(gy, x, mean, rstd, w, gx, gw, gb, False)
        ge = np.zeros((5, 32), np.float32)
        k.embedding_backward(ids, gy, ge)
        p = np.empty_like(s)
        k.causal_softmax(s, p, 0.5)
        return [y, gx, gw, gb, ge, p]

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(2)
        two = run()
    finally:
        numba.set_num_threads(before)
    for a, b_ in zip(one, two):
        np.testing.assert_array_equal(a, b_)
