"""CPU convolution, one image at a time: im2col into a cache-sized buffer, BLAS, fused epilogues.

An optional part of the CPU backend, outside the kernel contract (kernels/contract.py): Conv2D
runs ``conv2d_forward`` / ``conv2d_backward`` when its backend has them and the contract's
im2col + GEMM + transpose path otherwise (the GPU backends, where one launch over the whole batch
is what is fast). Same mathematics, a different order of float additions.

Why per image: the batch-wide im2col buffer of a LeNet conv (N*OH*OW x C*K*K floats, 40 MB)
lives in main memory, so writing it, reading it in the GEMM and reading it again in backward all
run at memory speed (im2col + col2im were 23 ms of LeNet's 100 ms step). One image's columns
(C*K*K x OH*OW, 0.6 MB) stay in L2 between the im2col that writes them and the GEMM that reads
them, and the GEMM orientations below produce NCHW directly, so there are no layout transposes:

    forward      y[n] (OC, P)   = W (OC, CKK) @ cols (CKK, P)          then bias (+ ReLU) in place
    backward     g (OC, P)      = grad_y[n] * (y[n] > 0)               bias grad summed alongside
                 dW^T (CKK, OC) += cols (CKK, P) @ g^T (P, OC)         cols recomputed from x[n]
                 dcols (CKK, P) = W^T (CKK, OC) @ g (OC, P)            then col2im into dx[n]

(P = OH*OW, CKK = C*KH*KW.) The weight gradient accumulates transposed, in a (CKK, OC) scratch
array, and is transposed into the caller's gradient once per call. Measured at batch 64, one
thread, LeNet's conv2 (docs/benchmarks.md).

Scratch arrays are kept per (shape, dtype), as kernels/cpu.py's GEMM scratch; the per-image loop
runs in Python (BLAS cannot be called from an njit function without SciPy), about 2 us a call.
"""
import numpy as np
from numba import njit

_scratch = {}


def _buffer(tag, shape, dtype):
    key = (tag, shape, np.dtype(dtype).str)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = np.empty(shape, dtype)
    return buf


def _out_size(size, k, stride, pad):
    return (size + 2 * pad - k) // stride + 1


@njit(cache=True, nogil=True)
def _valid_range(kj, stride, pad, w, ow):
    """Output columns j whose input column j*stride - pad + kj lies inside [0, w)."""
    lo = max(0, (pad - kj + stride - 1) // stride)
    hi = min(ow, (w - 1 + pad - kj) // stride + 1)
    return lo, max(lo, hi)


@njit(cache=True, nogil=True)
def im2col_image(x, cols, kh, kw, stride, pad):
    """x (C, H, W) -> cols (C*KH*KW, OH*OW): one row per kernel tap, contiguous image rows."""
    chans, h, w = x.shape                       # (C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for c in range(chans):
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]     # (OH*OW,)
                lo, hi = _valid_range(kj, stride, pad, w, ow)
                shift = kj - pad
                for i in range(oh):
                    hh = i * stride - pad + ki
                    dst = row[i * ow:(i + 1) * ow]          # (OW,)
                    if hh < 0 or hh >= h:
                        for j in range(ow):
                            dst[j] = 0
                        continue
                    # Views starting at the first valid column keep every index a plain loop
                    # counter (no negative-index wraparound, so LLVM vectorises the copies).
                    src = x[c, hh, lo * stride + shift:]     # (W - ...,)
                    for j in range(lo):
                        dst[j] = 0
                    valid = dst[lo:hi]
                    for t in range(hi - lo):
                        valid[t] = src[t * stride]
                    for j in range(hi, ow):
                        dst[j] = 0


@njit(cache=True, nogil=True)
def col2im_image(cols, dx, kh, kw, stride, pad):
    """Overwrites dx (C, H, W) with the scatter-add of cols (C*KH*KW, OH*OW)."""
    chans, h, w = dx.shape                      # (C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for c in range(chans):
        for hh in range(h):
            for ww in range(w):
                dx[c, hh, ww] = 0
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]     # (OH*OW,)
                lo, hi = _valid_range(kj, stride, pad, w, ow)
                shift = kj - pad
                for i in range(oh):
                    hh = i * stride - pad + ki
                    if 0 <= hh < h:
                        dst = dx[c, hh, lo * stride + shift:]    # (W - ...,)
                        src = row[i * ow + lo:]
                        for t in range(hi - lo):
                            dst[t * stride] += src[t]


@njit(cache=True, nogil=True)
def _bias_act_planes(y, bias, use_bias, relu):
    """y (OC, P) += bias[o] per row, then ReLU."""
    chans, plane = y.shape
    for o in range(chans):
        b = bias[o] if use_bias else 0
        row = y[o]
        for p in range(plane):
            v = row[p] + b
            if relu and v < 0:
                v = 0
            row[p] = v


@njit(cache=True, nogil=True)
def _grad_planes(y, grad_y, g, grad_bias, relu):
    """g (OC, P) = grad_y * (y > 0) (or grad_y); grad_bias[o] += the row sums of g."""
    chans, plane = g.shape
    for o in range(chans):
        s = 0.0
        gy, yy, dst = grad_y[o], y[o], g[o]
        for p in range(plane):
            v = gy[p]
            if relu and not yy[p] > 0:
                v = 0
            dst[p] = v
            s += v
        grad_bias[o] += s


@njit(cache=True, nogil=True)
def _add_transposed(dst, src_t, accumulate):
    """dst (OC, CKK) (+)= src_t (CKK, OC).T"""
    rows, cols = dst.shape
    for i in range(rows):
        for j in range(cols):
            v = src_t[j, i]
            dst[i, j] = dst[i, j] + v if accumulate else v


# Stride 1: the "wide" layout. The image is copied once into a zero-padded flat buffer whose rows
# are RS = W + pad long (the right padding of a row doubles as the left padding of the next), so
# for tap (c, ki, kj) the input of output pixel (i, j) sits at c*CH + ki*RS + kj + (i*RS + j): one
# contiguous run of OH*RS elements per tap. im2col becomes C*KH*KW block copies (short per-row
# segments cost ~40 cycles each: the tight layout's im2col was 10 ms for LeNet's conv2, this one
# is ~1 ms) at the price of RS - OW junk columns per output row in the GEMMs (RS/OW = 16/14 for
# LeNet's conv2, 33/32 for a 3x3 conv on 32x32): the forward drops them in its epilogue, backward
# gives them a zero gradient so they add nothing to dW and only zeros to the padding of dx.

def _wide_dims(c, h, w, kh, pad):
    """(RS, CH): row stride and per-channel length of the padded flat image."""
    rs = w + pad
    return rs, (h + 2 * pad) * rs + 2 * pad + kh       # slack: a tap's run may end past a plane


@njit(cache=True, nogil=True)
def _pad_image(x, xp, pad, rs, ch):
    """The data slots of xp (flat, zeros elsewhere since allocation) = x (C, H, W)."""
    chans, h, w = x.shape
    for c in range(chans):
        for hh in range(h):
            dst = xp[c * ch + pad + (hh + pad) * rs:]
            src = x[c, hh]
            for ww in range(w):
                dst[ww] = src[ww]


@njit(cache=True, nogil=True)
def _im2col_wide(xp, cols, chans, kh, kw, rs, ch):
    """cols (C*KH*KW, OH*RS): row (c, ki, kj) = xp[c*CH + ki*RS + kj :][:OH*RS]."""
    run = cols.shape[1]
    for c in range(chans):
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]
                src = xp[c * ch + ki * rs + kj:]
                for q in range(run):
                    row[q] = src[q]


@njit(cache=True, nogil=True)
def _col2im_wide(cols, dxp, dx, kh, kw, pad, rs, ch):
    """dx (C, H, W) = the scatter-add of cols (C*KH*KW, OH*RS), through the flat buffer dxp."""
    chans, h, w = dx.shape
    run = cols.shape[1]
    for i in range(dxp.size):
        dxp[i] = 0
    for c in range(chans):
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]
                dst = dxp[c * ch + ki * rs + kj:]
                for q in range(run):
                    dst[q] += row[q]
        for hh in range(h):
            src = dxp[c * ch + pad + (hh + pad) * rs:]
            dst = dx[c, hh]
            for ww in range(w):
                dst[ww] = src[ww]


@njit(cache=True, nogil=True)
def _crop_bias_act(y_wide, y, bias, use_bias, relu, rs):
    """y (OC, OH, OW) = y_wide (OC, OH*RS) without its junk columns, + bias, then ReLU."""
    chans, oh, ow = y.shape
    for o in range(chans):
        b = bias[o] if use_bias else 0
        for i in range(oh):
            src = y_wide[o, i * rs:]
            dst = y[o, i]
            for j in range(ow):
                v = src[j] + b
                if relu and v < 0:
                    v = 0
                dst[j] = v


@njit(cache=True, nogil=True)
def _grad_wide(y, grad_y, g, grad_bias, relu, rs):
    """g (OC, OH*RS) = grad_y * (y > 0) (or grad_y), zero in the junk columns;
    grad_bias[o] += the sums over the pixels."""
    chans, oh, ow = y.shape
    for o in range(chans):
        s = 0.0
        for i in range(oh):
            gy, yy, dst = grad_y[o, i], y[o, i], g[o, i * rs:(i + 1) * rs]
            for j in range(ow):
                v = gy[j]
                if relu and not yy[j] > 0:
                    v = 0
                dst[j] = v
                s += v
            for j in range(ow, rs):
                dst[j] = 0
        grad_bias[o] += s


def _use_wide(w, kw, stride, pad):
    """Stride 1 and at most a third more GEMM columns than output pixels."""
    ow = w + 2 * pad - kw + 1
    return stride == 1 and pad <= kw - 1 and 3 * (w + pad) <= 4 * ow


def _padded(c, h, w, kh, pad, dtype):
    """The flat padded image buffer for the wide layout; zero outside the data slots."""
    rs, ch = _wide_dims(c, h, w, kh, pad)
    key = ("xp", (c, h, w, kh, pad), np.dtype(dtype).str)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = np.zeros(c * ch + rs, dtype)   # + rs: the last run's junk tail
    return buf


def _dims(x, weight, stride, pad):
    n, c, h, w = x.shape
    oc, _, kh, kw = weight.shape
    return n, c, oc, kh, kw, _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)


def gemm_shapes(x_shape, weight_shape, stride, pad, input_grad=True):
    """The GEMMs one forward + backward issues, for benchmarks/step.py:
    [(a_shape, b_shape, trans_a, trans_b, out_shape, times)]."""
    n, c, h, w = x_shape
    oc, _, kh, kw = weight_shape
    oh, ow = _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)
    run = oh * _wide_dims(c, h, w, kh, pad)[0] if _use_wide(w, kw, stride, pad) else oh * ow
    ckk = c * kh * kw
    plan = [((oc, ckk), (ckk, run), False, False, (oc, run), n),      # y = W @ cols
            ((ckk, run), (oc, run), False, True, (ckk, oc), n)]       # dW^T = cols @ g^T
    if input_grad:
        plan.append(((oc, ckk), (oc, run), True, False, (ckk, run), n))   # dcols = W^T @ g
    return plan


def conv2d_forward(x, weight, bias, y, stride, pad, relu):
    """y (N, OC, OH, OW) = conv(x (N, C, H, W), weight (OC, C, KH, KW)) + bias (OC,) or None,
    then ReLU if ``relu``."""
    n, c, oc, kh, kw, oh, ow = _dims(x, weight, stride, pad)
    h, w = x.shape[2], x.shape[3]
    ckk = c * kh * kw
    w2d = weight.reshape((oc, ckk))                          # (OC, CKK), a view
    use_bias = bias is not None
    b = bias if use_bias else w2d[0]                         # any array of the dtype: unused
    if _use_wide(w, kw, stride, pad):
        rs, ch = _wide_dims(c, h, w, kh, pad)
        xp = _padded(c, h, w, kh, pad, x.dtype)              # (C*CH + RS,) flat
        cols = _buffer("cols", (ckk, oh * rs), x.dtype)      # (CKK, OH*RS)
        y_wide = _buffer("y_wide", (oc, oh * rs), x.dtype)   # (OC, OH*RS)
        for i in range(n):
            _pad_image(x[i], xp, pad, rs, ch)
            _im2col_wide(xp, cols, c, kh, kw, rs, ch)
            np.matmul(w2d, cols, out=y_wide)
            _crop_bias_act(y_wide, y[i], b, use_bias, relu, rs)
        return
    cols = _buffer("cols", (ckk, oh * ow), x.dtype)          # (CKK, P)
    for i in range(n):
        im2col_image(x[i], cols, kh, kw, stride, pad)
        y_plane = y[i].reshape((oc, oh * ow))               # (OC, P), a view of y
        np.matmul(w2d, cols, out=y_plane)
        _bias_act_planes(y_plane, b, use_bias, relu)


def conv2d_backward(x, weight, y, grad_y, stride, pad, relu, grad_weight, accumulate_weight,
                    grad_bias, grad_x):
    """Gradients of conv2d_forward: grad_weight (=|+=), grad_bias (+=, or None: no bias),
    grad_x overwritten (or None: not wanted). ``y`` is the forward output (the ReLU mask)."""
    n, c, oc, kh, kw, oh, ow = _dims(x, weight, stride, pad)
    h, w = x.shape[2], x.shape[3]
    ckk = c * kh * kw
    w2d = weight.reshape((oc, ckk))                          # (OC, CKK)
    wide = _use_wide(w, kw, stride, pad)
    rs, ch = _wide_dims(c, h, w, kh, pad)
    run = oh * rs if wide else oh * ow                       # GEMM columns per image
    cols = _buffer("cols", (ckk, run), x.dtype)              # (CKK, run)
    g = _buffer("g", (oc, run), x.dtype)                     # (OC, run)
    dw_t = _buffer("dw_t", (ckk, oc), x.dtype)               # (CKK, OC): sum over images
    dw_img = _buffer("dw_img", (ckk, oc), x.dtype)           # (CKK, OC): one image
    gb = grad_bias
    if gb is None:                                           # no bias: sums go to scratch
        gb = _buffer("gb", (oc,), x.dtype)
        gb.fill(0)
    if n == 0:
        dw_t.fill(0)
    if wide:
        xp = _padded(c, h, w, kh, pad, x.dtype)
        dxp = _buffer("dxp", xp.shape, x.dtype)
    for i in range(n):
        if wide:
            _grad_wide(y[i], grad_y[i], g, gb, relu, rs)
            _pad_image(x[i], xp, pad, rs, ch)
            _im2col_wide(xp, cols, c, kh, kw, rs, ch)
        else:
            _grad_planes(y[i].reshape((oc, run)), grad_y[i].reshape((oc, run)), g, gb, relu)
            im2col_image(x[i], cols, kh, kw, stride, pad)
        np.matmul(cols, g.T, out=dw_t if i == 0 else dw_img)
        if i > 0:
            np.add(dw_t, dw_img, out=dw_t)
        if grad_x is None:
            continue
        np.matmul(w2d.T, g, out=cols)                        # d(cols), (CKK, run)
        if wide:
            _col2im_wide(cols, dxp, grad_x[i], kh, kw, pad, rs, ch)
        else:
            col2im_image(cols, grad_x[i], kh, kw, stride, pad)
    _add_transposed(grad_weight.reshape((oc, ckk)), dw_t, accumulate_weight)
