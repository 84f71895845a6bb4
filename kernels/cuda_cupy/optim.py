"""The CuPy flavour's optimizer updates, and SGD over every parameter in one launch."""
import cupy as cp
import numpy as np

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_cupy.arrays import flat, raw_kernel, scalar

_sgd_plain = cp.ElementwiseKernel(
    "T grad, T lr, T wd", "T param", "param = param - lr * (grad + wd * param)",
    "mpitrain_sgd_plain")
_sgd_momentum = cp.ElementwiseKernel(
    "T grad, T lr, T momentum, bool nesterov, T wd", "T param, T buf",
    """
    T g = grad + wd * param;
    T b = momentum * buf + g;
    buf = b;
    param = param - lr * (nesterov ? g + momentum * b : b);
    """, "mpitrain_sgd_momentum")
_adam = cp.ElementwiseKernel(
    "T grad, T step_size, T beta1, T beta2, T eps, T wd, T inv_sqrt_bc2", "T param, T m, T v",
    """
    T g = grad + wd * param;
    T mi = beta1 * m + ((T)1 - beta1) * g;
    T vi = beta2 * v + ((T)1 - beta2) * g * g;
    m = mi;
    v = vi;
    param = param - step_size * mi / (sqrt(vi) * inv_sqrt_bc2 + eps);
    """, "mpitrain_adam")
_adamw = cp.ElementwiseKernel(
    "T grad, T step_size, T beta1, T beta2, T eps, T decay, T inv_sqrt_bc2", "T param, T m, T v",
    """
    T mi = beta1 * m + ((T)1 - beta1) * grad;
    T vi = beta2 * v + ((T)1 - beta2) * grad * grad;
    m = mi;
    v = vi;
    T p = param * decay;
    param = p - step_size * mi / (sqrt(vi) * inv_sqrt_bc2 + eps);
    """, "mpitrain_adamw")


def sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay):
    param, grad = checks.same_size("sgd_update", flat(param), flat(grad))
    if momentum == 0:                                    # buf unused (and may be None)
        _sgd_plain(grad, scalar(param, lr), scalar(param, weight_decay), param)
        return
    buf = flat(buf)
    checks.same_size("sgd_update", param, buf)
    _sgd_momentum(grad, scalar(param, lr), scalar(param, momentum), bool(nesterov),
                  scalar(param, weight_decay), param, buf)


# Every parameter of an optimizer in one launch (PyTorch's multi-tensor apply): a table of the
# tensors' addresses and sizes, and one block per chunk of a tensor. The arithmetic is
# sgd_update's, in the same order, so the two give the same values.
_SGD_GROUP_SRC = r"""
extern "C" __global__ void mpitrain_sgd_group(const long long* params, const long long* grads,
                                              const long long* bufs, const long long* sizes,
                                              const T* decays, const int* chunk_tensor,
                                              const long long* chunk_start, long long chunk,
                                              T lr, T momentum, int nesterov) {
    int t = chunk_tensor[blockIdx.x];
    long long start = chunk_start[blockIdx.x], end = start + chunk;
    end = end < sizes[t] ? end : sizes[t];
    T* param = (T*)params[t];
    const T* grad = (const T*)grads[t];
    T* buf = (T*)bufs[t];
    T wd = decays[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        if (momentum == (T)0) {
            param[i] = param[i] - lr * (grad[i] + wd * param[i]);
        } else {
            T g = grad[i] + wd * param[i];
            T b = momentum * buf[i] + g;
            buf[i] = b;
            param[i] = param[i] - lr * (nesterov ? g + momentum * b : b);
        }
    }
}
"""
_GROUP_CHUNK = 8192
_group_tables = {}


def _address(a):
    """The device address of ``a`` (a NumPy array's own address for the CPU stand-in of CuPy
    that the tests use)."""
    data = a.data
    return data.ptr if hasattr(data, "ptr") else a.ctypes.data


def _group_table(arrays, decays, dtype):
    """Device tables of a multi-tensor launch over ``arrays`` (lists of equal-length lists of
    C-contiguous arrays of ``dtype``, the same size at each position), cached by addresses; None
    where the arrays do not qualify."""
    key = (dtype.str, tuple(decays), tuple(a.size for a in arrays[0])) + tuple(
        _address(a) for group in arrays for a in group)
    table = _group_tables.get(key)
    if table is None:
        if len(_group_tables) >= 64:     # optimizers come and go (tests, restarts): keep a few
            _group_tables.clear()
        sizes = [a.size for a in arrays[0]]
        for group in arrays:
            for a, size in zip(group, sizes):
                if (not isinstance(a, cp.ndarray) or a.dtype != dtype or a.size != size
                        or not a.flags.c_contiguous):
                    return None
        starts = [(t, s) for t, size in enumerate(sizes) for s in range(0, size, _GROUP_CHUNK)]
        table = tuple(cp.asarray(np.asarray(v, dt)) for v, dt in (
            ([[_address(a) for a in group] for group in arrays], np.int64),
            (sizes, np.int64), (decays, dtype), ([t for t, _ in starts] or [0], np.int32),
            ([s for _, s in starts] or [0], np.int64))) + (len(starts),)
        _group_tables[key] = table
    return table


def sgd_update_group(params, grads, bufs, lr, momentum, nesterov, weight_decays):
    """sgd_update of every (param, grad, buf, weight decay) in one launch; ``bufs`` may be the
    params themselves when momentum is 0 (not read then)."""
    dtype = params[0].dtype if params else None
    table = (_group_table([params, grads, bufs], [float(d) for d in weight_decays], dtype)
             if dtype in (np.float32, np.float64) else None)
    if table is None:                    # mixed dtypes, views, host arrays: one launch each
        for p, g, b, wd in zip(params, grads, bufs, weight_decays):
            sgd_update(p, g, b, lr, momentum, nesterov, wd)
        return
    addresses, sizes, decays, chunk_tensor, chunk_start, chunks = table
    if chunks:
        raw_kernel(_SGD_GROUP_SRC, "mpitrain_sgd_group", dtype)(
            (chunks,), (256,), (addresses[0], addresses[1], addresses[2], sizes, decays,
                                chunk_tensor, chunk_start, np.int64(_GROUP_CHUNK),
                                dtype.type(lr), dtype.type(momentum), np.int32(bool(nesterov))))


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    checks.adam_step(step)
    param, grad, m, v = flat(param), flat(grad), flat(m), flat(v)
    checks.same_size("adam_update", param, grad)
    # PyTorch: step_size = lr / (1 - b1^t); denom = sqrt(v) / sqrt(1 - b2^t) + eps
    s = lambda value: scalar(param, value)  # noqa: E731
    _adam(grad, s(lr / (1.0 - beta1 ** step)), s(beta1), s(beta2), s(eps), s(weight_decay),
          s(1.0 / np.sqrt(1.0 - beta2 ** step)), param, m, v)


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step!r}")
    param, grad, m, v = flat(param), flat(grad), flat(m), flat(v)
    checks.same_size("adamw_update", param, grad, m, v)
    # PyTorch AdamW: param *= 1 - lr*wd, then Adam's update (no decay in the gradient)
    s = lambda value: scalar(param, value)  # noqa: E731
    _adamw(grad, s(lr / (1.0 - beta1 ** step)), s(beta1), s(beta2), s(eps),
           s(1.0 - lr * weight_decay), s(1.0 / np.sqrt(1.0 - beta2 ** step)), param, m, v)


# grad_avg and buf are raw (indexed by i, never touched when unused), so the param may stand in
# for them without centering / momentum
_rmsprop = cp.ElementwiseKernel(
    "T grad, T lr, T alpha, T eps, T wd, T momentum, bool centered",
    "T param, T square_avg, raw T grad_avg, raw T buf",
    """
    T g = grad + wd * param;
    T v = alpha * square_avg + ((T)1 - alpha) * g * g;
    square_avg = v;
    if (centered) {
        T ga = alpha * grad_avg[i] + ((T)1 - alpha) * g;
        grad_avg[i] = ga;
        v = v - ga * ga;
    }
    T step = g / (sqrt(v) + eps);
    if (momentum != (T)0) {
        T b = momentum * buf[i] + step;
        buf[i] = b;
        step = b;
    }
    param = param - lr * step;
    """, "mpitrain_rmsprop")


def rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered):
    param, grad, square_avg = flat(param), flat(grad), flat(square_avg)
    grad_avg = flat(grad_avg) if centered else param
    buf = flat(buf) if momentum != 0 else param
    checks.same_size("rmsprop_update", param, grad, square_avg, grad_avg, buf)
    s = lambda value: scalar(param, value)  # noqa: E731
    _rmsprop(grad, s(lr), s(alpha), s(eps), s(weight_decay), s(momentum), bool(centered), param,
             square_avg, grad_avg, buf)
