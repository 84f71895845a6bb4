"""The Numba flavour's optimizer updates, flat and in place (float16 too: half_safe)."""
import math

from numba import cuda

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import flat, grid, half_safe, launch, scalar


@half_safe
def _sgd_k(param, grad, buf, lr, momentum, nesterov, weight_decay):
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        g = grad[i] + weight_decay * param[i]
        if momentum != 0:
            b = momentum * buf[i] + g
            buf[i] = b
            g = g + momentum * b if nesterov else b
        param[i] = param[i] - lr * g


def sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay):
    # buf is unused (and may be None) without momentum
    param, grad = flat(param), flat(grad)
    buf = flat(buf) if momentum != 0 else param
    checks.same_size("sgd_update", param, grad, buf)
    s = lambda v: scalar(param, v)  # noqa: E731
    launch(_sgd_k.pick(param, grad, buf), param.size, param, grad, buf, s(lr), s(momentum),
           bool(nesterov), s(weight_decay))


@half_safe
def _adam_k(param, grad, m, v, step_size, beta1, beta2, eps, decay, decoupled, inv_sqrt_bc2):
    # Adam adds decay * param to the gradient; AdamW (``decoupled``) multiplies param by decay
    # (1 - lr * weight_decay) instead, before the update
    one = param.dtype.type(1)
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        p = param[i]
        g = grad[i]
        if decoupled:
            p = p * decay
        else:
            g = g + decay * p
        mi = beta1 * m[i] + (one - beta1) * g
        vi = beta2 * v[i] + (one - beta2) * g * g
        m[i] = mi
        v[i] = vi
        param[i] = p - step_size * mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    param, grad, m, v = flat(param), flat(grad), flat(m), flat(v)
    checks.same_size("adam_update", param, grad)
    if step < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step}")
    if param.size:
        # PyTorch: step_size = lr / (1 - b1^t); denom = sqrt(v) / sqrt(1 - b2^t) + eps
        s = lambda x: scalar(param, x)  # noqa: E731
        _adam_k.pick(param, grad, m, v)[grid(param.size)](
            param, grad, m, v, s(lr / (1 - beta1 ** step)), s(beta1), s(beta2), s(eps),
            s(weight_decay), False, s(1 / math.sqrt(1 - beta2 ** step)))


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    param, grad, m, v = flat(param), flat(grad), flat(m), flat(v)
    checks.same_size("adamw_update", param, grad, m, v)
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step}")
    if param.size:
        # PyTorch AdamW: param *= 1 - lr*wd, then Adam's update (no decay in the gradient)
        s = lambda x: scalar(param, x)  # noqa: E731
        _adam_k.pick(param, grad, m, v)[grid(param.size)](
            param, grad, m, v, s(lr / (1 - beta1 ** step)), s(beta1), s(beta2), s(eps),
            s(1 - lr * weight_decay), True, s(1 / math.sqrt(1 - beta2 ** step)))


@half_safe
def _rmsprop_k(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay, momentum,
               centered, one):
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        g = grad[i] + weight_decay * param[i]
        v = alpha * square_avg[i] + (one - alpha) * g * g
        square_avg[i] = v
        if centered:
            ga = alpha * grad_avg[i] + (one - alpha) * g
            grad_avg[i] = ga
            v = v - ga * ga
        step = g / (math.sqrt(v) + eps)
        if momentum != 0:
            b = momentum * buf[i] + step
            buf[i] = b
            step = b
        param[i] = param[i] - lr * step


def rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered):
    # grad_avg and buf are unused (and may be None) without centering / momentum
    param, grad, square_avg = flat(param), flat(grad), flat(square_avg)
    grad_avg = flat(grad_avg) if centered else param
    buf = flat(buf) if momentum != 0 else param
    checks.same_size("rmsprop_update", param, grad, square_avg, grad_avg, buf)
    s = lambda v: scalar(param, v)  # noqa: E731
    kernel = _rmsprop_k.pick(param, grad, square_avg, grad_avg, buf)
    launch(kernel, param.size, param, grad, square_avg, grad_avg, buf, s(lr), s(alpha), s(eps),
           s(weight_decay), s(momentum), bool(centered), s(1))
