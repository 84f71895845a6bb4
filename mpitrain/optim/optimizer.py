"""Optimizer base: the parameter list, lr, zero_grad and flat state dicts.

State dicts hold only plain numbers and host NumPy arrays under flat string keys
(``"momentum_buffer.3"``), so the checkpoint code can write them with ``np.savez`` and read them
back with ``allow_pickle=False``. Per-parameter state lives on the parameters' backend and is
updated in place by one fused kernel per parameter.

Weight decay per parameter (PyTorch's param groups, as a mask): ``no_decay`` names the parameters
that get none -- a predicate on the Parameter (``is_bias_or_norm``: every parameter with
``ndim <= 1``, which covers biases and BatchNorm's weight and bias, the standard ResNet recipe) or
one bool per parameter. The mask is part of the state dict (``"no_decay"``, uint8 per parameter), so
a checkpoint or ``broadcast_optimizer_state`` carries it like ``weight_decay`` itself; a state dict
without it (written before the mask existed) means "decay every parameter".
"""
import numpy as np


def is_bias_or_norm(param):
    """True for the parameters the standard recipe does not decay: ndim <= 1 (biases, norms)."""
    return param.data.ndim <= 1


def check_nonnegative(**values):
    """ValueError naming the first of ``values`` (in the order given) that is not >= 0."""
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


class Optimizer:
    """Base of SGD, Adam and RMSprop: owns the parameter list, lr, the step count and the
    per-parameter state, and writes ``Parameter.data`` (nothing else does).

    Arguments:
        params    the Parameters to update, in a fixed order (``model.parameters()``); that
                  order indexes the state (``"exp_avg.3"`` is parameter 3's)
        lr        learning rate, >= 0; a plain attribute, so a schedule sets ``opt.lr``
        no_decay  parameters that get no weight decay: a predicate on the Parameter (e.g.
                  ``is_bias_or_norm``) or one bool per parameter; None decays all

    State: ``lr``, ``steps`` (optimizer steps taken), ``no_decay`` (uint8 (P,) mask) and
    ``state`` (buffer name -> one backend array per parameter, created as zeros). A subclass
    names its float hyper-parameters in ``_hyper`` and its buffers in ``_buffers``
    (``_active_buffers()`` the ones its settings use) and implements ``_update(i, p)`` with one
    fused kernel per parameter.
    """

    _hyper = ()        # names of float hyper-parameters saved in the state dict (besides lr)
    _buffers = ()      # names of per-parameter state arrays

    def __init__(self, params, lr, no_decay=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.trained = self.params      # whose gradients zero_grad clears (restrict keeps it)
        if not lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {lr!r}")
        self.lr = float(lr)
        self.no_decay = _no_decay_mask(no_decay, self.params)  # (P,) uint8, 1 = no decay
        self.kernels = self.params[0].kernels
        self.steps = 0
        self.state = {name: [self.kernels.zeros(p.data.shape, p.data.dtype)
                             for p in self.params] for name in self._active_buffers()}

    def _active_buffers(self):
        return self._buffers

    def restrict(self, pieces, owners):
        """Update only ``pieces`` from now on (optimizer-state sharding, parallel/sharded.py):
        Parameter-like views (``.data``, ``.grad``, ``.kernels``) of parts of the parameters,
        ``owners[j]`` the index of the parameter piece j belongs to. The state is made anew
        for the pieces alone (zeros, as at construction: call it before the first step), and
        each piece takes its parameter's weight-decay flag; every update is elementwise, so a
        piece steps to the bits its part of the whole parameter would. ``zero_grad`` still
        clears every parameter's gradient."""
        self.no_decay = self.no_decay[np.asarray(owners, np.int64)].astype(np.uint8)
        self.params = list(pieces)
        self.state = {name: [self.kernels.zeros(p.data.shape, p.data.dtype)
                             for p in self.params] for name in self._active_buffers()}

    def zero_grad(self):
        """Mark every parameter's gradient as zero (lazily: see Parameter.zero_grad)."""
        for p in self.trained:
            p.zero_grad()

    def state_dict(self):
        """A flat dict of host copies: ``lr``, ``step``, ``no_decay``, every hyper-parameter by
        name, and every buffer as ``"<buffer>.<i>"`` (NumPy arrays), for np.savez and
        ``load_state_dict``."""
        d = {"lr": float(self.lr), "step": int(self.steps), "no_decay": self.no_decay.copy()}
        for h in self._hyper:
            d[h] = getattr(self, h)
        for name, bufs in self.state.items():
            for i, buf in enumerate(bufs):
                d[f"{name}.{i}"] = np.array(self.kernels.to_host(buf), copy=True)
        return d

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned (of an optimizer with the same parameters and
        buffers: a key missing or unexpected, or a buffer of another shape, is a ValueError);
        buffers are copied into the existing backend arrays, in place."""
        expected = {f"{name}.{i}" for name, bufs in self.state.items() for i in range(len(bufs))}
        expected |= {"lr", "step", *self._hyper}
        missing = sorted(expected - set(state))
        optional = {"no_decay"}  # absent from state dicts written before the mask existed
        unexpected = sorted(set(state) - expected - optional)
        if missing or unexpected:
            raise ValueError(f"{type(self).__name__} state_dict mismatch: missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        for name, bufs in self.state.items():
            for i, buf in enumerate(bufs):
                value = np.asarray(state[f"{name}.{i}"])
                if tuple(value.shape) != tuple(buf.shape):
                    raise ValueError(f"state_dict[{name}.{i!r}] has shape {tuple(value.shape)}, "
                                     f"parameter {i} has {tuple(buf.shape)}")
                host = np.ascontiguousarray(value, dtype=buf.dtype)
                self.kernels.copy(buf, self.kernels.to_device(host))
        mask = np.zeros(len(self.params), np.uint8)
        if "no_decay" in state:
            mask = np.asarray(state["no_decay"])
            if mask.shape != (len(self.params),):
                raise ValueError(f"state_dict['no_decay'] has shape {mask.shape}, expected "
                                 f"({len(self.params)},): one flag per parameter")
        self.no_decay = (mask != 0).astype(np.uint8)  # (P,)
        self.lr = float(np.asarray(state["lr"]))
        self.steps = int(np.asarray(state["step"]))
        for h in self._hyper:
            value = np.asarray(state[h]).item()
            setattr(self, h, type(getattr(self, h))(value))

    def step(self):
        """Update every parameter from its ``.grad`` (one kernel each, or one for all where the
        backend has a group kernel); ``steps`` counts them."""
        self.steps += 1
        if not self._update_all():
            for i, p in enumerate(self.params):
                self._update(i, p)

    def _update_all(self):
        """Update every parameter in one backend call and return True, or return False where the
        backend has no such call (then ``_update`` runs per parameter)."""
        return False

    def decay_of(self, i, weight_decay):
        """Parameter i's weight decay: ``weight_decay``, or 0 where the mask excludes it."""
        return 0.0 if self.no_decay[i] else weight_decay

    def _update(self, i, p):
        """Update parameter ``i`` (``p``) and its state in place."""
        raise NotImplementedError


def _no_decay_mask(no_decay, params):
    """uint8 (P,): 1 for the parameters that get no weight decay."""
    if no_decay is None:
        return np.zeros(len(params), np.uint8)
    if callable(no_decay):
        return np.array([bool(no_decay(p)) for p in params], np.uint8)
    flags = [bool(f) for f in no_decay]
    if len(flags) != len(params):
        raise ValueError(f"no_decay has {len(flags)} flags for {len(params)} parameters")
    return np.array(flags, np.uint8)
