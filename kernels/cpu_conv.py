"""CPU convolution, a few images at a time: im2col in a cache-sized buffer, GEMMs, fused epilogues.

An optional part of the CPU backend, outside the kernel contract (kernels/contract.py): Conv2D
runs ``conv2d_forward`` / ``conv2d_backward`` when its backend has them and the contract's
im2col + GEMM + transpose path otherwise (the GPU backends, where one launch over the whole batch
is what is fast). Same mathematics, a different order of float additions.

Why by groups of images: the batch-wide im2col buffer of a LeNet conv (N*OH*OW x C*K*K floats,
40 MB) lives in main memory, so writing it, reading it in the GEMM and reading it again in
backward all run at memory speed (im2col + col2im were 23 ms of LeNet's 100 ms step). A group of
G images whose columns fit in COLS_BYTES (one LeNet conv2 image, 0.7 MB; four 7x7 ResNet images)
stays in L2 between the im2col that writes it and the GEMMs that read it, and the GEMM
orientations below produce channel-major output, so no layout transposes are needed:

    forward      yc (OC, G*R)   = W (OC, CKK) @ cols (CKK, G*R)      then crop + bias (+ ReLU)
                                                                      into y[n:n+G] (NCHW)
    backward     g (OC, G*R)    = grad_y[n:n+G] * (y > 0)             bias grad += g row sums
                 dW (OC, CKK)   += g (OC, G*R) @ cols^T (G*R, CKK)    cols recomputed from x
                 dcols          = W^T (CKK, OC) @ g (OC, G*R)         then col2im into dx[n:n+G]

(CKK = C*KH*KW; R = the GEMM columns of one image: OH*OW, or OH*RS in the wide layout below.)
The weight gradient accumulates transposed, cols @ g^T into a (CKK, OC) scratch array
(OpenBLAS's faster orientation), transposed into the caller's gradient once per call.

Stride-1 layers with at most 64 output channels whose image rows fill the kernels' strips
(ResNet's first two stages, LeNet's and cifar_cnn's convolutions; cpu_gemm.covers) take the
"gathered" path instead (below): kernels/cpu_gemm.py's register-blocked kernels read the padded
image in place, so neither im2col nor col2im runs, and they beat OpenBLAS on these skinny shapes:
a 16-channel 28x28 layer's forward + backward 17.0 -> 11.0 ms. Measured at batch 64, one thread
(docs/benchmarks.md).

Scratch arrays are kept per thread and (tag, dtype), regrown when too small; the loop over
groups runs in Python (BLAS cannot be called from an njit function without SciPy).
"""
import threading

import numpy as np
from numba import njit

from mpitrain.kernels import cpu_gemm

# Bytes of im2col columns per group: about half of a core's L2 (1 MB on the Zen 4 and 2 MB on the
# Xeons this runs on), so the columns, a slice of W and the GEMM output stay in it together.
COLS_BYTES = 512 * 1024
# Bytes of padded images per group on the gathered path (no columns there): four 16-channel 28x28
# images, eight 32-channel 14x14 ones; 11.1 vs 12.0 ms (16 channels) and 10.8 vs 11.4 ms (32)
# against one and two images a group, forward + backward at batch 64.
GATHER_BYTES = 256 * 1024

# Scratch per thread: two models may train in two threads (the kernels release the GIL).
_local = threading.local()


def _scratch():
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    return bufs


def _matrix(tag, rows, cols, dtype):
    """A C-contiguous (rows, cols) view of a reusable flat buffer (grown, never shrunk)."""
    key = (tag, np.dtype(dtype).str)
    bufs = _scratch()
    buf = bufs.get(key)
    if buf is None or buf.size < rows * cols:
        buf = bufs[key] = np.empty(rows * cols, dtype)
    return buf[:rows * cols].reshape((rows, cols))


def _out_size(size, k, stride, pad):
    return (size + 2 * pad - k) // stride + 1


# Per-row layout (any stride): columns of image g, output row i start at g*OH*OW + i*OW. -------

@njit(cache=True, nogil=True)
def _valid_range(kj, stride, pad, w, ow):
    """Output columns j whose input column j*stride - pad + kj lies inside [0, w)."""
    lo = max(0, (pad - kj + stride - 1) // stride)
    hi = min(ow, (w - 1 + pad - kj) // stride + 1)
    return lo, max(lo, hi)


@njit(cache=True, nogil=True)
def _im2col_rows(x, cols, kh, kw, stride, pad):
    """x (G, C, H, W) -> cols (C*KH*KW, G*OH*OW): one row per kernel tap."""
    groups, chans, h, w = x.shape               # (G, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for g in range(groups):
        for c in range(chans):
            for ki in range(kh):
                for kj in range(kw):
                    row = cols[(c * kh + ki) * kw + kj]     # (G*OH*OW,)
                    lo, hi = _valid_range(kj, stride, pad, w, ow)
                    shift = kj - pad
                    for i in range(oh):
                        hh = i * stride - pad + ki
                        dst = row[(g * oh + i) * ow:(g * oh + i + 1) * ow]     # (OW,)
                        if hh < 0 or hh >= h:
                            for j in range(ow):
                                dst[j] = 0
                            continue
                        # Views starting at the first valid column keep every index a plain
                        # loop counter (no negative-index wraparound: LLVM vectorises the copy).
                        src = x[g, c, hh, lo * stride + shift:]
                        for j in range(lo):
                            dst[j] = 0
                        valid = dst[lo:hi]
                        for t in range(hi - lo):
                            valid[t] = src[t * stride]
                        for j in range(hi, ow):
                            dst[j] = 0


@njit(cache=True, nogil=True)
def _col2im_rows(cols, dx, kh, kw, stride, pad):
    """Overwrites dx (G, C, H, W) with the scatter-add of cols (C*KH*KW, G*OH*OW)."""
    groups, chans, h, w = dx.shape              # (G, C, H, W)
    oh = (h + 2 * pad - kh) // stride + 1
    ow = (w + 2 * pad - kw) // stride + 1
    for g in range(groups):
        for c in range(chans):
            plane = dx[g, c]
            for hh in range(h):
                for ww in range(w):
                    plane[hh, ww] = 0
            for ki in range(kh):
                for kj in range(kw):
                    row = cols[(c * kh + ki) * kw + kj]
                    lo, hi = _valid_range(kj, stride, pad, w, ow)
                    shift = kj - pad
                    for i in range(oh):
                        hh = i * stride - pad + ki
                        if 0 <= hh < h:
                            dst = plane[hh, lo * stride + shift:]
                            src = row[(g * oh + i) * ow + lo:]
                            for t in range(hi - lo):
                                dst[t * stride] += src[t]


# Stride 1: the "wide" layout. Each image is copied into a zero-padded flat buffer whose rows are
# RS = W + pad long (the right padding of a row doubles as the left padding of the next), so for
# tap (c, ki, kj) the input of output pixel (i, j) sits at c*CH + ki*RS + kj + (i*RS + j): one
# contiguous run of OH*RS elements per tap and image. im2col becomes block copies (the per-row
# layout's runs of OW elements cost ~40 cycles each: 10 ms for LeNet's conv2, 0.7 ms this way) at
# the price of RS - OW junk columns per output row in the GEMMs (16/14 for LeNet's conv2, 29/28
# for a 3x3 conv on 28x28): the forward drops them in its epilogue; backward gives them a zero
# gradient, so they add nothing to dW and only zeros to the padding of dx.

def _wide_dims(h, w, kh, pad):
    """(RS, CH): row stride and per-channel length of the padded flat image."""
    rs = w + pad
    return rs, (h + 2 * pad) * rs + 2 * pad + kh       # slack: a tap's run may end past a plane


def _use_wide(w, kw, stride, pad):
    """Stride 1 and at most a third more GEMM columns than output pixels."""
    ow = w + 2 * pad - kw + 1
    return stride == 1 and pad <= kw - 1 and 3 * (w + pad) <= 4 * ow


def _columns(h, w, kh, kw, stride, pad):
    """(RS, R): columns per output row and per image in the GEMMs."""
    oh, ow = _out_size(h, kh, stride, pad), _out_size(w, kw, stride, pad)
    rs = _wide_dims(h, w, kh, pad)[0] if _use_wide(w, kw, stride, pad) else ow
    return rs, oh * rs


def _group(n, ckk, run, itemsize):
    """Images per GEMM: as many as keep the columns within COLS_BYTES (at least one)."""
    return max(1, min(n, COLS_BYTES // (ckk * run * itemsize)))


@njit(cache=True, nogil=True)
def _pad_images(x, xp, pad, rs, ch):
    """The data slots of xp (flat; zeros elsewhere, written once) = x (G, C, H, W)."""
    groups, chans, h, w = x.shape
    for g in range(groups):
        for c in range(chans):
            for hh in range(h):
                dst = xp[(g * chans + c) * ch + pad + (hh + pad) * rs:]
                src = x[g, c, hh]
                for ww in range(w):
                    dst[ww] = src[ww]


@njit(cache=True, nogil=True)
def _im2col_wide(xp, cols, groups, chans, kh, kw, rs, ch):
    """cols (C*KH*KW, G*OH*RS): row (c, ki, kj), image g's part is the run of OH*RS elements
    from xp[(g*C + c)*CH + ki*RS + kj]."""
    run = cols.shape[1] // groups
    for c in range(chans):
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]
                for g in range(groups):
                    src = xp[(g * chans + c) * ch + ki * rs + kj:]
                    dst = row[g * run:]
                    for q in range(run):
                        dst[q] = src[q]


@njit(cache=True, nogil=True)
def _col2im_wide(cols, dxp, dx, kh, kw, pad, rs, ch):
    """dx (G, C, H, W) = the scatter-add of cols (C*KH*KW, G*OH*RS), through the flat dxp."""
    groups, chans, h, w = dx.shape
    run = cols.shape[1] // groups
    for i in range(groups * chans * ch):
        dxp[i] = 0
    for c in range(chans):
        for ki in range(kh):
            for kj in range(kw):
                row = cols[(c * kh + ki) * kw + kj]
                for g in range(groups):
                    dst = dxp[(g * chans + c) * ch + ki * rs + kj:]
                    src = row[g * run:]
                    for q in range(run):
                        dst[q] += src[q]
    for g in range(groups):
        for c in range(chans):
            for hh in range(h):
                src = dxp[(g * chans + c) * ch + pad + (hh + pad) * rs:]
                dst = dx[g, c, hh]
                for ww in range(w):
                    dst[ww] = src[ww]


# Gathered: the wide layout without columns. Row (c, ki, kj) of image i's im2col matrix *is* the
# run xp[i*C*CH + c*CH + ki*RS + kj:][:OH*RS] of the padded images, so cpu_gemm.gathered reads
# it there (``tap_starts``); the weight gradient contracts g with the same runs
# (gathered_nt; g's runs rounded up to whole vectors with zeros, R8). The input gradient is the
# transposed convolution written as a gather: padded row u of dx's channel c is
#     sum over (o, ki, kj) of W[o, c, ki, kj] * g[o, u - (ki*RS + kj)],
# g zero outside its OH*RS columns; with g copied into zero-padded "gradient planes" (``_spread``,
# ``grad_planes``: Z zeros before each, enough after) that is gathered rows again, starting at
# o*GS + Z + u0 - (ki*RS + kj) (also from ``grad_planes``), with W^T (C, OC*KH*KW) as the
# weight operand; the epilogue crops the junk columns. It needs C a multiple of 4 (else the
# backward runs the column path; the first layer, C = 1 or 3, needs no input gradient).

@njit(cache=True, nogil=True)
def _spread(g, gp, images, z, gs):
    """gp[(i*OC + o)*GS + Z:][:R8] = g[o, i*R8:(i+1)*R8] for the images i of g (OC, images*R8)."""
    chans, columns = g.shape
    run = columns // images
    for i in range(images):
        for o in range(chans):
            dst = gp[(i * chans + o) * gs + z:]
            src = g[o, i * run:]
            for q in range(run):
                dst[q] = src[q]


# Both layouts: epilogue and prologue between the GEMM columns and NCHW. -------------------------

@njit(cache=True, nogil=True)
def _crop_bias_act(y_cols, y, bias, use_bias, relu, rs):
    """y (G, OC, OH, OW) = y_cols (OC, G*OH*RS) without junk columns, + bias, then ReLU."""
    groups, chans, oh, ow = y.shape
    for g in range(groups):
        for o in range(chans):
            b = bias[o] if use_bias else 0
            for i in range(oh):
                src = y_cols[o, (g * oh + i) * rs:]
                dst = y[g, o, i]
                for j in range(ow):
                    v = src[j] + b
                    if relu and v < 0:
                        v = 0
                    dst[j] = v


@njit(cache=True, nogil=True)
def _grad_cols(y, grad_y, g_cols, relu, rs):
    """g_cols (OC, G*IC) = grad_y * (y > 0) (or grad_y): image g's OH rows of RS columns from
    column g*IC (IC = g_cols' width / G >= OH*RS), zero in the junk columns and after OH*RS."""
    groups, chans, oh, ow = y.shape
    image_cols = g_cols.shape[1] // groups
    for o in range(chans):
        for g in range(groups):
            image = g_cols[o, g * image_cols:(g + 1) * image_cols]
            for i in range(oh):
                gy, yy = grad_y[g, o, i], y[g, o, i]
                dst = image[i * rs:(i + 1) * rs]
                if relu:
                    for j in range(ow):
                        dst[j] = gy[j] if yy[j] > 0 else 0
                else:
                    for j in range(ow):
                        dst[j] = gy[j]
                for j in range(ow, rs):
                    dst[j] = 0
            for j in range(oh * rs, image_cols):
                image[j] = 0


@njit(cache=True, nogil=True)
def _add_transposed(dst, src_t, accumulate):
    """dst (OC, CKK) (+)= src_t (CKK, OC).T"""
    rows, cols = dst.shape
    for i in range(rows):
        for j in range(cols):
            v = src_t[j, i]
            dst[i, j] = dst[i, j] + v if accumulate else v


class _Plan:
    """Sizes and scratch of one call: layout, group, buffers."""

    def __init__(self, x, weight, stride, pad):
        self.n, self.c, self.h, self.w = x.shape
        self.oc, _, self.kh, self.kw = weight.shape
        self.stride, self.pad, self.dtype = stride, pad, x.dtype
        self.oh = _out_size(self.h, self.kh, stride, pad)
        self.ckk = self.c * self.kh * self.kw
        self.wide = _use_wide(self.w, self.kw, stride, pad)
        self.rs, self.run = _columns(self.h, self.w, self.kh, self.kw, stride, pad)
        self.ch = _wide_dims(self.h, self.w, self.kh, pad)[1]
        # Gathered (stride 1, cpu_gemm.covers: at most 64 output channels, rows that fill its
        # strips): the padded images read in place; the input gradient too when the input
        # channels are a multiple of 4 (and at most 64).
        self.gathered = self.wide and cpu_gemm.covers(self.oc, self.ckk, x.dtype, self.run) \
            and cpu_gemm.covers_nt(self.oc, self.ckk, x.dtype)
        self.gathered_input_grad = cpu_gemm.covers(self.c, self.oc * self.kh * self.kw, x.dtype,
                                                   self.h * self.rs)
        if self.gathered:       # no columns: as many padded images as fit in GATHER_BYTES
            self.group = max(1, min(self.n, GATHER_BYTES // (self.c * self.ch * x.dtype.itemsize)))
        else:
            self.group = _group(self.n, self.ckk, self.run, x.dtype.itemsize)
        self.run8 = -(-self.run // 8) * 8                    # R rounded up to whole vectors
        if self.wide:
            # + RS: the last run's junk tail; + 8: run8's
            size = self.group * self.c * self.ch + self.rs + 8
            key = ("xp", (self.c, self.h, self.w, self.kh, pad, self.group), x.dtype.str)
            bufs = _scratch()
            self.xp = bufs.get(key)
            if self.xp is None:                                # zeros stay where no data goes
                self.xp = bufs[key] = np.zeros(size, x.dtype)

    def tap_starts(self):
        """(CKK,): where tap (c, ki, kj)'s run starts in a padded image (see "Gathered")."""
        return (np.arange(self.c)[:, None, None] * self.ch + np.arange(self.kh)[:, None] * self.rs
                + np.arange(self.kw)).reshape(-1).astype(np.intp)

    def grad_planes(self):
        """(gp, Z, GS, starts): the gradient planes of the input gradient, GS long each, image
        i's channel o's g at gp[(i*OC + o)*GS + Z:][:R8], zeros around it (written once); and
        (OC*KH*KW,) where the run for tap (o, ki, kj) starts in them: the input gradient's row u
        gathers g[u - (ki*RS + kj)]."""
        u0 = self.pad * self.rs + self.pad                  # x[0, 0] in a padded image
        z = max(0, (self.kh - 1) * self.rs + self.kw - 1 - u0)
        gs = max(z + u0 + self.h * self.rs, z + self.run8)
        key = ("gp", (self.oc, self.h, self.w, self.kh, self.kw, self.pad, self.group),
               self.dtype.str)
        bufs = _scratch()
        if key not in bufs:
            bufs[key] = np.zeros(self.group * self.oc * gs, self.dtype)
        starts = (np.arange(self.oc)[:, None, None] * gs + z + u0
                  - np.arange(self.kh)[:, None] * self.rs - np.arange(self.kw))
        return bufs[key], z, gs, starts.reshape(-1).astype(np.intp)

    def cols(self, tag, rows, images):
        return _matrix(tag, rows, images * self.run, self.dtype)

    def im2col(self, x, cols):
        if self.wide:
            _pad_images(x, self.xp, self.pad, self.rs, self.ch)
            _im2col_wide(self.xp, cols, x.shape[0], self.c, self.kh, self.kw, self.rs, self.ch)
        else:
            _im2col_rows(x, cols, self.kh, self.kw, self.stride, self.pad)

    def col2im(self, cols, dx):
        if self.wide:
            dxp = _matrix("dxp", 1, self.xp.size, self.dtype)[0]
            _col2im_wide(cols, dxp, dx, self.kh, self.kw, self.pad, self.rs, self.ch)
        else:
            _col2im_rows(cols, dx, self.kh, self.kw, self.stride, self.pad)


def gemm_shapes(x_shape, weight_shape, stride, pad, input_grad=True, itemsize=4):
    """The GEMMs one forward + backward issues on the column path, for benchmarks/step.py's BLAS
    reference (the gathered path does the same products in other kernels):
    [(a_shape, b_shape, trans_a, trans_b, out_shape, times)]."""
    n, c, h, w = x_shape
    oc, _, kh, kw = weight_shape
    ckk, run = c * kh * kw, _columns(h, w, kh, kw, stride, pad)[1]
    group = _group(n, ckk, run, itemsize)
    plan = []
    for images, times in ((group, n // group), (n % group, 1)):
        if images == 0 or times == 0:
            continue
        cols = images * run
        plan += [((oc, ckk), (ckk, cols), False, False, (oc, cols), times),    # W @ cols
                 ((ckk, cols), (oc, cols), False, True, (ckk, oc), times)]     # cols @ g^T
        if input_grad:
            plan.append(((oc, ckk), (oc, cols), True, False, (ckk, cols), times))  # W^T @ g
    return plan


def conv2d_forward(x, weight, bias, y, stride, pad, relu):
    """y (N, OC, OH, OW) = conv(x (N, C, H, W), weight (OC, C, KH, KW)) + bias (OC,) or None,
    then ReLU if ``relu``."""
    p = _Plan(x, weight, stride, pad)
    w2d = weight.reshape((p.oc, p.ckk))                      # (OC, CKK), a view
    use_bias = bias is not None
    b = bias if use_bias else w2d[0]                         # any array of the dtype: unused
    if p.gathered:
        w_quads, starts = cpu_gemm.quads(w2d), p.tap_starts()
    for n0 in range(0, p.n, p.group):
        xg = x[n0:n0 + p.group]                              # (G, C, H, W)
        y_cols = p.cols("y_cols", p.oc, xg.shape[0])         # (OC, G*R)
        if p.gathered:
            _pad_images(xg, p.xp, p.pad, p.rs, p.ch)
            cpu_gemm.gathered(w_quads, p.xp, starts, p.c * p.ch, p.run, y_cols)
        else:
            cols = p.cols("cols", p.ckk, xg.shape[0])        # (CKK, G*R)
            p.im2col(xg, cols)
            np.matmul(w2d, cols, out=y_cols)
        _crop_bias_act(y_cols, y[n0:n0 + p.group], b, use_bias, relu, p.rs)


def conv2d_backward(x, weight, y, grad_y, stride, pad, relu, grad_weight, accumulate_weight,
                    grad_bias, grad_x):
    """Gradients of conv2d_forward: grad_weight (=|+=), grad_bias (+=, or None: no bias),
    grad_x overwritten (or None: not wanted). ``y`` is the forward output (the ReLU mask)."""
    p = _Plan(x, weight, stride, pad)
    if p.gathered and (grad_x is None or p.gathered_input_grad):
        _backward_gathered(p, x, weight, y, grad_y, relu, grad_weight, accumulate_weight,
                           grad_bias, grad_x)
        return
    w2d = weight.reshape((p.oc, p.ckk))                      # (OC, CKK)
    dw_t = _matrix("dw_t", p.ckk, p.oc, x.dtype)             # (CKK, OC): sum over groups
    dw_part = _matrix("dw_part", p.ckk, p.oc, x.dtype)       # (CKK, OC): one group
    dw_t.fill(0)
    for n0 in range(0, p.n, p.group):
        xg = x[n0:n0 + p.group]                              # (G, C, H, W)
        cols = p.cols("cols", p.ckk, xg.shape[0])            # (CKK, G*R)
        g = p.cols("g_cols", p.oc, xg.shape[0])              # (OC, G*R)
        _grad_cols(y[n0:n0 + p.group], grad_y[n0:n0 + p.group], g, relu, p.rs)
        if grad_bias is not None:                            # junk columns add zeros
            np.add(grad_bias, g.sum(axis=1), out=grad_bias)
        p.im2col(xg, cols)
        np.matmul(cols, g.T, out=dw_part)
        np.add(dw_t, dw_part, out=dw_t)
        if grad_x is not None:
            np.matmul(w2d.T, g, out=cols)                    # d(cols), (CKK, G*R)
            p.col2im(cols, grad_x[n0:n0 + p.group])
    _add_transposed(grad_weight.reshape((p.oc, p.ckk)), dw_t, accumulate_weight)


def _backward_gathered(p, x, weight, y, grad_y, relu, grad_weight, accumulate_weight, grad_bias,
                       grad_x):
    """conv2d_backward without columns (see "Gathered" above)."""
    dw = grad_weight.reshape((p.oc, p.ckk))                  # (OC, CKK)
    starts = p.tap_starts()
    if grad_x is not None:
        gp, z, gs, back = p.grad_planes()
        # dx's wide rows (C, G*H*RS) = W^T (C, OC*KH*KW) @ the gradient planes, read backwards
        wt_quads = cpu_gemm.quads(np.ascontiguousarray(weight.transpose(1, 0, 2, 3))
                                  .reshape((p.c, p.oc * p.kh * p.kw)))
    for n0 in range(0, p.n, p.group):
        xg = x[n0:n0 + p.group]                              # (G, C, H, W)
        images = xg.shape[0]
        g = _matrix("g_runs", p.oc, images * p.run8, x.dtype)  # (OC, G*R8): no short tails
        _grad_cols(y[n0:n0 + p.group], grad_y[n0:n0 + p.group], g, relu, p.rs)
        if grad_bias is not None:                            # junk columns add zeros
            np.add(grad_bias, g.sum(axis=1), out=grad_bias)
        _pad_images(xg, p.xp, p.pad, p.rs, p.ch)
        cpu_gemm.gathered_nt(g, p.xp, starts, p.c * p.ch, p.run8, dw,
                             accumulate_weight or n0 > 0)
        if grad_x is not None:
            _spread(g, gp, images, z, gs)
            dx_rows = _matrix("dx_rows", p.c, images * p.h * p.rs, x.dtype)
            cpu_gemm.gathered(wt_quads, gp, back, p.oc * gs, p.h * p.rs, dx_rows)
            _crop_bias_act(dx_rows, grad_x[n0:n0 + p.group], dx_rows[0], False, False, p.rs)
