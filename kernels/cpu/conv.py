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

Float32 layers whose output channels are a multiple of 16 (every convolution of ResNet-20, LeNet
and cifar_cnn, the strided ones too) take the "gathered" path instead (below): the
register-blocked kernels of kernels/cpu/conv_gemm.py read the padded image in place, output
pixels as rows, so neither im2col nor col2im runs and no padding column is computed. Forward +
backward at batch 64, one thread, against the previous (column-run) gathered kernels in the same
run: ResNet's 64-channel 7x7 layer 13.2 -> 10.9 ms, its stride-2 layers 14.7 -> 8.5 and
11.1 -> 7.9, LeNet's conv2 58.0 -> 53.9 (docs/benchmarks.md).

Scratch arrays are kept per thread and (tag, dtype), regrown when too small; the loop over
groups runs in Python (BLAS cannot be called from an njit function without SciPy), on THREADS
threads on the gathered path (below).
"""
import concurrent.futures
import threading

import numpy as np
from numba import njit

from mpitrain.kernels.checks import out_size
from mpitrain.kernels.cpu import conv_gemm
from mpitrain.kernels.cpu.simd import vtranspose8

# Bytes of im2col columns per group: about half of a core's L2 (1 MB on the Zen 4 and 2 MB on the
# Xeons this runs on), so the columns, a slice of W and the GEMM output stay in it together.
COLS_BYTES = 512 * 1024
# Bytes of a group on the gathered path: its padded images and its output (or gradient) as
# pixels x channels; four 16-channel 28x28 images, sixteen 64-channel 7x7 ones. ResNet-20's step
# 217.7 / 212.1 / 211.3 ms at 256 KiB / 512 KiB / 1 MiB, LeNet's 81.1 / 80.4 / 85.3; at 64 images
# the first layer's pixels (6 MB) leave the cache.
GATHER_BYTES = 512 * 1024

# Scratch per thread: two models may train in two threads (the kernels release the GIL).
_local = threading.local()

# Threads the gathered path splits a batch over (whole groups each; BLAS is idle meanwhile):
# mpitrain.threads.configure sets it to the rank's thread budget. The weight gradient is summed
# over them in thread order, so results depend on it (bitwise), not on scheduling.
THREADS = 1
_pool = None
_pool_size = 0
_pool_lock = threading.Lock()


def _ranges(n, group):
    """[(lo, hi)]: images 0:n in contiguous ranges of whole groups, one per thread."""
    groups = -(-n // group)
    threads = max(1, min(THREADS, groups))
    cuts = [min(n, groups * t // threads * group) for t in range(threads + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _in_parallel(work, ranges):
    """work(lo, hi, t) for each range t, range 0 on this thread; waits for all, then raises the
    first error."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool_size < len(ranges) - 1:
            _pool_size = len(ranges) - 1
            _pool = concurrent.futures.ThreadPoolExecutor(_pool_size, "mpitrain-conv")
        futures = [_pool.submit(work, lo, hi, t) for t, (lo, hi) in enumerate(ranges) if t]
    errors = []
    try:
        work(*ranges[0], 0)
    except BaseException as e:          # the other ranges still finish before it is raised
        errors.append(e)
    for future in futures:
        error = future.exception()
        if error is not None:
            errors.append(error)
    if errors:
        raise errors[0]


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
    oh, ow = out_size(h, kh, stride, pad), out_size(w, kw, stride, pad)
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


# Gathered: no columns. X[p, k], the im2col matrix with output pixels as rows, is the element
# xp[pixels[p] + taps[k]] of the padded images (wide layout above; pixels[p] = image*C*CH +
# i*S*RS + j*S for output pixel (i, j) at stride S, taps[k] = c*CH + ki*RS + kj), so conv_gemm
# reads it there:
#     forward      y (P, OC)    = X @ W^T           then transposed into NCHW + bias (+ ReLU)
#     backward     g (P, OC)    = grad_y * (y > 0), pixel-major
#                  dW^T (CKK, OC) += X^T @ g
#                  dx           = the transposed convolution, as S*S gathers ("phases"): dx's
#                                 pixels (S*u + a, S*v + b) of phase (a, b) sum W[o, c, ki, kj] *
#                                 g[o, u + di, v + dj] over o and the taps with a + pad - ki =
#                                 S*di (and b + pad - kj = S*dj), read from g zero-padded
#                                 ("gradient planes", written by the ReLU mask); at stride 1 one
#                                 phase, a stride-1 convolution of g with W flipped
# It needs a square kernel with pad < K and, for the input gradient, C a multiple of 16 and six
# pixels a phase (else the backward runs the column path; the first layer, C = 1 or 3, needs no
# input gradient).

def _windows(chans, h, w, k, pad, stride, images):
    """The gathered operands of a convolution of ``images`` padded (chans, h, w) images in the
    wide layout: (pixels (images*OH*OW,), taps (chans*K*K,))."""
    rs, ch = _wide_dims(h, w, k, pad)
    oh, ow = out_size(h, k, stride, pad), out_size(w, k, stride, pad)
    pixels = (np.arange(images)[:, None, None] * chans * ch
              + np.arange(oh)[:, None] * (stride * rs) + np.arange(ow) * stride)
    taps = np.arange(chans)[:, None, None] * ch + np.arange(k)[:, None] * rs + np.arange(k)
    return pixels.reshape(-1).astype(np.intp), taps.reshape(-1).astype(np.intp)


@njit(cache=True, nogil=True, inline="always")
def _transpose(a, b):
    """b (C, R) = a (R, C) transposed: 8 x 8 blocks in registers, the edges one by one."""
    rows, cols = a.shape
    whole_rows, whole_cols = rows - rows % 8, cols - cols % 8
    for i in range(0, whole_rows, 8):
        for j in range(0, whole_cols, 8):
            vtranspose8(a, i, j, b, j, i)
    for i in range(rows):
        for j in range(whole_cols if i < whole_rows else 0, cols):
            b[j, i] = a[i, j]


@njit(cache=True, nogil=True)
def _store_pixels(out, y, bias, use_bias, relu):
    """y (G, N, OH, OW) = out (G*OH*OW, N) transposed, + bias, then ReLU; y C-contiguous."""
    groups, chans, oh, ow = y.shape
    pixels = oh * ow
    for g in range(groups):
        planes = y[g].reshape((chans, pixels))
        _transpose(out[g * pixels:(g + 1) * pixels], planes)
        if use_bias or relu:
            for o in range(chans):
                b = bias[o] if use_bias else 0
                plane = planes[o]
                for p in range(pixels):
                    v = plane[p] + b
                    plane[p] = 0 if relu and v < 0 else v


def _store(out, y, bias, relu):
    """_store_pixels into y (G, N, OH, OW) of any strides (a phase of dx, a caller's view)."""
    b = bias if bias is not None else out[0]                 # any array of the dtype: unused
    if y.flags.c_contiguous:
        _store_pixels(out, y, b, bias is not None, relu)
        return
    dense = _matrix("dense", 1, y.size, y.dtype).reshape(y.shape)
    _store_pixels(out, dense, b, bias is not None, relu)
    y[...] = dense


@njit(cache=True, nogil=True)
def _mask_pixels(y, grad_y, relu, g, planes, want_planes, pad, rs, ch):
    """g (G*OH*OW, OC) = grad_y * (y > 0) (or grad_y), pixel-major; if ``want_planes``, the same
    values into the data slots of the padded gradient planes (flat, wide layout, zeros
    elsewhere, written once): channel o of image i at planes[(i*OC + o)*CH:]."""
    groups, chans, oh, ow = y.shape
    # one image masked, channel-major; rows an odd number of cache lines apart, so the
    # transpose's column walk does not keep hitting one cache set (32x32 images: 2x slower)
    image = np.empty((chans, (-(-oh * ow // 16) | 1) * 16), g.dtype)
    for i in range(groups):
        # plane by plane (y and grad_y stream from memory in order), each row a contiguous
        # select LLVM vectorises (a branch per pixel mispredicts on ReLU's random signs)
        for o in range(chans):
            for r in range(oh):
                gy, yy, masked = grad_y[i, o, r], y[i, o, r], image[o, r * ow:(r + 1) * ow]
                if relu:
                    for j in range(ow):
                        masked[j] = gy[j] if yy[j] > 0 else 0
                else:
                    masked[:] = gy
                if want_planes:
                    dst = planes[(i * chans + o) * ch + pad + (r + pad) * rs:]
                    for j in range(ow):
                        dst[j] = masked[j]
        _transpose(image[:, :oh * ow], g[i * oh * ow:(i + 1) * oh * ow])


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
    """g_cols (OC, G*OH*RS) = grad_y * (y > 0) (or grad_y), zero in the junk columns."""
    groups, chans, oh, ow = y.shape
    for o in range(chans):
        for g in range(groups):
            for i in range(oh):
                gy, yy = grad_y[g, o, i], y[g, o, i]
                dst = g_cols[o, (g * oh + i) * rs:(g * oh + i + 1) * rs]
                if relu:
                    for j in range(ow):
                        dst[j] = gy[j] if yy[j] > 0 else 0
                else:
                    for j in range(ow):
                        dst[j] = gy[j]
                for j in range(ow, rs):
                    dst[j] = 0


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
        self.stride, self.pad, self.dtype, self.weight = stride, pad, x.dtype, weight
        self.oh, self.ow = out_size(self.h, self.kh, stride, pad), out_size(self.w, self.kw,
                                                                             stride, pad)
        self.ckk = self.c * self.kh * self.kw
        # Gathered (see above): float32, output channels a multiple of 16, a square kernel with
        # pad < K, at least one six-row block of taps and of pixels.
        self.gathered = (self.kh == self.kw and pad < self.kh and conv_gemm.covers(self.oc, x.dtype)
                         and min(self.ckk, self.oh * self.ow) >= conv_gemm.ROWS)
        self.wide = _use_wide(self.w, self.kw, stride, pad)  # the column path's layout
        self.rs, self.ch = _wide_dims(self.h, self.w, self.kh, pad)
        # the column path's GEMM columns per output row and per image
        self.row, self.run = _columns(self.h, self.w, self.kh, self.kw, stride, pad)
        if self.gathered:       # as many images as fit in GATHER_BYTES: padded, and as pixels
            image = (self.c * self.ch + self.oh * self.ow * self.oc) * x.dtype.itemsize
            self.group = max(1, min(self.n, GATHER_BYTES // image))
        else:
            self.group = _group(self.n, self.ckk, self.run, x.dtype.itemsize)
        if self.wide:                                        # (the gathered path's: per thread)
            self.xp = self.padded("xp", self.c, self.h, self.w, pad)

    def phases(self):
        """The input gradient's gathers (see "Gathered"), or None where they do not cover it:
        (q, [(a, b, pixels, taps, w_phase (taps, C))]), the gradient planes padded by q."""
        s, k = self.stride, self.kh
        if not conv_gemm.covers(self.c, self.dtype):
            return None
        steps = [[(ki, (a + self.pad - ki) // s) for ki in range(k)
                  if (a + self.pad - ki) % s == 0] for a in range(s)]
        sizes = [(-(-(self.h - a) // s), -(-(self.w - a) // s)) for a in range(s)]
        if min(hu * wv for hu, _ in sizes for _, wv in sizes) < conv_gemm.ROWS:
            return None
        # padding that keeps every g[u + di, v + dj] read inside the planes (zeros outside g)
        q = max([0] + [max(-d, hu - 1 + d - (self.oh - 1), wv - 1 + d - (self.ow - 1))
                       for a in range(s) for _, d in steps[a] for hu, wv in [sizes[a]]])
        rs, ch = _wide_dims(self.oh, self.ow, k, q)
        phases = []
        for a in range(s):
            for b in range(s):
                if not (steps[a] and steps[b]):
                    phases.append((a, b, None, None, None))     # no tap reaches these pixels
                    continue
                (ki, di), (kj, dj) = zip(*steps[a]), zip(*steps[b])
                hu, wv = sizes[a][0], sizes[b][1]
                pixels = (np.arange(self.group)[:, None, None] * self.oc * ch
                          + (np.arange(hu)[:, None] + q) * rs + np.arange(wv) + q)
                taps = (np.arange(self.oc)[:, None, None] * ch + np.array(di)[:, None] * rs
                        + np.array(dj))
                w_phase = self.weight[:, :, list(ki)][:, :, :, list(kj)]   # (OC, C, |ki|, |kj|)
                phases.append((a, b, pixels.reshape(-1).astype(np.intp),
                               taps.reshape(-1).astype(np.intp),
                               np.ascontiguousarray(w_phase.transpose(0, 2, 3, 1))
                               .reshape((-1, self.c))))
        return q, phases

    def padded(self, tag, chans, h, w, pad):
        """A group's zero-padded (chans, h, w) images, flat in the wide layout; zeros stay where no
        data goes (written once). + RS: the last run's junk tail (column path)."""
        rs, ch = _wide_dims(h, w, self.kh, pad)
        key = (tag, (chans, h, w, self.kh, pad, self.group), self.dtype.str)
        bufs = _scratch()
        if key not in bufs:
            bufs[key] = np.zeros(self.group * chans * ch + rs, self.dtype)
        return bufs[key]

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
    if p.gathered:
        w_t = np.ascontiguousarray(w2d.T)                    # (CKK, OC)
        _in_parallel(lambda lo, hi, t: _forward_gathered(p, x, w_t, bias, y, relu, lo, hi),
                     _ranges(p.n, p.group))
        return
    use_bias = bias is not None
    b = bias if use_bias else w2d[0]                         # any array of the dtype: unused
    for n0 in range(0, p.n, p.group):
        xg = x[n0:n0 + p.group]                              # (G, C, H, W)
        y_cols = p.cols("y_cols", p.oc, xg.shape[0])         # (OC, G*R)
        cols = p.cols("cols", p.ckk, xg.shape[0])            # (CKK, G*R)
        p.im2col(xg, cols)
        np.matmul(w2d, cols, out=y_cols)
        _crop_bias_act(y_cols, y[n0:n0 + p.group], b, use_bias, relu, p.row)


def _forward_gathered(p, x, w_t, bias, y, relu, lo, hi):
    """conv2d_forward of images lo:hi without columns (see "Gathered" above), on this thread's
    scratch."""
    pixels, taps = _windows(p.c, p.h, p.w, p.kh, p.pad, p.stride, p.group)
    xp = p.padded("xp", p.c, p.h, p.w, p.pad)
    y_pix = _matrix("y_pixels", len(pixels), p.oc, x.dtype)  # (G*OH*OW, OC)
    for n0 in range(lo, hi, p.group):
        xg = x[n0:min(hi, n0 + p.group)]                     # (G, C, H, W)
        rows = xg.shape[0] * p.oh * p.ow
        _pad_images(xg, xp, p.pad, p.rs, p.ch)
        conv_gemm.gathered(w_t, xp, pixels[:rows], taps, y_pix[:rows])
        _store(y_pix, y[n0:n0 + xg.shape[0]], bias, relu)


def conv2d_backward(x, weight, y, grad_y, stride, pad, relu, grad_weight, accumulate_weight,
                    grad_bias, grad_x):
    """Gradients of conv2d_forward: grad_weight (=|+=), grad_bias (+=, or None: no bias),
    grad_x overwritten (or None: not wanted). ``y`` is the forward output (the ReLU mask)."""
    p = _Plan(x, weight, stride, pad)
    phases = p.phases() if p.gathered and grad_x is not None else None
    if p.gathered and (grad_x is None or phases is not None):
        # one weight (and bias) gradient per thread, added in thread order
        ranges = _ranges(p.n, p.group)
        dw_parts = _matrix("dw_parts", len(ranges) * p.ckk, p.oc, x.dtype)
        db_parts = np.zeros((len(ranges), p.oc), x.dtype)
        _in_parallel(lambda lo, hi, t: _backward_gathered(
            p, x, y, grad_y, relu, dw_parts[t * p.ckk:(t + 1) * p.ckk],
            db_parts[t] if grad_bias is not None else None, grad_x, phases, lo, hi), ranges)
        for t in range(1, len(ranges)):
            dw_parts[:p.ckk] += dw_parts[t * p.ckk:(t + 1) * p.ckk]
        if grad_bias is not None:
            np.add(grad_bias, db_parts.sum(axis=0), out=grad_bias)
        _add_transposed(grad_weight.reshape((p.oc, p.ckk)), dw_parts[:p.ckk], accumulate_weight)
        return
    w2d = weight.reshape((p.oc, p.ckk))                      # (OC, CKK)
    dw_t = _matrix("dw_t", p.ckk, p.oc, x.dtype)             # (CKK, OC): sum over groups
    dw_part = _matrix("dw_part", p.ckk, p.oc, x.dtype)       # (CKK, OC): one group
    dw_t.fill(0)
    for n0 in range(0, p.n, p.group):
        xg = x[n0:n0 + p.group]                              # (G, C, H, W)
        cols = p.cols("cols", p.ckk, xg.shape[0])            # (CKK, G*R)
        g = p.cols("g_cols", p.oc, xg.shape[0])              # (OC, G*R)
        _grad_cols(y[n0:n0 + p.group], grad_y[n0:n0 + p.group], g, relu, p.row)
        if grad_bias is not None:                            # junk columns add zeros
            np.add(grad_bias, g.sum(axis=1), out=grad_bias)
        p.im2col(xg, cols)
        np.matmul(cols, g.T, out=dw_part)
        np.add(dw_t, dw_part, out=dw_t)
        if grad_x is not None:
            np.matmul(w2d.T, g, out=cols)                    # d(cols), (CKK, G*R)
            p.col2im(cols, grad_x[n0:n0 + p.group])
    _add_transposed(grad_weight.reshape((p.oc, p.ckk)), dw_t, accumulate_weight)


def _backward_gathered(p, x, y, grad_y, relu, dw_t, db, grad_x, phases, lo, hi):
    """The gradients of images lo:hi without columns (see "Gathered" above), on this thread's
    scratch: dw_t (CKK, OC) overwritten with their weight gradient, db (OC,) (if not None)
    added their bias gradient, grad_x[lo:hi] (if not None) overwritten with theirs;
    ``phases`` = p.phases()."""
    pixels, taps = _windows(p.c, p.h, p.w, p.kh, p.pad, p.stride, p.group)
    xp = p.padded("xp", p.c, p.h, p.w, p.pad)
    g_pix = _matrix("g_pixels", len(pixels), p.oc, x.dtype)  # (G*OH*OW, OC)
    planes, q = dw_t[0], 0                                   # (unused without grad_x)
    if grad_x is not None:
        q, phases = phases
        planes = p.padded("grad_planes", p.oc, p.oh, p.ow, q)
        dx = _matrix("dx_pixels", p.group * p.h * p.w, p.c, x.dtype)
    grs, gch = _wide_dims(p.oh, p.ow, p.kh, q)
    if lo == hi:                                             # an empty batch
        dw_t[...] = 0
    for n0 in range(lo, hi, p.group):
        n1 = min(hi, n0 + p.group)
        xg = x[n0:n1]                                        # (G, C, H, W)
        g = g_pix[:(n1 - n0) * p.oh * p.ow]
        _mask_pixels(y[n0:n1], grad_y[n0:n1], relu, g, planes, grad_x is not None, q, grs, gch)
        if db is not None:
            db += g.sum(axis=0)
        _pad_images(xg, xp, p.pad, p.rs, p.ch)
        conv_gemm.gathered_t(g, xp, pixels[:len(g)], taps, dw_t, n0 > lo)
        if grad_x is None:
            continue
        for a, b, dx_pixels, dx_taps, w_phase in phases:
            dst = grad_x[n0:n1, :, a::p.stride, b::p.stride]   # (G, C, HU, WV)
            if dx_pixels is None:
                dst[...] = 0
                continue
            rows = (n1 - n0) * dst.shape[2] * dst.shape[3]
            conv_gemm.gathered(w_phase, planes, dx_pixels[:rows], dx_taps, dx[:rows])
            _store(dx, dst, None, False)
