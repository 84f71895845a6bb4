"""RMSprop (Hinton's lecture 6e), PyTorch's update rule, including its centered and momentum
variants and L2 weight decay added to the gradient:

    g = grad + weight_decay * param
    square_avg = alpha * square_avg + (1 - alpha) * g^2
    centered:  grad_avg = alpha * grad_avg + (1 - alpha) * g
               avg = sqrt(square_avg - grad_avg^2) + eps
    else:      avg = sqrt(square_avg) + eps
    momentum > 0:  buf = momentum * buf + g / avg;  param -= lr * buf
    else:          param -= lr * g / avg

Every buffer starts at zeros (PyTorch's too), so there is no bias correction and no step count
in the rule. ``no_decay``: parameters that get weight_decay 0 (see optimizer.py).
"""
from mpitrain.optim.optimizer import Optimizer, check_nonnegative


class RMSprop(Optimizer):
    """Divide each gradient by a running root mean square of its recent values.

    Arguments (PyTorch's names and defaults):
        params        the Parameters to update (``model.parameters()``)
        lr            learning rate (default 0.01)
        alpha         smoothing constant of the running averages, in [0, 1) (default 0.99)
        eps           added to the denominator, > 0 (default 1e-8)
        weight_decay  L2 penalty added to the gradient, >= 0 (default 0)
        momentum      momentum of the scaled step, >= 0 (default 0: no momentum buffer)
        centered      divide by the running variance (mean square minus squared mean) instead
                      of the mean square (default False)
        no_decay      parameters exempt from weight decay: a predicate such as
                      ``mpitrain.optim.is_bias_or_norm`` or one bool per parameter

    State, one array per parameter on the parameters' backend (in ``state_dict()`` as
    ``"<name>.<i>"``): ``square_avg`` always, ``grad_avg`` when centered, ``momentum_buffer``
    when momentum > 0. The state dict also holds lr, step, the no-decay mask and the
    hyper-parameters above, so checkpoints and ``mt.broadcast_optimizer_state`` carry all of it.
    """

    _hyper = ("alpha", "eps", "weight_decay", "momentum", "centered")
    _buffers = ("square_avg", "grad_avg", "momentum_buffer")

    def __init__(self, params, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False, no_decay=None):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"RMSprop alpha must be in [0, 1), got {alpha!r}")
        if not eps > 0:
            raise ValueError(f"RMSprop eps must be > 0, got {eps!r}")
        check_nonnegative(weight_decay=weight_decay, momentum=momentum)
        self.alpha, self.eps = float(alpha), float(eps)
        self.weight_decay, self.momentum = float(weight_decay), float(momentum)
        self.centered = bool(centered)
        super().__init__(params, lr, no_decay)

    def _active_buffers(self):
        return (("square_avg",) + (("grad_avg",) if self.centered else ())
                + (("momentum_buffer",) if self.momentum != 0 else ()))

    def _update(self, i, p):
        grad_avg = self.state["grad_avg"][i] if self.centered else None
        buf = self.state["momentum_buffer"][i] if self.momentum != 0 else None
        self.kernels.rmsprop_update(p.data, p.grad, self.state["square_avg"][i], grad_avg, buf,
                                    self.lr, self.alpha, self.eps,
                                    self.decay_of(i, self.weight_decay), self.momentum,
                                    self.centered)
