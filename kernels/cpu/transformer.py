"""The CPU's transformer kernels: token embeddings, LayerNorm, GELU, the head permutations,
batched GEMM and the causal softmax (the contract: kernels/__init__.py, "Transformer layers").

Token rows are n = B*T rows of C channels; attention works on G = B*H groups of (T, T) scores.
Every loop over rows is ``prange`` and every row is independent, so the results are the same
whatever the number of Numba threads; the two reductions over rows (the embedding's scatter-add
and LayerNorm's weight and bias gradients) run serially in increasing row order. Row statistics
accumulate in float64. ``batched_gemm`` is BLAS through NumPy, one GEMM per group.

The argument checks are the backends' common ones (kernels/checks.py), without the contract's
dtypes (the Numba kernels compile for whatever they get). What is the CPU's own: a token id
outside [0, V) is an error here (the GPU gives a row of NaN instead), and only the arrays the
kernels walk flat or reshape must be C-contiguous.
"""
import math

import numpy as np
from numba import njit, prange

from mpitrain.kernels import checks
from mpitrain.kernels.cpu.dense import matmul_into

_GELU_C = math.sqrt(2.0 / math.pi)


def _contiguous(kind, name, a):
    return checks.contiguous(kind, name, a, a.flags.c_contiguous)


def _rows(kind, name, a):
    """(n, C) view of a C-contiguous (..., C) array."""
    return _contiguous(kind, name, a).reshape(checks.channel_rows(kind, name, a.shape))


def _flat(kind, name, a):
    return _contiguous(kind, name, a).reshape(-1)


# Embedding -----------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def _embedding_forward(ids, weight, out):
    n, c = out.shape                            # (n, C)
    v = weight.shape[0]
    bad = 0
    for i in prange(n):
        t = ids[i]
        if t < 0 or t >= v:
            bad += 1
            continue
        for j in range(c):
            out[i, j] = weight[t, j]
    return bad


@njit(cache=True, nogil=True)
def _embedding_backward(ids, grad_out, grad_weight):
    n, c = grad_out.shape                       # (n, C): serial, rows added in increasing n
    for i in range(n):
        t = ids[i]
        for j in range(c):
            grad_weight[t, j] += grad_out[i, j]


def embedding_forward(ids, weight, out):
    ids1 = ids.reshape(-1)
    rows = _rows("embedding_forward", "out", out)                  # (n, C)
    checks.embedding("embedding_forward", ids1, weight, "out", rows)
    if rows.size and _embedding_forward(ids1, weight, rows):
        raise ValueError(f"embedding_forward: token id out of range [0, {weight.shape[0]})")


def embedding_backward(ids, grad_out, grad_weight):
    ids1 = ids.reshape(-1)
    rows = _rows("embedding_backward", "grad_out", grad_out)       # (n, C)
    checks.embedding("embedding_backward", ids1, grad_weight, "grad_out", rows)
    if ids1.size and (ids1.min() < 0 or ids1.max() >= grad_weight.shape[0]):
        raise ValueError(f"embedding_backward: token id out of range "
                         f"[0, {grad_weight.shape[0]})")
    if rows.size:
        _embedding_backward(ids1, rows, grad_weight)


# LayerNorm -----------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc"})
def _layernorm_forward(x, weight, bias, y, mean, rstd, eps):
    n, c = x.shape                              # (n, C)
    for i in prange(n):
        s = 0.0
        for j in range(c):
            s += np.float64(x[i, j])
        m = s / c
        s2 = 0.0
        for j in range(c):
            d = np.float64(x[i, j]) - m
            s2 += d * d
        r = 1.0 / np.sqrt(s2 / c + eps)
        mean[i] = m
        rstd[i] = r
        mt = x.dtype.type(m)
        rt = x.dtype.type(r)
        for j in range(c):
            y[i, j] = (x[i, j] - mt) * rt * weight[j] + bias[j]


@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc"})
def _layernorm_grad_x(grad_y, x, mean, rstd, weight, grad_x):
    n, c = x.shape                              # (n, C)
    for i in prange(n):
        m = x.dtype.type(mean[i])
        r = x.dtype.type(rstd[i])
        s1 = 0.0                                # sum of dxhat
        s2 = 0.0                                # sum of dxhat * xhat
        for j in range(c):
            dxh = np.float64(grad_y[i, j] * weight[j])
            s1 += dxh
            s2 += dxh * np.float64((x[i, j] - m) * r)
        a = x.dtype.type(s1 / c)
        b = x.dtype.type(s2 / c)
        for j in range(c):
            xh = (x[i, j] - m) * r
            grad_x[i, j] = r * (grad_y[i, j] * weight[j] - a - xh * b)


@njit(cache=True, nogil=True)
def _layernorm_grad_params(grad_y, x, mean, rstd, grad_weight, grad_bias, accumulate):
    n, c = x.shape                              # (n, C): serial over rows, fixed order
    if not accumulate:
        for j in range(c):
            grad_weight[j] = 0
            grad_bias[j] = 0
    for i in range(n):
        m = x.dtype.type(mean[i])
        r = x.dtype.type(rstd[i])
        for j in range(c):
            g = grad_y[i, j]
            grad_weight[j] += g * ((x[i, j] - m) * r)
            grad_bias[j] += g


def layernorm_forward(x, weight, bias, y, mean, rstd, eps):
    kind = "layernorm_forward"
    x2, y2 = _rows(kind, "x", x), _rows(kind, "y", y)              # (n, C)
    checks.layernorm(kind, dict(x=x2, y=y2), dict(weight=weight, bias=bias), mean, rstd)
    if x2.size:
        _layernorm_forward(x2, weight, bias, y2, mean.reshape(-1), rstd.reshape(-1), float(eps))


def layernorm_backward(grad_y, x, mean, rstd, weight, grad_x, grad_weight, grad_bias,
                       accumulate):
    kind = "layernorm_backward"
    x2, gy = _rows(kind, "x", x), _rows(kind, "grad_y", grad_y)    # (n, C)
    gx = _rows(kind, "grad_x", grad_x)
    checks.layernorm(kind, dict(x=x2, grad_y=gy, grad_x=gx),
                     dict(weight=weight, grad_weight=grad_weight, grad_bias=grad_bias), mean,
                     rstd)
    m1, r1 = mean.reshape(-1), rstd.reshape(-1)
    _layernorm_grad_params(gy, x2, m1, r1, grad_weight, grad_bias, bool(accumulate))
    if x2.size:
        _layernorm_grad_x(gy, x2, m1, r1, weight, gx)


# GELU (tanh form) ----------------------------------------------------------------------------
# float32 evaluates tanh as a rational function (Eigen's float tanh: x P(x^2) / Q(x^2) on x
# clamped to +-7.905, within 3e-7 of tanh everywhere, +-1 beyond): plain arithmetic that LLVM
# vectorises, where np.tanh is a scalar libm call per element (20x slower). error_model="numpy":
# a division without Python's zero check, which would keep the loop scalar. float64: np.tanh.
_T_CLAMP = 7.90531110763549805
_T_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
        5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_T_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", inline="always")
def _tanh32(v):
    f = np.float32
    v = min(max(v, f(-_T_CLAMP)), f(_T_CLAMP))
    v2 = v * v
    p = f(_T_P[0])
    p = p * v2 + f(_T_P[1])
    p = p * v2 + f(_T_P[2])
    p = p * v2 + f(_T_P[3])
    p = p * v2 + f(_T_P[4])
    p = p * v2 + f(_T_P[5])
    p = p * v2 + f(_T_P[6])
    q = f(_T_Q[0])
    q = q * v2 + f(_T_Q[1])
    q = q * v2 + f(_T_Q[2])
    q = q * v2 + f(_T_Q[3])
    r = p * v / q
    r = r if v < f(_T_CLAMP) else f(1.0)        # saturated: exactly +-1, as tanh rounds there
    return r if v > f(-_T_CLAMP) else f(-1.0)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _gelu32(x, out):
    f = np.float32
    for i in range(x.size):
        v = x[i]
        out[i] = f(0.5) * v * (f(1.0) + _tanh32(f(_GELU_C) * (v + f(0.044715) * v * v * v)))


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _gelu_backward32(x, grad_out, grad_in):
    f = np.float32
    for i in range(x.size):
        v = x[i]
        th = _tanh32(f(_GELU_C) * (v + f(0.044715) * v * v * v))
        d = (f(0.5) * (f(1.0) + th) + f(0.5) * v * (f(1.0) - th * th) * f(_GELU_C)
             * (f(1.0) + f(3 * 0.044715) * v * v))
        grad_in[i] = grad_out[i] * d


@njit(cache=True, nogil=True)
def _gelu64(x, out):
    for i in range(x.size):
        v = x[i]
        out[i] = 0.5 * v * (1.0 + np.tanh(_GELU_C * (v + 0.044715 * v * v * v)))


@njit(cache=True, nogil=True)
def _gelu_backward64(x, grad_out, grad_in):
    for i in range(x.size):
        v = x[i]
        th = np.tanh(_GELU_C * (v + 0.044715 * v * v * v))
        d = (0.5 * (1.0 + th)
             + 0.5 * v * (1.0 - th * th) * _GELU_C * (1.0 + 3 * 0.044715 * v * v))
        grad_in[i] = grad_out[i] * d


def gelu(x, out):
    checks.elementwise("gelu", x=x, out=out)
    fn = _gelu32 if x.dtype == np.float32 else _gelu64
    fn(_flat("gelu", "x", x), _flat("gelu", "out", out))


def gelu_backward(x, grad_out, grad_in):
    kind = "gelu_backward"
    checks.elementwise(kind, x=x, grad_out=grad_out, grad_in=grad_in)
    fn = _gelu_backward32 if x.dtype == np.float32 else _gelu_backward64
    fn(_flat(kind, "x", x), _flat(kind, "grad_out", grad_out), _flat(kind, "grad_in", grad_in))


# Head permutations ---------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def _to_heads(x, out):
    b_, t_, s_, h_, d_ = x.shape                # (B, T, S, H, D) -> (S, B, H, T, D)
    for b in prange(b_):
        for t in range(t_):
            for s in range(s_):
                for h in range(h_):
                    for d in range(d_):
                        out[s, b, h, t, d] = x[b, t, s, h, d]


@njit(cache=True, nogil=True, parallel=True)
def _from_heads(x, out):
    s_, b_, h_, t_, d_ = x.shape                # (S, B, H, T, D) -> (B, T, S, H, D)
    for b in prange(b_):
        for t in range(t_):
            for s in range(s_):
                for h in range(h_):
                    for d in range(d_):
                        out[b, t, s, h, d] = x[s, b, h, t, d]


def _heads(kind, x, out, rows_side):
    checks.heads(kind, x, out, rows_side)
    _contiguous(kind, "x", x)
    _contiguous(kind, "out", out)


def to_heads(x, out):
    _heads("to_heads", x, out, "x")
    if x.size:
        _to_heads(x, out)


def from_heads(x, out):
    _heads("from_heads", x, out, "out")
    if x.size:
        _from_heads(x, out)


# Batched GEMM: BLAS per group through NumPy's matmul on 3-D arrays (dense.matmul_into, as the
# 2-D gemm).

def batched_gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    checks.batched_gemm(a, b, out, trans_a, trans_b)
    op_a = a.transpose(0, 2, 1) if trans_a else a
    op_b = b.transpose(0, 2, 1) if trans_b else b
    if accumulate:
        _flat("batched_gemm", "out", out)          # added into through a flat view
    matmul_into(op_a, op_b, out, accumulate)


# Causal softmax ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "nsz", "arcp", "contract"})
def _causal_softmax(scores, probs, scale):
    g_, t_, _ = scores.shape                    # (G, T, T), rows independent
    sc = scores.dtype.type(scale)
    for r in prange(g_ * t_):
        g = r // t_
        i = r - g * t_
        m = scores[g, i, 0] * sc
        for j in range(1, i + 1):
            v = scores[g, i, j] * sc
            if v > m:
                m = v
        s = 0.0
        for j in range(i + 1):
            e = np.exp(scores[g, i, j] * sc - m)
            probs[g, i, j] = e
            s += e
        inv = probs.dtype.type(1.0 / s)
        for j in range(i + 1):
            probs[g, i, j] = probs[g, i, j] * inv
        for j in range(i + 1, t_):
            probs[g, i, j] = 0


@njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "nsz", "arcp", "contract"})
def _causal_softmax_backward(probs, grad_probs, grad_scores, scale):
    g_, t_, _ = probs.shape                     # (G, T, T), rows independent
    sc = probs.dtype.type(scale)
    for r in prange(g_ * t_):
        g = r // t_
        i = r - g * t_
        dot = 0.0
        for j in range(i + 1):
            dot += grad_probs[g, i, j] * probs[g, i, j]
        dt = probs.dtype.type(dot)
        for j in range(i + 1):
            grad_scores[g, i, j] = sc * probs[g, i, j] * (grad_probs[g, i, j] - dt)
        for j in range(i + 1, t_):
            grad_scores[g, i, j] = 0


def _scores(kind, **arrays):
    checks.causal_scores(kind, **arrays)
    for name, a in arrays.items():
        _contiguous(kind, name, a)


def causal_softmax(scores, probs, scale):
    _scores("causal_softmax", scores=scores, probs=probs)
    if scores.size:
        _causal_softmax(scores, probs, float(scale))


def causal_softmax_backward(probs, grad_probs, grad_scores, scale):
    _scores("causal_softmax_backward", probs=probs, grad_probs=grad_probs,
            grad_scores=grad_scores)
    if probs.size:
        _causal_softmax_backward(probs, grad_probs, grad_scores, float(scale))
