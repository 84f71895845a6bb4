"""The CPU's own convolution (kernels/cpu/conv.py) against a NumPy reference and against Conv2D's
contract path (im2col + GEMM + transposes), on small shapes covering both column layouts."""
import types

import numpy as np
import pytest

from mpitrain import kernels
from mpitrain.kernels.cpu import conv
from mpitrain.nn import Conv2D

k = kernels.get("cpu")

# (N, C, H, W, OC, K, stride, pad): stride 1 with padding takes the wide layout, stride 2, no
# padding with a big kernel, and 1x1 take the per-row layout (checked by the first test).
SHAPES = [
    (3, 2, 7, 6, 4, 3, 1, 1),
    (2, 1, 8, 8, 3, 5, 1, 2),
    (2, 3, 9, 8, 5, 3, 2, 1),
    (2, 2, 5, 7, 3, 3, 1, 0),
    (1, 2, 6, 6, 3, 1, 1, 0),
    (2, 2, 6, 5, 3, 3, 3, 2),
    (2, 2, 4, 4, 3, 5, 1, 4),
    # float32 with output channels a multiple of 16: the gathered path (kernels/cpu/conv_gemm.py),
    # the input gradient too when C is a multiple of 16 and every phase has six pixels
    (2, 16, 6, 7, 16, 3, 1, 1),         # 42 pixels an image
    (2, 16, 5, 5, 32, 5, 1, 2),         # 25 pixels: a ragged last block of six
    (3, 1, 8, 8, 16, 5, 1, 2),          # C*K*K = 25 taps: ragged; input gradient on columns
    (2, 3, 7, 7, 16, 3, 1, 1),          # C = 3: gathered forward, backward on columns
    (2, 16, 7, 7, 16, 3, 1, 0),         # pad 0: the transposed convolution pads by 2
    (2, 16, 2, 3, 16, 3, 1, 1),         # six pixels an image, exactly one block
    (2, 16, 9, 9, 16, 3, 2, 1),         # stride 2: the input gradient in four phases
    (2, 16, 8, 7, 16, 3, 2, 1),         # even and odd sizes: phases of 4x4, 4x3, ...
    (2, 16, 7, 7, 32, 1, 2, 0),         # 1x1 at stride 2: three phases no tap reaches
    (2, 16, 10, 10, 16, 3, 3, 1),       # stride 3: one tap per phase and dimension
    (2, 16, 4, 4, 16, 3, 2, 1),         # phases of four pixels: input gradient on columns
    (2, 16, 2, 2, 16, 3, 1, 1),         # four pixels an image (less than a block): columns
]


def reference(x, w, b, stride, pad, relu, grad_y):
    """Direct loops over output pixels: y, dW, db, dx in float64."""
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    xp = np.zeros((n, c, h + 2 * pad, wd + 2 * pad))
    xp[:, :, pad:pad + h, pad:pad + wd] = x
    oh, ow = grad_y.shape[2], grad_y.shape[3]
    y = np.zeros((n, oc, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            y[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w) + (0 if b is None else b)
    g = grad_y * (y > 0) if relu else grad_y
    y = np.maximum(y, 0) if relu else y
    dw, dxp = np.zeros(w.shape), np.zeros(xp.shape)
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            dw += np.einsum("no,nckl->ockl", g[:, :, i, j], patch)
            dxp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw] += np.einsum(
                "no,ockl->nckl", g[:, :, i, j], w)
    return y, dw, g.sum(axis=(0, 2, 3)), dxp[:, :, pad:pad + h, pad:pad + wd]


def test_both_layouts_are_covered():
    wide = [conv._use_wide(w, kk, s, p) for _, _, _, w, _, kk, s, p in SHAPES]
    assert any(wide) and not all(wide)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("group", [1, 2, None])
def test_forward_backward_against_reference(shape, relu, dtype, group, monkeypatch):
    n, c, h, w, oc, ks, stride, pad = shape
    oh, ow = (h + 2 * pad - ks) // stride + 1, (w + 2 * pad - ks) // stride + 1
    if group is not None:       # images per GEMM: one, two (a smaller last group), else all
        run = conv._columns(h, w, ks, ks, stride, pad)[1]
        itemsize = np.dtype(dtype).itemsize
        monkeypatch.setattr(conv, "COLS_BYTES", group * c * ks * ks * run * itemsize)
        pixels = (c * conv._wide_dims(h, w, ks, pad)[1] + oh * ow * oc) * itemsize
        monkeypatch.setattr(conv, "GATHER_BYTES", group * pixels)
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((oc, c, ks, ks)).astype(dtype)
    b = rng.standard_normal(oc).astype(dtype)
    grad_y = rng.standard_normal((n, oc, oh, ow)).astype(dtype)
    want_y, want_dw, want_db, want_dx = reference(x, wt, b, stride, pad, relu, grad_y)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-11)

    y = np.full((n, oc, oh, ow), np.nan, dtype)
    k.conv2d_forward(x, wt, b, y, stride, pad, relu)
    np.testing.assert_allclose(y, want_y, **tol)
    dw, db, dx = np.full(wt.shape, 0.5, dtype), np.full(oc, 0.25, dtype), np.full(x.shape, 9, dtype)
    k.conv2d_backward(x, wt, y, grad_y, stride, pad, relu, dw, True, db, dx)   # accumulates
    np.testing.assert_allclose(dw, want_dw + 0.5, **tol)
    np.testing.assert_allclose(db, want_db + 0.25, **tol)
    np.testing.assert_allclose(dx, want_dx, **tol)
    # overwrite, no bias, no input gradient
    y_nb = np.empty_like(y)
    k.conv2d_forward(x, wt, None, y_nb, stride, pad, relu)
    want_nb = reference(x, wt, None, stride, pad, relu, grad_y)
    np.testing.assert_allclose(y_nb, want_nb[0], **tol)
    dw[...] = np.nan
    k.conv2d_backward(x, wt, y_nb, grad_y, stride, pad, relu, dw, False, None, None)
    np.testing.assert_allclose(dw, want_nb[1], **tol)


def test_gemm_shapes_count_the_work():
    plan = conv.gemm_shapes((64, 32, 14, 14), (64, 32, 5, 5), 1, 2)
    # wide rows of 14 + 2 columns: 14 * 16 GEMM columns per image
    assert plan == [((64, 800), (800, 224), False, False, (64, 224), 64),
                    ((800, 224), (64, 224), False, True, (800, 64), 64),
                    ((64, 800), (64, 224), True, False, (800, 224), 64)]
    assert len(conv.gemm_shapes((2, 3, 9, 8), (5, 3, 3, 3), 2, 1, input_grad=False)) == 2
    # ResNet's 7x7 stage: 64 * 9 rows, 7 * 8 columns per image; four images fit in COLS_BYTES
    plan = conv.gemm_shapes((10, 64, 7, 7), (64, 64, 3, 3), 1, 1)
    assert [(a, times) for a, _, _, _, _, times in plan] == [
        ((64, 576), 2), ((576, 224), 2), ((64, 576), 2),
        ((64, 576), 1), ((576, 112), 1), ((64, 576), 1)]


def contract_only():
    """The CPU backend without its own convolution: Conv2D takes the contract path."""
    names = {n: getattr(k, n) for n in dir(k) if not n.startswith("conv2d_")}
    return types.SimpleNamespace(**names)


@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_layer_same_as_contract_path(bias):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 9, 9)).astype(np.float64)
    layers = [Conv2D(4, 6, 3, padding=1, relu=True, seed=5, dtype=np.float64, kernels=kk,
                     bias=bias) for kk in (k, contract_only())]
    outs = [layer.forward(x).copy() for layer in layers]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    grad_y = rng.standard_normal(outs[0].shape)
    grads = [layer.backward(grad_y) for layer in layers]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    for (name, p0), (_, p1) in zip(layers[0].named_parameters(), layers[1].named_parameters()):
        np.testing.assert_allclose(p0.grad, p1.grad, rtol=1e-12, atol=1e-12, err_msg=name)
    assert layers[1].backward(grad_y, need_input_grad=False) is None
    assert layers[0].backward(grad_y, need_input_grad=False) is None


@pytest.mark.parametrize("c,oc", [(3, 5), (16, 16)])     # columns + BLAS; gathered
def test_threads_have_their_own_scratch(c, oc):
    """Two threads convolving at once (the kernels release the GIL) get the serial results."""
    import threading
    rng = np.random.default_rng(7)
    cases = []
    for shape in [(4, c, 12, 12), (3, c, 12, 12)]:     # same C/H/W: same scratch keys per thread
        x = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
        y = np.empty((shape[0], oc, 12, 12), np.float32)
        k.conv2d_forward(x, w, None, y, 1, 1, True)
        dx = np.empty_like(x)
        k.conv2d_backward(x, w, y, y, 1, 1, True, np.empty_like(w), False, None, dx)
        cases.append((x, w, y.copy(), dx.copy()))
    failures = []

    def work(x, w, want_y, want_dx):
        y, dx, dw = np.empty_like(want_y), np.empty_like(want_dx), np.empty_like(w)
        for _ in range(200):
            k.conv2d_forward(x, w, None, y, 1, 1, True)
            k.conv2d_backward(x, w, y, y, 1, 1, True, dw, False, None, dx)
            if not (np.array_equal(y, want_y) and np.array_equal(dx, want_dx)):
                failures.append(x.shape)
                return

    threads = [threading.Thread(target=work, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.parametrize("stride", [1, 2])
def test_outputs_may_be_views(stride):
    """y and grad_x given as strided views (every other column of a bigger array) get the values a
    contiguous array gets, and nothing around them is written."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 16, 8, 8)).astype(np.float32)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    out = (8 + 2 - 3) // stride + 1
    y = np.empty((3, 16, out, out), np.float32)
    k.conv2d_forward(x, w, None, y, stride, 1, True)
    dx = np.empty_like(x)
    k.conv2d_backward(x, w, y, y, stride, 1, True, np.empty_like(w), False, None, dx)
    y_big, dx_big = np.full((3, 16, out, 2 * out), 7, np.float32), np.full((3, 16, 8, 16), 7,
                                                                           np.float32)
    k.conv2d_forward(x, w, None, y_big[..., ::2], stride, 1, True)
    k.conv2d_backward(x, w, y, y, stride, 1, True, np.empty_like(w), False, None,
                      dx_big[..., ::2])
    assert np.array_equal(y_big[..., ::2], y) and np.all(y_big[..., 1::2] == 7)
    assert np.array_equal(dx_big[..., ::2], dx) and np.all(dx_big[..., 1::2] == 7)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("stride", [1, 2])
def test_threads_split_the_batch(threads, stride, monkeypatch):
    """conv.THREADS > 1 splits the gathered path's groups over threads: y and dx bit for bit
    as on one thread (each image's own sums), dW and db within rounding (summed per thread, then
    in thread order), and the same bits on every call."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((5, 16, 8, 8)).astype(np.float32)
    w, b = rng.standard_normal((32, 16, 3, 3)).astype(np.float32), np.ones(32, np.float32)
    out = (8 + 2 - 3) // stride + 1
    grad_y = rng.standard_normal((5, 32, out, out)).astype(np.float32)
    monkeypatch.setattr(conv, "GATHER_BYTES", 1)          # one image a group: five groups

    def run():
        y, dw, db, dx = (np.empty((5, 32, out, out), np.float32), np.empty_like(w),
                         np.zeros(32, np.float32), np.empty_like(x))
        k.conv2d_forward(x, w, b, y, stride, 1, True)
        k.conv2d_backward(x, w, y, grad_y, stride, 1, True, dw, False, db, dx)
        return y, dw, db, dx

    one = run()
    monkeypatch.setattr(conv, "THREADS", threads)
    assert len(conv._ranges(5, 1)) == threads
    many, again = run(), run()
    assert all(np.array_equal(a, c) for a, c in zip(many, again))
    assert np.array_equal(many[0], one[0]) and np.array_equal(many[3], one[3])
    for got, want in zip(many[1:3], one[1:3]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_an_error_on_any_thread_is_raised_after_all_finish():
    finished = []

    def work(lo, hi, t):
        if t == 1:
            raise ValueError("range 1")
        finished.append(t)

    with pytest.raises(ValueError, match="range 1"):
        conv._in_parallel(work, [(0, 1), (1, 2), (2, 3)])
    assert sorted(finished) == [0, 2]


@pytest.mark.parametrize("c,oc", [(3, 5), (16, 16)])     # columns + BLAS; gathered
def test_an_empty_batch_has_zero_gradients(c, oc):
    x, w = np.zeros((0, c, 8, 8), np.float32), np.ones((oc, c, 3, 3), np.float32)
    y = np.zeros((0, oc, 8, 8), np.float32)
    k.conv2d_forward(x, w, None, y, 1, 1, True)
    for accumulate in (False, True):
        dw, db = np.full_like(w, 5), np.full(oc, 2, np.float32)
        k.conv2d_backward(x, w, y, y, 1, 1, True, dw, accumulate, db, np.zeros_like(x))
        assert np.all(dw == (5 if accumulate else 0)) and np.all(db == 2)
