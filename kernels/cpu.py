"""CPU backend: NumPy arrays, numba.njit kernels, BLAS GEMM.

The contract (names, shapes, semantics) is the docstring of kernels/__init__.py.
"""
import numpy as np
from numba import njit, prange  # noqa: F401

from mpitrain.kernels import dropout_hash, half, host_shape

name = "cpu"

# --- Memory, GEMM, layer, loss, conv, pooling, dropout and optimizer kernels (engine) ---
#
# Every kernel takes preallocated, C-contiguous outputs, so a training step allocates nothing once
# the layers' workspaces exist. Elementwise kernels work on flat views (``a.reshape(-1)`` is a view
# of a contiguous array), so one compiled specialisation serves every rank of array. The outer loops
# over the batch are ``prange``: with one Numba thread (the trainer's default, threads.py) they run
# serially at no cost; with more threads they split over samples, which never share an element.
# ``nogil=True`` everywhere: the gradient allreduce thread (comm/overlap.py) runs while they do.


def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


def to_device(host):
    """A C-contiguous copy: the CPU "device" must not alias the caller's array."""
    return np.array(host, copy=True, order="C")


def to_host(a):
    return a


def synchronize():
    pass


@njit(cache=True, nogil=True)
def _fill(a, value):
    for i in range(a.size):
        a[i] = value


@njit(cache=True, nogil=True)
def _copy(dst, src):
    for i in range(dst.size):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def _scale(a, factor):
    for i in range(a.size):
        a[i] = a[i] * factor


@njit(cache=True, nogil=True)
def _add(dst, src):
    for i in range(dst.size):
        dst[i] = dst[i] + src[i]


@njit(cache=True, nogil=True)
def _total(a):
    s = 0.0
    for i in range(a.size):
        s += a[i]
    return s


def _flat(a, name="array"):
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {a.strides}")
    return a.reshape(-1)


def _same_size(dst, src):
    if dst.size != src.size:
        raise ValueError(f"size mismatch: dst has {dst.size} elements, src has {src.size}")


# float16 (the fp16 compression's wire dtype): Numba has no float16 on the CPU, so these kernels see
# float16 arrays as uint16 bit patterns and convert in registers (kernels/half.py), with NumPy's
# results bit for bit: each element is computed in float32 and rounded to half once, as NumPy's
# float16 ufuncs do. NaN results follow NumPy's too: the second operand's NaN, quieted, if it is
# one, else the first's (the FPU picks any one of two; this pins it).

@njit(cache=True, nogil=True)
def _half_from_float32(dst, src):
    """dst (uint16 half bits) = src (float32 bits as uint32), rounded as NumPy's astype."""
    for i in range(dst.size):
        dst[i] = half.float32_bits_to_half(src[i])


@njit(cache=True, nogil=True)
def _half_to_float32(dst, src):
    """dst (float32) = src (uint16 half bits), exact."""
    for i in range(dst.size):
        dst[i] = half.half_to_float32(src[i])


@njit(cache=True, nogil=True)
def _nan_rule(a, b, h):
    """h, unless a or b is a NaN: then b quieted if b is one, else a quieted (half bits)."""
    h = a | half.HALF_QUIET if half.is_nan(a) else h
    return b | half.HALF_QUIET if half.is_nan(b) else h


@njit(cache=True, nogil=True)
def _half_scale(a, factor):
    """a (uint16 half bits) *= factor (float32), in float32, rounded once."""
    nan_factor = factor != factor       # then every result is the factor's NaN, quieted
    quiet_factor = half.float32_bits_to_half(half.float32_bits(factor) | 0x400000)
    for i in range(a.size):
        h = a[i]
        r = half.float32_to_half(half.half_to_float32(h) * factor)
        r = h | half.HALF_QUIET if half.is_nan(h) else r
        a[i] = quiet_factor if nan_factor else r


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _half_block_sum(a, start, stop):
    """Exact float64 sum of a[start:stop] (half bits) when stop - start <= 2**13 (see below)."""
    block = 0.0
    for i in range(start, stop):
        block += np.float64(half.half_to_float32(a[i]))
    return block


@njit(cache=True, nogil=True)
def _half_total(a, chunk):
    """NumPy's a.sum(dtype=float64): exact sums of chunk-element blocks, added in order.

    NumPy converts float16 to float64 in buffers of ``chunk`` elements and adds each buffer's
    pairwise sum to the total. A half is a multiple of 2**-24 below 2**16, so a block of at most
    2**13 of them sums exactly in float64 in any order (hence reassoc in the block sum, which lets
    LLVM vectorise it); only the block-to-total additions round, in NumPy's order.
    """
    total = 0.0
    for start in range(0, a.size, chunk):
        total = total + _half_block_sum(a, start, min(a.size, start + chunk))
    return total


_EXACT_BLOCK = 1 << 13   # the largest block of halves whose float64 sum is always exact


def fill(a, value):
    if a.dtype == np.float16:
        one = np.empty(1, np.float16)
        one.fill(value)                 # NumPy's own conversion of value, once
        _fill(_flat(a).view(np.uint16), one.view(np.uint16)[0])
    else:
        _fill(_flat(a), value)


def copy(dst, src):
    _same_size(dst, src)
    if dst.dtype == np.float16 or src.dtype == np.float16:
        cast(dst, src)
    else:
        _copy(_flat(dst, "dst"), _flat(src, "src"))


def scale(a, factor):
    if a.dtype != np.float16:
        _scale(_flat(a), factor)
        return
    flat = _flat(a)
    # NumPy's promotion decides the arithmetic: a Python float or int (weak, NEP 50) or a float16
    # becomes a float16 first; a float32 keeps float32. Either runs as one float32 multiply.
    # Anything else (a float64 scalar computes in float64) keeps NumPy's own multiply.
    kind = np.result_type(a.dtype, factor) if np.ndim(factor) == 0 else None
    if kind == np.float16:
        _half_scale(flat.view(np.uint16), np.float32(np.array(factor, dtype=np.float16)))
    elif kind == np.float32:
        _half_scale(flat.view(np.uint16), np.float32(factor))
    else:
        np.multiply(flat, factor, out=flat, casting="unsafe")


def add(dst, src):
    _same_size(dst, src)
    if dst.dtype == np.float16 and src.dtype == np.float16:
        _half_reduce_sum(_flat(dst, "dst").view(np.uint16), _flat(src, "src").view(np.uint16))
    elif dst.dtype == np.float16 or src.dtype == np.float16:
        np.add(_flat(dst, "dst"), _flat(src, "src"), out=_flat(dst, "dst"), casting="unsafe")
    else:
        _add(_flat(dst, "dst"), _flat(src, "src"))


def cast(dst, src):
    """dst[...] = src in dst's dtype; float32 <-> float16 (the fp16 compression) in Numba."""
    _same_size(dst, src)
    d, s = _flat(dst, "dst"), _flat(src, "src")
    if d.dtype == np.float16 and s.dtype == np.float32:
        _half_from_float32(d.view(np.uint16), s.view(np.uint32))
    elif d.dtype == np.float32 and s.dtype == np.float16:
        _half_to_float32(d, s.view(np.uint16))
    elif d.dtype == np.float16 and s.dtype == np.float16:
        _copy(d.view(np.uint16), s.view(np.uint16))
    else:
        np.copyto(d, s, casting="unsafe")


def total(a):
    if a.dtype == np.float16:
        chunk = np.getbufsize()
        if chunk > _EXACT_BLOCK:        # blocks no longer sum exactly: NumPy's own order
            return float(_flat(a).sum(dtype=np.float64))
        return float(_half_total(_flat(a).view(np.uint16), chunk))
    return float(_total(_flat(a)))


# GEMM: BLAS through NumPy. A transposed operand is a transposed view (F-contiguous), which BLAS
# reads directly with its trans flag, so nothing is copied. NumPy has no beta=1 GEMM, so
# accumulating goes through a scratch buffer kept per (shape, dtype); layers avoid it by
# overwriting a freshly zeroed gradient instead (Parameter.grad_target).
_scratch = {}


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    if op_a.ndim != 2 or op_b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm needs 2-D arrays, got {op_a.shape}, {op_b.shape} -> {out.shape}")
    if (op_a.shape[1] != op_b.shape[0] or out.shape != (op_a.shape[0], op_b.shape[1])):
        raise ValueError(f"gemm shapes do not agree: {op_a.shape} @ {op_b.shape} -> {out.shape}")
    if not accumulate:
        np.matmul(op_a, op_b, out=out)
        return
    key = (out.shape, out.dtype.str)
    tmp = _scratch.get(key)
    if tmp is None:
        tmp = _scratch[key] = np.empty(out.shape, out.dtype)
    np.matmul(op_a, op_b, out=tmp)
    _add(out.reshape(-1), tmp.reshape(-1))


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
    _same_size(out, x)
    _relu(_flat(x, "x"), _flat(out, "out"))


def relu_backward(y, grad_out, grad_in):
    _same_size(grad_out, y)
    _same_size(grad_in, y)
    _relu_backward(_flat(y, "y"), _flat(grad_out, "grad_out"), _flat(grad_in, "grad_in"))


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
    _same_size(out, x)
    _tanh(_flat(x, "x"), _flat(out, "out"))


def tanh_backward(y, grad_out, grad_in):
    _same_size(grad_out, y)
    _same_size(grad_in, y)
    _tanh_backward(_flat(y, "y"), _flat(grad_out, "grad_out"), _flat(grad_in, "grad_in"))


def sigmoid(x, out):
    _same_size(out, x)
    _sigmoid(_flat(x, "x"), _flat(out, "out"))


def sigmoid_backward(y, grad_out, grad_in):
    _same_size(grad_out, y)
    _same_size(grad_in, y)
    _sigmoid_backward(_flat(y, "y"), _flat(grad_out, "grad_out"), _flat(grad_in, "grad_in"))


def leaky_relu(x, out, negative_slope):
    _same_size(out, x)
    _leaky_relu(_flat(x, "x"), _flat(out, "out"), float(negative_slope))


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    _same_size(grad_out, x)
    _same_size(grad_in, x)
    _leaky_relu_backward(_flat(x, "x"), _flat(grad_out, "grad_out"), _flat(grad_in, "grad_in"),
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
    return _flat(a, name).reshape((r, k))


def softmax(x, y):
    r, k = host_shape.rows("softmax", x.shape, y)
    if r and k:
        _softmax(_as_rows(x, r, k, "x"), _as_rows(y, r, k, "y"))


def softmax_backward(y, grad_out, grad_in):
    r, k = host_shape.rows("softmax_backward", y.shape, grad_out, grad_in)
    if r and k:
        _softmax_backward(_as_rows(y, r, k, "y"), _as_rows(grad_out, r, k, "grad_out"),
                          _as_rows(grad_in, r, k, "grad_in"))


# Loss --------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def softmax_xent(logits, labels, grad, losses):
    """Per-sample -log softmax[label] (log-sum-exp with the row max subtracted) and its gradient."""
    rows, k = logits.shape                      # (B, K)
    inv_b = 1.0 / rows
    for i in range(rows):
        label = labels[i]
        if label < 0 or label >= k:
            raise ValueError("softmax_xent: label out of range [0, K)")
        m = logits[i, 0]
        for j in range(1, k):
            if logits[i, j] > m:
                m = logits[i, j]
        s = 0.0
        for j in range(k):
            e = np.exp(logits[i, j] - m)
            grad[i, j] = e
            s += e
        losses[i] = np.log(s) + m - logits[i, label]
        inv_s = 1.0 / s
        for j in range(k):
            grad[i, j] = grad[i, j] * inv_s * inv_b
        grad[i, label] -= inv_b


@njit(cache=True, nogil=True)
def count_correct(logits, labels):
    rows, k = logits.shape                      # (B, K)
    hits = 0
    for i in range(rows):
        best = 0
        for j in range(1, k):
            if logits[i, j] > logits[i, best]:
                best = j
        if best == labels[i]:
            hits += 1
    return hits


@njit(cache=True, nogil=True)
def _label_smoothing(logits, labels, grad, losses, smoothing):
    rows, k = logits.shape                      # (B, K)
    inv_b = 1.0 / rows
    off = smoothing * inv_b / k
    for i in range(rows):
        label = labels[i]
        if label < 0 or label >= k:
            raise ValueError("label_smoothing: label out of range [0, K)")
        s = 0.0
        for j in range(k):
            s += logits[i, j]
            grad[i, j] -= off
        losses[i] += smoothing * (logits[i, label] - s / k)
        grad[i, label] += smoothing * inv_b


def label_smoothing(logits, labels, grad, losses, smoothing):
    host_shape.xent("label_smoothing", logits, labels, grad, losses)
    if logits.shape[0] and smoothing != 0:
        _label_smoothing(logits, labels, grad, losses, float(smoothing))


@njit(cache=True, nogil=True)
def _mse(x, target, grad, losses, scale):
    for i in range(x.size):
        d = x[i] - target[i]
        losses[i] = d * d
        grad[i] = d * scale


@njit(cache=True, nogil=True)
def _bce_logits(x, target, grad, losses, inv_n):
    for i in range(x.size):
        v = x[i]
        t = target[i]
        e = np.exp(-abs(v))                     # <= 1: no overflow for any logit
        losses[i] = (v if v > 0 else 0.0) - v * t + np.log1p(e)
        p = 1.0 / (1.0 + e) if v >= 0 else e / (1.0 + e)
        grad[i] = (p - t) * inv_n


def mse(x, target, grad, losses):
    for a in (target, grad, losses):
        _same_size(a, x)
    if x.size:
        _mse(_flat(x, "x"), _flat(target, "target"), _flat(grad, "grad"),
             _flat(losses, "losses"), 2.0 / x.size)


def bce_logits(x, target, grad, losses):
    for a in (target, grad, losses):
        _same_size(a, x)
    if x.size:
        _bce_logits(_flat(x, "x"), _flat(target, "target"), _flat(grad, "grad"),
                    _flat(losses, "losses"), 1.0 / x.size)


# Convolution: im2col + GEMM ----------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def im2col(x, cols, kh, kw, stride, pad):
    n_img, chans, h, w = x.shape                # (N, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for n in prange(n_img):
        for i in range(oh):
            h0 = i * stride - pad
            for j in range(ow):
                w0 = j * stride - pad
                # The kernel columns that fall inside the image: [lo, hi); padding elsewhere.
                lo = max(0, -w0)
                hi = min(kw, w - w0)
                row = (n * oh + i) * ow + j     # cols: (N*OH*OW, C*KH*KW)
                col = 0
                for c in range(chans):
                    for ki in range(kh):
                        hh = h0 + ki
                        if hh < 0 or hh >= h:
                            for kj in range(kw):
                                cols[row, col + kj] = 0
                        else:
                            for kj in range(lo):
                                cols[row, col + kj] = 0
                            for kj in range(lo, hi):
                                cols[row, col + kj] = x[n, c, hh, w0 + kj]
                            for kj in range(max(hi, lo), kw):
                                cols[row, col + kj] = 0
                        col += kw


@njit(cache=True, nogil=True, parallel=True)
def col2im(cols, dx, kh, kw, stride, pad):
    n_img, chans, h, w = dx.shape               # (N, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for n in prange(n_img):
        dx[n] = 0
        for i in range(oh):
            h0 = i * stride - pad
            for j in range(ow):
                w0 = j * stride - pad
                lo = max(0, -w0)
                hi = min(kw, w - w0)
                row = (n * oh + i) * ow + j
                col = 0
                for c in range(chans):
                    for ki in range(kh):
                        hh = h0 + ki
                        if 0 <= hh < h:
                            for kj in range(lo, hi):
                                dx[n, c, hh, w0 + kj] += cols[row, col + kj]
                        col += kw


# The layout transposes view the NCHW side as (N, C, OH*OW) (no index division) and walk one pixel
# row of the (N*OH*OW, C) side at a time: measured 1.7x faster than 4-D indexing or tiling.
@njit(cache=True, nogil=True, parallel=True)
def nhwc_to_nchw(src, dst):
    n_img, chans, oh, ow = dst.shape            # src: (N*OH*OW, C)
    plane = oh * ow
    out = dst.reshape((n_img, chans, plane))    # (N, C, OH*OW), a view
    for n in prange(n_img):
        for p in range(plane):
            row = src[n * plane + p]            # (C,)
            for c in range(chans):
                out[n, c, p] = row[c]


@njit(cache=True, nogil=True, parallel=True)
def nchw_to_nhwc(src, dst):
    n_img, chans, oh, ow = src.shape            # dst: (N*OH*OW, C)
    plane = oh * ow
    inp = src.reshape((n_img, chans, plane))    # (N, C, OH*OW), a view
    for n in prange(n_img):
        for p in range(plane):
            row = dst[n * plane + p]            # (C,)
            for c in range(chans):
                row[c] = inp[n, c, p]


# Outside the contract: Conv2D's own path on this backend (groups of images, NCHW out of the
# GEMMs, fused bias/ReLU; LeNet's step 100 -> 78 ms). The kernels above stay for the contract.
from mpitrain.kernels.cpu_conv import conv2d_backward, conv2d_forward  # noqa: E402

CONV_KERNELS = (conv2d_forward, conv2d_backward)     # re-exported (pyflakes ignores noqa)


# Pooling and dropout -----------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def maxpool_forward(x, y, argmax, k, stride):
    n_img, chans, h, w = x.shape                # (N, C, H, W)
    oh, ow = y.shape[2], y.shape[3]             # (N, C, OH, OW)
    for n in prange(n_img):
        for c in range(chans):
            plane = x[n, c]
            for i in range(oh):
                h0 = i * stride
                for j in range(ow):
                    w0 = j * stride
                    best = plane[h0, w0]
                    at = h0 * w + w0
                    if k == 2:
                        # The common 2x2 window unrolled (same first-max tie rule as the loop).
                        if plane[h0, w0 + 1] > best:
                            best = plane[h0, w0 + 1]
                            at = h0 * w + w0 + 1
                        if plane[h0 + 1, w0] > best:
                            best = plane[h0 + 1, w0]
                            at = (h0 + 1) * w + w0
                        if plane[h0 + 1, w0 + 1] > best:
                            best = plane[h0 + 1, w0 + 1]
                            at = (h0 + 1) * w + w0 + 1
                    else:
                        for ki in range(k):
                            for kj in range(k):
                                v = plane[h0 + ki, w0 + kj]
                                if v > best:
                                    best = v
                                    at = (h0 + ki) * w + w0 + kj
                    y[n, c, i, j] = best
                    argmax[n, c, i, j] = at


@njit(cache=True, nogil=True, parallel=True)
def maxpool_backward(grad_y, argmax, grad_x):
    n_img, chans, oh, ow = grad_y.shape         # (N, C, OH, OW)
    w = grad_x.shape[3]
    for n in prange(n_img):
        grad_x[n] = 0
        for c in range(chans):
            for i in range(oh):
                for j in range(ow):
                    at = argmax[n, c, i, j]
                    hi = at // w
                    grad_x[n, c, hi, at - hi * w] += grad_y[n, c, i, j]


@njit(cache=True, nogil=True, parallel=True)
def _avgpool_forward(x, y, k, stride):
    n_img, chans = x.shape[0], x.shape[1]       # (N, C, H, W)
    oh, ow = y.shape[2], y.shape[3]             # (N, C, OH, OW)
    area = k * k
    for n in prange(n_img):
        for c in range(chans):
            for i in range(oh):
                for j in range(ow):
                    s = 0.0
                    for ki in range(k):
                        for kj in range(k):
                            s += x[n, c, i * stride + ki, j * stride + kj]
                    y[n, c, i, j] = s / area


@njit(cache=True, nogil=True, parallel=True)
def _avgpool_backward(grad_y, grad_x, k, stride):
    # gather: input pixel (h, w) sums the windows i, j with i*stride <= h < i*stride + k
    n_img, chans, h_n, w_n = grad_x.shape       # (N, C, H, W)
    oh, ow = grad_y.shape[2], grad_y.shape[3]   # (N, C, OH, OW)
    area = k * k
    for n in prange(n_img):
        for c in range(chans):
            for h in range(h_n):
                i_lo = max(0, (h - k + stride) // stride)
                i_hi = min(oh - 1, h // stride)
                for w in range(w_n):
                    j_lo = max(0, (w - k + stride) // stride)
                    j_hi = min(ow - 1, w // stride)
                    s = 0.0
                    for i in range(i_lo, i_hi + 1):
                        for j in range(j_lo, j_hi + 1):
                            s += grad_y[n, c, i, j]
                    grad_x[n, c, h, w] = s / area


def avgpool_forward(x, y, k, stride):
    host_shape.pool("avgpool_forward", x.shape, y.shape, k, stride)
    _avgpool_forward(x, y, int(k), int(stride))


def avgpool_backward(grad_y, grad_x, k, stride):
    host_shape.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    _avgpool_backward(grad_y, grad_x, int(k), int(stride))


@njit(cache=True, nogil=True)
def _mix32(x):
    """lowbias32 (Chris Wellons' 32-bit integer hash), on uint64 holding a uint32."""
    x = x & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    return x


@njit(cache=True, nogil=True)
def _dropout_forward(x, y, mask, threshold, keep_scale, seed_hash):
    for i in range(x.size):
        h = _mix32(_mix32(np.uint64(i)) ^ seed_hash)
        mask[i] = keep_scale if (h >> np.uint64(8)) >= threshold else 0.0
        y[i] = x[i] * mask[i]


@njit(cache=True, nogil=True)
def _mul(a, b, out):
    for i in range(a.size):
        out[i] = a[i] * b[i]


def dropout_forward(x, y, mask, p, seed):
    _same_size(y, x)
    _same_size(mask, x)
    seed_hash = np.uint64(dropout_hash.mix32(int(seed)))
    _dropout_forward(_flat(x, "x"), _flat(y, "y"), _flat(mask, "mask"),
                     np.uint64(dropout_hash.keep_threshold(p)), 1.0 / (1.0 - p), seed_hash)


def dropout_backward(grad_y, mask, grad_x):
    _same_size(mask, grad_y)
    _same_size(grad_x, grad_y)
    _mul(_flat(grad_y, "grad_y"), _flat(mask, "mask"), _flat(grad_x, "grad_x"))


# Optimizer updates (flat, in place) --------------------------------------------------------------

@njit(cache=True, nogil=True)
def _sgd(param, grad, buf, lr, momentum, nesterov, weight_decay):
    for i in range(param.size):
        g = grad[i] + weight_decay * param[i]
        if momentum != 0.0:
            b = momentum * buf[i] + g
            buf[i] = b
            g = g + momentum * b if nesterov else b
        param[i] = param[i] - lr * g


@njit(cache=True, nogil=True)
def _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    step_size = lr / (1.0 - beta1 ** step)
    inv_sqrt_c2 = 1.0 / np.sqrt(1.0 - beta2 ** step)
    for i in range(param.size):
        g = grad[i] + weight_decay * param[i]
        mi = beta1 * m[i] + (1.0 - beta1) * g
        vi = beta2 * v[i] + (1.0 - beta2) * g * g
        m[i] = mi
        v[i] = vi
        param[i] = param[i] - step_size * mi / (np.sqrt(vi) * inv_sqrt_c2 + eps)


def sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay):
    _same_size(grad, param)
    flat_buf = _flat(buf, "buf") if momentum != 0 else _flat(param)
    _sgd(_flat(param, "param"), _flat(grad, "grad"), flat_buf, float(lr), float(momentum),
         bool(nesterov), float(weight_decay))


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    if step < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step!r}")
    _same_size(grad, param)
    _adam(_flat(param, "param"), _flat(grad, "grad"), _flat(m, "m"), _flat(v, "v"), float(lr),
          float(beta1), float(beta2), float(eps), float(weight_decay), int(step))


@njit(cache=True, nogil=True)
def _rmsprop(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay, momentum,
             centered):
    for i in range(param.size):
        g = grad[i] + weight_decay * param[i]
        v = alpha * square_avg[i] + (1.0 - alpha) * g * g
        square_avg[i] = v
        if centered:
            ga = alpha * grad_avg[i] + (1.0 - alpha) * g
            grad_avg[i] = ga
            v = v - ga * ga
        step = g / (np.sqrt(v) + eps)
        if momentum != 0.0:
            b = momentum * buf[i] + step
            buf[i] = b
            step = b
        param[i] = param[i] - lr * step


def rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered):
    _same_size(grad, param)
    _same_size(square_avg, param)
    flat = _flat(param, "param")
    # grad_avg and buf are unused (and may be None) without centering / momentum
    flat_avg = _flat(grad_avg, "grad_avg") if centered else flat
    flat_buf = _flat(buf, "buf") if momentum != 0 else flat
    _same_size(flat_avg, param)
    _same_size(flat_buf, param)
    _rmsprop(flat, _flat(grad, "grad"), _flat(square_avg, "square_avg"), flat_avg, flat_buf,
             float(lr), float(alpha), float(eps), float(weight_decay), float(momentum),
             bool(centered))


# --- Collective reductions (comm): reduce_into(dst, src, op) ---
# The ring reduces every received sub-chunk into the caller's buffer with these: one pass over
# memory, in place, SIMD-vectorised by LLVM. Integer overflow wraps, as in MPI_Allreduce.
# float16 runs on half bits (kernels/half.py) with NumPy's results: float32 arithmetic rounded to
# half once per element and reduction; min/max keep dst when equal or when dst is NaN, else take a
# NaN src (NumPy's minimum/maximum propagate NaN, bits unchanged).


@njit(cache=True, nogil=True)
def _reduce_prod(dst, src):
    for i in range(dst.shape[0]):
        dst[i] *= src[i]


@njit(cache=True, nogil=True)
def _reduce_min(dst, src):
    for i in range(dst.shape[0]):
        if src[i] < dst[i]:
            dst[i] = src[i]


@njit(cache=True, nogil=True)
def _reduce_max(dst, src):
    for i in range(dst.shape[0]):
        if src[i] > dst[i]:
            dst[i] = src[i]


@njit(cache=True, nogil=True)
def _half_reduce_sum(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        r = half.float32_to_half(half.half_to_float32(a) + half.half_to_float32(b))
        dst[i] = _nan_rule(a, b, r)


@njit(cache=True, nogil=True)
def _half_reduce_prod(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        r = half.float32_to_half(half.half_to_float32(a) * half.half_to_float32(b))
        dst[i] = _nan_rule(a, b, r)


@njit(cache=True, nogil=True)
def _half_reduce_min(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        keep = half.half_to_float32(a) <= half.half_to_float32(b) or half.is_nan(a)
        dst[i] = a if keep else b


@njit(cache=True, nogil=True)
def _half_reduce_max(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        keep = half.half_to_float32(a) >= half.half_to_float32(b) or half.is_nan(a)
        dst[i] = a if keep else b


_REDUCE_NUMBA = {"sum": _add, "prod": _reduce_prod, "min": _reduce_min, "max": _reduce_max}
_REDUCE_HALF = {"sum": _half_reduce_sum, "prod": _half_reduce_prod, "min": _half_reduce_min,
                "max": _half_reduce_max}


def reduce_into(dst, src, op):
    """dst = op(dst, src) elementwise; dst, src 1-D, same length and dtype; op in sum/prod/min/max.

    NaN follows NumPy's minimum/maximum only on the float16 path; the numba min/max keep dst when
    the comparison with NaN is false (MPI makes no promise about NaN either).
    """
    if dst.dtype == np.float16:
        _REDUCE_HALF[op](dst.view(np.uint16), src.view(np.uint16))
    else:
        _REDUCE_NUMBA[op](dst, src)


# BatchNorm, global average pooling, ResNet shortcut: kernels/cpu_norm.py; the tuple
# names them as this module's own (pyflakes sees a re-export only through a use).
from mpitrain.kernels.cpu_norm import (bn_backward_input, bn_backward_stats,  # noqa: E402
                                       bn_eval_moments, bn_forward, bn_moments, bn_param_grads,
                                       bn_stats, global_avgpool_backward, global_avgpool_forward,
                                       shortcut_backward, shortcut_forward)
NORM_KERNELS = (bn_stats, bn_moments, bn_eval_moments, bn_forward, bn_backward_stats,
                bn_param_grads, bn_backward_input, global_avgpool_forward,
                global_avgpool_backward, shortcut_forward, shortcut_backward)
