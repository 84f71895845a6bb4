"""The CuPy flavour's im2col, col2im, layout transposes and its own convolution."""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import dev, launch_planes
from mpitrain.kernels.cuda_cupy.dense import gemm, ones_row

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
    x, cols = dev(x), dev(cols)
    c, h, w, oh, ow = checks.dims("im2col", x.shape, cols.shape, kh, kw, stride, pad)
    _im2col(x, c, h, w, kh, kw, stride, pad, oh, ow, cols)


def col2im(cols, dx, kh, kw, stride, pad):
    cols, dx = dev(cols), dev(dx)
    c, h, w, oh, ow = checks.dims("col2im", dx.shape, cols.shape, kh, kw, stride, pad)
    _col2im(cols, c, h, w, kh, kw, stride, pad, oh, ow, dx)


def nhwc_to_nchw(src, dst):
    src, dst = dev(src), dev(dst)
    c, h, w = checks.layout("nhwc_to_nchw", dst.shape, src, "src")
    _nhwc_to_nchw(src, c, h, w, dst)


def nchw_to_nhwc(src, dst):
    src, dst = dev(src), dev(dst)
    c, h, w = checks.layout("nchw_to_nhwc", src.shape, dst, "dst")
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
    oh, ow = checks.out_size(h, kh, stride, pad), checks.out_size(w, kw, stride, pad)
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
        launch_planes(_IM2COL_CM_SRC, "mpitrain_im2col_cm", x.dtype, oh * ow, c, n,
                      (x, cols) + _geometry(dims, stride, pad))
    return cols


def conv2d_forward(x, weight, bias, y, stride, pad, relu):
    x, weight, y = dev(x), dev(weight), dev(y)
    dims = _conv_plan("conv2d_forward", x, weight, y, stride, pad)
    n, _, _, _, oc, _, _, oh, ow = dims
    if bias is not None:
        bias = dev(bias)
        checks.same_shape("conv2d_forward", (oc,), bias=bias)
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
    x, weight, y, grad_y = dev(x), dev(weight), dev(y), dev(grad_y)
    dims = _conv_plan("conv2d_backward", x, weight, y, stride, pad)
    n, c, h, w, oc, kh, kw, oh, ow = dims
    grad_weight = dev(grad_weight)
    checks.same_shape("conv2d_backward", y.shape, grad_y=grad_y)
    checks.same_shape("conv2d_backward", weight.shape, grad_weight=grad_weight)
    if grad_x is not None:
        grad_x = dev(grad_x)
        checks.same_shape("conv2d_backward", x.shape, grad_x=grad_x)
    nl = n * oh * ow
    g = cp.empty((oc, nl), x.dtype)                           # (OC, N*L)
    if nl:
        _nchw_to_rows(grad_y, y, bool(relu), oc, oh * ow, nl, g)
    cols = _columns(x, dims, stride, pad)                     # (CKK, N*L)
    gemm(g, cols, grad_weight.reshape(oc, -1), trans_b=True, accumulate=accumulate_weight)
    if grad_bias is not None:                                 # grad_bias (OC, 1) += g @ ones
        grad_bias = dev(grad_bias)
        checks.same_shape("conv2d_backward", (oc,), grad_bias=grad_bias)
        gemm(g, ones_row(nl, g.dtype).reshape(nl, 1), grad_bias.reshape(oc, 1), accumulate=True)
    if grad_x is None:
        return
    gemm(weight.reshape(oc, -1), g, cols, trans_a=True)       # d(cols), in place of cols
    if grad_x.size:
        launch_planes(_COL2IM_CM_SRC, "mpitrain_col2im_cm", x.dtype, h * w, c, n,
                      (cols, grad_x) + _geometry(dims, stride, pad))
