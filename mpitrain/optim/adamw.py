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
from mpitrain.optim.optimizer import Optimizer


class AdamW(Optimizer):
    """Adam with decoupled weight decay (PyTorch's AdamW; defaults as there).

    Arguments:
        params        the Parameters to update (``model.parameters()``)
        lr            learning rate, >= 0 (default 1e-3)
        betas         (beta1, beta2), each in [0, 1): decay rates of the two averages
                      (default (0.9, 0.999))
        eps           added to the denominator, > 0 (default 1e-8)
        weight_decay  decoupled decay: each step multiplies the parameter by
                      ``1 - lr * weight_decay``, >= 0 (default 1e-2)
        no_decay      parameters exempt from weight decay: a predicate such as
                      ``is_bias_or_norm`` or one bool per parameter

    State: ``exp_avg`` (m) and ``exp_avg_sq`` (v), one array per parameter on its backend, and
    the step count t of the bias correction (``steps``); ``state_dict()`` adds lr, the no-decay
    mask and the hyper-parameters (beta1 and beta2 under their own keys).
    """

    _hyper = ("beta1", "beta2", "eps", "weight_decay")
    _buffers = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 no_decay=None):
        beta1, beta2 = betas
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdamW {name} must be in [0, 1), got {b!r}")
        if not eps > 0:
            raise ValueError(f"AdamW eps must be > 0, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        super().__init__(params, lr, no_decay)

    @property
    def betas(self):
        """(beta1, beta2), PyTorch's spelling."""
        return (self.beta1, self.beta2)

    def _update(self, i, p):
        self.kernels.adamw_update(p.data, p.grad, self.state["exp_avg"][i],
                                  self.state["exp_avg_sq"][i], self.lr, self.beta1, self.beta2,
                                  self.eps, self.decay_of(i, self.weight_decay), self.steps)
