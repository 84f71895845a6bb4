"""Every CPU kernel against a plain NumPy (or pure-Python) reference, on tiny shapes."""
import numpy as np
import pytest

from mpitrain import kernels

k = kernels.get("cpu")
DTYPES = [np.float32, np.float64]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


@pytest.fixture
def rng():
    return np.random.default_rng(42)


def test_registry_and_errors():
    assert kernels.get("cpu") is k and kernels.get("cpu", "numba") is k and k.name == "cpu"
    with pytest.raises(ValueError, match="tpu"):
        kernels.get("tpu")
    with pytest.raises(ValueError, match="opencl"):
        kernels.get("cpu", "opencl")


def test_memory_kernels(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    d = k.to_device(a)
    assert d is not a and d.flags.c_contiguous
    np.testing.assert_array_equal(k.to_host(d), a)
    k.fill(d, 2.5)
    assert (d == 2.5).all()
    k.copy(d, a)
    np.testing.assert_array_equal(d, a)
    k.scale(d, 3.0)
    np.testing.assert_allclose(d, a * 3, rtol=1e-6)
    k.add(d, a)
    np.testing.assert_allclose(d, a * 4, rtol=1e-6)
    assert k.total(a) == pytest.approx(float(a.astype(np.float64).sum()), rel=1e-6)
    h = k.empty((3, 4), np.float16)
    k.cast(h, a)
    np.testing.assert_array_equal(h, a.astype(np.float16))
    k.scale(h, 2.0)                                     # float16: the Numba half path
    k.add(h, h)
    np.testing.assert_array_equal(h, a.astype(np.float16) * 4)
    k.fill(h, 1.0)
    assert k.total(h) == 12.0
    assert k.zeros((2,), np.float64).dtype == np.float64 and not k.zeros((2,)).any()
    with pytest.raises(ValueError, match="size mismatch"):
        k.copy(d, a[:2])
    with pytest.raises(ValueError, match="C-contiguous"):
        k.fill(a.T, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm(rng, dtype, ta, tb):
    a = rng.standard_normal((5, 3) if ta else (3, 5)).astype(dtype)
    b = rng.standard_normal((4, 5) if tb else (5, 4)).astype(dtype)
    ref = (a.T if ta else a) @ (b.T if tb else b)
    out = np.full((3, 4), np.nan, dtype)
    k.gemm(a, b, out, trans_a=ta, trans_b=tb)
    np.testing.assert_allclose(out, ref, **tol(dtype))
    k.gemm(a, b, out, trans_a=ta, trans_b=tb, accumulate=True)
    np.testing.assert_allclose(out, 2 * ref, **tol(dtype))


def test_gemm_shape_error(rng):
    with pytest.raises(ValueError, match="do not agree"):
        k.gemm(np.ones((2, 3)), np.ones((4, 2)), np.empty((2, 2)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [False, True])
def test_bias_act_relu_and_bias_grad(rng, dtype, relu):
    y = rng.standard_normal((4, 6)).astype(dtype)
    b = rng.standard_normal(6).astype(dtype)
    ref = y + b
    if relu:
        ref = np.maximum(ref, 0)
    k.bias_act(y, b, relu)
    np.testing.assert_allclose(y, ref, **tol(dtype))

    x = rng.standard_normal((3, 5)).astype(dtype)
    out = np.empty_like(x)
    k.relu(x, out)
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    g = rng.standard_normal(x.shape).astype(dtype)
    gin = np.empty_like(x)
    k.relu_backward(out, g, gin)
    np.testing.assert_array_equal(gin, np.where(out > 0, g, 0))

    gb = np.ones(5, dtype)
    k.bias_grad(g, gb)                                  # accumulates
    np.testing.assert_allclose(gb, 1 + g.sum(axis=0), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_xent(rng, dtype):
    logits = (rng.standard_normal((5, 4)) * 4).astype(dtype)
    logits[0] += 1000                                   # would overflow a naive exp
    labels = np.array([1, 0, 3, 3, 2], dtype=np.int64)
    grad = np.empty_like(logits)
    losses = np.empty(5, dtype)
    k.softmax_xent(logits, labels, grad, losses)
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(losses, -logp[np.arange(5), labels], **tol(dtype))
    onehot = np.eye(4)[labels]
    np.testing.assert_allclose(grad, (np.exp(logp) - onehot) / 5, **tol(dtype))
    assert k.count_correct(logits, labels) == int((logits.argmax(axis=1) == labels).sum())
    with pytest.raises(ValueError, match="label"):
        k.softmax_xent(logits, np.array([0, 1, 2, 3, 4]), grad, losses)


def im2col_ref(x, kh, kw, stride, pad):
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    cols = np.empty((n, oh, ow, c, kh, kw), x.dtype)
    for i in range(oh):
        for j in range(ow):
            cols[:, i, j] = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
    return cols.reshape(n * oh * ow, c * kh * kw)


@pytest.mark.parametrize("kh,kw,stride,pad", [(3, 3, 1, 0), (3, 2, 2, 1), (5, 5, 1, 2)])
def test_im2col_col2im(rng, kh, kw, stride, pad):
    x = rng.standard_normal((2, 3, 7, 6))
    ref = im2col_ref(x, kh, kw, stride, pad)
    cols = np.full(ref.shape, np.nan)
    k.im2col(x, cols, kh, kw, stride, pad)
    np.testing.assert_array_equal(cols, ref)
    # col2im is the adjoint of im2col: <im2col(x), c> == <x, col2im(c)>.
    c = rng.standard_normal(ref.shape)
    dx = np.full(x.shape, np.nan)
    k.col2im(c, dx, kh, kw, stride, pad)
    assert np.sum(ref * c) == pytest.approx(np.sum(x * dx), rel=1e-12)
    # ... and overwrites dx: the result does not depend on its previous content.
    dx2 = np.full(x.shape, 7.0)
    k.col2im(c, dx2, kh, kw, stride, pad)
    np.testing.assert_array_equal(dx, dx2)


def test_layout_transposes(rng):
    src = rng.standard_normal((2 * 3 * 4, 5)).astype(np.float32)       # (N*OH*OW, C)
    dst = np.empty((2, 5, 3, 4), np.float32)
    k.nhwc_to_nchw(src, dst)
    np.testing.assert_array_equal(dst, src.reshape(2, 3, 4, 5).transpose(0, 3, 1, 2))
    back = np.empty_like(src)
    k.nchw_to_nhwc(dst, back)
    np.testing.assert_array_equal(back, src)


@pytest.mark.parametrize("ks,stride", [(2, 2), (3, 2), (2, 1)])
def test_maxpool(rng, ks, stride):
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    n, c, h, w = x.shape
    oh, ow = (h - ks) // stride + 1, (w - ks) // stride + 1
    y = np.empty((n, c, oh, ow), np.float32)
    am = np.empty(y.shape, np.int32)
    k.maxpool_forward(x, y, am, ks, stride)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx_ref = np.zeros_like(x)
    for i in range(oh):
        for j in range(ow):
            win = x[:, :, i * stride:i * stride + ks, j * stride:j * stride + ks]
            np.testing.assert_array_equal(y[:, :, i, j], win.max(axis=(2, 3)))
            flat = win.reshape(n, c, -1).argmax(axis=2)
            hh, ww = i * stride + flat // ks, j * stride + flat % ks
            np.testing.assert_array_equal(am[:, :, i, j], hh * w + ww)
            for a in range(n):
                for b in range(c):
                    gx_ref[a, b, hh[a, b], ww[a, b]] += gy[a, b, i, j]
    gx = np.full_like(x, np.nan)
    k.maxpool_backward(gy, am, gx)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-6)


def mix32(x):
    """lowbias32, the hash the kernel contract specifies (pure Python reference)."""
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


def dropout_mask_ref(size, p, seed):
    s = mix32(seed & 0xFFFFFFFF)
    thresh = int(p * 2 ** 24)
    return np.array([(mix32(mix32(i) ^ s) >> 8) >= thresh for i in range(size)])


@pytest.mark.parametrize("p,seed", [(0.5, 0), (0.25, 12345), (0.0, 7), (0.9, 2 ** 33 + 5)])
def test_dropout_matches_contract_hash(rng, p, seed):
    x = rng.standard_normal((4, 50)).astype(np.float32)
    y, mask = np.empty_like(x), np.empty_like(x)
    k.dropout_forward(x, y, mask, p, seed)
    keep = dropout_mask_ref(x.size, p, seed).reshape(x.shape)
    np.testing.assert_array_equal(mask, np.where(keep, np.float32(1 / (1 - p)), 0))
    np.testing.assert_array_equal(y, x * mask)
    g = rng.standard_normal(x.shape).astype(np.float32)
    gx = np.empty_like(x)
    k.dropout_backward(g, mask, gx)
    np.testing.assert_array_equal(gx, g * mask)


def test_dropout_rate_and_seed_dependence():
    x = np.ones(20000, np.float32)
    y, m1, m2 = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    k.dropout_forward(x, y, m1, 0.3, 1)
    k.dropout_forward(x, y, m2, 0.3, 2)
    assert abs((m1 == 0).mean() - 0.3) < 0.02
    assert (m1 != m2).mean() > 0.3                      # different seeds, different masks
    with pytest.raises(ValueError, match="1.0"):
        k.dropout_forward(x, y, m1, 1.0, 0)


@pytest.mark.parametrize("momentum,nesterov,wd", [(0.0, False, 0.0), (0.9, False, 0.0),
                                                  (0.9, True, 0.01), (0.5, False, 0.1)])
def test_sgd_update_vs_numpy(rng, momentum, nesterov, wd):
    p = rng.standard_normal(7)
    buf = np.zeros(7)
    ref_p, ref_buf = p.copy(), None
    for _ in range(3):
        g = rng.standard_normal(7)
        k.sgd_update(p, g, buf, 0.1, momentum, nesterov, wd)
        d = g + wd * ref_p                              # PyTorch's algorithm, literally
        if momentum:
            ref_buf = d.copy() if ref_buf is None else momentum * ref_buf + d
            d = d + momentum * ref_buf if nesterov else ref_buf
        ref_p -= 0.1 * d
        np.testing.assert_allclose(p, ref_p, rtol=1e-13)


def test_adam_update_vs_numpy(rng):
    p = rng.standard_normal(6).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    rp, rm, rv = p.astype(np.float64), np.zeros(6), np.zeros(6)
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.99, 1e-6, 0.05
    for t in range(1, 4):
        g = rng.standard_normal(6).astype(np.float32)
        k.adam_update(p, g, m, v, lr, b1, b2, eps, wd, t)
        d = g + wd * rp
        rm = b1 * rm + (1 - b1) * d
        rv = b2 * rv + (1 - b2) * d * d
        rp -= lr * (rm / (1 - b1 ** t)) / (np.sqrt(rv / (1 - b2 ** t)) + eps)
        np.testing.assert_allclose(p, rp, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="step"):
        k.adam_update(p, g, m, v, lr, b1, b2, eps, wd, 0)


def test_im2col_shape_dims_and_refusal():
    """The device backends' shared geometry: sizes as the CPU kernels compute them, and a cols
    buffer of the wrong shape refused with one message naming the kernel."""
    from mpitrain.kernels import checks
    assert checks.dims("im2col", (2, 3, 7, 5), (2 * 4 * 3, 3 * 9), 3, 3, 2, 1) == \
        (3, 7, 5, 4, 3)
    with pytest.raises(ValueError, match=r"col2im: cols \(23, 27\) != \(24, 27\)"):
        checks.dims("col2im", (2, 3, 7, 5), (23, 27), 3, 3, 2, 1)
