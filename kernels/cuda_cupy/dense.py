"""The CuPy flavour's GEMM (cuBLAS), dense-layer kernels and activations.

GEMMs go to cuBLAS: one sgemm/dgemm call with beta 0 or 1 on contiguous arrays (``cupy.matmul``
otherwise).
"""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import dev, flat, launch_rows, scalar

try:
    from cupy import cublas as _cublas          # gemm with beta=1 (CuPy >= 9)
except ImportError:
    _cublas = None
try:                                            # cuBLAS itself, without cupy.matmul's checks
    from cupy.cuda import device as _device
    from cupy_backends.cuda.libs import cublas as _blas
except ImportError:
    _blas = None

_scratch = {}


# alpha = 1 and beta = 0 or 1, as host pointers (they must outlive the calls)
_SCALARS = {np.dtype(t): (np.ones(1, t), np.zeros(1, t)) for t in (np.float32, np.float64)}
_SCALAR_PTRS = {t: tuple(v.ctypes.data for v in pair) for t, pair in _SCALARS.items()}


def _cublas_gemm(a, b, out, trans_a, trans_b, accumulate):
    """out (=|+=) op(a) @ op(b) by one cuBLAS call on C-contiguous float32/float64 arrays, True;
    False where that does not apply. (cupy.matmul spends ~30 us of host time per call, several
    times the kernel of a small layer.) Row-major out is column-major out.T = op(b).T @ op(a).T,
    so b goes first."""
    dtype = out.dtype
    if (_blas is None or dtype.char not in "fd" or a.dtype != dtype or b.dtype != dtype
            or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous)):
        return False
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if not (m and n and k):
        return False
    handle = _device.get_cublas_handle()
    _blas.setPointerMode(handle, _blas.CUBLAS_POINTER_MODE_HOST)
    one, zero = _SCALAR_PTRS[dtype]
    (_blas.sgemm if dtype.char == "f" else _blas.dgemm)(
        handle, _blas.CUBLAS_OP_T if trans_b else _blas.CUBLAS_OP_N,
        _blas.CUBLAS_OP_T if trans_a else _blas.CUBLAS_OP_N, n, m, k, one, b.data.ptr,
        b.shape[1], a.data.ptr, a.shape[1], one if accumulate else zero, out.data.ptr, n)
    return True


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    a, b, out = dev(a), dev(b), dev(out)
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    checks.gemm(op_a, op_b, out)
    if _cublas_gemm(a, b, out, trans_a, trans_b, accumulate):
        return
    if not accumulate:
        cp.matmul(op_a, op_b, out=out)
        return
    if out.dtype.char in "fd" and a.dtype == b.dtype == out.dtype and hasattr(_cublas, "gemm"):
        _cublas.gemm("T" if trans_a else "N", "T" if trans_b else "N", a, b, out=out,
                     alpha=1.0, beta=1.0)
        return
    key = (out.shape, out.dtype.str)
    if key not in _scratch:
        _scratch[key] = cp.empty(out.shape, out.dtype)
    cp.matmul(op_a, op_b, out=_scratch[key])
    out += _scratch[key]


# Dense layers ------------------------------------------------------------------------------------

_bias_act = cp.ElementwiseKernel(
    "T bias, bool relu", "T y",
    "T v = y + bias; y = (relu && v < (T)0) ? (T)0 : v;", "mpitrain_bias_act")
_relu = cp.ElementwiseKernel("T x", "T out", "out = x > (T)0 ? x : (T)0", "mpitrain_relu")
_relu_backward = cp.ElementwiseKernel(
    "T y, T g", "T gin", "gin = y > (T)0 ? g : (T)0", "mpitrain_relu_backward")


def bias_act(y, bias, relu):
    y, bias = dev(y), dev(bias)
    checks.bias("bias_act", y, bias, ("y", "bias"))
    _bias_act(bias, bool(relu), y)                       # bias (F,) broadcasts over y (B, F)


def relu(x, out):
    x, out = checks.same_size("relu", flat(x), flat(out))
    _relu(x, out)


def relu_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("relu_backward", flat(y), flat(grad_out), flat(grad_in))
    _relu_backward(y, grad_out, grad_in)


_ones = {}


def bias_grad(grad_out, grad_bias):
    grad_out, grad_bias = dev(grad_out), dev(grad_bias)
    checks.bias("bias_grad", grad_out, grad_bias, ("grad_out", "grad_bias"))
    # grad_bias (1, F) += ones (1, B) @ grad_out (B, F): cuBLAS reads the rows coalesced, where a
    # sum over axis 0 gives each of the F columns one block (a convolution's B is N*OH*OW)
    gemm(ones_row(grad_out.shape[0], grad_out.dtype), grad_out, grad_bias.reshape(1, -1),
         accumulate=True)


def ones_row(size, dtype):
    """A cached (1, size) array of ones."""
    key = (size, np.dtype(dtype).str)
    if key not in _ones:
        _ones[key] = cp.empty((1, size), dtype)
        _ones[key].fill(1)
    return _ones[key]


# Activations and softmax -------------------------------------------------------------------------

_tanh = cp.ElementwiseKernel("T x", "T out", "out = tanh(x)", "mpitrain_tanh")
_tanh_backward = cp.ElementwiseKernel(
    "T y, T g", "T gin", "gin = g * ((T)1 - y * y)", "mpitrain_tanh_backward")
# exp of a non-positive number only: no overflow for large |x|
_sigmoid = cp.ElementwiseKernel(
    "T x", "T out",
    "if (x >= (T)0) { out = (T)1 / ((T)1 + exp(-x)); } "
    "else { T e = exp(x); out = e / ((T)1 + e); }", "mpitrain_sigmoid")
_sigmoid_backward = cp.ElementwiseKernel(
    "T y, T g", "T gin", "gin = g * y * ((T)1 - y)", "mpitrain_sigmoid_backward")
_leaky_relu = cp.ElementwiseKernel(
    "T x, T slope", "T out", "out = x > (T)0 ? x : x * slope", "mpitrain_leaky_relu")
_leaky_relu_backward = cp.ElementwiseKernel(
    "T x, T g, T slope", "T gin", "gin = x > (T)0 ? g : g * slope",
    "mpitrain_leaky_relu_backward")


def tanh(x, out):
    x, out = checks.same_size("tanh", flat(x), flat(out))
    _tanh(x, out)


def tanh_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("tanh_backward", flat(y), flat(grad_out), flat(grad_in))
    _tanh_backward(y, grad_out, grad_in)


def sigmoid(x, out):
    x, out = checks.same_size("sigmoid", flat(x), flat(out))
    _sigmoid(x, out)


def sigmoid_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("sigmoid_backward", *map(flat, (y, grad_out, grad_in)))
    _sigmoid_backward(y, grad_out, grad_in)


def leaky_relu(x, out, negative_slope):
    x, out = checks.same_size("leaky_relu", flat(x), flat(out))
    _leaky_relu(x, scalar(x, negative_slope), out)


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    x, grad_out, grad_in = flat(x), flat(grad_out), flat(grad_in)
    checks.same_size("leaky_relu_backward", x, grad_out, grad_in)
    _leaky_relu_backward(x, grad_out, scalar(x, negative_slope), grad_in)


# Softmax over the last axis: one thread per row, like the cross-entropy, sums in double.
_SOFTMAX_SRC = r"""
extern "C" __global__ void mpitrain_softmax(const T* x, T* y, int rows, int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* z = x + (long long)r * k;
    T* p = y + (long long)r * k;
    T top = z[0];
    for (int j = 1; j < k; ++j) top = z[j] > top ? z[j] : top;
    double s = 0.0;
    for (int j = 0; j < k; ++j) { T e = exp(z[j] - top); p[j] = e; s += (double)e; }
    double inv = 1.0 / s;
    for (int j = 0; j < k; ++j) p[j] = (T)((double)p[j] * inv);
}
"""
_SOFTMAX_BACKWARD_SRC = r"""
extern "C" __global__ void mpitrain_softmax_backward(const T* y, const T* g, T* gin, int rows,
                                                     int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    long long base = (long long)r * k;
    double dot = 0.0;
    for (int j = 0; j < k; ++j) dot += (double)g[base + j] * (double)y[base + j];
    for (int j = 0; j < k; ++j)
        gin[base + j] = (T)((double)y[base + j] * ((double)g[base + j] - dot));
}
"""


def softmax(x, y):
    x, y = dev(x), dev(y)
    r, k = checks.rows("softmax", x.shape, y)
    if k:
        launch_rows(_SOFTMAX_SRC, "mpitrain_softmax", x.dtype, r,
                    (flat(x), flat(y), np.int32(r), np.int32(k)))


def softmax_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = dev(y), dev(grad_out), dev(grad_in)
    r, k = checks.rows("softmax_backward", y.shape, grad_out, grad_in)
    if k:
        launch_rows(_SOFTMAX_BACKWARD_SRC, "mpitrain_softmax_backward", y.dtype, r,
                    (flat(y), flat(grad_out), flat(grad_in), np.int32(r), np.int32(k)))
