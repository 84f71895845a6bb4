"""The Numba flavour's transformer kernels (the contract: kernels/__init__.py, "Transformer
layers"): embeddings, LayerNorm, GELU, the head layout changes, a batched tiled GEMM and the fused
causal softmax, all ``numba.cuda`` kernels (so they run under the simulator too).

Row kernels (LayerNorm, causal softmax) give one block of _ROW threads to a row: the threads
stride through the row (coalesced) and combine their float64 partials in a shared-memory tree, so
every sum has a fixed order. The embedding gradient gathers instead of scattering: the block of a
token that is the first with its id walks the ids in order and adds every matching row of
grad_out (no atomics: the same bits every run, in the contract's order). LayerNorm's weight and
bias gradients: partial sums over chunks of _LN_CHUNK rows, then each column adds its chunks in
order. The batched GEMM is the tiled, register-blocked GEMM of dense.py with a second grid axis
over the groups (no K split: attention's products have many tiles). No ids are checked on the
device (that would synchronise with the host): an id outside [0, V) gives a row of NaN in the
forward and is skipped by the gradient, and reads nothing out of bounds. The argument checks are
the backends' common ones (kernels/checks.py) with the contract's dtypes; every array must be
C-contiguous.
"""
import math

import numpy as np
from numba import cuda, float64

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import SIM, dev, grid, launch, scratch
from mpitrain.kernels.cuda_numba.dense import MAX_GEMM_BLOCKS, MICRO, TILE, make_gemm

_ROW = 8 if SIM else 128            # threads per block of the row kernels (a power of two)
_ROW_BLOCKS = 2 if SIM else 2**31 - 1
_LN_CHUNK = 4 if SIM else 64        # rows per partial sum of LayerNorm's weight/bias gradients
_GROUP_BLOCKS = 2 if SIM else 65535         # grid y (groups, tokens)
_NEG_MAX = -1.7976931348623157e308  # the float64 maximum's neutral value (a thread without keys)


# --- Device views (the checks themselves: kernels/checks.py) -----------------------------------

def _contiguous(kind, name, a):
    a = dev(a)
    return checks.contiguous(kind, name, a, a.is_c_contiguous())


def _rows(kind, name, a):
    """(n, C) view of a C-contiguous (..., C) device array."""
    a = _contiguous(kind, name, a)
    return a.reshape(*checks.channel_rows(kind, name, a.shape))


def _flat(kind, name, a):
    a = _contiguous(kind, name, a)
    return a if a.ndim == 1 else a.reshape(a.size)


# --- Block reductions (device functions stay in their kernels' module: see arrays.py) -----------

def _row_reduction(take_max):
    """A device function: the sum (or with ``take_max`` the maximum) of one float64 per thread
    of the block, for every thread (all must call)."""
    @cuda.jit(device=True)
    def reduce(v):
        buf = cuda.shared.array(_ROW, float64)
        tid = cuda.threadIdx.x
        buf[tid] = v
        cuda.syncthreads()
        half = _ROW // 2
        while half > 0:
            if tid < half:
                if take_max:            # a constant: Numba compiles the branch taken only
                    if buf[tid + half] > buf[tid]:
                        buf[tid] = buf[tid + half]
                else:
                    buf[tid] += buf[tid + half]
            cuda.syncthreads()
            half //= 2
        result = buf[0]
        cuda.syncthreads()          # buf is reused by the next reduction
        return result
    return reduce


_row_sum = _row_reduction(False)
_row_max = _row_reduction(True)


def _row_launch(kernel, rows, *args):
    if rows:
        kernel[min(rows, _ROW_BLOCKS), _ROW](*args)


# --- Embeddings ---------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _embedding_forward_k(ids, weight, out, nan):
    # gather over out (n, C); an id outside [0, V) gives a row of NaN (no out-of-bounds read)
    n, c_n = out.shape
    v_n = weight.shape[0]
    for i in range(cuda.grid(1), n * c_n, cuda.gridsize(1)):
        r = i // c_n
        c = i - r * c_n
        tok = ids[r]
        if tok >= 0 and tok < v_n:
            out[r, c] = weight[tok, c]
        else:
            out[r, c] = nan


@cuda.jit(cache=True)
def _embedding_backward_k(ids, grad_out, grad_weight):
    # grid (column blocks, tokens): token k's blocks do nothing unless k is the first token with
    # its id; then they add grad_out[j, c] of every token j >= k with that id to
    # grad_weight[id, c] in increasing j (ids outside [0, V) are skipped)
    n, c_n = grad_out.shape
    v_n = grad_weight.shape[0]
    for k in range(cuda.blockIdx.y, n, cuda.gridDim.y):
        tok = ids[k]
        if tok < 0 or tok >= v_n:
            continue
        first = True
        for j in range(k):
            if ids[j] == tok:
                first = False
                break
        if not first:
            continue
        for c in range(cuda.grid(1), c_n, cuda.gridsize(1)):
            acc = grad_weight[tok, c]
            for j in range(k, n):
                if ids[j] == tok:
                    acc += grad_out[j, c]
            grad_weight[tok, c] = acc


def _embedding_args(kind, ids, weight, rows_name, rows):
    """Flat ids (n,), weight (V, C) and the (n, C) view of the token rows."""
    ids, weight = _flat(kind, "ids", ids), _contiguous(kind, "weight", weight)
    rows = _rows(kind, rows_name, rows)
    checks.embedding(kind, ids, weight, rows_name, rows, dtypes=True)
    return ids, weight, rows


def embedding_forward(ids, weight, out):
    ids, weight, out = _embedding_args("embedding_forward", ids, weight, "out", out)
    launch(_embedding_forward_k, out.size, ids, weight, out, out.dtype.type(np.nan))


def embedding_backward(ids, grad_out, grad_weight):
    ids, grad_weight, grad_out = _embedding_args("embedding_backward", ids, grad_weight,
                                                 "grad_out", grad_out)
    n, c = grad_out.shape
    if n * c:
        threads = 32 if SIM else min(128, 32 * ((c + 31) // 32))
        col_blocks = 1 if SIM else (c + threads - 1) // threads
        _embedding_backward_k[(col_blocks, min(n, _GROUP_BLOCKS)), threads](
            ids, grad_out, grad_weight)


# --- LayerNorm ----------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _layernorm_forward_k(x, weight, bias, y, mean, rstd, eps):
    # one block per row of x (n, C): the mean, then the biased variance around it (float64);
    # y in x's dtype from the mean and rstd rounded to it
    rows, c_n = x.shape
    tid = cuda.threadIdx.x
    for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        s = float64(0.0)
        for c in range(tid, c_n, _ROW):
            s += float64(x[r, c])
        m = _row_sum(s) / c_n
        s = float64(0.0)
        for c in range(tid, c_n, _ROW):
            d = float64(x[r, c]) - m
            s += d * d
        rs = 1.0 / math.sqrt(_row_sum(s) / c_n + eps)
        if tid == 0:
            mean[r] = m
            rstd[r] = rs
        mt = x.dtype.type(m)
        rt = x.dtype.type(rs)
        for c in range(tid, c_n, _ROW):
            y[r, c] = (x[r, c] - mt) * rt * weight[c] + bias[c]


@cuda.jit(cache=True)
def _layernorm_backward_x_k(grad_y, x, mean, rstd, weight, grad_x):
    # one block per row: with xhat = (x - mean) * rstd and dxhat = grad_y * weight,
    # grad_x = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the means in float64
    rows, c_n = x.shape
    tid = cuda.threadIdx.x
    for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        m = x.dtype.type(mean[r])
        rs = x.dtype.type(rstd[r])
        s0 = float64(0.0)
        s1 = float64(0.0)
        for c in range(tid, c_n, _ROW):
            d = float64(grad_y[r, c] * weight[c])
            s0 += d
            s1 += d * float64((x[r, c] - m) * rs)
        a = x.dtype.type(_row_sum(s0) / c_n)
        b = x.dtype.type(_row_sum(s1) / c_n)
        for c in range(tid, c_n, _ROW):
            xhat = (x[r, c] - m) * rs
            grad_x[r, c] = rs * (grad_y[r, c] * weight[c] - a - xhat * b)


@cuda.jit(cache=True)
def _layernorm_param_chunks_k(grad_y, x, mean, rstd, part, chunk):
    # part (2, chunks, C): per (chunk of rows, column) the sums of grad_y * xhat and of grad_y
    # in row order (neighbouring threads: neighbouring columns)
    rows, c_n = x.shape
    chunks = part.shape[1]
    for i in range(cuda.grid(1), chunks * c_n, cuda.gridsize(1)):
        k = i // c_n
        c = i - k * c_n
        end = (k + 1) * chunk
        if end > rows:              # not min(): see norm.py
            end = rows
        sw = float64(0.0)
        sb = float64(0.0)
        for r in range(k * chunk, end):
            g = grad_y[r, c]
            sw += float64(g * ((x[r, c] - x.dtype.type(mean[r])) * x.dtype.type(rstd[r])))
            sb += float64(g)
        part[0, k, c] = sw
        part[1, k, c] = sb


@cuda.jit(cache=True)
def _layernorm_param_sum_k(part, grad_weight, grad_bias, accumulate):
    # grad_weight, grad_bias (C,) (=|+=) the chunk sums, added in chunk order
    chunks = part.shape[1]
    for c in range(cuda.grid(1), grad_weight.size, cuda.gridsize(1)):
        sw = float64(0.0)
        sb = float64(0.0)
        for k in range(chunks):
            sw += part[0, k, c]
            sb += part[1, k, c]
        if accumulate:
            sw += float64(grad_weight[c])
            sb += float64(grad_bias[c])
        grad_weight[c] = sw
        grad_bias[c] = sb


def _layernorm(kind, rows, vectors, mean, rstd):
    """(n, C) of LayerNorm's checked arrays and flat views of (vectors, mean, rstd)."""
    vectors = {name: _contiguous(kind, name, a) for name, a in vectors.items()}
    mean, rstd = _flat(kind, "mean", mean), _flat(kind, "rstd", rstd)
    n, c = checks.layernorm(kind, rows, vectors, mean, rstd, dtypes=True)
    return n, c, list(vectors.values()) + [mean, rstd]


def layernorm_forward(x, weight, bias, y, mean, rstd, eps):
    kind = "layernorm_forward"
    x, y = _rows(kind, "x", x), _rows(kind, "y", y)                 # (n, C)
    n, c, (weight, bias, mean, rstd) = _layernorm(kind, dict(x=x, y=y),
                                                  dict(weight=weight, bias=bias), mean, rstd)
    if c:
        _row_launch(_layernorm_forward_k, n, x, weight, bias, y, mean, rstd, float(eps))


def layernorm_backward(grad_y, x, mean, rstd, weight, grad_x, grad_weight, grad_bias,
                       accumulate):
    kind = "layernorm_backward"
    x, grad_y = _rows(kind, "x", x), _rows(kind, "grad_y", grad_y)  # (n, C)
    grad_x = _rows(kind, "grad_x", grad_x)
    n, c, (weight, grad_weight, grad_bias, mean, rstd) = _layernorm(
        kind, dict(x=x, grad_y=grad_y, grad_x=grad_x),
        dict(weight=weight, grad_weight=grad_weight, grad_bias=grad_bias), mean, rstd)
    if not c:
        return
    _row_launch(_layernorm_backward_x_k, n, grad_y, x, mean, rstd, weight, grad_x)
    chunks = max(1, -(-n // _LN_CHUNK))
    part = scratch((2, chunks, c))
    _layernorm_param_chunks_k[grid(chunks * c)](grad_y, x, mean, rstd, part, _LN_CHUNK)
    _layernorm_param_sum_k[grid(c)](part, grad_weight, grad_bias, bool(accumulate))


# --- GELU ---------------------------------------------------------------------------------------
# GPT-2's tanh form, u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh(u): gelu = 0.5 x (1 + t),
# d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2); the constants come
# in x's dtype, so float32 work stays in float32.

_GELU_K0 = math.sqrt(2.0 / math.pi)
_GELU_K1 = 0.044715


@cuda.jit(cache=True)
def _gelu_k(x, out, half, one, k0, k1):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        out[i] = half * v * (one + math.tanh(k0 * (v + k1 * v * v * v)))


@cuda.jit(cache=True)
def _gelu_backward_k(x, grad_out, grad_in, half, one, k0, k1, k3):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        t = math.tanh(k0 * (v + k1 * v * v * v))
        grad_in[i] = grad_out[i] * (half * (one + t)
                                    + half * v * (one - t * t) * k0 * (one + k3 * v * v))


def _same_floats(kind, **arrays):
    """Flat views of same-sized arrays of one float dtype."""
    views = {name: _flat(kind, name, a) for name, a in arrays.items()}
    checks.elementwise(kind, dtypes=True, **views)
    return list(views.values())


def gelu(x, out):
    x, out = _same_floats("gelu", x=x, out=out)
    t = x.dtype.type
    launch(_gelu_k, x.size, x, out, t(0.5), t(1), t(_GELU_K0), t(_GELU_K1))


def gelu_backward(x, grad_out, grad_in):
    x, grad_out, grad_in = _same_floats("gelu_backward", x=x, grad_out=grad_out,
                                        grad_in=grad_in)
    t = x.dtype.type
    launch(_gelu_backward_k, x.size, x, grad_out, grad_in, t(0.5), t(1), t(_GELU_K0),
           t(_GELU_K1), t(3 * _GELU_K1))


# --- Head layouts -------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _to_heads_k(x, out, b_n, t_n, s_n, h_n, d_n):
    # gather over out (S, B, H, T, D) from x (B, T, S, H, D), both flat
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        d = i % d_n
        t = (i // d_n) % t_n
        h = (i // (d_n * t_n)) % h_n
        b = (i // (d_n * t_n * h_n)) % b_n
        s = i // (d_n * t_n * h_n * b_n)
        out[i] = x[(((b * t_n + t) * s_n + s) * h_n + h) * d_n + d]


@cuda.jit(cache=True)
def _from_heads_k(x, out, b_n, t_n, s_n, h_n, d_n):
    # gather over out (B, T, S, H, D) from x (S, B, H, T, D), both flat
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        d = i % d_n
        h = (i // d_n) % h_n
        s = (i // (d_n * h_n)) % s_n
        t = (i // (d_n * h_n * s_n)) % t_n
        b = i // (d_n * h_n * s_n * t_n)
        out[i] = x[(((s * b_n + b) * h_n + h) * t_n + t) * d_n + d]


def _heads(kind, x, out, rows_side):
    """Flat x and out and (B, T, S, H, D) of a head layout change; ``rows_side`` names which of
    x / out is the (B, T, S, H, D) one."""
    x, out = _contiguous(kind, "x", x), _contiguous(kind, "out", out)
    dims = checks.heads(kind, x, out, rows_side, dtypes=True)
    return x.reshape(x.size), out.reshape(out.size), dims


def to_heads(x, out):
    x, out, dims = _heads("to_heads", x, out, "x")
    launch(_to_heads_k, out.size, x, out, *dims)


def from_heads(x, out):
    x, out, dims = _heads("from_heads", x, out, "out")
    launch(_from_heads_k, out.size, x, out, *dims)


# --- Batched GEMM -------------------------------------------------------------------------------

def batched_gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    kind = "batched_gemm"
    a, b, out = _contiguous(kind, "a", a), _contiguous(kind, "b", b), _contiguous(kind, "out",
                                                                                   out)
    g, m, n, _ = checks.batched_gemm(a, b, out, trans_a, trans_b, dtypes=True)
    if not (g and m and n):
        return
    bm = TILE * MICRO
    tiles = ((m + bm - 1) // bm) * ((n + bm - 1) // bm)
    kernel = make_gemm(out.dtype, batched=True)        # dense.py's tiled GEMM, groups on y
    kernel[(min(tiles, MAX_GEMM_BLOCKS), min(g, _GROUP_BLOCKS)), (TILE, TILE)](
        a, b, out, bool(trans_a), bool(trans_b), bool(accumulate))


# --- Causal softmax -----------------------------------------------------------------------------

@cuda.jit(cache=True)
def _causal_softmax_k(scores, probs, sc):
    # one block per row (g, i) of (G, T, T), fused: scale, mask j > i, max, exp-sum (float64),
    # normalise, zeros above the diagonal; the elements in the arrays' dtype (sc too). scores
    # and probs may be one array: each element is read, then written, by one thread, after the
    # block's last reduction
    groups, t_n, _ = scores.shape
    tid = cuda.threadIdx.x
    for r in range(cuda.blockIdx.x, groups * t_n, cuda.gridDim.x):
        g = r // t_n
        i = r - g * t_n
        part = float64(_NEG_MAX)
        for j in range(tid, i + 1, _ROW):
            v = float64(scores[g, i, j] * sc)
            if v > part:
                part = v
        top = scores.dtype.type(_row_max(part))
        acc = float64(0.0)
        for j in range(tid, i + 1, _ROW):
            acc += float64(math.exp(scores[g, i, j] * sc - top))
        inv = scores.dtype.type(1.0 / _row_sum(acc))
        for j in range(tid, t_n, _ROW):
            if j <= i:
                probs[g, i, j] = math.exp(scores[g, i, j] * sc - top) * inv
            else:
                probs[g, i, j] = 0


@cuda.jit(cache=True)
def _causal_softmax_backward_k(probs, grad_probs, grad_scores, sc):
    # grad_scores = sc * probs * (grad_probs - sum_{j<=i} grad_probs * probs), 0 for j > i;
    # grad_probs and grad_scores may be one array (read, then written, by one thread)
    groups, t_n, _ = probs.shape
    tid = cuda.threadIdx.x
    for r in range(cuda.blockIdx.x, groups * t_n, cuda.gridDim.x):
        g = r // t_n
        i = r - g * t_n
        acc = float64(0.0)
        for j in range(tid, i + 1, _ROW):
            acc += float64(grad_probs[g, i, j] * probs[g, i, j])
        dot = probs.dtype.type(_row_sum(acc))
        for j in range(tid, t_n, _ROW):
            if j <= i:
                grad_scores[g, i, j] = sc * probs[g, i, j] * (grad_probs[g, i, j] - dot)
            else:
                grad_scores[g, i, j] = 0


def _attention(kind, **arrays):
    """Device arrays (G, T, T) of one float dtype."""
    views = {name: _contiguous(kind, name, a) for name, a in arrays.items()}
    checks.causal_scores(kind, dtypes=True, **views)
    return list(views.values())


def causal_softmax(scores, probs, scale):
    scores, probs = _attention("causal_softmax", scores=scores, probs=probs)
    _row_launch(_causal_softmax_k, scores.shape[0] * scores.shape[1], scores, probs,
                scores.dtype.type(scale))


def causal_softmax_backward(probs, grad_probs, grad_scores, scale):
    probs, grad_probs, grad_scores = _attention(
        "causal_softmax_backward", probs=probs, grad_probs=grad_probs, grad_scores=grad_scores)
    _row_launch(_causal_softmax_backward_k, probs.shape[0] * probs.shape[1], probs, grad_probs,
                grad_scores, probs.dtype.type(scale))
