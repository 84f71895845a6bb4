"""Kernel cases shared by the device backends' tests: one backend against kernels/cpu/.

Each case builds host arguments from a seeded generator; ``run_case`` gives the CPU kernel NumPy
copies and the device kernel ``to_device`` copies of the same arrays, then compares every array
argument afterwards (outputs and in-place updates alike) and the return value. Shapes are tiny
(the CUDA simulator runs one Python thread per GPU thread) but cross the simulator's block and
GEMM-tile edges (32 threads x 2 blocks, 8 x 8 GEMM tiles with K-stages of 4), so
grid-stride loops, partial tiles and several K-stages run; the split-K GEMM cases have few
tiles and a long K, so the Numba GEMM splits K (in the simulator and, for the longest, on a GPU).
The float16 cases are the kernels the fp16 gradient compression runs on float16 buffers.
Used by tests/cudasim (Numba CUDA under NUMBA_ENABLE_CUDASIM=1) and tests/gpu (CuPy).
"""
import numpy as np
import pytest

F32 = dict(rtol=2e-5, atol=1e-6)
F64 = dict(rtol=1e-12, atol=1e-12)
EXACT = dict(rtol=0, atol=0)


def _r(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _conv_out(h, k, s, p):
    return (h + 2 * p - k) // s + 1


def _gemm(rng, m, k, n, ta, tb, acc, dtype=np.float32):
    """gemm's arguments for out (m, n) (=|+=) op(a) (m, k) @ op(b) (k, n)."""
    a = _r(rng, k, m, dtype=dtype) if ta else _r(rng, m, k, dtype=dtype)
    b = _r(rng, n, k, dtype=dtype) if tb else _r(rng, k, n, dtype=dtype)
    return [a, b, _r(rng, m, n, dtype=dtype), ta, tb, acc]


def _cases():
    """(id, kernel name, builder(rng) -> args, tolerance)."""
    c = []
    c.append(("fill", "fill", lambda g: [_r(g, 5, 7), 3.5], EXACT))
    c.append(("fill-f16", "fill", lambda g: [_r(g, 5, 7, dtype=np.float16), -2.75], EXACT))
    c.append(("copy", "copy", lambda g: [_r(g, 37), _r(g, 37)], EXACT))
    c.append(("copy-2d", "copy", lambda g: [_r(g, 4, 9), _r(g, 4, 9)], EXACT))
    c.append(("copy-f16", "copy", lambda g: [_r(g, 37, dtype=np.float16),
                                             _r(g, 37, dtype=np.float16)], EXACT))
    c.append(("scale", "scale", lambda g: [_r(g, 70), 0.25], F32))
    c.append(("scale-int32", "scale", lambda g: [(_r(g, 40) * 50).astype(np.int32), 0.3],
              EXACT))                                   # float product, truncated toward zero
    c.append(("add", "add", lambda g: [_r(g, 70), _r(g, 70)], F32))
    c.append(("add-f64", "add", lambda g: [_r(g, 9, dtype=np.float64),
                                           _r(g, 9, dtype=np.float64)], F64))
    # float16 products and sums rounded once from float32 (exact there): the same bits everywhere
    c.append(("scale-f16", "scale", lambda g: [_r(g, 70, dtype=np.float16), 0.3], EXACT))
    c.append(("add-f16", "add", lambda g: [_r(g, 70, dtype=np.float16),
                                           _r(g, 70, dtype=np.float16)], EXACT))
    c.append(("cast-f16", "cast", lambda g: [np.zeros(37, np.float16), _r(g, 37)], EXACT))
    c.append(("cast-f32", "cast", lambda g: [np.zeros(37, np.float32),
                                             _r(g, 37).astype(np.float16)], EXACT))
    c.append(("total", "total", lambda g: [_r(g, 3, 50)], dict(rtol=1e-9, atol=1e-9)))
    c.append(("total-empty", "total", lambda g: [np.zeros(0, np.float32)], EXACT))
    c.append(("total-f16", "total", lambda g: [_r(g, 3, 50, dtype=np.float16)],
              dict(rtol=1e-9, atol=1e-9)))
    for ta in (False, True):
        for tb in (False, True):
            for acc in (False, True):
                tag = f"ta{int(ta)}-tb{int(tb)}-acc{int(acc)}"
                # > one 8x8 tile in every dimension
                c.append((f"gemm-{tag}", "gemm",
                          lambda g, ta=ta, tb=tb, acc=acc: _gemm(g, 13, 11, 9, ta, tb, acc),
                          dict(rtol=1e-4, atol=1e-5)))
                # split K: two output tiles, K = 50 (13 K-stages: 5 splits in the simulator)
                c.append((f"gemm-splitk-{tag}", "gemm",
                          lambda g, ta=ta, tb=tb, acc=acc: _gemm(g, 9, 50, 7, ta, tb, acc),
                          dict(rtol=1e-4, atol=1e-5)))
    c.append(("gemm-f64", "gemm", lambda g: [_r(g, 3, 17, dtype=np.float64),
                                             _r(g, 17, 5, dtype=np.float64),
                                             np.zeros((3, 5)), False, False, False], F64))
    c.append(("gemm-splitk-f64", "gemm",
              lambda g: _gemm(g, 9, 50, 7, True, False, True, np.float64), F64))
    # K = 600: split on a GPU too (38 K-stages of 16: 2 splits)
    c.append(("gemm-splitk-long", "gemm", lambda g: _gemm(g, 9, 600, 7, True, False, True),
              dict(rtol=1e-4, atol=1e-4)))
    c.append(("bias_act", "bias_act", lambda g: [_r(g, 5, 7), _r(g, 7), False], F32))
    c.append(("bias_act-relu", "bias_act", lambda g: [_r(g, 9, 8), _r(g, 8), True], F32))
    c.append(("relu", "relu", lambda g: [_r(g, 6, 11), _r(g, 6, 11)], EXACT))

    def relu_bw(g):
        y = np.maximum(_r(g, 6, 11), 0)                  # a ReLU output: zeros included
        return [y, _r(g, 6, 11), _r(g, 6, 11)]
    c.append(("relu_backward", "relu_backward", relu_bw, EXACT))
    c.append(("bias_grad", "bias_grad", lambda g: [_r(g, 6, 5), _r(g, 5)], F32))
    c.append(("bias_grad-tall", "bias_grad", lambda g: [_r(g, 37, 3), _r(g, 3)], F32))

    def xent(g, shift=0.0):
        logits = _r(g, 5, 4) * 3 + shift                 # (B, K)
        labels = g.integers(0, 4, size=5).astype(np.int64)
        return [logits, labels, _r(g, 5, 4), _r(g, 5)]
    c.append(("softmax_xent", "softmax_xent", xent, dict(rtol=1e-5, atol=1e-6)))
    c.append(("softmax_xent-large", "softmax_xent", lambda g: xent(g, 1000.0),
              dict(rtol=1e-4, atol=1e-5)))

    def correct(g):
        logits = np.round(_r(g, 70, 4))                  # rounding makes ties: first max wins
        return [logits, g.integers(0, 4, size=70).astype(np.int64)]
    c.append(("count_correct", "count_correct", correct, EXACT))
    for k, s, p in ((3, 1, 1), (2, 2, 0), (3, 2, 1)):
        def i2c(g, k=k, s=s, p=p):
            n, ch, h, w = 2, 3, 5, 6
            oh, ow = _conv_out(h, k, s, p), _conv_out(w, k, s, p)
            return [_r(g, n, ch, h, w), _r(g, n * oh * ow, ch * k * k), k, k, s, p]

        def c2i(g, k=k, s=s, p=p):
            n, ch, h, w = 2, 3, 5, 6
            oh, ow = _conv_out(h, k, s, p), _conv_out(w, k, s, p)
            return [_r(g, n * oh * ow, ch * k * k), _r(g, n, ch, h, w), k, k, s, p]
        c.append((f"im2col-k{k}s{s}p{p}", "im2col", i2c, EXACT))
        c.append((f"col2im-k{k}s{s}p{p}", "col2im", c2i, F32))

    def c2i_nan(g):                         # dx is an output: its old NaNs must not leak in
        cols, dx, *rest = c2i(g)
        return [cols, np.full_like(dx, np.nan), *rest]
    c.append(("col2im-nan-dx", "col2im", c2i_nan, F32))
    c.append(("nhwc_to_nchw", "nhwc_to_nchw", lambda g: [_r(g, 2 * 2 * 3, 3),
                                                         _r(g, 2, 3, 2, 3)], EXACT))
    c.append(("nchw_to_nhwc", "nchw_to_nhwc", lambda g: [_r(g, 2, 3, 2, 3),
                                                         _r(g, 2 * 2 * 3, 3)], EXACT))
    for k, s in ((2, 2), (3, 1), (3, 2)):
        def pool(g, k=k, s=s):
            n, ch, h, w = 2, 2, 5, 7
            oh, ow = (h - k) // s + 1, (w - k) // s + 1
            x = np.round(_r(g, n, ch, h, w))             # ties: the first maximum wins
            return [x, _r(g, n, ch, oh, ow), np.zeros((n, ch, oh, ow), np.int32), k, s]

        def pool_bw(g, k=k, s=s):
            x, y, arg, _, _ = pool(g)
            from mpitrain.kernels import cpu
            cpu.maxpool_forward(x, y, arg, k, s)
            return [_r(g, *y.shape), arg, _r(g, *x.shape)]
        c.append((f"maxpool_forward-k{k}s{s}", "maxpool_forward", pool, EXACT))
        c.append((f"maxpool_backward-k{k}s{s}", "maxpool_backward", pool_bw, F32))
    for p, seed in ((0.3, 1234567), (0.5, 2**40 + 17), (0.0, 5)):
        c.append((f"dropout_forward-p{p}", "dropout_forward",
                  lambda g, p=p, seed=seed: [_r(g, 100), _r(g, 100), _r(g, 100), p, seed],
                  EXACT))

    def drop_bw(g):
        mask = (g.random(50) > 0.4).astype(np.float32) / np.float32(0.6)
        return [_r(g, 50), mask, _r(g, 50)]
    c.append(("dropout_backward", "dropout_backward", drop_bw, EXACT))
    for mom, nest, wd in ((0.9, False, 0.0), (0.9, True, 0.01), (0.0, False, 0.1)):
        c.append((f"sgd_update-m{mom}-n{int(nest)}-wd{wd}", "sgd_update",
                  lambda g, mom=mom, nest=nest, wd=wd: [_r(g, 4, 17), _r(g, 4, 17),
                                                        _r(g, 4, 17), 0.1, mom, nest, wd],
                  F32))
    for step, wd in ((1, 0.0), (3, 0.01)):
        c.append((f"adam_update-step{step}", "adam_update",
                  lambda g, step=step, wd=wd: [_r(g, 70), _r(g, 70), _r(g, 70) * 0.1,
                                               np.abs(_r(g, 70)) * 0.01, 1e-3, 0.9, 0.999,
                                               1e-8, wd, step], dict(rtol=1e-5, atol=1e-6)))
    for step, lr, wd in ((1, 1e-3, 0.0), (4, 3e-3, 0.1)):
        c.append((f"adamw_update-step{step}-wd{wd}", "adamw_update",
                  lambda g, step=step, lr=lr, wd=wd: [_r(g, 70), _r(g, 70), _r(g, 70) * 0.1,
                                                      np.abs(_r(g, 70)) * 0.01, lr, 0.9, 0.999,
                                                      1e-8, wd, step],
                  dict(rtol=1e-5, atol=1e-6)))
    for op in ("sum", "min", "max", "prod"):
        for dt in (np.float32, np.float64, np.int32, np.int64):
            def red(g, op=op, dt=dt):
                return [(_r(g, 67) * 10).astype(dt), (_r(g, 67) * 10).astype(dt), op]
            c.append((f"reduce_into-{op}-{np.dtype(dt).name}", "reduce_into", red, F32))
    c.append(("reduce_into-sum-float16", "reduce_into",
              lambda g: [_r(g, 33).astype(np.float16), _r(g, 33).astype(np.float16), "sum"],
              EXACT))
    c += _norm_cases()
    c += _activation_loss_cases()
    return c


def _activation_loss_cases():
    """Activations, softmax, average pooling, the extra losses and RMSprop. Elementwise shapes
    have 78 values (beyond 2 simulated blocks of 32); row kernels 70 rows in one case."""
    c = []
    for dt in (np.float32, np.float64):
        tol = F32 if dt == np.float32 else F64
        name = np.dtype(dt).name

        def wide(g, dt=dt):
            x = _r(g, 6, 13, dtype=dt) * 3                      # (6, 13)
            x[0, :4] = np.array([60, -60, 0, -0.0], dt)         # saturated and zero inputs
            return x
        c.append((f"tanh-{name}", "tanh", lambda g, w=wide: [w(g), np.zeros_like(w(g))], tol))
        c.append((f"tanh_backward-{name}", "tanh_backward",
                  lambda g, w=wide: [np.tanh(w(g)), w(g), w(g)], tol))
        c.append((f"sigmoid-{name}", "sigmoid",
                  lambda g, w=wide: [w(g) * 10, np.zeros_like(w(g))], tol))
        c.append((f"sigmoid_backward-{name}", "sigmoid_backward",
                  lambda g, w=wide: [1 / (1 + np.exp(-w(g))), w(g), w(g)], tol))
        for slope in (0.01, 0.2):
            c.append((f"leaky_relu-{name}-s{slope}", "leaky_relu",
                      lambda g, w=wide, s=slope: [w(g), w(g), s], tol))
            c.append((f"leaky_relu_backward-{name}-s{slope}", "leaky_relu_backward",
                      lambda g, w=wide, s=slope: [w(g), w(g), w(g), s], tol))
        for shape, shift in (((5, 7), 0.0), ((3, 4, 9), 500.0), ((70, 3), 0.0)):
            tag = "x".join(map(str, shape))
            c.append((f"softmax-{name}-{tag}", "softmax",
                      lambda g, shape=shape, shift=shift, dt=dt: [
                          _r(g, *shape, dtype=dt) * 4 + shift, _r(g, *shape, dtype=dt)],
                      dict(rtol=1e-5, atol=1e-6) if dt == np.float32 else F64))

            def softmax_bw(g, shape=shape, dt=dt):
                z = _r(g, *shape, dtype=dt)
                y = (np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)).astype(dt)
                return [y, _r(g, *shape, dtype=dt), _r(g, *shape, dtype=dt)]
            c.append((f"softmax_backward-{name}-{tag}", "softmax_backward", softmax_bw,
                      dict(rtol=1e-5, atol=1e-6) if dt == np.float32 else F64))
        for smoothing, rows in ((0.1, 5), (0.3, 70), (0.0, 5)):
            c.append((f"label_smoothing-{name}-e{smoothing}-b{rows}", "label_smoothing",
                      lambda g, e=smoothing, b=rows, dt=dt: [
                          _r(g, b, 4, dtype=dt) * 3, g.integers(0, 4, size=b).astype(np.int64),
                          _r(g, b, 4, dtype=dt), np.abs(_r(g, b, dtype=dt)), e],
                      dict(rtol=1e-5, atol=1e-6) if dt == np.float32 else F64))
        c.append((f"mse-{name}", "mse", lambda g, w=wide: [w(g), w(g), w(g), w(g)], tol))
        c.append((f"bce_logits-{name}", "bce_logits",
                  lambda g, w=wide, dt=dt: [w(g) * 10, g.random((6, 13)).astype(dt), w(g), w(g)],
                  dict(rtol=1e-5, atol=1e-6) if dt == np.float32 else F64))
        for k, s in ((2, 2), (3, 2), (2, 1), (3, 3)):
            oh, ow = _conv_out(7, k, s, 0), _conv_out(6, k, s, 0)
            c.append((f"avgpool_forward-{name}-k{k}s{s}", "avgpool_forward",
                      lambda g, k=k, s=s, oh=oh, ow=ow, dt=dt: [
                          _r(g, 2, 3, 7, 6, dtype=dt), _r(g, 2, 3, oh, ow, dtype=dt), k, s], tol))
            c.append((f"avgpool_backward-{name}-k{k}s{s}", "avgpool_backward",
                      lambda g, k=k, s=s, oh=oh, ow=ow, dt=dt: [
                          _r(g, 2, 3, oh, ow, dtype=dt), _r(g, 2, 3, 7, 6, dtype=dt), k, s], tol))
    for centered, mom, wd in ((False, 0.0, 0.0), (True, 0.9, 0.01), (False, 0.9, 0.0),
                              (True, 0.0, 0.0)):
        def rmsprop(g, centered=centered, mom=mom, wd=wd):
            # unused buffers are passed too: they must come back untouched on every backend
            return [_r(g, 4, 17), _r(g, 4, 17), np.abs(_r(g, 4, 17)) + 1, _r(g, 4, 17) * 0.1,
                    _r(g, 4, 17), 0.01, 0.99, 1e-8, wd, mom, centered]
        c.append((f"rmsprop_update-c{int(centered)}-m{mom}-wd{wd}", "rmsprop_update", rmsprop,
                  dict(rtol=1e-5, atol=1e-6)))
    return c


def _norm_cases():
    """BatchNorm, global average pooling and the option-A shortcut. The (N, C, H, W)
    shape has 75 values per channel: two chunks of the simulated per-channel sums (2 x 32)."""
    c = []
    for shape, dt in ((s, dt) for s in ((3, 4, 5, 5), (7, 3)) for dt in (np.float32, np.float64)):
        tag = f"{len(shape)}d-{np.dtype(dt).name}"
        tol = F32 if dt == np.float32 else F64
        ch = shape[1]

        def batch(g, shape=shape, dt=dt):
            """x, and its per-channel mean and 1/std (what bn_moments makes of its stats)."""
            x = _r(g, *shape, dtype=dt) * 2 + 1                 # (N, C[, H, W])
            axes = (0,) + tuple(range(2, x.ndim))
            return x, x.mean(axis=axes).astype(dt), (1 / x.std(axis=axes)).astype(dt)

        def forward(g, batch=batch, ch=ch, dt=dt):
            x, mean, invstd = batch(g)
            return [x, mean, invstd, _r(g, ch, dtype=dt), _r(g, ch, dtype=dt), np.zeros_like(x)]

        def backward_stats(g, batch=batch, ch=ch):
            x, mean, invstd = batch(g)
            return [_r(g, *x.shape, dtype=x.dtype), x, mean, invstd, np.zeros((2, ch))]

        def backward_input(g, batch=batch, ch=ch, dt=dt):
            x, mean, invstd = batch(g)
            stats = _r(g, 2, ch, dtype=np.float64) * 10         # (2, C) sums of g, g * xhat
            return [_r(g, *x.shape, dtype=dt), x, mean, invstd, _r(g, ch, dtype=dt), stats,
                    x.size // ch, np.zeros_like(x)]
        c.append((f"bn_stats-{tag}", "bn_stats",
                  lambda g, shape=shape, dt=dt: [_r(g, *shape, dtype=dt) + 3,
                                                 np.zeros((2, shape[1]))], F64))
        c.append((f"bn_forward-{tag}", "bn_forward", forward, tol))
        c.append((f"bn_backward_stats-{tag}", "bn_backward_stats", backward_stats,
                  dict(rtol=1e-9, atol=1e-9)))
        c.append((f"bn_backward_input-{tag}", "bn_backward_input", backward_input,
                  dict(rtol=1e-4, atol=1e-5) if dt == np.float32 else F64))
    for dt in (np.float32, np.float64):
        tol = F32 if dt == np.float32 else F64
        name = np.dtype(dt).name
        for count in (75, 1):                                   # 1: running_var takes var
            c.append((f"bn_moments-{name}-count{count}", "bn_moments",
                      lambda g, dt=dt, count=count: [
                          np.abs(_r(g, 2, 5, dtype=np.float64)) * count, count, 1e-5, 0.1,
                          _r(g, 5, dtype=dt), _r(g, 5, dtype=dt), _r(g, 5, dtype=dt),
                          np.abs(_r(g, 5, dtype=dt))], tol))
        c.append((f"bn_eval_moments-{name}", "bn_eval_moments",
                  lambda g, dt=dt: [_r(g, 5, dtype=dt), np.abs(_r(g, 5, dtype=dt)), 1e-5,
                                    _r(g, 5, dtype=dt), _r(g, 5, dtype=dt)], tol))
        for acc in (False, True):
            c.append((f"bn_param_grads-{name}-acc{int(acc)}", "bn_param_grads",
                      lambda g, dt=dt, acc=acc: [_r(g, 2, 5, dtype=np.float64),
                                                 _r(g, 5, dtype=dt), _r(g, 5, dtype=dt), acc],
                      tol))
        c.append((f"global_avgpool_forward-{name}", "global_avgpool_forward",
                  lambda g, dt=dt: [_r(g, 3, 4, 5, 6, dtype=dt), _r(g, 3, 4, dtype=dt)], tol))
        c.append((f"global_avgpool_backward-{name}", "global_avgpool_backward",
                  lambda g, dt=dt: [_r(g, 3, 4, dtype=dt), _r(g, 3, 4, 5, 6, dtype=dt)], tol))
    for stride, offset, c2 in ((1, 0, 4), (2, 2, 8), (2, 0, 5), (3, 1, 6)):
        def shortcut(g, stride=stride, offset=offset, c2=c2):
            oh, ow = -(-5 // stride), -(-6 // stride)            # odd H: ceil keeps the edge
            return [_r(g, 2, 4, 5, 6), _r(g, 2, c2, oh, ow), stride, offset]

        def shortcut_bw(g, shortcut=shortcut):
            x, y, stride, offset = shortcut(g)
            return [y, x, stride, offset]
        tag = f"s{stride}-o{offset}-c{c2}"
        c.append((f"shortcut_forward-{tag}", "shortcut_forward", shortcut, EXACT))
        c.append((f"shortcut_backward-{tag}", "shortcut_backward", shortcut_bw, EXACT))
    return c


CASES = [pytest.param(name, build, tol, id=cid) for cid, name, build, tol in _cases()]
KERNEL_NAMES = sorted({name for _, name, _, _ in _cases()})


def run_case(cpu, dev, name, build, tol, seed=0):
    """Run kernel ``name`` on both backends from the same host arguments and compare all arrays."""
    if not hasattr(cpu, name):
        pytest.skip(f"kernels/cpu/ has no {name} yet")
    args = build(np.random.default_rng(seed))
    host = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    on_dev = [dev.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    want = getattr(cpu, name)(*host)
    got = getattr(dev, name)(*on_dev)
    dev.synchronize()
    if want is None:
        assert got is None, f"{name} should return None, got {got!r}"
    else:
        assert type(got) is type(want), f"{name} returned {type(got)}, CPU {type(want)}"
        np.testing.assert_allclose(got, want, **tol, err_msg=f"{name} return value")
    for i, (h, d) in enumerate(zip(host, on_dev)):
        if isinstance(h, np.ndarray):
            out = dev.to_host(d)
            assert out.dtype == h.dtype and out.shape == h.shape, f"{name} arg {i}"
            np.testing.assert_allclose(out.astype(np.float64), h.astype(np.float64), **tol,
                                       err_msg=f"{name}: argument {i} differs from the CPU")
