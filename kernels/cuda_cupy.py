"""CUDA backend, CuPy flavour: CuPy arrays, cuBLAS GEMMs, CuPy elementwise/raw kernels.

The same names as kernels/cpu.py (see kernels/__init__.py for the contract). GEMMs go to cuBLAS:
one sgemm/dgemm call with beta 0 or 1 on contiguous arrays (``cupy.matmul`` otherwise).
Everything else is one kernel per operation, written as a gather over the output (im2col,
col2im, layout changes, pooling), which needs no atomics and sums in a fixed order; only max-pool
backward scatters with ``atomicAdd`` because its windows may overlap. Convolution layers use this
module's own conv2d_forward / conv2d_backward (columns in (C*K*K, N*OH*OW) layout, one GEMM per
batch). BatchNorm's per-channel sums are RawKernels in float64 that add in a fixed order (runs
of each (n, c) plane, then images, then runs), so they are deterministic. The dropout
mask uses the contract's exact lowbias32 hash in 32-bit arithmetic, so masks are bit-identical
to the CPU's. Scalars are passed in the array's dtype, so float32 work stays in float32
(PyTorch's choice; the CPU backend computes its scalars in float64, hence tolerances).

Importing this module without CuPy, or without a usable CUDA device, raises ImportError with one
line saying what to install or which flag to use; the CLI turns it into exit code 2.
"""
import numpy as np

from mpitrain.kernels import dropout_hash, host_shape, norm_shape

try:
    import cupy as cp
except ImportError as _exc:
    raise ImportError(f"--kernels cupy needs CuPy ({_exc}); install it with "
                      "pip install -e '.[cuda]' or use --kernels numba") from None
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception as _exc:  # noqa: BLE001 - CUDARuntimeError and friends: no driver/device
    raise ImportError(f"--kernels cupy: no usable CUDA device ({_exc})") from None
if _DEVICES < 1:
    raise ImportError("--kernels cupy: no CUDA device is visible")
try:
    from cupy import cublas as _cublas          # gemm with beta=1 (CuPy >= 9)
except ImportError:
    _cublas = None
try:                                            # cuBLAS itself, without cupy.matmul's checks
    from cupy.cuda import device as _device
    from cupy_backends.cuda.libs import cublas as _blas
except ImportError:
    _blas = None

name = "cuda-cupy"
_OPS = {"sum": cp.add, "prod": cp.multiply, "min": cp.minimum, "max": cp.maximum}


# --- Array plumbing -----------------------------------------------------------------------------

def _dev(a):
    """A CuPy array for ``a`` (zero-copy for other CUDA arrays); refuse host arrays."""
    if isinstance(a, cp.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cp.asarray(a)
    raise TypeError(f"cuda-cupy kernels need device arrays, got {type(a).__name__}; "
                    "copy host data with kernels.to_device")


def _flat(a):
    a = _dev(a)
    if not a.flags.c_contiguous:
        raise ValueError(f"array must be C-contiguous, got strides {a.strides}")
    return a.reshape(a.size)


def _s(a, value):
    """``value`` as a scalar of ``a``'s dtype (the kernels' T)."""
    return a.dtype.type(value)


# --- Memory -------------------------------------------------------------------------------------

def empty(shape, dtype=np.float32):
    return cp.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    return cp.zeros(shape, dtype=dtype)


def to_device(host):
    return cp.array(host, copy=True, order="C")


def to_host(a):
    return cp.asnumpy(_dev(a))


def synchronize():
    cp.cuda.get_current_stream().synchronize()


def fill(a, value):
    _dev(a).fill(value)


def copy(dst, src):
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("copy", src, dst)
    cp.copyto(dst, src, casting="unsafe")


cast = copy                                              # copyto converts to dst's dtype


# integers scale in float64 and truncate toward zero, as on the CPU
_scale_int = cp.ElementwiseKernel("float64 f", "T a", "a = (T)(a * f)", "mpitrain_scale_int")


def scale(a, factor):
    a = _flat(a)
    if a.dtype.kind == "f":
        a *= _s(a, factor)
    else:
        _scale_int(float(factor), a)


def add(dst, src):
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("add", src, dst)
    dst += src


def total(a):
    return float(_dev(a).sum(dtype=cp.float64))


# --- GEMM ---------------------------------------------------------------------------------------

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
    a, b, out = _dev(a), _dev(b), _dev(out)
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    if op_a.ndim != 2 or op_b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm needs 2-D arrays, got {op_a.shape}, {op_b.shape} -> {out.shape}")
    if op_a.shape[1] != op_b.shape[0] or out.shape != (op_a.shape[0], op_b.shape[1]):
        raise ValueError(f"gemm shapes do not agree: {op_a.shape} @ {op_b.shape} -> {out.shape}")
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


# --- Dense layers -------------------------------------------------------------------------------

_bias_act = cp.ElementwiseKernel(
    "T bias, bool relu", "T y",
    "T v = y + bias; y = (relu && v < (T)0) ? (T)0 : v;", "mpitrain_bias_act")
_relu = cp.ElementwiseKernel("T x", "T out", "out = x > (T)0 ? x : (T)0", "mpitrain_relu")
_relu_backward = cp.ElementwiseKernel(
    "T y, T g", "T gin", "gin = y > (T)0 ? g : (T)0", "mpitrain_relu_backward")


def bias_act(y, bias, relu):
    y, bias = _dev(y), _dev(bias)
    host_shape.bias("bias_act", y, bias, ("y", "bias"))
    _bias_act(bias, bool(relu), y)                       # bias (F,) broadcasts over y (B, F)


def relu(x, out):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("relu", x, out)
    _relu(x, out)


def relu_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("relu_backward", y, grad_out, grad_in)
    _relu_backward(y, grad_out, grad_in)


_ones = {}


def bias_grad(grad_out, grad_bias):
    grad_out, grad_bias = _dev(grad_out), _dev(grad_bias)
    host_shape.bias("bias_grad", grad_out, grad_bias, ("grad_out", "grad_bias"))
    # grad_bias (1, F) += ones (1, B) @ grad_out (B, F): cuBLAS reads the rows coalesced, where a
    # sum over axis 0 gives each of the F columns one block (a convolution's B is N*OH*OW)
    gemm(_ones_row(grad_out.shape[0], grad_out.dtype), grad_out, grad_bias.reshape(1, -1),
         accumulate=True)


def _ones_row(size, dtype):
    """A cached (1, size) array of ones."""
    key = (size, np.dtype(dtype).str)
    if key not in _ones:
        _ones[key] = cp.empty((1, size), dtype)
        _ones[key].fill(1)
    return _ones[key]


# --- Activations and softmax --------------------------------------------------------------------

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
    x, out = _flat(x), _flat(out)
    host_shape.same_size("tanh", x, out)
    _tanh(x, out)


def tanh_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("tanh_backward", y, grad_out, grad_in)
    _tanh_backward(y, grad_out, grad_in)


def sigmoid(x, out):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("sigmoid", x, out)
    _sigmoid(x, out)


def sigmoid_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("sigmoid_backward", y, grad_out, grad_in)
    _sigmoid_backward(y, grad_out, grad_in)


def leaky_relu(x, out, negative_slope):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("leaky_relu", x, out)
    _leaky_relu(x, _s(x, negative_slope), out)


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    x, grad_out, grad_in = _flat(x), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("leaky_relu_backward", x, grad_out, grad_in)
    _leaky_relu_backward(x, grad_out, _s(x, negative_slope), grad_in)


# Row kernels (softmax over the last axis, label smoothing): one thread per row, like the
# cross-entropy, sums in double; one RawKernel per source and dtype, compiled at first use.
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
_LABEL_SMOOTHING_SRC = r"""
extern "C" __global__ void mpitrain_label_smoothing(const T* logits, const long long* labels,
                                                    T* grad, T* losses, double smoothing,
                                                    int rows, int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* z = logits + (long long)r * k;
    T* g = grad + (long long)r * k;
    double off = smoothing / ((double)rows * k);
    double s = 0.0;
    for (int j = 0; j < k; ++j) { s += (double)z[j]; g[j] = (T)((double)g[j] - off); }
    long long label = labels[r];
    losses[r] = (T)((double)losses[r] + smoothing * ((double)z[label] - s / k));
    g[label] = (T)((double)g[label] + smoothing / rows);
}
"""
_raw_kernels = {}


def _raw_kernel(source, kernel_name, dtype):
    """The RawKernel of ``source`` with T = ``dtype`` (float32 or float64), compiled once."""
    key = (kernel_name, dtype.name)
    if key not in _raw_kernels:
        ctype = {"float32": "float", "float64": "double"}[dtype.name]
        _raw_kernels[key] = cp.RawKernel(f"typedef {ctype} T;\n" + source, kernel_name)
    return _raw_kernels[key]


def _launch_rows(source, kernel_name, dtype, rows, args):
    """``rows`` threads in blocks of 128 (none when ``rows`` is 0)."""
    if rows:
        threads = 128
        _raw_kernel(source, kernel_name, dtype)(((rows + threads - 1) // threads,), (threads,),
                                                args)


def softmax(x, y):
    x, y = _dev(x), _dev(y)
    r, k = host_shape.rows("softmax", x.shape, y)
    if k:
        _launch_rows(_SOFTMAX_SRC, "mpitrain_softmax", x.dtype, r,
                     (_flat(x), _flat(y), np.int32(r), np.int32(k)))


def softmax_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _dev(y), _dev(grad_out), _dev(grad_in)
    r, k = host_shape.rows("softmax_backward", y.shape, grad_out, grad_in)
    if k:
        _launch_rows(_SOFTMAX_BACKWARD_SRC, "mpitrain_softmax_backward", y.dtype, r,
                     (_flat(y), _flat(grad_out), _flat(grad_in), np.int32(r), np.int32(k)))


# --- Loss ---------------------------------------------------------------------------------------

_XENT_SRC = r"""
extern "C" __global__ void mpitrain_softmax_xent(const T* logits, const long long* labels,
                                                 T* grad, T* losses, int rows, int k) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* z = logits + (long long)r * k;
    T* g = grad + (long long)r * k;
    T top = z[0];
    for (int j = 1; j < k; ++j) top = z[j] > top ? z[j] : top;
    double s = 0.0;
    for (int j = 0; j < k; ++j) { T e = exp(z[j] - top); g[j] = e; s += (double)e; }
    long long label = labels[r];
    losses[r] = (T)(log(s) + (double)top - (double)z[label]);
    double inv = 1.0 / (s * rows);
    for (int j = 0; j < k; ++j) g[j] = (T)((double)g[j] * inv);
    g[label] -= (T)(1.0 / rows);
}
"""
_xent_kernels = {}


def softmax_xent(logits, labels, grad, losses):
    logits, labels, grad, losses = _dev(logits), _dev(labels), _dev(grad), _dev(losses)
    rows = logits.shape[0]
    if (logits.ndim != 2 or labels.shape != (rows,) or grad.shape != logits.shape
            or losses.shape != (rows,)):
        raise ValueError(f"softmax_xent: logits {logits.shape}, labels {labels.shape}, grad "
                         f"{grad.shape}, losses {losses.shape} do not match")
    if labels.dtype != np.int64:
        raise ValueError(f"softmax_xent: labels must be int64, got {labels.dtype}")
    ctype = {"float32": "float", "float64": "double"}[logits.dtype.name]
    if ctype not in _xent_kernels:
        _xent_kernels[ctype] = cp.RawKernel(f"typedef {ctype} T;\n" + _XENT_SRC,
                                            "mpitrain_softmax_xent")
    if rows:
        threads = 128
        _xent_kernels[ctype](((rows + threads - 1) // threads,), (threads,),
                             (logits, labels, grad, losses, np.int32(rows),
                              np.int32(logits.shape[1])))


def count_correct(logits, labels):
    logits, labels = _dev(logits), _dev(labels)
    if logits.shape[0] == 0:
        return 0
    return int((logits.argmax(axis=1) == labels).sum())  # argmax: first maximum, like NumPy


def label_smoothing(logits, labels, grad, losses, smoothing):
    logits, labels, grad, losses = _dev(logits), _dev(labels), _dev(grad), _dev(losses)
    host_shape.xent("label_smoothing", logits, labels, grad, losses)
    if labels.dtype != np.int64:
        raise ValueError(f"label_smoothing: labels must be int64, got {labels.dtype}")
    if smoothing != 0:
        _launch_rows(_LABEL_SMOOTHING_SRC, "mpitrain_label_smoothing", logits.dtype,
                     logits.shape[0], (logits, labels, grad, losses, np.float64(smoothing),
                                       np.int32(logits.shape[0]), np.int32(logits.shape[1])))


_mse = cp.ElementwiseKernel(
    "T x, T t, T scale", "T grad, T losses",
    "T d = x - t; losses = d * d; grad = d * scale", "mpitrain_mse")
# exp(-|x|) <= 1: no overflow for any logit; log1p keeps the small terms
_bce_logits = cp.ElementwiseKernel(
    "T x, T t, T inv_n", "T grad, T losses",
    """
    T e = exp(x >= (T)0 ? -x : x);
    losses = (x > (T)0 ? x : (T)0) - x * t + (T)log1p((double)e);
    T p = x >= (T)0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
    grad = (p - t) * inv_n;
    """, "mpitrain_bce_logits")


def mse(x, target, grad, losses):
    x, target, grad, losses = _flat(x), _flat(target), _flat(grad), _flat(losses)
    host_shape.same_size("mse", x, target, grad, losses)
    if x.size:
        _mse(x, target, _s(x, 2.0 / x.size), grad, losses)


def bce_logits(x, target, grad, losses):
    x, target, grad, losses = _flat(x), _flat(target), _flat(grad), _flat(losses)
    host_shape.same_size("bce_logits", x, target, grad, losses)
    if x.size:
        _bce_logits(x, target, _s(x, 1.0 / x.size), grad, losses)


# --- Convolution --------------------------------------------------------------------------------

_im2col = cp.ElementwiseKernel(
    "raw T x, int32 c_n, int32 h_n, int32 w_n, int32 kh, int32 kw, int32 stride, int32 pad, "
    "int32 oh_n, int32 ow_n", "T cols",
    """
    long long ck = (long long)c_n * kh * kw;
    long long row = i / ck, col = i - row * ck;
    long long n = row / (oh_n * ow_n), rem = row - n * (oh_n * ow_n);
    int oh = rem / ow_n, ow = rem - (long long)oh * ow_n;
    int c = col / (kh * kw), r2 = col - (long long)c * (kh * kw);
    int ki = r2 / kw, kj = r2 - ki * kw;
    int h = oh * stride - pad + ki, w = ow * stride - pad + kj;
    cols = (h >= 0 && h < h_n && w >= 0 && w < w_n) ? x[((n * c_n + c) * h_n + h) * w_n + w]
                                                     : (T)0;
    """, "mpitrain_im2col")

# gather: every input pixel sums the columns that read it (no atomics, fixed order)
_col2im = cp.ElementwiseKernel(
    "raw T cols, int32 c_n, int32 h_n, int32 w_n, int32 kh, int32 kw, int32 stride, int32 pad, "
    "int32 oh_n, int32 ow_n", "T dx",
    """
    int w = i % w_n, h = (i / w_n) % h_n, c = (i / ((long long)w_n * h_n)) % c_n;
    long long n = i / ((long long)w_n * h_n * c_n);
    T acc = 0;
    for (int ki = 0; ki < kh; ++ki) {
        int th = h + pad - ki;
        if (th < 0 || th % stride != 0 || th / stride >= oh_n) continue;
        int oh = th / stride;
        for (int kj = 0; kj < kw; ++kj) {
            int tw = w + pad - kj;
            if (tw < 0 || tw % stride != 0 || tw / stride >= ow_n) continue;
            int ow = tw / stride;
            acc += cols[((n * oh_n + oh) * ow_n + ow) * ((long long)c_n * kh * kw)
                        + (c * kh + ki) * kw + kj];
        }
    }
    dx = acc;
    """, "mpitrain_col2im")

_nhwc_to_nchw = cp.ElementwiseKernel(
    "raw T src, int32 c_n, int32 h_n, int32 w_n", "T dst",
    """
    int w = i % w_n, h = (i / w_n) % h_n, c = (i / ((long long)w_n * h_n)) % c_n;
    long long n = i / ((long long)w_n * h_n * c_n);
    dst = src[((n * h_n + h) * w_n + w) * c_n + c];
    """, "mpitrain_nhwc_to_nchw")

_nchw_to_nhwc = cp.ElementwiseKernel(
    "raw T src, int32 c_n, int32 h_n, int32 w_n", "T dst",
    """
    int c = i % c_n;
    long long pix = i / c_n;
    int w = pix % w_n, h = (pix / w_n) % h_n;
    long long n = pix / ((long long)w_n * h_n);
    dst = src[((n * c_n + c) * h_n + h) * w_n + w];
    """, "mpitrain_nchw_to_nhwc")


def im2col(x, cols, kh, kw, stride, pad):
    x, cols = _dev(x), _dev(cols)
    c, h, w, oh, ow = host_shape.dims("im2col", x.shape, cols.shape, kh, kw, stride, pad)
    _im2col(x, c, h, w, kh, kw, stride, pad, oh, ow, cols)


def col2im(cols, dx, kh, kw, stride, pad):
    cols, dx = _dev(cols), _dev(dx)
    c, h, w, oh, ow = host_shape.dims("col2im", dx.shape, cols.shape, kh, kw, stride, pad)
    _col2im(cols, c, h, w, kh, kw, stride, pad, oh, ow, dx)


def nhwc_to_nchw(src, dst):
    src, dst = _dev(src), _dev(dst)
    c, h, w = host_shape.layout("nhwc_to_nchw", dst.shape, src, "src")
    _nhwc_to_nchw(src, c, h, w, dst)


def nchw_to_nhwc(src, dst):
    src, dst = _dev(src), _dev(dst)
    c, h, w = host_shape.layout("nchw_to_nhwc", src.shape, dst, "dst")
    _nchw_to_nhwc(src, c, h, w, dst)


# The convolution itself (the optional hooks Conv2D prefers to im2col + GEMM + transposes): columns
# in (C*KH*KW, N*OH*OW) layout, one GEMM over the whole batch, and one pass that moves the
# (OC, N, OH*OW) product to NCHW. In that layout consecutive threads touch consecutive output
# pixels, so the column gather, its inverse and the move read and write runs of memory, where
# the (N*OH*OW, C*KH*KW) layout of im2col above strides every access by a row.
# grid: x over the output pixels of one image, y over channels, z over images; each thread writes
# its pixel's K*K taps (rows c*K*K .. c*K*K + K*K - 1), so the index arithmetic (32 bits) is paid
# once per pixel, not per element: it, not memory, bounded the one-element-per-thread version
_IM2COL_CM_SRC = r"""
extern "C" __global__ void mpitrain_im2col_cm(const T* x, T* cols, int n_n, int c_n, int h_n,
                                              int w_n, int k, int stride, int pad, int oh_n,
                                              int ow_n) {
    int l_n = oh_n * ow_n, p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= l_n) return;
    int oh = p / ow_n, ow = p - oh * ow_n;
    int h0 = oh * stride - pad, w0 = ow * stride - pad;
    long long nl = (long long)n_n * l_n;
    for (int c = blockIdx.y; c < c_n; c += gridDim.y)
        for (int n = blockIdx.z; n < n_n; n += gridDim.z) {
            const T* plane = x + ((long long)n * c_n + c) * h_n * w_n;
            T* out = cols + (long long)c * k * k * nl + (long long)n * l_n + p;
            for (int ki = 0; ki < k; ++ki) {
                int h = h0 + ki;
                bool row_inside = h >= 0 && h < h_n;
                for (int kj = 0; kj < k; ++kj, out += nl) {
                    int w = w0 + kj;
                    *out = (row_inside && w >= 0 && w < w_n) ? plane[h * w_n + w] : (T)0;
                }
            }
        }
}
"""

# gather: every input pixel sums the columns that read it (no atomics, fixed order); grid: x
# over the pixels of one plane, y over channels, z over images; stride 1 divides nothing
_COL2IM_CM_SRC = r"""
extern "C" __global__ void mpitrain_col2im_cm(const T* cols, T* dx, int n_n, int c_n, int h_n,
                                              int w_n, int k, int stride, int pad, int oh_n,
                                              int ow_n) {
    int pix = blockIdx.x * blockDim.x + threadIdx.x;
    if (pix >= h_n * w_n) return;
    int h = pix / w_n, w = pix - h * w_n, l_n = oh_n * ow_n;
    long long nl = (long long)n_n * l_n;
    for (int c = blockIdx.y; c < c_n; c += gridDim.y)
        for (int n = blockIdx.z; n < n_n; n += gridDim.z) {
            const T* img = cols + (long long)c * k * k * nl + (long long)n * l_n;
            T acc = 0;
            for (int ki = 0; ki < k; ++ki) {
                int th = h + pad - ki, oh = stride == 1 ? th : th / stride;   // no division
                if (th < 0 || oh >= oh_n || (stride != 1 && th % stride != 0)) continue;
                for (int kj = 0; kj < k; ++kj) {
                    int tw = w + pad - kj, ow = stride == 1 ? tw : tw / stride;
                    if (tw < 0 || ow >= ow_n || (stride != 1 && tw % stride != 0)) continue;
                    acc += img[(ki * k + kj) * nl + oh * ow_n + ow];
                }
            }
            dx[(((long long)n * c_n + c) * h_n + h) * w_n + w] = acc;
        }
}
"""
_GRID_MAX = 65535                        # gridDim.y and .z; the kernels loop over the rest


def _launch_planes(source, kernel_name, dtype, pixels, rows, images, args):
    """A grid of ``pixels`` threads in blocks of 128, by ``rows``, by ``images`` (the kernel
    loops over what exceeds _GRID_MAX)."""
    threads = 128
    grid = ((pixels + threads - 1) // threads, min(rows, _GRID_MAX), min(images, _GRID_MAX))
    _raw_kernel(source, kernel_name, dtype)(grid, (threads,), args)


# y (N, OC, L) = rows (OC, N*L) moved to NCHW, + bias, then ReLU
_rows_to_nchw = cp.ElementwiseKernel(
    "raw T rows, raw T bias, bool use_bias, bool relu, int32 oc_n, int32 l_n, int64 nl", "T y",
    """
    long long n = i / ((long long)oc_n * l_n);
    int rest = (int)(i - n * oc_n * l_n), o = rest / l_n, p = rest - o * l_n;
    T v = rows[o * nl + n * l_n + p];
    if (use_bias) v += bias[o];
    y = (relu && v < (T)0) ? (T)0 : v;
    """, "mpitrain_rows_to_nchw")

# g (OC, N*L) = grad_y (N, OC, L) moved to rows, zero where the forward ReLU was
_nchw_to_rows = cp.ElementwiseKernel(
    "raw T gy, raw T y, bool relu, int32 oc_n, int32 l_n, int64 nl", "T g",
    """
    long long o = i / nl, q = i - o * nl, n = q / l_n;
    long long src = (n * oc_n + o) * l_n + (q - n * l_n);
    g = (relu && !(y[src] > (T)0)) ? (T)0 : gy[src];
    """, "mpitrain_nchw_to_rows")


def _conv_plan(kind, x, weight, y, stride, pad):
    """(N, C, H, W, OC, KH, KW, OH, OW) of a convolution; ValueError naming ``kind``."""
    if x.ndim != 4 or weight.ndim != 4 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{kind}: x {x.shape} and weight {weight.shape} do not match "
                         f"(need (N, C, H, W) and (OC, C, KH, KW))")
    n, c, h, w = x.shape
    oc, _, kh, kw = weight.shape
    if kh != kw:
        raise ValueError(f"{kind}: the kernel must be square, got {kh}x{kw}")
    oh, ow = host_shape.out_size(h, kh, stride, pad), host_shape.out_size(w, kw, stride, pad)
    if y.shape != (n, oc, oh, ow) or not (x.flags.c_contiguous and y.flags.c_contiguous
                                          and weight.flags.c_contiguous):
        raise ValueError(f"{kind}: y {y.shape} != {(n, oc, oh, ow)} or not C-contiguous")
    return n, c, h, w, oc, kh, kw, oh, ow


def _geometry(dims, stride, pad):
    """The kernels' int32 arguments after the two arrays."""
    n, c, h, w, _, k, _, oh, ow = dims
    return tuple(np.int32(v) for v in (n, c, h, w, k, stride, pad, oh, ow))


def _columns(x, dims, stride, pad):
    n, c, _, _, _, k, _, oh, ow = dims
    cols = cp.empty((c * k * k, n * oh * ow), x.dtype)         # (CKK, N*L)
    if cols.size:
        _launch_planes(_IM2COL_CM_SRC, "mpitrain_im2col_cm", x.dtype, oh * ow, c, n,
                       (x, cols) + _geometry(dims, stride, pad))
    return cols


def conv2d_forward(x, weight, bias, y, stride, pad, relu):
    x, weight, y = _dev(x), _dev(weight), _dev(y)
    dims = _conv_plan("conv2d_forward", x, weight, y, stride, pad)
    n, _, _, _, oc, _, _, oh, ow = dims
    if bias is not None:
        bias = _dev(bias)
        norm_shape.same_shape("conv2d_forward", (oc,), bias=bias)
    if not y.size:
        return
    cols = _columns(x, dims, stride, pad)
    rows = cp.empty((oc, cols.shape[1]), x.dtype)              # (OC, N*L)
    gemm(weight.reshape(oc, -1), cols, rows)
    del cols
    _rows_to_nchw(rows, weight if bias is None else bias, bias is not None, bool(relu), oc,
                  oh * ow, n * oh * ow, y)


def conv2d_backward(x, weight, y, grad_y, stride, pad, relu, grad_weight, accumulate_weight,
                    grad_bias, grad_x):
    x, weight, y, grad_y = _dev(x), _dev(weight), _dev(y), _dev(grad_y)
    dims = _conv_plan("conv2d_backward", x, weight, y, stride, pad)
    n, c, h, w, oc, kh, kw, oh, ow = dims
    grad_weight = _dev(grad_weight)
    norm_shape.same_shape("conv2d_backward", y.shape, grad_y=grad_y)
    norm_shape.same_shape("conv2d_backward", weight.shape, grad_weight=grad_weight)
    if grad_x is not None:
        grad_x = _dev(grad_x)
        norm_shape.same_shape("conv2d_backward", x.shape, grad_x=grad_x)
    nl = n * oh * ow
    g = cp.empty((oc, nl), x.dtype)                           # (OC, N*L)
    if nl:
        _nchw_to_rows(grad_y, y, bool(relu), oc, oh * ow, nl, g)
    cols = _columns(x, dims, stride, pad)                     # (CKK, N*L)
    gemm(g, cols, grad_weight.reshape(oc, -1), trans_b=True, accumulate=accumulate_weight)
    if grad_bias is not None:                                 # grad_bias (OC, 1) += g @ ones
        grad_bias = _dev(grad_bias)
        norm_shape.same_shape("conv2d_backward", (oc,), grad_bias=grad_bias)
        gemm(g, _ones_row(nl, g.dtype).reshape(nl, 1), grad_bias.reshape(oc, 1), accumulate=True)
    if grad_x is None:
        return
    gemm(weight.reshape(oc, -1), g, cols, trans_a=True)       # d(cols), in place of cols
    if grad_x.size:
        _launch_planes(_COL2IM_CM_SRC, "mpitrain_col2im_cm", x.dtype, h * w, c, n,
                       (cols, grad_x) + _geometry(dims, stride, pad))


# --- Pooling and dropout ------------------------------------------------------------------------

_maxpool_forward = cp.ElementwiseKernel(
    "raw T x, int32 c_n, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n",
    "T y, int32 argmax",
    """
    int ow = i % ow_n, oh = (i / ow_n) % oh_n;
    long long plane = i / ((long long)ow_n * oh_n);         // n * C + c
    const long long base = plane * h_n * w_n;
    int h0 = oh * stride, w0 = ow * stride;
    T best = x[base + h0 * w_n + w0];
    int at = h0 * w_n + w0;
    for (int h = h0; h < h0 + k; ++h)
        for (int w = w0; w < w0 + k; ++w) {
            T v = x[base + h * w_n + w];
            if (v > best) { best = v; at = h * w_n + w; }  // first maximum wins
        }
    y = best;
    argmax = at;
    """, "mpitrain_maxpool_forward")

_maxpool_backward = cp.ElementwiseKernel(
    "T gy, int32 arg, int64 hw_in, int64 hw_out", "raw T gx",
    "atomicAdd(&gx[(i / hw_out) * hw_in + arg], gy)", "mpitrain_maxpool_backward")


def maxpool_forward(x, y, argmax, k, stride):
    x, y, argmax = _dev(x), _dev(y), _dev(argmax)
    n, c, h, w = x.shape
    expect = (n, c, (h - k) // stride + 1, (w - k) // stride + 1)
    if y.shape != expect or argmax.shape != expect or argmax.dtype != np.int32:
        raise ValueError(f"maxpool_forward: y {y.shape} / argmax {argmax.shape} "
                         f"{argmax.dtype} != {expect} int32")
    _maxpool_forward(x, c, h, w, k, stride, expect[2], expect[3], y, argmax)


def maxpool_backward(grad_y, argmax, grad_x):
    grad_y, argmax, grad_x = _dev(grad_y), _dev(argmax), _dev(grad_x)
    if grad_y.shape != argmax.shape or grad_y.shape[:2] != grad_x.shape[:2]:
        raise ValueError(f"maxpool_backward: grad_y {grad_y.shape}, argmax {argmax.shape}, "
                         f"grad_x {grad_x.shape} do not match")
    grad_x.fill(0)
    hw_in = grad_x.shape[2] * grad_x.shape[3]
    hw_out = grad_y.shape[2] * grad_y.shape[3]
    _maxpool_backward(grad_y, argmax, hw_in, hw_out, grad_x)


# gather over y (N, C, OH, OW), summed in double
_avgpool_forward = cp.ElementwiseKernel(
    "raw T x, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n", "T y",
    """
    int ow = i % ow_n, oh = (i / ow_n) % oh_n;
    long long base = (i / ((long long)ow_n * oh_n)) * h_n * w_n;   // plane n * C + c
    double s = 0.0;
    for (int ki = 0; ki < k; ++ki)
        for (int kj = 0; kj < k; ++kj)
            s += (double)x[base + (long long)(oh * stride + ki) * w_n + ow * stride + kj];
    y = (T)(s / (k * k));
    """, "mpitrain_avgpool_forward")

# gather over gx (N, C, H, W): the windows oh with oh*stride <= h < oh*stride + k
_avgpool_backward = cp.ElementwiseKernel(
    "raw T gy, int32 h_n, int32 w_n, int32 k, int32 stride, int32 oh_n, int32 ow_n", "T gx",
    """
    int w = i % w_n, h = (i / w_n) % h_n;
    long long base = (i / ((long long)w_n * h_n)) * oh_n * ow_n;   // plane n * C + c
    int i_lo = h - k + 1, j_lo = w - k + 1;
    i_lo = i_lo <= 0 ? 0 : (i_lo + stride - 1) / stride;
    j_lo = j_lo <= 0 ? 0 : (j_lo + stride - 1) / stride;
    int i_hi = h / stride < oh_n - 1 ? h / stride : oh_n - 1;
    int j_hi = w / stride < ow_n - 1 ? w / stride : ow_n - 1;
    double s = 0.0;
    for (int a = i_lo; a <= i_hi; ++a)
        for (int b = j_lo; b <= j_hi; ++b)
            s += (double)gy[base + (long long)a * ow_n + b];
    gx = (T)(s / (k * k));
    """, "mpitrain_avgpool_backward")


def avgpool_forward(x, y, k, stride):
    x, y = _dev(x), _dev(y)
    oh, ow = host_shape.pool("avgpool_forward", x.shape, y.shape, k, stride)
    _avgpool_forward(_flat(x), x.shape[2], x.shape[3], int(k), int(stride), oh, ow, _flat(y))


def avgpool_backward(grad_y, grad_x, k, stride):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    oh, ow = host_shape.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    _avgpool_backward(_flat(grad_y), grad_x.shape[2], grad_x.shape[3], int(k), int(stride),
                      oh, ow, _flat(grad_x))


_dropout_forward = cp.ElementwiseKernel(
    "T x, uint32 threshold, T keep_scale, uint32 seed_hash", "T y, T mask",
    """
    unsigned int h = mpitrain_mix32(mpitrain_mix32((unsigned int)i) ^ seed_hash);
    T m = (h >> 8) >= threshold ? keep_scale : (T)0;
    mask = m;
    y = x * m;
    """, "mpitrain_dropout_forward", preamble=r"""
    __device__ unsigned int mpitrain_mix32(unsigned int x) {   // lowbias32, the contract's hash
        x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
        return x;
    }
    """)


def dropout_forward(x, y, mask, p, seed):
    x, y, mask = _flat(x), _flat(y), _flat(mask)
    host_shape.same_size("dropout_forward", x, y, mask)
    threshold = np.uint32(dropout_hash.keep_threshold(p))
    _dropout_forward(x, threshold, _s(mask, 1.0 / (1.0 - p)),
                     np.uint32(dropout_hash.mix32(int(seed))), y, mask)


def dropout_backward(grad_y, mask, grad_x):
    grad_y, mask, grad_x = _flat(grad_y), _flat(mask), _flat(grad_x)
    host_shape.same_size("dropout_backward", grad_y, mask, grad_x)
    cp.multiply(grad_y, mask, out=grad_x)


# --- Optimizer updates --------------------------------------------------------------------------

_sgd_plain = cp.ElementwiseKernel(
    "T grad, T lr, T wd", "T param", "param = param - lr * (grad + wd * param)",
    "mpitrain_sgd_plain")
_sgd_momentum = cp.ElementwiseKernel(
    "T grad, T lr, T momentum, bool nesterov, T wd", "T param, T buf",
    """
    T g = grad + wd * param;
    T b = momentum * buf + g;
    buf = b;
    param = param - lr * (nesterov ? g + momentum * b : b);
    """, "mpitrain_sgd_momentum")
_adam = cp.ElementwiseKernel(
    "T grad, T step_size, T beta1, T beta2, T eps, T wd, T inv_sqrt_bc2", "T param, T m, T v",
    """
    T g = grad + wd * param;
    T mi = beta1 * m + ((T)1 - beta1) * g;
    T vi = beta2 * v + ((T)1 - beta2) * g * g;
    m = mi;
    v = vi;
    param = param - step_size * mi / (sqrt(vi) * inv_sqrt_bc2 + eps);
    """, "mpitrain_adam")


def sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay):
    param, grad = _flat(param), _flat(grad)
    host_shape.same_size("sgd_update", param, grad)
    if momentum == 0:                                    # buf unused (and may be None)
        _sgd_plain(grad, _s(param, lr), _s(param, weight_decay), param)
        return
    buf = _flat(buf)
    host_shape.same_size("sgd_update", param, buf)
    _sgd_momentum(grad, _s(param, lr), _s(param, momentum), bool(nesterov),
                  _s(param, weight_decay), param, buf)


# Every parameter of an optimizer in one launch (PyTorch's multi-tensor apply): a table of the
# tensors' addresses and sizes, and one block per chunk of a tensor. The arithmetic is
# sgd_update's, in the same order, so the two give the same values.
_SGD_GROUP_SRC = r"""
extern "C" __global__ void mpitrain_sgd_group(const long long* params, const long long* grads,
                                              const long long* bufs, const long long* sizes,
                                              const T* decays, const int* chunk_tensor,
                                              const long long* chunk_start, long long chunk,
                                              T lr, T momentum, int nesterov) {
    int t = chunk_tensor[blockIdx.x];
    long long start = chunk_start[blockIdx.x], end = start + chunk;
    end = end < sizes[t] ? end : sizes[t];
    T* param = (T*)params[t];
    const T* grad = (const T*)grads[t];
    T* buf = (T*)bufs[t];
    T wd = decays[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        if (momentum == (T)0) {
            param[i] = param[i] - lr * (grad[i] + wd * param[i]);
        } else {
            T g = grad[i] + wd * param[i];
            T b = momentum * buf[i] + g;
            buf[i] = b;
            param[i] = param[i] - lr * (nesterov ? g + momentum * b : b);
        }
    }
}
"""
_GROUP_CHUNK = 8192
_group_tables = {}


def _address(a):
    """The device address of ``a`` (a NumPy array's own address for the CPU stand-in of CuPy
    that the tests use)."""
    data = a.data
    return data.ptr if hasattr(data, "ptr") else a.ctypes.data


def _group_table(arrays, decays, dtype):
    """Device tables of a multi-tensor launch over ``arrays`` (lists of equal-length lists of
    C-contiguous arrays of ``dtype``, the same size at each position), cached by addresses; None
    where the arrays do not qualify."""
    key = (dtype.str, tuple(decays), tuple(a.size for a in arrays[0])) + tuple(
        _address(a) for group in arrays for a in group)
    table = _group_tables.get(key)
    if table is None:
        if len(_group_tables) >= 64:     # optimizers come and go (tests, restarts): keep a few
            _group_tables.clear()
        sizes = [a.size for a in arrays[0]]
        for group in arrays:
            for a, size in zip(group, sizes):
                if (not isinstance(a, cp.ndarray) or a.dtype != dtype or a.size != size
                        or not a.flags.c_contiguous):
                    return None
        starts = [(t, s) for t, size in enumerate(sizes) for s in range(0, size, _GROUP_CHUNK)]
        table = tuple(cp.asarray(np.asarray(v, dt)) for v, dt in (
            ([[_address(a) for a in group] for group in arrays], np.int64),
            (sizes, np.int64), (decays, dtype), ([t for t, _ in starts] or [0], np.int32),
            ([s for _, s in starts] or [0], np.int64))) + (len(starts),)
        _group_tables[key] = table
    return table


def sgd_update_group(params, grads, bufs, lr, momentum, nesterov, weight_decays):
    """sgd_update of every (param, grad, buf, weight decay) in one launch; ``bufs`` may be the
    params themselves when momentum is 0 (not read then)."""
    dtype = params[0].dtype if params else None
    table = (_group_table([params, grads, bufs], [float(d) for d in weight_decays], dtype)
             if dtype in _SCALARS else None)
    if table is None:                    # mixed dtypes, views, host arrays: one launch each
        for p, g, b, wd in zip(params, grads, bufs, weight_decays):
            sgd_update(p, g, b, lr, momentum, nesterov, wd)
        return
    addresses, sizes, decays, chunk_tensor, chunk_start, chunks = table
    if chunks:
        _raw_kernel(_SGD_GROUP_SRC, "mpitrain_sgd_group", dtype)(
            (chunks,), (256,), (addresses[0], addresses[1], addresses[2], sizes, decays,
                                chunk_tensor, chunk_start, np.int64(_GROUP_CHUNK),
                                dtype.type(lr), dtype.type(momentum), np.int32(bool(nesterov))))


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    if step < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step!r}")
    param, grad, m, v = _flat(param), _flat(grad), _flat(m), _flat(v)
    host_shape.same_size("adam_update", param, grad)
    # PyTorch: step_size = lr / (1 - b1^t); denom = sqrt(v) / sqrt(1 - b2^t) + eps
    s = lambda value: _s(param, value)  # noqa: E731
    _adam(grad, s(lr / (1.0 - beta1 ** step)), s(beta1), s(beta2), s(eps), s(weight_decay),
          s(1.0 / np.sqrt(1.0 - beta2 ** step)), param, m, v)


# grad_avg and buf are raw (indexed by i, never touched when unused), so the param may stand in
# for them without centering / momentum
_rmsprop = cp.ElementwiseKernel(
    "T grad, T lr, T alpha, T eps, T wd, T momentum, bool centered",
    "T param, T square_avg, raw T grad_avg, raw T buf",
    """
    T g = grad + wd * param;
    T v = alpha * square_avg + ((T)1 - alpha) * g * g;
    square_avg = v;
    if (centered) {
        T ga = alpha * grad_avg[i] + ((T)1 - alpha) * g;
        grad_avg[i] = ga;
        v = v - ga * ga;
    }
    T step = g / (sqrt(v) + eps);
    if (momentum != (T)0) {
        T b = momentum * buf[i] + step;
        buf[i] = b;
        step = b;
    }
    param = param - lr * step;
    """, "mpitrain_rmsprop")


def rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered):
    param, grad, square_avg = _flat(param), _flat(grad), _flat(square_avg)
    grad_avg = _flat(grad_avg) if centered else param
    buf = _flat(buf) if momentum != 0 else param
    host_shape.same_size("rmsprop_update", param, grad, square_avg, grad_avg, buf)
    s = lambda value: _s(param, value)  # noqa: E731
    _rmsprop(grad, s(lr), s(alpha), s(eps), s(weight_decay), s(momentum), bool(centered), param,
             square_avg, grad_avg, buf)


# --- Collective reductions ----------------------------------------------------------------------

def reduce_into(dst, src, op):
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {sorted(_OPS)}")
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("reduce_into", src, dst)
    _OPS[op](dst, src, out=dst)


# --- Normalisation, pooling and shortcuts -------------------------------------------------------

# Per-channel sums over x viewed as (N, C, L), two at once, in float64, in three launches with
# a fixed order of additions (deterministic): every thread sums one run of _RUN values of an
# (n, c) plane (consecutive threads, consecutive runs: a warp reads 2 KiB in a row), then each
# (c, run) sums its N values, then each channel its runs. A CuPy ReductionKernel over axes (0, 2)
# gives a channel one block (1-3 % of the copy's bandwidth on 16 channels), and a ReductionKernel
# call costs tens of microseconds of host time, several times a RawKernel launch.
_RUN = 16
_CHANNEL_SUMS_SRC = f"#define RUN {_RUN}\n" + r"""
extern "C" __global__ void mpitrain_channel_runs(const T* x, const T* g, const T* mean,
                                                 const T* invstd, double* part, int n_n,
                                                 int c_n, int l_n, int runs, int with_grad) {
    // part (2, N, C, runs): sums of x and x*x, or (with_grad) of g and g*(x - mean)*invstd
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= runs) return;
    int lo = j * RUN, hi = lo + RUN < l_n ? lo + RUN : l_n;
    long long half = (long long)n_n * c_n * runs;
    for (int c = blockIdx.y; c < c_n; c += gridDim.y) {
        double m = with_grad ? (double)mean[c] : 0.0, is = with_grad ? (double)invstd[c] : 0.0;
        for (int n = blockIdx.z; n < n_n; n += gridDim.z) {
            long long base = ((long long)n * c_n + c) * l_n;
            double s0 = 0.0, s1 = 0.0;
            for (int i = lo; i < hi; ++i) {
                double v = (double)x[base + i];
                if (with_grad) {
                    double gv = (double)g[base + i];
                    s0 += gv;
                    s1 += gv * ((v - m) * is);
                } else {
                    s0 += v;
                    s1 += v * v;
                }
            }
            long long o = ((long long)n * c_n + c) * runs + j;
            part[o] = s0;
            part[half + o] = s1;
        }
    }
}

extern "C" __global__ void mpitrain_sum_images(const double* part, double* runs_sum, int n_n,
                                               int cr) {
    // runs_sum (2, C*runs) = part (2, N, C*runs) summed over N, in order
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= 2 * cr) return;
    int s = t / cr, r = t - s * cr;
    const double* p = part + (long long)s * n_n * cr + r;
    double acc = 0.0;
    for (int n = 0; n < n_n; ++n) acc += p[(long long)n * cr];
    runs_sum[t] = acc;
}

extern "C" __global__ void mpitrain_sum_runs(const double* runs_sum, double* stats, int c_n,
                                             int runs) {
    // stats (2, C) = runs_sum (2, C, runs) summed over the runs, in order
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= 2 * c_n) return;
    double acc = 0.0;
    for (int j = 0; j < runs; ++j) acc += runs_sum[(long long)t * runs + j];
    stats[t] = acc;
}
"""


def _ncl(kind, x):
    """(N, C, L) view of a contiguous (N, C) or (N, C, H, W) array, and (N, C, L)."""
    x = _dev(x)
    n, c, l = norm_shape.ncl(kind, x.shape)
    if not x.flags.c_contiguous:
        raise ValueError(f"{kind}: array must be C-contiguous, got strides {x.strides}")
    return x.reshape(n, c, l), (n, c, l)


def _channel_sums(stats, x3, grad=None, mean=None, invstd=None):
    """stats (2, C) float64 = per-channel sums of x3 (N, C, L) and x3**2, or with ``grad`` of
    grad and grad * (x3 - mean) * invstd."""
    n, c, l = x3.shape
    runs = (l + _RUN - 1) // _RUN
    dtype = x3.dtype
    if not stats.flags.c_contiguous or any(a is not None and a.dtype != dtype
                                           for a in (grad, mean, invstd)):
        raise ValueError(f"BatchNorm sums: stats must be C-contiguous and grad, mean and invstd "
                         f"{dtype} like x")
    if not n * c * l:
        stats.fill(0)
        return
    part = cp.empty((2, n, c, runs), np.float64)
    _launch_planes(_CHANNEL_SUMS_SRC, "mpitrain_channel_runs", dtype, runs, c, n,
                   (x3, x3 if grad is None else grad, x3 if mean is None else mean,
                    x3 if invstd is None else invstd, part, np.int32(n), np.int32(c),
                    np.int32(l), np.int32(runs), np.int32(grad is not None)))
    runs_sum = cp.empty((2, c * runs), np.float64)
    _launch_rows(_CHANNEL_SUMS_SRC, "mpitrain_sum_images", dtype, 2 * c * runs,
                 (part, runs_sum, np.int32(n), np.int32(c * runs)))
    _launch_rows(_CHANNEL_SUMS_SRC, "mpitrain_sum_runs", dtype, 2 * c,
                 (runs_sum, stats, np.int32(c), np.int32(runs)))


def bn_stats(x, stats):
    x3, (_, c, _) = _ncl("bn_stats", x)                          # (N, C, L)
    stats = _dev(stats)
    norm_shape.stats("bn_stats", stats, c)
    _channel_sums(stats, x3)


_bn_moments = cp.ElementwiseKernel(
    "float64 s0, float64 s1, float64 count, float64 eps, float64 momentum, float64 unbias",
    "T mean, T invstd, T running_mean, T running_var",
    """
    double m = s0 / count;
    double var = s1 / count - m * m;
    var = var > 0.0 ? var : 0.0;                                // biased
    mean = (T)m;
    invstd = (T)(1.0 / sqrt(var + eps));
    running_mean = (T)((1.0 - momentum) * (double)running_mean + momentum * m);
    running_var = (T)((1.0 - momentum) * (double)running_var + momentum * var * unbias);
    """, "mpitrain_bn_moments")

_bn_eval_moments = cp.ElementwiseKernel(
    "T running_mean, T running_var, float64 eps", "T mean, T invstd",
    "mean = running_mean; invstd = (T)(1.0 / sqrt((double)running_var + eps))",
    "mpitrain_bn_eval_moments")


def bn_moments(stats, count, eps, momentum, mean, invstd, running_mean, running_var):
    stats, mean, invstd = _dev(stats), _dev(mean), _dev(invstd)
    running_mean, running_var = _dev(running_mean), _dev(running_var)
    c = mean.size
    norm_shape.stats("bn_moments", stats, c)
    norm_shape.same_shape("bn_moments", (c,), mean=mean, invstd=invstd,
                          running_mean=running_mean, running_var=running_var)
    count = norm_shape.count("bn_moments", count)
    unbias = count / (count - 1.0) if count > 1.0 else 1.0     # running_var is unbiased
    _bn_moments(stats[0], stats[1], count, float(eps), float(momentum), unbias, mean, invstd,
                running_mean, running_var)


def bn_eval_moments(running_mean, running_var, eps, mean, invstd):
    running_mean, running_var = _dev(running_mean), _dev(running_var)
    mean, invstd = _dev(mean), _dev(invstd)
    norm_shape.same_shape("bn_eval_moments", (mean.size,), invstd=invstd,
                          running_mean=running_mean, running_var=running_var)
    _bn_eval_moments(running_mean, running_var, float(eps), mean, invstd)


# x and y flat; element i is in channel (i / L) % C
_bn_forward = cp.ElementwiseKernel(
    "T x, raw T mean, raw T invstd, raw T weight, raw T bias, int64 l_n, int64 c_n", "T y",
    """
    long long c = (i / l_n) % c_n;
    y = (x - mean[c]) * (invstd[c] * weight[c]) + bias[c];
    """, "mpitrain_bn_forward")


def bn_forward(x, mean, invstd, weight, bias, y):
    x3, (_, c, l) = _ncl("bn_forward", x)
    y = _dev(y)
    norm_shape.same_shape("bn_forward", x.shape, y=y)
    mean, invstd, weight, bias = _dev(mean), _dev(invstd), _dev(weight), _dev(bias)
    norm_shape.same_shape("bn_forward", (c,), mean=mean, invstd=invstd, weight=weight, bias=bias)
    _bn_forward(_flat(x3), mean, invstd, weight, bias, l, c, _flat(y))


def bn_backward_stats(grad_y, x, mean, invstd, stats):
    x3, (_, c, _) = _ncl("bn_backward_stats", x)                 # (N, C, L)
    g3, _ = _ncl("bn_backward_stats", grad_y)
    norm_shape.same_shape("bn_backward_stats", x3.shape, grad_y=g3)
    mean, invstd, stats = _dev(mean), _dev(invstd), _dev(stats)
    norm_shape.same_shape("bn_backward_stats", (c,), mean=mean, invstd=invstd)
    norm_shape.stats("bn_backward_stats", stats, c)
    _channel_sums(stats, x3, g3, mean, invstd)


_bn_param_grads = cp.ElementwiseKernel(
    "float64 s0, float64 s1, bool accumulate", "T grad_weight, T grad_bias",
    """
    grad_weight = (T)(accumulate ? (double)grad_weight + s1 : s1);
    grad_bias = (T)(accumulate ? (double)grad_bias + s0 : s0);
    """, "mpitrain_bn_param_grads")


def bn_param_grads(stats, grad_weight, grad_bias, accumulate):
    stats, grad_weight, grad_bias = _dev(stats), _dev(grad_weight), _dev(grad_bias)
    c = grad_weight.size
    norm_shape.stats("bn_param_grads", stats, c)
    norm_shape.same_shape("bn_param_grads", (c,), grad_weight=grad_weight, grad_bias=grad_bias)
    _bn_param_grads(stats[0], stats[1], bool(accumulate), grad_weight, grad_bias)


# grad_x = k*g - k*s0/count - k*invstd*(s1/count)*(x - mean), k = weight*invstd: the per-channel
# constants in double, then cast to T so that the element arithmetic stays in T
_bn_backward_input = cp.ElementwiseKernel(
    "T gy, T x, raw T mean, raw T invstd, raw T weight, raw float64 stats, float64 count, "
    "int64 l_n, int64 c_n", "T gx",
    """
    long long c = (i / l_n) % c_n;
    double inv = (double)invstd[c];
    double k = (double)weight[c] * inv;
    T c0 = (T)(k * stats[c] / count);
    T c1 = (T)(k * inv * stats[c_n + c] / count);
    gx = (T)k * gy - c0 - c1 * (x - mean[c]);
    """, "mpitrain_bn_backward_input")


def bn_backward_input(grad_y, x, mean, invstd, weight, stats, count, grad_x):
    x3, (_, c, l) = _ncl("bn_backward_input", x)
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    norm_shape.same_shape("bn_backward_input", x.shape, grad_y=grad_y, grad_x=grad_x)
    mean, invstd, weight, stats = _dev(mean), _dev(invstd), _dev(weight), _dev(stats)
    norm_shape.same_shape("bn_backward_input", (c,), mean=mean, invstd=invstd, weight=weight)
    norm_shape.stats("bn_backward_input", stats, c)
    count = norm_shape.count("bn_backward_input", count)
    _bn_backward_input(_flat(grad_y), _flat(x3), mean, invstd, weight, stats, count, l, c,
                       _flat(grad_x))


# one thread per (n, c) plane, summed in double: the planes at the end of a network are small
# (8 x 8 in ResNet-20), so a reduction per plane would idle most of its threads
_global_avgpool_forward = cp.ElementwiseKernel(
    "raw T x, int64 l_n", "T y",
    """
    double s = 0.0;
    for (long long j = i * l_n; j < (i + 1) * l_n; ++j) s += (double)x[j];
    y = (T)(s / l_n);
    """, "mpitrain_global_avgpool_forward")

_global_avgpool_backward = cp.ElementwiseKernel(
    "raw T gy, int64 l_n", "T gx", "gx = (T)((double)gy[i / l_n] / l_n)",
    "mpitrain_global_avgpool_backward")


def global_avgpool_forward(x, y):
    x, y = _dev(x), _dev(y)
    _, _, l = norm_shape.pool("global_avgpool_forward", x.shape, y.shape)
    _global_avgpool_forward(_flat(x), l, _flat(y))


def global_avgpool_backward(grad_y, grad_x):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    _, _, l = norm_shape.pool("global_avgpool_backward", grad_x.shape, grad_y.shape)
    _global_avgpool_backward(_flat(grad_y), l, _flat(grad_x))


# gather over y (N, C2, OH, OW): channel c2 reads x's channel c2 - offset, or is zero
_shortcut_forward = cp.ElementwiseKernel(
    "raw T x, int32 c_n, int32 h_n, int32 w_n, int32 c2_n, int32 oh_n, int32 ow_n, "
    "int32 stride, int32 offset", "T y",
    """
    int ow = i % ow_n, oh = (i / ow_n) % oh_n;
    int c = (int)((i / ((long long)ow_n * oh_n)) % c2_n) - offset;
    long long n = i / ((long long)ow_n * oh_n * c2_n);
    y = (c >= 0 && c < c_n) ? x[((n * c_n + c) * h_n + oh * stride) * w_n + ow * stride]
                            : (T)0;
    """, "mpitrain_shortcut_forward")

# gather over grad_x (N, C, H, W): only pixels on the stride grid received a value
_shortcut_backward = cp.ElementwiseKernel(
    "raw T gy, int32 c_n, int32 h_n, int32 w_n, int32 c2_n, int32 oh_n, int32 ow_n, "
    "int32 stride, int32 offset", "T gx",
    """
    int w = i % w_n, h = (i / w_n) % h_n, c = (i / ((long long)w_n * h_n)) % c_n;
    long long n = i / ((long long)w_n * h_n * c_n);
    gx = (h % stride == 0 && w % stride == 0)
        ? gy[((n * c2_n + c + offset) * oh_n + h / stride) * ow_n + w / stride] : (T)0;
    """, "mpitrain_shortcut_backward")


def shortcut_forward(x, y, stride, offset):
    x, y = _dev(x), _dev(y)
    stride, offset = norm_shape.shortcut("shortcut_forward", x.shape, y.shape, stride, offset)
    _, c, h, w = x.shape
    _, c2, oh, ow = y.shape
    _shortcut_forward(_flat(x), c, h, w, c2, oh, ow, stride, offset, _flat(y))


def shortcut_backward(grad_y, grad_x, stride, offset):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    stride, offset = norm_shape.shortcut("shortcut_backward", grad_x.shape, grad_y.shape,
                                         stride, offset, names=("grad_x", "grad_y"))
    _, c, h, w = grad_x.shape
    _, c2, oh, ow = grad_y.shape
    _shortcut_backward(_flat(grad_y), c, h, w, c2, oh, ow, stride, offset, _flat(grad_x))
