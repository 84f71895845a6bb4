"""The CuPy flavour's transformer kernels (the contract: kernels/__init__.py, "Transformer
layers"): embeddings, LayerNorm, GELU, the head layout changes, the batched GEMM of attention
(cuBLAS, strided-batched) and the fused causal softmax.

Row kernels (LayerNorm, causal softmax) give one block to a row (a warp for short rows, up to
_ROW_THREADS threads for long ones): the threads stride through the row (coalesced) and combine
their float64 partials in a shared-memory tree, so every sum has a fixed order. The embedding
gradient gathers instead of scattering: the block of a token that is the first with its id walks
the ids in order and adds every matching row of grad_out (no atomics: the same bits every run,
in the contract's order). LayerNorm's weight and bias gradients: partial sums over chunks of
_LN_CHUNK rows, then each column adds its chunks in order. No ids are checked on the device (that
would synchronise with the host): an id outside [0, V) gives a row of NaN in the forward and is
skipped by the gradient, and reads nothing out of bounds. The argument checks are the backends'
common ones (kernels/checks.py) with the contract's dtypes; every array must be C-contiguous.
"""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import dev, flat

try:                                            # cuBLAS itself, for the batched GEMM
    from cupy.cuda import device as _device
    from cupy_backends.cuda.libs import cublas as _blas
except ImportError:
    _blas = None

_ROW_THREADS = 128          # most threads per block of the row kernels (a power of two, <= 256)
_GRID_X = 2**31 - 1         # gridDim.x; the row kernels loop over the rest
_LN_CHUNK = 64              # rows per partial sum of LayerNorm's weight and bias gradients


def _c_contiguous(kind, **arrays):
    """Device arrays for ``arrays``, in order; ValueError naming one that is not C-contiguous."""
    arrays = {name: dev(a) for name, a in arrays.items()}
    return [checks.contiguous(kind, name, a, a.flags.c_contiguous) for name, a in arrays.items()]


def _rows(kind, name, a):
    """(n, C) view of a C-contiguous (..., C) array."""
    a = dev(a)
    rows = checks.channel_rows(kind, name, a.shape)
    return checks.contiguous(kind, name, a, a.flags.c_contiguous).reshape(rows)


_CTYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long"}
_kernels = {}


def _kernel(source, name, **types):
    """The RawKernel ``name`` of ``source`` with a typedef per keyword (T=dtype, ...), compiled
    at its first use."""
    key = (name,) + tuple((k, np.dtype(v).name) for k, v in sorted(types.items()))
    if key not in _kernels:
        typedefs = "".join(f"typedef {_CTYPES[np.dtype(v).name]} {k};\n"
                           for k, v in sorted(types.items()))
        _kernels[key] = cp.RawKernel(typedefs + source, name)
    return _kernels[key]


def _row_blocks(kernel, rows, length, args):
    """One block per row of ``length`` values (blocks loop over the rows beyond _GRID_X): a
    power of two of threads, from a warp for short rows up to _ROW_THREADS."""
    if rows:
        threads = 32
        while threads < min(length, _ROW_THREADS):
            threads *= 2
        kernel((min(rows, _GRID_X),), (threads,), args)


def _threads(kernel, count, args):
    """``count`` threads in blocks of 128 (none when ``count`` is 0)."""
    if count:
        kernel(((count + 127) // 128,), (128,), args)


# A block's float64 tree reductions: every thread passes its partial and gets the total (or the
# maximum). buf holds one value per thread; the closing barrier lets buf be reused.
_BLOCK_REDUCE = r"""
#define MAX_THREADS 256
__device__ double block_sum(double v, double* buf) {
    unsigned int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half) buf[t] += buf[t + half];
        __syncthreads();
    }
    double total = buf[0];
    __syncthreads();
    return total;
}
__device__ double block_max(double v, double* buf) {
    unsigned int t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (t < half && buf[t + half] > buf[t]) buf[t] = buf[t + half];
        __syncthreads();
    }
    double top = buf[0];
    __syncthreads();
    return top;
}
"""


# Embeddings --------------------------------------------------------------------------------------

# gather over out (n, C); an id outside [0, V) gives a row of NaN (never an out-of-bounds read)
_EMBED_SRC = r"""
extern "C" __global__ void mpitrain_embedding_forward(const ID* ids, const T* weight, T* out,
                                                      long long n, long long c_n, long long v_n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n * c_n) return;
    long long row = i / c_n, c = i - row * c_n;
    long long id = (long long)ids[row];
    out[i] = (id >= 0 && id < v_n) ? weight[id * c_n + c] : (T)nan("");
}

// grid (C blocks of threads, tokens): the block of token k does nothing unless k is the first
// token with its id; then its threads add grad_out[j, c] of every token j >= k with that id to
// grad_weight[id, c], in increasing j (ids outside [0, V) are skipped)
extern "C" __global__ void mpitrain_embedding_backward(const ID* ids, const T* grad_out,
                                                       T* grad_weight, long long n,
                                                       long long c_n, long long v_n) {
    long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (long long k = blockIdx.y; k < n; k += gridDim.y) {
        ID id = ids[k];
        if ((long long)id < 0 || (long long)id >= v_n) continue;
        bool first = true;
        for (long long j = 0; j < k && first; ++j) first = ids[j] != id;
        if (!first || c >= c_n) continue;
        T acc = grad_weight[(long long)id * c_n + c];
        for (long long j = k; j < n; ++j)
            if (ids[j] == id) acc += grad_out[j * c_n + c];
        grad_weight[(long long)id * c_n + c] = acc;
    }
}
"""


def _embedding_args(kind, ids, weight, rows_name, rows):
    """Flat ids (n,), weight (V, C) and the (n, C) view of the token rows."""
    ids, weight = _c_contiguous(kind, ids=ids, weight=weight)
    rows = _rows(kind, rows_name, rows)
    checks.embedding(kind, ids, weight, rows_name, rows, dtypes=True)
    return ids.reshape(-1), weight, rows


def embedding_forward(ids, weight, out):
    ids, weight, out = _embedding_args("embedding_forward", ids, weight, "out", out)
    (n, c), v = out.shape, weight.shape[0]
    _threads(_kernel(_EMBED_SRC, "mpitrain_embedding_forward", T=out.dtype, ID=ids.dtype),
             n * c, (ids, weight, out, np.int64(n), np.int64(c), np.int64(v)))


def embedding_backward(ids, grad_out, grad_weight):
    ids, grad_weight, grad_out = _embedding_args("embedding_backward", ids, grad_weight,
                                                 "grad_out", grad_out)
    (n, c), v = grad_out.shape, grad_weight.shape[0]
    if n * c:
        threads = min(128, 32 * ((c + 31) // 32))
        _kernel(_EMBED_SRC, "mpitrain_embedding_backward", T=grad_out.dtype, ID=ids.dtype)(
            ((c + threads - 1) // threads, min(n, 65535)), (threads,),
            (ids, grad_out, grad_weight, np.int64(n), np.int64(c), np.int64(v)))


# LayerNorm ---------------------------------------------------------------------------------------

# one block per row of x (n, C): mean, then the biased variance around it (two passes over the
# row, in float64); mean and rstd are stored in their own dtype (S); y is computed in T
_LAYERNORM_SRC = _BLOCK_REDUCE + r"""
extern "C" __global__ void mpitrain_layernorm_forward(const T* x, const T* weight, const T* bias,
                                                      T* y, S* mean, S* rstd, double eps,
                                                      long long rows, int c_n) {
    __shared__ double buf[MAX_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * c_n;
        double s = 0.0;
        for (int c = threadIdx.x; c < c_n; c += blockDim.x) s += (double)xr[c];
        double m = block_sum(s, buf) / c_n;
        s = 0.0;
        for (int c = threadIdx.x; c < c_n; c += blockDim.x) {
            double d = (double)xr[c] - m;
            s += d * d;
        }
        double var = block_sum(s, buf) / c_n;
        double rs = 1.0 / sqrt(var + eps);
        if (threadIdx.x == 0) { mean[r] = (S)m; rstd[r] = (S)rs; }
        T mt = (T)m, rt = (T)rs;
        for (int c = threadIdx.x; c < c_n; c += blockDim.x)
            y[r * c_n + c] = (xr[c] - mt) * rt * weight[c] + bias[c];
    }
}

// grad_x (n, C) of one row per block: with xhat = (x - mean) * rstd and dxhat = grad_y * weight,
// grad_x = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)): the two means in float64,
// the elements in T
extern "C" __global__ void mpitrain_layernorm_backward_x(const T* grad_y, const T* x,
                                                         const S* mean, const S* rstd,
                                                         const T* weight, T* grad_x,
                                                         long long rows, int c_n) {
    __shared__ double buf[MAX_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * c_n;
        const T* gr = grad_y + r * c_n;
        T m = (T)mean[r], rs = (T)rstd[r];
        double s0 = 0.0, s1 = 0.0;
        for (int c = threadIdx.x; c < c_n; c += blockDim.x) {
            double d = (double)(gr[c] * weight[c]);
            s0 += d;
            s1 += d * (double)((xr[c] - m) * rs);
        }
        T mean_d = (T)(block_sum(s0, buf) / c_n);
        T mean_dx = (T)(block_sum(s1, buf) / c_n);
        for (int c = threadIdx.x; c < c_n; c += blockDim.x) {
            T xhat = (xr[c] - m) * rs;
            grad_x[r * c_n + c] = rs * (gr[c] * weight[c] - mean_d - xhat * mean_dx);
        }
    }
}

// part (2, chunks, C): per (chunk of `chunk` rows, column) the sums of grad_y * xhat and of
// grad_y, in row order (consecutive threads: consecutive columns)
extern "C" __global__ void mpitrain_layernorm_param_chunks(const T* grad_y, const T* x,
                                                           const S* mean, const S* rstd,
                                                           double* part, long long rows,
                                                           int c_n, int chunks, int chunk) {
    long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t >= (long long)chunks * c_n) return;
    int k = (int)(t / c_n), c = (int)(t - (long long)k * c_n);
    long long lo = (long long)k * chunk, hi = lo + chunk < rows ? lo + chunk : rows;
    double sw = 0.0, sb = 0.0;
    for (long long r = lo; r < hi; ++r) {
        T g = grad_y[r * c_n + c];
        sw += (double)(g * ((x[r * c_n + c] - (T)mean[r]) * (T)rstd[r]));
        sb += (double)g;
    }
    part[t] = sw;
    part[(long long)chunks * c_n + t] = sb;
}

// grad_weight, grad_bias (C,) (=|+=) the chunk sums, added in chunk order
extern "C" __global__ void mpitrain_layernorm_param_sum(const double* part, T* grad_weight,
                                                        T* grad_bias, int c_n, int chunks,
                                                        int accumulate) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= c_n) return;
    double sw = 0.0, sb = 0.0;
    for (int k = 0; k < chunks; ++k) {
        sw += part[(long long)k * c_n + c];
        sb += part[(long long)(chunks + k) * c_n + c];
    }
    if (accumulate) {
        grad_weight[c] = (T)((double)grad_weight[c] + sw);
        grad_bias[c] = (T)((double)grad_bias[c] + sb);
    } else {
        grad_weight[c] = (T)sw;
        grad_bias[c] = (T)sb;
    }
}
"""


def _layernorm_kernel(name, x, stats):
    return _kernel(_LAYERNORM_SRC, name, T=x.dtype, S=stats.dtype)


def layernorm_forward(x, weight, bias, y, mean, rstd, eps):
    kind = "layernorm_forward"
    x, y = _rows(kind, "x", x), _rows(kind, "y", y)                 # (n, C)
    weight, bias, mean, rstd = _c_contiguous(kind, weight=weight, bias=bias, mean=mean,
                                             rstd=rstd)
    n, c = checks.layernorm(kind, dict(x=x, y=y), dict(weight=weight, bias=bias), mean, rstd,
                            dtypes=True)
    mean, rstd = mean.reshape(-1), rstd.reshape(-1)
    if c:
        _row_blocks(_layernorm_kernel("mpitrain_layernorm_forward", x, mean), n, c,
                    (x, weight, bias, y, mean, rstd, np.float64(eps), np.int64(n), np.int32(c)))


_ln_scratch = {}


def layernorm_backward(grad_y, x, mean, rstd, weight, grad_x, grad_weight, grad_bias,
                       accumulate):
    kind = "layernorm_backward"
    x, grad_y, grad_x = _rows(kind, "x", x), _rows(kind, "grad_y", grad_y), _rows(
        kind, "grad_x", grad_x)                                     # (n, C)
    weight, grad_weight, grad_bias, mean, rstd = _c_contiguous(
        kind, weight=weight, grad_weight=grad_weight, grad_bias=grad_bias, mean=mean, rstd=rstd)
    n, c = checks.layernorm(kind, dict(x=x, grad_y=grad_y, grad_x=grad_x),
                            dict(weight=weight, grad_weight=grad_weight, grad_bias=grad_bias),
                            mean, rstd, dtypes=True)
    mean, rstd = mean.reshape(-1), rstd.reshape(-1)
    if not c:
        return
    _row_blocks(_layernorm_kernel("mpitrain_layernorm_backward_x", x, mean), n, c,
                (grad_y, x, mean, rstd, weight, grad_x, np.int64(n), np.int32(c)))
    chunks = max(1, (n + _LN_CHUNK - 1) // _LN_CHUNK)
    key = (chunks, c)
    if key not in _ln_scratch:
        _ln_scratch[key] = cp.empty((2, chunks, c), np.float64)
    part = _ln_scratch[key]
    _threads(_layernorm_kernel("mpitrain_layernorm_param_chunks", x, mean), chunks * c,
                (grad_y, x, mean, rstd, part, np.int64(n), np.int32(c), np.int32(chunks),
                 np.int32(_LN_CHUNK)))
    _threads(_layernorm_kernel("mpitrain_layernorm_param_sum", x, mean), c,
                (part, grad_weight, grad_bias, np.int32(c), np.int32(chunks),
                 np.int32(bool(accumulate))))


# GELU --------------------------------------------------------------------------------------------

# GPT-2's tanh form, u = sqrt(2/pi) * (x + 0.044715 x^3):
# gelu = 0.5 x (1 + tanh(u)), t = tanh(u);
# d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
_GELU_PREAMBLE = r"""
#define GELU_K0 0.7978845608028654
#define GELU_K1 0.044715
"""
_gelu = cp.ElementwiseKernel(
    "T x", "T out",
    "T t = tanh((T)GELU_K0 * (x + (T)GELU_K1 * x * x * x)); out = (T)0.5 * x * ((T)1 + t)",
    "mpitrain_gelu", preamble=_GELU_PREAMBLE)
_gelu_backward = cp.ElementwiseKernel(
    "T x, T g", "T gin",
    """
    T x2 = x * x;
    T t = tanh((T)GELU_K0 * (x + (T)GELU_K1 * x2 * x));
    gin = g * ((T)0.5 * ((T)1 + t)
               + (T)0.5 * x * ((T)1 - t * t) * (T)GELU_K0 * ((T)1 + (T)(3 * GELU_K1) * x2))
    """, "mpitrain_gelu_backward", preamble=_GELU_PREAMBLE)


def _same_floats(kind, **arrays):
    """Flat views of same-sized arrays of one float dtype."""
    views = {name: flat(a) for name, a in arrays.items()}
    checks.elementwise(kind, dtypes=True, **views)
    return list(views.values())


def gelu(x, out):
    x, out = _same_floats("gelu", x=x, out=out)
    _gelu(x, out)


def gelu_backward(x, grad_out, grad_in):
    x, grad_out, grad_in = _same_floats("gelu_backward", x=x, grad_out=grad_out,
                                        grad_in=grad_in)
    _gelu_backward(x, grad_out, grad_in)


# Head layouts ------------------------------------------------------------------------------------

# gather over the output: to_heads writes out (S, B, H, T, D) from x (B, T, S, H, D); from_heads
# writes out (B, T, S, H, D) from x (S, B, H, T, D)
_to_heads = cp.ElementwiseKernel(
    "raw T x, int64 b_n, int64 t_n, int64 s_n, int64 h_n, int64 d_n", "T out",
    """
    long long d = i % d_n, t = (i / d_n) % t_n, h = (i / (d_n * t_n)) % h_n;
    long long b = (i / (d_n * t_n * h_n)) % b_n, s = i / (d_n * t_n * h_n * b_n);
    out = x[(((b * t_n + t) * s_n + s) * h_n + h) * d_n + d];
    """, "mpitrain_to_heads")
_from_heads = cp.ElementwiseKernel(
    "raw T x, int64 b_n, int64 t_n, int64 s_n, int64 h_n, int64 d_n", "T out",
    """
    long long d = i % d_n, h = (i / d_n) % h_n, s = (i / (d_n * h_n)) % s_n;
    long long t = (i / (d_n * h_n * s_n)) % t_n, b = i / (d_n * h_n * s_n * t_n);
    out = x[(((s * b_n + b) * h_n + h) * t_n + t) * d_n + d];
    """, "mpitrain_from_heads")


def _heads(kind, x, out, rows_side):
    """(B, T, S, H, D) of a head layout change; ``rows_side`` names which of x / out is the
    (B, T, S, H, D) one."""
    x, out = _c_contiguous(kind, x=x, out=out)
    return x, out, checks.heads(kind, x, out, rows_side, dtypes=True)


def to_heads(x, out):
    x, out, dims = _heads("to_heads", x, out, "x")
    if out.size:
        _to_heads(flat(x), *dims, flat(out))


def from_heads(x, out):
    x, out, dims = _heads("from_heads", x, out, "out")
    if out.size:
        _from_heads(flat(x), *dims, flat(out))


# Batched GEMM ------------------------------------------------------------------------------------

# alpha = 1 and beta = 0 or 1, as host pointers (they must outlive the calls)
_SCALARS = {np.dtype(t): (np.ones(1, t), np.zeros(1, t)) for t in (np.float32, np.float64)}
_SCALAR_PTRS = {t: tuple(v.ctypes.data for v in pair) for t, pair in _SCALARS.items()}
_bmm_scratch = {}


def _cublas_batched(a, b, out, trans_a, trans_b, accumulate):
    """out[g] (=|+=) op(a[g]) @ op(b[g]) by one strided-batched cuBLAS call; False where cuBLAS
    is not at hand. Row-major out[g] is column-major out[g].T = op(b[g]).T @ op(a[g]).T, so b
    goes first."""
    if _blas is None:
        return False
    groups, m, n = out.shape
    k = a.shape[1] if trans_a else a.shape[2]
    handle = _device.get_cublas_handle()
    _blas.setPointerMode(handle, _blas.CUBLAS_POINTER_MODE_HOST)
    one, zero = _SCALAR_PTRS[out.dtype]
    (_blas.sgemmStridedBatched if out.dtype.char == "f" else _blas.dgemmStridedBatched)(
        handle, _blas.CUBLAS_OP_T if trans_b else _blas.CUBLAS_OP_N,
        _blas.CUBLAS_OP_T if trans_a else _blas.CUBLAS_OP_N, n, m, k, one,
        b.data.ptr, b.shape[2], b.shape[1] * b.shape[2],
        a.data.ptr, a.shape[2], a.shape[1] * a.shape[2],
        one if accumulate else zero, out.data.ptr, n, m * n, groups)
    return True


def batched_gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    a, b, out = _c_contiguous("batched_gemm", a=a, b=b, out=out)
    k = checks.batched_gemm(a, b, out, trans_a, trans_b, dtypes=True)[3]
    op_a = a.transpose(0, 2, 1) if trans_a else a
    op_b = b.transpose(0, 2, 1) if trans_b else b
    if not out.size:
        return
    if not k:                                   # K = 0: the product is zero
        if not accumulate:
            out.fill(0)
        return
    if _cublas_batched(a, b, out, trans_a, trans_b, accumulate):
        return
    if not accumulate:
        cp.matmul(op_a, op_b, out=out)
        return
    key = (out.shape, out.dtype.str)
    if key not in _bmm_scratch:
        _bmm_scratch[key] = cp.empty(out.shape, out.dtype)
    cp.matmul(op_a, op_b, out=_bmm_scratch[key])
    out += _bmm_scratch[key]


# Causal softmax ----------------------------------------------------------------------------------

# One block per row (g, i) of scores (G, T, T), fused: scale, mask j > i, max, exp-sum (float64),
# normalise, zeros above the diagonal; the elements in T (the scale too), the sums in float64.
# scores and probs may be one array: every element is read and then written by the same thread,
# after the block's last reduction.
_CAUSAL_SRC = _BLOCK_REDUCE + r"""
extern "C" __global__ void mpitrain_causal_softmax(const T* scores, T* probs, T sc,
                                                   long long rows, int t_n) {
    __shared__ double buf[MAX_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        int i = (int)(r % t_n);                  // the query position: keys 0..i are visible
        const T* s = scores + r * t_n;
        T* p = probs + r * t_n;
        double part = -1.7976931348623157e308;    // -DBL_MAX: a thread without keys
        for (int j = threadIdx.x; j <= i; j += blockDim.x) {
            double v = (double)(s[j] * sc);
            part = v > part ? v : part;
        }
        T top = (T)block_max(part, buf);
        double acc = 0.0;
        for (int j = threadIdx.x; j <= i; j += blockDim.x) acc += (double)exp(s[j] * sc - top);
        T inv = (T)(1.0 / block_sum(acc, buf));
        for (int j = threadIdx.x; j < t_n; j += blockDim.x)
            p[j] = j <= i ? exp(s[j] * sc - top) * inv : (T)0;
    }
}

// grad_scores = scale * probs * (grad_probs - sum_{j<=i} grad_probs * probs), 0 for j > i;
// grad_probs and grad_scores may be one array (read, then written, by the same thread)
extern "C" __global__ void mpitrain_causal_softmax_backward(const T* probs, const T* grad_probs,
                                                            T* grad_scores, T sc,
                                                            long long rows, int t_n) {
    __shared__ double buf[MAX_THREADS];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        int i = (int)(r % t_n);
        const T* p = probs + r * t_n;
        const T* gp = grad_probs + r * t_n;
        T* gs = grad_scores + r * t_n;
        double acc = 0.0;
        for (int j = threadIdx.x; j <= i; j += blockDim.x) acc += (double)(gp[j] * p[j]);
        T dot = (T)block_sum(acc, buf);
        for (int j = threadIdx.x; j < t_n; j += blockDim.x)
            gs[j] = j <= i ? sc * p[j] * (gp[j] - dot) : (T)0;
    }
}
"""


def _attention(kind, **arrays):
    """Device arrays (G, T, T) of one float dtype, and (G, T)."""
    views = _c_contiguous(kind, **arrays)
    g, t = checks.causal_scores(kind, dtypes=True, **dict(zip(arrays, views)))
    return views, g, t


def causal_softmax(scores, probs, scale):
    (scores, probs), g, t = _attention("causal_softmax", scores=scores, probs=probs)
    _row_blocks(_kernel(_CAUSAL_SRC, "mpitrain_causal_softmax", T=scores.dtype), g * t, t,
                (scores, probs, scores.dtype.type(scale), np.int64(g * t), np.int32(t)))


def causal_softmax_backward(probs, grad_probs, grad_scores, scale):
    (probs, grad_probs, grad_scores), g, t = _attention(
        "causal_softmax_backward", probs=probs, grad_probs=grad_probs, grad_scores=grad_scores)
    _row_blocks(_kernel(_CAUSAL_SRC, "mpitrain_causal_softmax_backward", T=probs.dtype), g * t,
                t, (probs, grad_probs, grad_scores, probs.dtype.type(scale), np.int64(g * t),
                 np.int32(t)))

