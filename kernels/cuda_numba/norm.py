"""The Numba flavour's BatchNorm, global average pooling and option-A shortcut kernels."""
import math

from numba import cuda, float64

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import (MAX_BLOCKS, SIM, TPB, dev, flat, grid, launch,
                                                scratch)

# Per-channel sums (BatchNorm's stats and the two sums of its backward) reduce N*L values for
# each of only C channels (16 in ResNet-20's first stage), so one block per channel would leave
# most of a GPU idle. Each channel's values are cut into chunks of at most _BN_CHUNK: block b
# reduces chunk b // C of channel b % C, its threads striding through the chunk (consecutive
# threads, consecutive addresses), in float64 in shared memory, into partials (chunks, 2*C); a
# second pass adds each channel's chunk partials in chunk order. Deterministic, no atomics.
_BN_CHUNK = 2 * TPB if SIM else 32 * TPB


@cuda.jit(device=True)
def _block_sum_pair(s, s2, partials, row, c, channels):
    """Tree-reduce two float64 per thread into partials[row, c] and partials[row, channels + c]
    (every thread of the block must call)."""
    buf = cuda.shared.array(TPB, float64)
    buf2 = cuda.shared.array(TPB, float64)
    tid = cuda.threadIdx.x
    buf[tid] = s
    buf2[tid] = s2
    cuda.syncthreads()
    half = TPB // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
            buf2[tid] += buf2[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partials[row, c] = buf[0]
        partials[row, channels + c] = buf2[0]
    cuda.syncthreads()              # a block's next (chunk, channel) reuses buf after this read


@cuda.jit(cache=True)
def _bn_stats_k(x, partials, chunk):
    # x (N, C, L) -> partials (chunks, 2*C): per (chunk, channel) the sums of x and of x**2
    n_n, c_n, l_n = x.shape
    values = n_n * l_n
    for b in range(cuda.blockIdx.x, partials.shape[0] * c_n, cuda.gridDim.x):
        k = b // c_n
        c = b - k * c_n
        end = (k + 1) * chunk
        if end > values:            # not min(): ptx_check's CUDA build (Numba 0.68) rejects it
            end = values
        s = float64(0.0)
        s2 = float64(0.0)
        for i in range(k * chunk + cuda.threadIdx.x, end, TPB):
            n = i // l_n
            v = float64(x[n, c, i - n * l_n])
            s += v
            s2 += v * v
        _block_sum_pair(s, s2, partials, k, c, c_n)


@cuda.jit(cache=True)
def _bn_backward_stats_k(grad_y, x, mean, invstd, partials, chunk):
    # partials (chunks, 2*C): per (chunk, channel) the sums of grad_y and of grad_y * xhat
    n_n, c_n, l_n = x.shape
    values = n_n * l_n
    for b in range(cuda.blockIdx.x, partials.shape[0] * c_n, cuda.gridDim.x):
        k = b // c_n
        c = b - k * c_n
        m = float64(mean[c])
        end = (k + 1) * chunk
        if end > values:
            end = values
        s = float64(0.0)
        s2 = float64(0.0)
        for i in range(k * chunk + cuda.threadIdx.x, end, TPB):
            n = i // l_n
            j = i - n * l_n
            g = float64(grad_y[n, c, j])
            s += g
            s2 += g * (float64(x[n, c, j]) - m)
        _block_sum_pair(s, s2 * float64(invstd[c]), partials, k, c, c_n)


@cuda.jit(cache=True)
def _sum_chunks_k(partials, out):
    # out (2*C,) = partials (chunks, 2*C) summed over chunks, in chunk order
    for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        acc = float64(0.0)
        for k in range(partials.shape[0]):
            acc += partials[k, j]
        out[j] = acc


def _channel_sums(kernel, arrays, values, channels, stats):
    """Launch a per-channel sum ``kernel(*arrays, partials, chunk)`` over ``values`` values per
    channel, then add its chunk partials into stats (2, C)."""
    if channels == 0:
        return
    chunks = max(1, -(-values // _BN_CHUNK))
    chunk = -(-values // chunks) if values else 1               # balanced, <= _BN_CHUNK
    partials = scratch((chunks, 2 * channels))
    kernel[min(chunks * channels, MAX_BLOCKS), TPB](*arrays, partials, chunk)
    _sum_chunks_k[grid(2 * channels)](partials, flat(stats))


def bn_stats(x, stats):
    x, stats = dev(x), dev(stats)
    n, c, l = checks.ncl("bn_stats", x.shape)
    checks.stats("bn_stats", stats, c)
    _channel_sums(_bn_stats_k, (x.reshape(n, c, l),), n * l, c, stats)


@cuda.jit(cache=True)
def _bn_moments_k(stats, count, eps, momentum, unbias, mean, invstd, running_mean, running_var):
    for c in range(cuda.grid(1), mean.size, cuda.gridsize(1)):
        m = stats[0, c] / count
        var = stats[1, c] / count - m * m                       # biased; >= 0 but for rounding
        if var < 0.0:
            var = 0.0
        mean[c] = m
        invstd[c] = 1.0 / math.sqrt(var + eps)
        running_mean[c] = (1.0 - momentum) * float64(running_mean[c]) + momentum * m
        running_var[c] = (1.0 - momentum) * float64(running_var[c]) + momentum * var * unbias


def bn_moments(stats, count, eps, momentum, mean, invstd, running_mean, running_var):
    stats, mean, invstd = dev(stats), dev(mean), dev(invstd)
    running_mean, running_var = dev(running_mean), dev(running_var)
    c = mean.size
    checks.stats("bn_moments", stats, c)
    checks.same_shape("bn_moments", (c,), invstd=invstd, running_mean=running_mean,
                      running_var=running_var)
    count = checks.count("bn_moments", count)
    unbias = count / (count - 1.0) if count > 1.0 else 1.0     # running_var is unbiased
    launch(_bn_moments_k, c, stats, count, float(eps), float(momentum), unbias, mean, invstd,
           running_mean, running_var)


@cuda.jit(cache=True)
def _bn_eval_moments_k(running_mean, running_var, eps, mean, invstd):
    for c in range(cuda.grid(1), mean.size, cuda.gridsize(1)):
        mean[c] = running_mean[c]
        invstd[c] = 1.0 / math.sqrt(float64(running_var[c]) + eps)


def bn_eval_moments(running_mean, running_var, eps, mean, invstd):
    running_mean, running_var = dev(running_mean), dev(running_var)
    mean, invstd = dev(mean), dev(invstd)
    c = mean.size
    checks.same_shape("bn_eval_moments", (c,), invstd=invstd, running_mean=running_mean,
                      running_var=running_var)
    launch(_bn_eval_moments_k, c, running_mean, running_var, float(eps), mean, invstd)


@cuda.jit(cache=True)
def _bn_forward_k(x, mean, invstd, weight, bias, y, l_n, c_n):
    # x, y flat (N*C*L,); element i is in channel (i // L) % C
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        c = (i // l_n) % c_n
        y[i] = (x[i] - mean[c]) * (invstd[c] * weight[c]) + bias[c]


def bn_forward(x, mean, invstd, weight, bias, y):
    x, y = dev(x), dev(y)
    n, c, l = checks.ncl("bn_forward", x.shape)
    checks.same_shape("bn_forward", x.shape, y=y)
    mean, invstd, weight, bias = dev(mean), dev(invstd), dev(weight), dev(bias)
    checks.same_shape("bn_forward", (c,), mean=mean, invstd=invstd, weight=weight, bias=bias)
    launch(_bn_forward_k, x.size, flat(x), mean, invstd, weight, bias, flat(y), l, c)


def bn_backward_stats(grad_y, x, mean, invstd, stats):
    grad_y, x, stats = dev(grad_y), dev(x), dev(stats)
    n, c, l = checks.ncl("bn_backward_stats", x.shape)
    checks.same_shape("bn_backward_stats", x.shape, grad_y=grad_y)
    mean, invstd = dev(mean), dev(invstd)
    checks.same_shape("bn_backward_stats", (c,), mean=mean, invstd=invstd)
    checks.stats("bn_backward_stats", stats, c)
    _channel_sums(_bn_backward_stats_k, (grad_y.reshape(n, c, l), x.reshape(n, c, l), mean,
                                         invstd), n * l, c, stats)


@cuda.jit(cache=True)
def _bn_param_grads_k(stats, grad_weight, grad_bias, accumulate):
    for c in range(cuda.grid(1), grad_weight.size, cuda.gridsize(1)):
        if accumulate:
            grad_weight[c] += stats[1, c]
            grad_bias[c] += stats[0, c]
        else:
            grad_weight[c] = stats[1, c]
            grad_bias[c] = stats[0, c]


def bn_param_grads(stats, grad_weight, grad_bias, accumulate):
    stats, grad_weight, grad_bias = dev(stats), dev(grad_weight), dev(grad_bias)
    c = grad_weight.size
    checks.stats("bn_param_grads", stats, c)
    checks.same_shape("bn_param_grads", (c,), grad_bias=grad_bias)
    launch(_bn_param_grads_k, c, stats, grad_weight, grad_bias, bool(accumulate))


@cuda.jit(cache=True)
def _bn_input_coeffs_k(invstd, weight, stats, count, coeffs):
    # grad_x = k*g - k*s0/count - k*invstd*(s1/count)*(x - mean), k = weight*invstd: the three
    # per-channel constants in float64, stored in x's dtype so the element pass stays in it
    for c in range(cuda.grid(1), invstd.size, cuda.gridsize(1)):
        inv = float64(invstd[c])
        k = float64(weight[c]) * inv
        coeffs[0, c] = k
        coeffs[1, c] = k * stats[0, c] / count
        coeffs[2, c] = k * inv * stats[1, c] / count


@cuda.jit(cache=True)
def _bn_backward_input_k(grad_y, x, mean, coeffs, grad_x, l_n, c_n):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        c = (i // l_n) % c_n
        grad_x[i] = coeffs[0, c] * grad_y[i] - coeffs[1, c] - coeffs[2, c] * (x[i] - mean[c])


def bn_backward_input(grad_y, x, mean, invstd, weight, stats, count, grad_x):
    grad_y, x, grad_x, stats = dev(grad_y), dev(x), dev(grad_x), dev(stats)
    n, c, l = checks.ncl("bn_backward_input", x.shape)
    checks.same_shape("bn_backward_input", x.shape, grad_y=grad_y, grad_x=grad_x)
    mean, invstd, weight = dev(mean), dev(invstd), dev(weight)
    checks.same_shape("bn_backward_input", (c,), mean=mean, invstd=invstd, weight=weight)
    checks.stats("bn_backward_input", stats, c)
    count = checks.count("bn_backward_input", count)
    if x.size == 0:
        return
    coeffs = scratch((3, c), x.dtype)                          # (3, C) in x's dtype
    _bn_input_coeffs_k[grid(c)](invstd, weight, stats, count, coeffs)
    _bn_backward_input_k[grid(x.size)](flat(grad_y), flat(x), mean, coeffs, flat(grad_x), l, c)


@cuda.jit(cache=True)
def _global_avgpool_forward_k(x, y, l_n):
    # one thread per (n, c) plane, summed in float64: the planes at the end of a network are
    # small (8 x 8 in ResNet-20), so a block per plane would idle most of its threads
    for p in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        s = float64(0.0)
        for j in range(p * l_n, (p + 1) * l_n):
            s += float64(x[j])
        y[p] = s / l_n


def global_avgpool_forward(x, y):
    x, y = dev(x), dev(y)
    n, c, l = checks.global_pool("global_avgpool_forward", x.shape, y.shape)
    launch(_global_avgpool_forward_k, y.size, flat(x), flat(y), l)


@cuda.jit(cache=True)
def _global_avgpool_backward_k(grad_y, grad_x, l_n):
    count = grad_x.dtype.type(l_n)  # dividing by the integer l_n would compute in float64
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        grad_x[i] = grad_y[i // l_n] / count


def global_avgpool_backward(grad_y, grad_x):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    n, c, l = checks.global_pool("global_avgpool_backward", grad_x.shape, grad_y.shape)
    launch(_global_avgpool_backward_k, grad_x.size, flat(grad_y), flat(grad_x), l)


@cuda.jit(cache=True)
def _shortcut_forward_k(x, y, stride, offset):
    # gather over y (N, C2, OH, OW): channel c2 reads x's channel c2 - offset, or is zero
    c_n = x.shape[1]
    c2_n, oh_n, ow_n = y.shape[1], y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c2 = (i // (ow_n * oh_n)) % c2_n
        n = i // (ow_n * oh_n * c2_n)
        c = c2 - offset
        if 0 <= c < c_n:
            y[n, c2, oh, ow] = x[n, c, oh * stride, ow * stride]
        else:
            y[n, c2, oh, ow] = 0


def shortcut_forward(x, y, stride, offset):
    x, y = dev(x), dev(y)
    stride, offset = checks.shortcut("shortcut_forward", x.shape, y.shape, stride, offset)
    launch(_shortcut_forward_k, y.size, x, y, stride, offset)


@cuda.jit(cache=True)
def _shortcut_backward_k(grad_y, grad_x, stride, offset):
    # gather over grad_x (N, C, H, W): only pixels on the stride grid received a value
    c_n, h_n, w_n = grad_x.shape[1], grad_x.shape[2], grad_x.shape[3]
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        if h % stride == 0 and w % stride == 0:
            grad_x[n, c, h, w] = grad_y[n, c + offset, h // stride, w // stride]
        else:
            grad_x[n, c, h, w] = 0


def shortcut_backward(grad_y, grad_x, stride, offset):
    grad_y, grad_x = dev(grad_y), dev(grad_x)
    stride, offset = checks.shortcut("shortcut_backward", grad_x.shape, grad_y.shape,
                                     stride, offset, names=("grad_x", "grad_y"))
    launch(_shortcut_backward_k, grad_x.size, grad_y, grad_x, stride, offset)
