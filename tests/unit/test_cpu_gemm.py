"""kernels/cpu_gemm.py's register-blocked GEMMs against float64 NumPy, on plain matrices and on
overlapping runs of one flat source (the convolution's padded image), what they refuse, and the
convolutions that take them."""
import numpy as np
import pytest

from mpitrain.kernels import cpu_conv, cpu_gemm


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def rows_of(b):
    """A C-contiguous (K, N) matrix as gathered operands: (src, starts)."""
    return b.reshape(-1), np.arange(b.shape[0], dtype=np.intp) * b.shape[1]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the Numba kernels called."""
    calls = []
    for name in ("_gathered", "_gathered_nt"):
        real = getattr(cpu_gemm, name)
        monkeypatch.setattr(cpu_gemm, name,
                            lambda *args, real=real, name=name: (calls.append(name), real(*args)))
    return calls


# (M, K, N): one strip exactly, a strip + 1 column (the overlapping last strip), primes, K = 1,
# a tall weight (the input gradient's), a ResNet 16-channel image
@pytest.mark.parametrize("m,k,n", [(4, 1, 24), (4, 7, 25), (8, 5, 47), (12, 3, 100),
                                   (144, 16, 61), (16, 144, 812)])
@pytest.mark.parametrize("transposed_a", [False, True])
def test_gathered_plain_matrix(m, k, n, transposed_a):
    rng = np.random.default_rng(m * k * n)
    a = rand(rng, k, m).T if transposed_a else rand(rng, m, k)
    b = rand(rng, k, n)
    out = np.full((m, n), np.nan, np.float32)
    cpu_gemm.gathered(cpu_gemm.quads(a), *rows_of(b), 0, n, out)
    close(out, a.astype(np.float64) @ b)


@pytest.mark.parametrize("m,p,n", [(4, 3, 8), (4, 3, 7), (8, 9, 13), (16, 144, 812),
                                   (32, 27, 101), (4, 1, 9), (4, 5, 30), (8, 25, 50)])
def test_gathered_nt_plain_matrix_overwrites_and_accumulates(m, p, n):
    rng = np.random.default_rng(m * p * n)
    g, c = rand(rng, m, n), rand(rng, p, n)
    want = g.astype(np.float64) @ c.T
    out = np.full((m, p), np.nan, np.float32)
    cpu_gemm.gathered_nt(g, *rows_of(c), 0, n, out, accumulate=False)
    close(out, want)
    start = rand(rng, m, p)
    out[...] = start
    cpu_gemm.gathered_nt(g, *rows_of(c), 0, n, out, accumulate=True)
    close(out, start + want)


@pytest.mark.parametrize("run", [24, 29, 40])
def test_overlapping_runs_of_several_images(run):
    """Rows that overlap (start 0, 1, 5, ...) in a flat source, three images 70 apart: the same
    products as the materialised rows."""
    rng = np.random.default_rng(run)
    src = rand(rng, 3 * 70 + 60)
    starts = np.array([0, 1, 5, 9, 13, 20], np.intp)
    b = [np.stack([src[i * 70 + s:][:run] for s in starts]) for i in range(3)]   # (6, run) each
    a = rand(rng, 8, 6)
    out = np.full((8, 3 * run), np.nan, np.float32)
    cpu_gemm.gathered(cpu_gemm.quads(a), src, starts, 70, run, out)
    close(out, np.hstack([a.astype(np.float64) @ bi for bi in b]))
    g = rand(rng, 4, 3 * run)
    dw = np.full((4, 6), np.nan, np.float32)
    cpu_gemm.gathered_nt(g, src, starts, 70, run, dw, False)
    close(dw, sum(g[:, i * run:(i + 1) * run].astype(np.float64) @ b[i].T for i in range(3)))


def test_results_are_deterministic():
    rng = np.random.default_rng(0)
    a, b, g = rand(rng, 16, 36), rand(rng, 36, 203), rand(rng, 16, 203)
    runs = []
    for _ in range(2):
        y, dw = np.empty((16, 203), np.float32), np.empty((16, 36), np.float32)
        cpu_gemm.gathered(cpu_gemm.quads(a), *rows_of(b), 0, 203, y)
        cpu_gemm.gathered_nt(g, *rows_of(b), 0, 203, dw, False)
        runs.append((y, dw))
    assert all(np.array_equal(x0, x1) for x0, x1 in zip(*runs))


def test_what_the_kernels_cover():
    """Where they beat BLAS: at most 64 channels on the short side, runs that 24-wide strips
    cover with little waste (ResNet's 16x28x28 and 64x14x14 images, not 7x7's 56 columns)."""
    for m, k, run in [(16, 144, 24), (144, 16, 812), (64, 576, 210), (32, 25, 812)]:
        assert cpu_gemm.covers(m, k, np.float32, run)
    for m, k, dtype, run in [(6, 144, np.float32, 100), (128, 1152, np.float32, 210),
                             (16, 144, np.float64, 100), (16, 144, np.float32, 23),
                             (64, 576, np.float32, 56)]:
        assert not cpu_gemm.covers(m, k, dtype, run)
    for m, p in [(16, 144), (16, 145), (64, 800)]:
        assert cpu_gemm.covers_nt(m, p, np.float32)
    for m, p, dtype in [(6, 144, np.float32), (128, 1152, np.float32), (16, 144, np.float64)]:
        assert not cpu_gemm.covers_nt(m, p, dtype)


def test_runs_outside_the_source_are_refused():
    """The loads are unchecked, so the wrappers check every run's bounds (and the shapes)."""
    src, a = np.zeros(100, np.float32), np.zeros((4, 2), np.float32)
    out = np.zeros((4, 48), np.float32)
    with pytest.raises(ValueError, match="leaves the source|whole runs"):
        cpu_gemm.gathered(cpu_gemm.quads(a), src, np.array([0, 70], np.intp), 10, 24, out)
    with pytest.raises(ValueError, match="leaves the source|whole runs"):
        cpu_gemm.gathered(cpu_gemm.quads(a), src, np.array([-1, 0], np.intp), 0, 48, out)
    with pytest.raises(ValueError, match="does not cover"):
        cpu_gemm.gathered(cpu_gemm.quads(a), src, np.array([0, 1], np.intp), 0, 12,
                          np.zeros((4, 12), np.float32))
    with pytest.raises(ValueError, match="whole runs"):
        cpu_gemm.gathered_nt(np.zeros((4, 24), np.float32), src, np.array([0, 1], np.intp), 0,
                             0, np.zeros((4, 2), np.float32), False)      # run 0
    with pytest.raises(ValueError, match="does not cover"):
        cpu_gemm.gathered_nt(np.zeros((6, 24), np.float32), src, np.array([0, 1], np.intp), 0,
                             24, np.zeros((6, 2), np.float32), False)     # M = 6: not 4k


@pytest.mark.parametrize("oc,c,size,expected", [
    (16, 16, 8, ["_gathered", "_gathered_nt"]),    # forward, weight and input gradients
    (16, 3, 8, ["_gathered", "_gathered_nt"]),     # C = 3: the input gradient needs BLAS
    (64, 64, 7, []),                                # 7x7: 56-column runs, BLAS on columns
    (128, 128, 8, []),                              # 128 channels: OpenBLAS
])
def test_which_convolutions_take_the_kernels(oc, c, size, expected, kernel_calls):
    rng = np.random.default_rng(2)
    x, w = rand(rng, 2, c, size, size), rand(rng, oc, c, 3, 3)
    y = np.empty((2, oc, size, size), np.float32)
    cpu_conv.conv2d_forward(x, w, None, y, 1, 1, False)
    cpu_conv.conv2d_backward(x, w, y, y, 1, 1, False, np.empty_like(w), False, None, None)
    assert sorted(set(kernel_calls)) == expected
    kernel_calls.clear()
    cpu_conv.conv2d_backward(x, w, y, y, 1, 1, False, np.empty_like(w), False, None,
                             np.empty_like(x))
    # with the input gradient: one group of two images; C = 3 sends the whole backward to BLAS
    assert kernel_calls == (["_gathered_nt", "_gathered"] if expected and c % 4 == 0 else [])
