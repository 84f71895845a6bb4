"""The CPU's GEMM (BLAS through NumPy), dense-layer kernels and activations."""
import numpy as np
from numba import njit, prange

from mpitrain.kernels import checks
from mpitrain.kernels.checks import flat, sizes_match
from mpitrain.kernels.cpu.arrays import add_flat


# GEMM: BLAS through NumPy. A transposed operand is a transposed view (F-contiguous), which BLAS
# reads directly with its trans flag, so nothing is copied. NumPy has no beta=1 GEMM, so
# accumulating goes through a scratch buffer kept per (shape, dtype); layers avoid it by
# overwriting a freshly zeroed gradient instead (Parameter.grad_target).
_scratch = {}


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    checks.gemm(op_a, op_b, out)
    matmul_into(op_a, op_b, out, accumulate)


def matmul_into(op_a, op_b, out, accumulate):
    """out (=|+=) op_a @ op_b through NumPy's matmul (BLAS; 2-D, or 3-D for one product per
    group; a transposed operand is a view, which BLAS reads with its trans flag). Accumulating
    goes through a scratch buffer per (shape, dtype). Shapes are the caller's to check; ``out``
    is C-contiguous."""
    if not accumulate:
        np.matmul(op_a, op_b, out=out)
        return
    key = (out.shape, out.dtype.str)
    tmp = _scratch.get(key)
    if tmp is None:
        tmp = _scratch[key] = np.empty(out.shape, out.dtype)
    np.matmul(op_a, op_b, out=tmp)
    add_flat(out.reshape(-1), tmp.reshape(-1))


# Dense layers ------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def bias_act(y, bias, relu):
    rows, cols = y.shape                        # (B, F)
    for i in prange(rows):
        for j in range(cols):
            v = y[i, j] + bias[j]
            if relu and v < 0:
                v = 0
            y[i, j] = v


@njit(cache=True, nogil=True)
def _relu(x, out):
    for i in range(x.size):
        v = x[i]
        out[i] = v if v > 0 else 0


@njit(cache=True, nogil=True)
def _relu_backward(y, grad_out, grad_in):
    for i in range(y.size):
        grad_in[i] = grad_out[i] if y[i] > 0 else 0


def relu(x, out):
    sizes_match(x, out)
    _relu(flat(x, "x"), flat(out, "out"))


def relu_backward(y, grad_out, grad_in):
    sizes_match(y, grad_out, grad_in)
    _relu_backward(flat(y, "y"), flat(grad_out, "grad_out"), flat(grad_in, "grad_in"))


@njit(cache=True, nogil=True)
def bias_grad(grad_out, grad_bias):
    # Row by row, so the inner loop runs along contiguous memory of both arrays.
    rows, cols = grad_out.shape                 # (B, F)
    for i in range(rows):
        for j in range(cols):
            grad_bias[j] += grad_out[i, j]


# Activations (elementwise, flat) and softmax (rows over the last axis) ------------------------

@njit(cache=True, nogil=True)
def _tanh(x, out):
    for i in range(x.size):
        out[i] = np.tanh(x[i])


@njit(cache=True, nogil=True)
def _tanh_backward(y, grad_out, grad_in):
    for i in range(y.size):
        grad_in[i] = grad_out[i] * (1.0 - y[i] * y[i])


@njit(cache=True, nogil=True)
def _sigmoid(x, out):
    # exp of a non-positive number only: no overflow for large |x|
    for i in range(x.size):
        v = x[i]
        if v >= 0:
            out[i] = 1.0 / (1.0 + np.exp(-v))
        else:
            e = np.exp(v)
            out[i] = e / (1.0 + e)


@njit(cache=True, nogil=True)
def _sigmoid_backward(y, grad_out, grad_in):
    for i in range(y.size):
        grad_in[i] = grad_out[i] * y[i] * (1.0 - y[i])


@njit(cache=True, nogil=True)
def _leaky_relu(x, out, negative_slope):
    for i in range(x.size):
        v = x[i]
        out[i] = v if v > 0 else v * negative_slope


@njit(cache=True, nogil=True)
def _leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    for i in range(x.size):
        grad_in[i] = grad_out[i] if x[i] > 0 else grad_out[i] * negative_slope


def tanh(x, out):
    sizes_match(x, out)
    _tanh(flat(x, "x"), flat(out, "out"))


def tanh_backward(y, grad_out, grad_in):
    sizes_match(y, grad_out, grad_in)
    _tanh_backward(flat(y, "y"), flat(grad_out, "grad_out"), flat(grad_in, "grad_in"))


def sigmoid(x, out):
    sizes_match(x, out)
    _sigmoid(flat(x, "x"), flat(out, "out"))


def sigmoid_backward(y, grad_out, grad_in):
    sizes_match(y, grad_out, grad_in)
    _sigmoid_backward(flat(y, "y"), flat(grad_out, "grad_out"), flat(grad_in, "grad_in"))


def leaky_relu(x, out, negative_slope):
    sizes_match(x, out)
    _leaky_relu(flat(x, "x"), flat(out, "out"), float(negative_slope))


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    sizes_match(x, grad_out, grad_in)
    _leaky_relu_backward(flat(x, "x"), flat(grad_out, "grad_out"), flat(grad_in, "grad_in"),
                         float(negative_slope))


@njit(cache=True, nogil=True, parallel=True)
def _softmax(x, y):
    rows, k = x.shape                           # (R, K)
    for i in prange(rows):
        m = x[i, 0]
        for j in range(1, k):
            if x[i, j] > m:
                m = x[i, j]
        s = 0.0
        for j in range(k):
            e = np.exp(x[i, j] - m)
            y[i, j] = e
            s += e
        inv = 1.0 / s
        for j in range(k):
            y[i, j] = y[i, j] * inv


@njit(cache=True, nogil=True, parallel=True)
def _softmax_backward(y, grad_out, grad_in):
    rows, k = y.shape                           # (R, K)
    for i in prange(rows):
        dot = 0.0
        for j in range(k):
            dot += grad_out[i, j] * y[i, j]
        for j in range(k):
            grad_in[i, j] = y[i, j] * (grad_out[i, j] - dot)


def _as_rows(a, r, k, name):
    """(R, K) view of a C-contiguous (..., K) array."""
    return flat(a, name).reshape((r, k))


def softmax(x, y):
    r, k = checks.rows("softmax", x.shape, y)
    if r and k:
        _softmax(_as_rows(x, r, k, "x"), _as_rows(y, r, k, "y"))


def softmax_backward(y, grad_out, grad_in):
    r, k = checks.rows("softmax_backward", y.shape, grad_out, grad_in)
    if r and k:
        _softmax_backward(_as_rows(y, r, k, "y"), _as_rows(grad_out, r, k, "grad_out"),
                          _as_rows(grad_in, r, k, "grad_in"))
