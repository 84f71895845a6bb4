"""kernels/cpu/conv_gemm.py's register-blocked GEMMs against float64 NumPy, on plain matrices and
on overlapping windows of one flat source (the convolution's padded image), what they refuse, and
the convolutions that take them."""
import numpy as np
import pytest

from mpitrain.kernels.cpu import conv, conv_gemm


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def rows_of(x):
    """A C-contiguous (P, K) matrix as gathered operands: (src, bases, offs)."""
    p, k = x.shape
    return x.reshape(-1), np.arange(p, dtype=np.intp) * k, np.arange(k, dtype=np.intp)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the Numba kernels called."""
    calls = []
    for name in ("_gathered", "_gathered_t"):
        real = getattr(conv_gemm, name)
        monkeypatch.setattr(conv_gemm, name,
                            lambda *args, real=real, name=name: (calls.append(name), real(*args)))
    return calls


# (P, K, N): one block exactly, a block + 1 row (the overlapping last block), K = 1, primes,
# two column panels, a 16-channel image's pixels
@pytest.mark.parametrize("p,k,n", [(6, 6, 16), (7, 1, 16), (13, 5, 32), (97, 144, 16),
                                   (784, 27, 48), (49, 576, 64)])
def test_gathered_plain_matrix(p, k, n):
    rng = np.random.default_rng(p * k * n)
    x, a = rand(rng, p, k), rand(rng, k, n)
    out = np.full((p, n), np.nan, np.float32)
    conv_gemm.gathered(a, *rows_of(x), out)
    close(out, x.astype(np.float64) @ a)


# (P, K, N): K a whole number of blocks, K % 6 = 1..5 (the overlapping last block must not
# store its old rows twice), one pixel
@pytest.mark.parametrize("p,k,n", [(1, 6, 16), (9, 7, 16), (50, 25, 32), (30, 27, 16),
                                   (784, 144, 16), (49, 575, 64)])
def test_gathered_t_plain_matrix_overwrites_and_accumulates(p, k, n):
    rng = np.random.default_rng(p * k * n)
    x, b = rand(rng, p, k), rand(rng, p, n)
    want = x.T.astype(np.float64) @ b
    out = np.full((k, n), np.nan, np.float32)
    conv_gemm.gathered_t(b, *rows_of(x), out, accumulate=False)
    close(out, want)
    start = rand(rng, k, n)
    out[...] = start
    conv_gemm.gathered_t(b, *rows_of(x), out, accumulate=True)
    close(out, start + want)


def test_overlapping_windows_of_a_flat_source():
    """Windows that overlap (offsets 0, 1, 5, ...) at arbitrary bases, some shared: the same
    products as the materialised X."""
    rng = np.random.default_rng(5)
    src = rand(rng, 300)
    bases = np.array([0, 3, 3, 70, 71, 140, 200, 201, 250], np.intp)
    offs = np.array([0, 1, 5, 9, 13, 20, 33], np.intp)
    x = src[bases[:, None] + offs].astype(np.float64)                 # (9, 7)
    a, b = rand(rng, 7, 32), rand(rng, 9, 16)
    out = np.full((9, 32), np.nan, np.float32)
    conv_gemm.gathered(a, src, bases, offs, out)
    close(out, x @ a)
    dw = np.full((7, 16), np.nan, np.float32)
    conv_gemm.gathered_t(b, src, bases, offs, dw, False)
    close(dw, x.T @ b)


def test_results_are_deterministic():
    rng = np.random.default_rng(0)
    x, a, b = rand(rng, 203, 36), rand(rng, 36, 32), rand(rng, 203, 16)
    runs = []
    for _ in range(2):
        y, dw = np.empty((203, 32), np.float32), np.empty((36, 16), np.float32)
        conv_gemm.gathered(a, *rows_of(x), y)
        conv_gemm.gathered_t(b, *rows_of(x), dw, False)
        runs.append((y, dw))
    assert all(np.array_equal(x0, x1) for x0, x1 in zip(*runs))


def test_what_the_kernels_cover():
    for n in (16, 32, 64, 128, 512):
        assert conv_gemm.covers(n, np.float32)
    for n, dtype in [(8, np.float32), (24, np.float32), (0, np.float32), (16, np.float64)]:
        assert not conv_gemm.covers(n, dtype)


def test_operands_outside_the_source_are_refused():
    """The loads are unchecked, so the wrappers check the bounds (and the shapes)."""
    src, a = np.zeros(100, np.float32), np.zeros((6, 16), np.float32)
    bases, offs = np.arange(6, dtype=np.intp) * 10, np.arange(6, dtype=np.intp)
    out = np.zeros((6, 16), np.float32)
    conv_gemm.gathered(a, src, bases, offs, out)                       # the last element is 55
    with pytest.raises(ValueError, match="outside the source"):
        conv_gemm.gathered(a, src, bases, offs + 45, out)              # 100: one past the end
    with pytest.raises(ValueError, match="outside the source"):
        conv_gemm.gathered(a, src, bases - 1, offs, out)
    with pytest.raises(ValueError, match="outside the source"):
        conv_gemm.gathered_t(out, src, bases, offs + 45, np.zeros((6, 16), np.float32), False)
    with pytest.raises(ValueError, match="does not cover"):
        conv_gemm.gathered(np.zeros((6, 8), np.float32), src, bases, offs,
                          np.zeros((6, 8), np.float32))               # N = 8: not 16k
    with pytest.raises(ValueError, match="does not cover"):
        conv_gemm.gathered(a, src, bases, offs, np.zeros((6, 16), np.float64))
    with pytest.raises(ValueError, match="at least 6 rows"):
        conv_gemm.gathered(a[:5], src, bases[:5], offs[:5], out[:5])
    with pytest.raises(ValueError, match="at least 6 rows of X\\^T"):
        conv_gemm.gathered_t(out, src, bases, offs[:5], np.zeros((5, 16), np.float32), False)
    with pytest.raises(ValueError, match="intp"):
        conv_gemm.gathered(a, src, bases.astype(np.int32), offs, out)


@pytest.mark.parametrize("oc,c,size,stride,expected", [
    (16, 16, 8, 1, ["_gathered", "_gathered_t"]),   # forward, weight and input gradients
    (16, 3, 8, 1, ["_gathered", "_gathered_t"]),    # C = 3: the input gradient needs BLAS
    (64, 64, 7, 1, ["_gathered", "_gathered_t"]),   # ResNet's 7x7 stage: no junk columns
    (24, 16, 8, 1, []),                             # 24 output channels: BLAS on columns
    (16, 16, 8, 2, ["_gathered", "_gathered_t"]),   # stride 2: four input-gradient phases
])
def test_which_convolutions_take_the_kernels(oc, c, size, stride, expected, kernel_calls):
    rng = np.random.default_rng(2)
    x, w = rand(rng, 2, c, size, size), rand(rng, oc, c, 3, 3)
    out = (size + 2 - 3) // stride + 1
    y = np.empty((2, oc, out, out), np.float32)
    conv.conv2d_forward(x, w, None, y, stride, 1, False)
    conv.conv2d_backward(x, w, y, y, stride, 1, False, np.empty_like(w), False, None, None)
    assert sorted(set(kernel_calls)) == expected
    kernel_calls.clear()
    conv.conv2d_backward(x, w, y, y, stride, 1, False, np.empty_like(w), False, None,
                             np.empty_like(x))
    # with the input gradient: one group of two images, a gather per phase; C = 3 sends the
    # whole backward to BLAS
    phases = ["_gathered"] * stride ** 2
    assert kernel_calls == (["_gathered_t"] + phases if expected and c % 16 == 0 else [])
