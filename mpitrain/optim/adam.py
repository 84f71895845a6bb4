"""Adam (Kingma & Ba), PyTorch's semantics: L2 weight decay added to the gradient, bias correction
with the 1-based step count.

    g = grad + weight_decay * param
    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
    param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

``no_decay``: parameters that get weight_decay 0 (see optimizer.py).
"""
from mpitrain.optim.optimizer import Optimizer, check_nonnegative


class Adam(Optimizer):
    """Adam: steps scaled by bias-corrected running averages of the gradient and its square.

    Arguments:
        params        the Parameters to update (``model.parameters()``)
        lr            learning rate, >= 0 (default 1e-3)
        betas         (beta1, beta2), each in [0, 1): decay rates of the two averages
                      (default (0.9, 0.999))
        eps           added to the denominator, > 0 (default 1e-8)
        weight_decay  L2 penalty added to the gradient (not AdamW's decoupled decay), >= 0
        no_decay      parameters exempt from weight decay: a predicate such as
                      ``is_bias_or_norm`` or one bool per parameter

    State: ``exp_avg`` (m) and ``exp_avg_sq`` (v), one array per parameter on its backend, and
    the step count t of the bias correction (``steps``); ``state_dict()`` adds lr, the no-decay
    mask and the hyper-parameters (beta1 and beta2 under their own keys).
    """

    _hyper = ("beta1", "beta2", "eps", "weight_decay")
    _buffers = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 no_decay=None):
        beta1, beta2 = betas
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{type(self).__name__} {name} must be in [0, 1), got {b!r}")
        if not eps > 0:
            raise ValueError(f"{type(self).__name__} eps must be > 0, got {eps!r}")
        check_nonnegative(weight_decay=weight_decay)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        super().__init__(params, lr, no_decay)

    @property
    def betas(self):
        """(beta1, beta2), PyTorch's spelling."""
        return (self.beta1, self.beta2)

    def _update(self, i, p):
        self._kernel(p.data, p.grad, self.state["exp_avg"][i], self.state["exp_avg_sq"][i],
                     self.lr, self.beta1, self.beta2, self.eps,
                     self.decay_of(i, self.weight_decay), self.steps)

    @property
    def _kernel(self):
        """The fused update: L2 decay added to the gradient (AdamW: decoupled decay)."""
        return self.kernels.adam_update
