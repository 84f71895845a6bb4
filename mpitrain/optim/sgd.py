"""SGD with momentum, Nesterov momentum and L2 weight decay, PyTorch's semantics.

    g = grad + weight_decay * param
    buf = momentum * buf + g            (buf starts at zeros, so step 1 gives buf = g)
    g = g + momentum * buf  if nesterov else  buf
    param -= lr * g

``no_decay`` (a predicate such as ``is_bias_or_norm``, or one bool per parameter): those
parameters get weight_decay 0 (see optimizer.py).
"""
from mpitrain.optim.optimizer import Optimizer, check_nonnegative


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay.

    Arguments:
        params        the Parameters to update (``model.parameters()``)
        lr            learning rate, >= 0 (required, as in PyTorch)
        momentum      momentum factor, >= 0 (default 0: plain SGD, no buffer)
        nesterov      Nesterov momentum (needs momentum > 0)
        weight_decay  L2 penalty added to the gradient, >= 0 (default 0)
        no_decay      parameters exempt from weight decay: a predicate such as
                      ``is_bias_or_norm`` or one bool per parameter

    State: ``momentum_buffer`` (one array per parameter, on its backend) when momentum > 0;
    ``state_dict()`` adds lr, step, the no-decay mask and the hyper-parameters.
    """

    _hyper = ("momentum", "nesterov", "weight_decay")

    def __init__(self, params, lr, momentum=0.0, nesterov=False, weight_decay=0.0, no_decay=None):
        check_nonnegative(momentum=momentum, weight_decay=weight_decay)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.weight_decay = float(weight_decay)
        super().__init__(params, lr, no_decay)

    def _active_buffers(self):
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def _update_all(self):
        group = getattr(self.kernels, "sgd_update_group", None)
        if group is None:
            return False
        params = [p.data for p in self.params]
        bufs = self.state["momentum_buffer"] if self.momentum != 0 else params
        group(params, [p.grad for p in self.params], bufs, self.lr, self.momentum, self.nesterov,
              [self.decay_of(i, self.weight_decay) for i in range(len(self.params))])
        return True

    def _update(self, i, p):
        buf = self.state["momentum_buffer"][i] if self.momentum != 0 else p.data
        self.kernels.sgd_update(p.data, p.grad, buf, self.lr, self.momentum, self.nesterov,
                                self.decay_of(i, self.weight_decay))
