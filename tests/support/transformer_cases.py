"""Transformer kernel cases shared by the device backends' tests: one backend against kernels/cpu/.

As tests/support/kernel_cases.py: each case builds host arguments from a seeded generator;
``run_case`` gives the CPU kernel NumPy copies and the device kernel ``to_device`` copies of the
same arrays, then compares every array argument afterwards (outputs and in-place updates alike).
An array passed twice (the in-place softmax: probs is scores) stays one array on both sides.
Shapes are tiny (B=2, T=5, H=2, D=4, V=7: the CUDA simulator runs one Python thread per GPU
thread) but cross the row kernels' thread count under the simulator (8: C = 13, T = 9), the
batched GEMM's 8 x 8 tiles and K-stages of 4, and (C = 130, emulated CuPy) its 128 row threads.
The embedding gradient is compared bit for bit: the contract fixes its order of additions.
"""
import math

import numpy as np
import pytest

F32 = dict(rtol=2e-5, atol=2e-6)
F64 = dict(rtol=1e-12, atol=1e-12)
EXACT = dict(rtol=0, atol=0)
_B, _T, _H, _D, _V = 2, 5, 2, 4, 7


def _r(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _ids(rng, dtype, shape=(_B, _T), vocab=_V):
    ids = rng.integers(0, vocab, size=shape).astype(dtype)
    ids.reshape(-1)[[1, 4, 7]] = vocab - 1          # some id for sure several times
    return ids


def _tol(dtype):
    return F64 if dtype == np.float64 else F32


def _layernorm_stats(x, eps=1e-5):
    """mean, rstd (n,) float32 of x (..., C), as the forward saves them."""
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    mean = x2.mean(axis=1)
    rstd = 1.0 / np.sqrt(((x2 - mean[:, None]) ** 2).mean(axis=1) + eps)
    return mean.astype(np.float32), rstd.astype(np.float32)


def _softmax_probs(rng, g, t, dtype, scale):
    """Causal softmax probabilities (G, T, T) of random scores."""
    s = rng.standard_normal((g, t, t)) * scale
    s[:, np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    return (p / p.sum(axis=2, keepdims=True)).astype(dtype)


def _bgemm(rng, g, m, k, n, ta, tb, acc, dtype=np.float32):
    """batched_gemm's arguments for out (g, m, n) (=|+=) op(a) (g, m, k) @ op(b) (g, k, n)."""
    a = _r(rng, g, k, m, dtype=dtype) if ta else _r(rng, g, m, k, dtype=dtype)
    b = _r(rng, g, n, k, dtype=dtype) if tb else _r(rng, g, k, n, dtype=dtype)
    return [a, b, _r(rng, g, m, n, dtype=dtype), ta, tb, acc]


def _cases():
    """(id, kernel name, builder(rng) -> args, tolerance)."""
    c = []
    for dt in (np.float32, np.float64):
        tag = np.dtype(dt).name
        for it in (np.int32, np.int64):
            itag = f"{tag}-{np.dtype(it).name}"
            c.append((f"embedding_forward-{itag}", "embedding_forward",
                      lambda g, dt=dt, it=it: [_ids(g, it), _r(g, _V, 6, dtype=dt),
                                               _r(g, _B, _T, 6, dtype=dt)], EXACT))
            # grad_weight starts non-zero: the kernel adds to it, each row in increasing n
            c.append((f"embedding_backward-{itag}", "embedding_backward",
                      lambda g, dt=dt, it=it: [_ids(g, it), _r(g, _B, _T, 6, dtype=dt),
                                               _r(g, _V, 6, dtype=dt)], EXACT))
        # a long run of one id over 40 tokens and 37 channels (several column blocks)
        c.append((f"embedding_backward-long-{tag}", "embedding_backward",
                  lambda g, dt=dt: [_ids(g, np.int64, (40,), vocab=3), _r(g, 40, 37, dtype=dt),
                                    _r(g, 3, 37, dtype=dt)], EXACT))

        for ch in (8, 13):
            def ln_forward(g, ch=ch, dt=dt):
                return [_r(g, _B, _T, ch, dtype=dt) * 3 + 1, _r(g, ch, dtype=dt),
                        _r(g, ch, dtype=dt), np.zeros((_B, _T, ch), dt),
                        np.zeros(_B * _T, np.float32), np.zeros(_B * _T, np.float32), 1e-5]

            def ln_backward(g, ch=ch, dt=dt, acc=False):
                x = _r(g, _B, _T, ch, dtype=dt) * 3 + 1
                mean, rstd = _layernorm_stats(x)
                return [_r(g, _B, _T, ch, dtype=dt), x, mean, rstd, _r(g, ch, dtype=dt),
                        np.zeros_like(x), _r(g, ch, dtype=dt), _r(g, ch, dtype=dt), acc]

            c.append((f"layernorm_forward-c{ch}-{tag}", "layernorm_forward", ln_forward,
                      _tol(dt) if dt == np.float32 else dict(rtol=1e-7, atol=1e-7)))
            for acc in (False, True):
                c.append((f"layernorm_backward-c{ch}-acc{int(acc)}-{tag}", "layernorm_backward",
                          lambda g, f=ln_backward, acc=acc: f(g, acc=acc), _tol(dt)))

        def wide(g, dt=dt):
            return _r(g, 3, 40, dtype=dt) * 4                  # tails of tanh too

        # float32's derivative loses ~1e-5 in the tails: 1 - t*t with t = tanh(u) near -1,
        # times 0.5 x k0 (1 + 3 k1 x^2) ~ 100, whatever tanh's last bit
        c.append((f"gelu-{tag}", "gelu", lambda g, w=wide, dt=dt: [w(g), np.zeros((3, 40), dt)],
                  _tol(dt)))
        c.append((f"gelu_backward-{tag}", "gelu_backward",
                  lambda g, w=wide, dt=dt: [w(g), _r(g, 3, 40, dtype=dt), np.zeros((3, 40), dt)],
                  F64 if dt == np.float64 else dict(rtol=2e-5, atol=1e-4)))

        for s in (3, 1):
            c.append((f"to_heads-s{s}-{tag}", "to_heads",
                      lambda g, s=s, dt=dt: [_r(g, _B, _T, s, _H, _D, dtype=dt),
                                             np.zeros((s, _B, _H, _T, _D), dt)], EXACT))
            c.append((f"from_heads-s{s}-{tag}", "from_heads",
                      lambda g, s=s, dt=dt: [_r(g, s, _B, _H, _T, _D, dtype=dt),
                                             np.zeros((_B, _T, s, _H, _D), dt)], EXACT))

        scale = 1 / math.sqrt(_D)
        for t in (5, 9):
            gt = f"t{t}-{tag}"
            c.append((f"causal_softmax-{gt}", "causal_softmax",
                      lambda g, t=t, dt=dt: [_r(g, 3, t, t, dtype=dt) * 2,
                                             np.full((3, t, t), np.nan, dt), scale], _tol(dt)))

            def in_place(g, t=t, dt=dt):
                scores = _r(g, 3, t, t, dtype=dt) * 2
                return [scores, scores, scale]

            c.append((f"causal_softmax-inplace-{gt}", "causal_softmax", in_place, _tol(dt)))
            c.append((f"causal_softmax_backward-{gt}", "causal_softmax_backward",
                      lambda g, t=t, dt=dt: [_softmax_probs(g, 3, t, dt, scale),
                                             _r(g, 3, t, t, dtype=dt),
                                             np.full((3, t, t), np.nan, dt), scale], _tol(dt)))

            def backward_in_place(g, t=t, dt=dt):
                grad = _r(g, 3, t, t, dtype=dt)
                return [_softmax_probs(g, 3, t, dt, scale), grad, grad, scale]

            c.append((f"causal_softmax_backward-inplace-{gt}", "causal_softmax_backward",
                      backward_in_place, _tol(dt)))

    for ta in (False, True):
        for tb in (False, True):
            for acc in (False, True):
                tag = f"ta{int(ta)}-tb{int(tb)}-acc{int(acc)}"
                # more than one 8x8 tile in M and N, three K-stages of 4, three groups
                c.append((f"batched_gemm-{tag}", "batched_gemm",
                          lambda g, ta=ta, tb=tb, acc=acc: _bgemm(g, 3, 9, 11, 10, ta, tb, acc),
                          dict(rtol=1e-4, atol=1e-5)))
    c.append(("batched_gemm-f64", "batched_gemm",
              lambda g: _bgemm(g, 2, 5, 7, 3, False, True, True, np.float64), F64))
    c.append(("batched_gemm-k0", "batched_gemm",
              lambda g: _bgemm(g, 2, 3, 0, 4, False, False, False), EXACT))
    return c


def emulated_cases():
    """The cases plus LayerNorm cases wider than the CuPy flavour's 128 row threads (its row
    kernels have the same strided loops as the causal softmax's, which T = 9 covers in the Numba
    simulator's blocks of 8 threads)."""
    c = _cases()

    def ln_wide(g):
        x = _r(g, 3, 130) * 3 + 1
        mean, rstd = _layernorm_stats(x)
        return [_r(g, 3, 130), x, mean, rstd, _r(g, 130), np.zeros_like(x), _r(g, 130),
                _r(g, 130), True]

    c.append(("layernorm_forward-c130", "layernorm_forward",
              lambda g: [_r(g, 3, 130), _r(g, 130), _r(g, 130), np.zeros((3, 130), np.float32),
                         np.zeros(3, np.float32), np.zeros(3, np.float32), 1e-5], F32))
    c.append(("layernorm_backward-c130", "layernorm_backward", ln_wide, F32))
    return c


def _params(cases):
    return [pytest.param(name, build, tol, id=cid) for cid, name, build, tol in cases]


CASES = _params(_cases())
EMULATED_CASES = _params(emulated_cases())
KERNEL_NAMES = sorted({name for _, name, _, _ in _cases()})


def run_case(cpu, dev, name, build, tol, seed=0):
    """Run kernel ``name`` on both backends from the same host arguments and compare all arrays
    (an argument given twice is one array on each side)."""
    if not hasattr(cpu, name):
        pytest.skip(f"kernels/cpu/ has no {name} yet")
    args = build(np.random.default_rng(seed))
    host, on_dev, seen = [], [], {}
    for a in args:
        if isinstance(a, np.ndarray):
            if id(a) not in seen:
                seen[id(a)] = (a.copy(), dev.to_device(a))
            h, d = seen[id(a)]
            host.append(h)
            on_dev.append(d)
        else:
            host.append(a)
            on_dev.append(a)
    assert getattr(cpu, name)(*host) is None
    assert getattr(dev, name)(*on_dev) is None, f"{name} should return None"
    dev.synchronize()
    for i, (h, d) in enumerate(zip(host, on_dev)):
        if isinstance(h, np.ndarray):
            out = dev.to_host(d)
            assert out.dtype == h.dtype and out.shape == h.shape, f"{name} arg {i}"
            np.testing.assert_allclose(out.astype(np.float64), h.astype(np.float64), **tol,
                                       err_msg=f"{name}: argument {i} differs from the CPU")
