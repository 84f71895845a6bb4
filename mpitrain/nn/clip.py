"""clip_grad_norm_: scale every gradient by one factor so that their global norm is at most
``max_norm`` (PyTorch's ``torch.nn.utils.clip_grad_norm_``).

    total = || (||g_1||_p, ||g_2||_p, ...) ||_p        the norm of all gradients as one vector
    g_i  *= max_norm / (total + 1e-6)                 only when that factor is below 1

The 2-norm of float32 host gradients is their exact sum of squares (exact_sum.py), rounded
once: the same bits however the gradients are cut (into parameters, or into the slices the ranks
of a sharded optimizer own, which sum theirs apart and add the exact sums). On a device backend
each squared norm is a 1 x n by n x 1 GEMM of the flattened gradient with itself (the kernel
contract's one reduction that multiplies), and only those scalars come back to the host. Other norms (``inf``, 1, any p > 0) are rarer: they read each
gradient on the host (``kernels.to_host``: a view on the CPU, a copy on a device) in float64.
The scaling is ``kernels.scale`` in place, so no parameter's ``.data`` is touched: gradients
only, between ``DistributedOptimizer.synchronize()`` and the step.
"""
import math

import numpy as np

from mpitrain.nn.exact_sum import exact_square_sum
from mpitrain.nn.parameter import Parameter

EPS = 1e-6      # PyTorch's: keeps the factor finite for an all-zero gradient


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale the ``.grad`` of ``parameters`` (Parameters, or one) in place so that their global
    ``norm_type``-norm is at most ``max_norm``; the norm before clipping, a Python float.

    In data-parallel training call it on the averaged gradients, the same on every rank:
    ``opt.synchronize(); mt.nn.clip_grad_norm_(model.parameters(), 1.0)`` and then
    ``with opt.skip_synchronize(): opt.step()``. A non-finite norm (an inf or NaN gradient)
    scales by NaN or 0, as PyTorch does, or raises RuntimeError with ``error_if_nonfinite``.
    """
    params = [parameters] if isinstance(parameters, Parameter) else list(parameters)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm {max_norm!r} must be >= 0")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type!r} must be > 0 or inf")
    if not params:
        return 0.0
    grads = [(p.kernels, p.grad) for p in params]
    if norm_type == 2.0 and all(isinstance(g, np.ndarray) and g.dtype == np.float32
                                for _, g in grads):
        total = math.sqrt(exact_square_sum(g for _, g in grads))     # any cut: the same bits
    elif norm_type == 2.0:
        total = math.sqrt(sum(_squared_norm(k, g) for k, g in grads))
    elif norm_type == math.inf:
        total = max(float(np.max(np.abs(k.to_host(g)), initial=0.0)) for k, g in grads)
    else:
        total = sum(float(np.sum(np.abs(k.to_host(g).astype(np.float64)) ** norm_type))
                    for k, g in grads) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total {norm_type:g}-norm of the gradients is "
                           f"{total}; pass error_if_nonfinite=False to scale them anyway")
    scale_to(grads, total, max_norm)
    return total


def scale_to(grads, total, max_norm):
    """Scale ``grads`` [(kernels, array)] in place by ``max_norm / (total + EPS)`` when that is
    below 1 (their norm was ``total``): clip_grad_norm_'s last step, also for the slices of a
    sharded optimizer, whose norm it sums elsewhere."""
    factor = max_norm / (total + EPS)       # 0 for an inf norm, NaN for a NaN one
    if not factor >= 1.0:               # NaN included: PyTorch's gradients become NaN too
        for k, g in grads:
            k.scale(g, factor)


def _squared_norm(k, g):
    """sum(g**2) on g's backend, as a Python float."""
    if g.size == 0:
        return 0.0
    row = g.reshape(1, g.size)                                          # (1, n)
    out = k.empty((1, 1), g.dtype)                                      # (1, 1)
    k.gemm(row, row, out, trans_b=True)
    return float(k.to_host(out)[0, 0])
