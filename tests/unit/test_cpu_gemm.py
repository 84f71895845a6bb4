"""kernels/cpu_gemm.py's register-blocked GEMMs against float64 NumPy, the shapes they hand to
BLAS, and the convolution shapes that take them."""
import numpy as np
import pytest

from mpitrain.kernels import cpu_conv, cpu_gemm


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


# (M, K, N): one strip exactly, a strip + 1 column (the overlapping last strip), primes, K = 1,
# the input gradient's tall W^T, a ResNet 16-channel group
@pytest.mark.parametrize("m,k,n", [(4, 1, 24), (4, 7, 25), (8, 5, 47), (12, 3, 100),
                                   (144, 16, 61), (16, 144, 812)])
@pytest.mark.parametrize("transposed_a", [False, True])
def test_matmul_kernel_against_float64(m, k, n, transposed_a):
    rng = np.random.default_rng(m * k * n)
    a = rand(rng, k, m).T if transposed_a else rand(rng, m, k)
    b = rand(rng, k, n)
    out = np.full((m, n), np.nan, np.float32)
    cpu_gemm._matmul(a, b, out)
    close(out, a.astype(np.float64) @ b)


@pytest.mark.parametrize("m,p,n", [(4, 3, 8), (4, 3, 7), (8, 9, 13), (16, 144, 812),
                                   (32, 27, 101)])
def test_matmul_nt_kernel_overwrites_and_accumulates(m, p, n):
    rng = np.random.default_rng(m * p * n)
    g, c = rand(rng, m, n), rand(rng, p, n)
    want = g.astype(np.float64) @ c.T
    out = np.full((m, p), np.nan, np.float32)
    cpu_gemm.matmul_nt(g, c, out, accumulate=False)
    close(out, want)
    start = rand(rng, m, p)
    out[...] = start
    cpu_gemm.matmul_nt(g, c, out, accumulate=True)
    close(out, start + want)


def test_results_are_deterministic():
    rng = np.random.default_rng(0)
    a, b, g = rand(rng, 16, 36), rand(rng, 36, 203), rand(rng, 16, 203)
    runs = []
    for _ in range(2):
        y, dw = np.empty((16, 203), np.float32), np.empty((16, 36), np.float32)
        cpu_gemm.matmul(a, b, y)
        cpu_gemm.matmul_nt(g, b, dw, False)
        runs.append((y, dw))
    assert all(np.array_equal(x0, x1) for x0, x1 in zip(*runs))


@pytest.mark.parametrize("a_shape,b_shape,dtype", [
    ((6, 8), (8, 40), np.float32),       # M not a multiple of 4
    ((8, 8), (8, 20), np.float32),       # fewer columns than one strip
    ((64, 576), (576, 224), np.float32),  # 64 channels: OpenBLAS is as fast
    ((8, 8), (8, 40), np.float64),
])
def test_matmul_hands_other_shapes_to_numpy(a_shape, b_shape, dtype, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_gemm, "_matmul", lambda *args: calls.append(args))
    rng = np.random.default_rng(1)
    a, b = rand(rng, *a_shape, dtype=dtype), rand(rng, *b_shape, dtype=dtype)
    out = np.empty((a_shape[0], b_shape[1]), dtype)
    cpu_gemm.matmul(a, b, out)
    assert calls == []
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


def test_matmul_nt_refuses_what_it_does_not_cover():
    assert cpu_gemm.covers_nt(16, 144, np.float32)
    for m, p, dtype in [(16, 145, np.float32), (6, 144, np.float32), (64, 576, np.float32),
                        (16, 144, np.float64)]:
        assert not cpu_gemm.covers_nt(m, p, dtype)
    g, c = np.ones((16, 10), np.float64), np.ones((144, 10), np.float64)
    with pytest.raises(ValueError, match="does not cover"):
        cpu_gemm.matmul_nt(g, c, np.empty((16, 144)), False)


@pytest.mark.parametrize("oc,skinny", [(16, True), (64, False)])
def test_convolution_takes_the_kernels_up_to_32_channels(oc, skinny, monkeypatch):
    """All three GEMMs of a 16-channel 3x3 convolution run the kernels; a 64-channel one's none."""
    calls = []
    for name in ("_matmul", "_matmul_nt"):
        real = getattr(cpu_gemm, name)
        monkeypatch.setattr(cpu_gemm, name,
                            lambda *args, real=real, name=name: (calls.append(name), real(*args)))
    rng = np.random.default_rng(2)
    x, w = rand(rng, 2, oc, 8, 8), rand(rng, oc, oc, 3, 3)
    y = np.empty((2, oc, 8, 8), np.float32)
    cpu_conv.conv2d_forward(x, w, None, y, 1, 1, False)
    cpu_conv.conv2d_backward(x, w, y, y, 1, 1, False, np.empty_like(w), False, None,
                             np.empty_like(x))
    assert sorted(set(calls)) == (["_matmul", "_matmul_nt"] if skinny else [])
