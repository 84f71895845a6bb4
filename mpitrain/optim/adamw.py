"""AdamW (Loshchilov & Hutter), PyTorch's ``torch.optim.AdamW`` semantics and defaults: the weight
decay is decoupled from the gradient -- it shrinks the parameter before the Adam update instead
of being added to the gradient (Adam's L2 penalty, adam.py) -- and bias correction uses the
1-based step count.

    param *= 1 - lr * weight_decay
    m = beta1 * m + (1 - beta1) * grad;   v = beta2 * v + (1 - beta2) * grad^2
    param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``no_decay``: parameters that get weight_decay 0 (see optimizer.py), e.g. ``is_bias_or_norm``
for the usual transformer recipe (no decay on biases, LayerNorm and, by that predicate, 1-D
parameters in general).
"""
from mpitrain.optim.adam import Adam


class AdamW(Adam):
    """Adam with decoupled weight decay (PyTorch's AdamW; defaults as there).

    Arguments as Adam's (adam.py), except:
        weight_decay  decoupled decay: each step multiplies the parameter by
                      ``1 - lr * weight_decay``, >= 0 (default 1e-2)

    State and ``state_dict()`` as Adam's: ``exp_avg`` (m), ``exp_avg_sq`` (v), the step count
    of the bias correction, lr, the no-decay mask and the hyper-parameters.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 no_decay=None):
        super().__init__(params, lr, betas, eps, weight_decay, no_decay)

    @property
    def _kernel(self):
        return self.kernels.adamw_update
