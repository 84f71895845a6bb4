"""The CuPy flavour's BatchNorm, global average pooling and option-A shortcut kernels."""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import dev, flat, launch_planes, launch_rows

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
    x = dev(x)
    n, c, l = checks.ncl(kind, x.shape)
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
    launch_planes(_CHANNEL_SUMS_SRC, "mpitrain_channel_runs", dtype, runs, c, n,
                  (x3, x3 if grad is None else grad, x3 if mean is None else mean,
                   x3 if invstd is None else invstd, part, np.int32(n), np.int32(c),
                   np.int32(l), np.int32(runs), np.int32(grad is not None)))
    runs_sum = cp.empty((2, c * runs), np.float64)
    launch_rows(_CHANNEL_SUMS_SRC, "mpitrain_sum_images", dtype, 2 * c * runs,
                (part, runs_sum, np.int32(n), np.int32(c * runs)))
    launch_rows(_CHANNEL_SUMS_SRC, "mpitrain_sum_runs", dtype, 2 * c,
                (runs_sum, stats, np.int32(c), np.int32(runs)))


def bn_stats(x, stats):
    x3, (_, c, _) = _ncl("bn_stats", x)                          # (N, C, L)
    stats = dev(stats)
    checks.stats("bn_stats", stats, c)
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
    stats, mean, invstd = dev(stats), dev(mean), dev(invstd)
    running_mean, running_var = dev(running_mean), dev(running_var)
    c = mean.size
    checks.stats("bn_moments", stats, c)
    checks.same_shape("bn_moments", (c,), mean=mean, invstd=invstd,
                      running_mean=running_mean, running_var=running_var)
    count = checks.count("bn_moments", count)
    unbias = count / (count - 1.0) if count > 1.0 else 1.0     # running_var is unbiased
    _bn_moments(stats[0], stats[1], count, float(eps), float(momentum), unbias, mean, invstd,
                running_mean, running_var)


def bn_eval_moments(running_mean, running_var, eps, mean, invstd):
    running_mean, running_var = dev(running_mean), dev(running_var)
    mean, invstd = dev(mean), dev(invstd)
    checks.same_shape("bn_eval_moments", (mean.size,), invstd=invstd,
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
    y = dev(y)
    checks.same_shape("bn_forward", x.shape, y=y)
    mean, invstd, weight, bias = dev(mean), dev(invstd), dev(weight), dev(bias)
    checks.same_shape("bn_forward", (c,), mean=mean, invstd=invstd, weight=weight, bias=bias)
    _bn_forward(flat(x3), mean, invstd, weight, bias, l, c, flat(y))


def bn_backward_stats(grad_y, x, mean, invstd, stats):
    x3, (_, c, _) = _ncl("bn_backward_stats", x)                 # (N, C, L)
    g3, _ = _ncl("bn_backward_stats", grad_y)
    checks.same_shape("bn_backward_stats", x3.shape, grad_y=g3)
    mean, invstd, stats = dev(mean), dev(invstd), dev(stats)
    checks.same_shape("bn_backward_stats", (c,), mean=mean, invstd=invstd)
    checks.stats("bn_backward_stats", stats, c)
    _channel_sums(stats, x3, g3, mean, invstd)


_bn_param_grads = cp.ElementwiseKernel(
    "float64 s0, float64 s1, bool accumulate", "T grad_weight, T grad_bias",
    """
    grad_weight = (T)(accumulate ? (double)grad_weight + s1 : s1);
    grad_bias = (T)(accumulate ? (double)grad_bias + s0 : s0);
    """, "mpitrain_bn_param_grads")


def bn_param_grads(stats, grad_weight, grad_bias, accumulate):
    stats, grad_weight, grad_bias = dev(stats), dev(grad_weight), dev(grad_bias)
    c = grad_weight.size
    checks.stats("bn_param_grads", stats, c)
    checks.same_shape("bn_param_grads", (c,), grad_weight=grad_weight, grad_bias=grad_bias)
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
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    checks.same_shape("bn_backward_input", x.shape, grad_y=grad_y, grad_x=grad_x)
    mean, invstd, weight, stats = dev(mean), dev(invstd), dev(weight), dev(stats)
    checks.same_shape("bn_backward_input", (c,), mean=mean, invstd=invstd, weight=weight)
    checks.stats("bn_backward_input", stats, c)
    count = checks.count("bn_backward_input", count)
    _bn_backward_input(flat(grad_y), flat(x3), mean, invstd, weight, stats, count, l, c,
                       flat(grad_x))


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
    x, y = dev(x), dev(y)
    _, _, l = checks.global_pool("global_avgpool_forward", x.shape, y.shape)
    _global_avgpool_forward(flat(x), l, flat(y))


def global_avgpool_backward(grad_y, grad_x):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    _, _, l = checks.global_pool("global_avgpool_backward", grad_x.shape, grad_y.shape)
    _global_avgpool_backward(flat(grad_y), l, flat(grad_x))


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
    x, y = dev(x), dev(y)
    stride, offset = checks.shortcut("shortcut_forward", x.shape, y.shape, stride, offset)
    _, c, h, w = x.shape
    _, c2, oh, ow = y.shape
    _shortcut_forward(flat(x), c, h, w, c2, oh, ow, stride, offset, flat(y))


def shortcut_backward(grad_y, grad_x, stride, offset):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    stride, offset = checks.shortcut("shortcut_backward", grad_x.shape, grad_y.shape,
                                     stride, offset, names=("grad_x", "grad_y"))
    _, c, h, w = grad_x.shape
    _, c2, oh, ow = grad_y.shape
    _shortcut_backward(flat(grad_y), c, h, w, c2, oh, ow, stride, offset, flat(grad_x))
