"""The CPU's optimizer updates: flat, in place on the parameter and its state."""
import numpy as np
from numba import njit

from mpitrain.kernels import checks
from mpitrain.kernels.checks import flat, sizes_match


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
    sizes_match(param, grad)
    flat_buf = flat(buf, "buf") if momentum != 0 else flat(param)
    _sgd(flat(param, "param"), flat(grad, "grad"), flat_buf, float(lr), float(momentum),
         bool(nesterov), float(weight_decay))


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    checks.adam_step(step)
    sizes_match(param, grad)
    _adam(flat(param, "param"), flat(grad, "grad"), flat(m, "m"), flat(v, "v"), float(lr),
          float(beta1), float(beta2), float(eps), float(weight_decay), int(step))


@njit(cache=True, nogil=True)
def _adamw(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    decay = 1.0 - lr * weight_decay                    # decoupled: param *= 1 - lr*wd first
    step_size = lr / (1.0 - beta1 ** step)
    inv_sqrt_c2 = 1.0 / np.sqrt(1.0 - beta2 ** step)
    for i in range(param.size):
        g = grad[i]
        mi = beta1 * m[i] + (1.0 - beta1) * g
        vi = beta2 * v[i] + (1.0 - beta2) * g * g
        m[i] = mi
        v[i] = vi
        param[i] = param[i] * decay - step_size * mi / (np.sqrt(vi) * inv_sqrt_c2 + eps)


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step!r}")
    sizes_match(param, grad, m, v)
    _adamw(flat(param, "param"), flat(grad, "grad"), flat(m, "m"), flat(v, "v"), float(lr),
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
    sizes_match(param, grad, square_avg)
    flat_param = flat(param, "param")
    # grad_avg and buf are unused (and may be None) without centering / momentum
    flat_avg = flat(grad_avg, "grad_avg") if centered else flat_param
    flat_buf = flat(buf, "buf") if momentum != 0 else flat_param
    sizes_match(param, flat_avg, flat_buf)
    _rmsprop(flat_param, flat(grad, "grad"), flat(square_avg, "square_avg"), flat_avg, flat_buf,
             float(lr), float(alpha), float(eps), float(weight_decay), float(momentum),
             bool(centered))
