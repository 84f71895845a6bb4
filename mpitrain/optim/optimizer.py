"""Optimizer base: the parameter list, lr, zero_grad and flat state dicts.

State dicts hold only plain numbers and host NumPy arrays under flat string keys
(``"momentum_buffer.3"``), so the checkpoint code can write them with ``np.savez`` and read them
back with ``allow_pickle=False``. Per-parameter state lives on the parameters' backend and is updated in
place by one fused kernel per parameter.
"""
import numpy as np


class Optimizer:
    _hyper = ()        # names of float hyper-parameters saved in the state dict (besides lr)
    _buffers = ()      # names of per-parameter state arrays

    def __init__(self, params, lr):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        if not lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {lr!r}")
        self.lr = float(lr)
        self.kernels = self.params[0].kernels
        self.steps = 0
        self.state = {name: [self.kernels.zeros(p.data.shape, p.data.dtype)
                             for p in self.params] for name in self._active_buffers()}

    def _active_buffers(self):
        return self._buffers

    def zero_grad(self):
        for p in self.params:
            p.zero_grad()

    def state_dict(self):
        d = {"lr": float(self.lr), "step": int(self.steps)}
        for h in self._hyper:
            d[h] = getattr(self, h)
        for name, bufs in self.state.items():
            for i, buf in enumerate(bufs):
                d[f"{name}.{i}"] = np.array(self.kernels.to_host(buf), copy=True)
        return d

    def load_state_dict(self, state):
        expected = {f"{name}.{i}" for name, bufs in self.state.items() for i in range(len(bufs))}
        expected |= {"lr", "step", *self._hyper}
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
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
        self.lr = float(np.asarray(state["lr"]))
        self.steps = int(np.asarray(state["step"]))
        for h in self._hyper:
            value = np.asarray(state[h]).item()
            setattr(self, h, type(getattr(self, h))(value))

    def step(self):
        self.steps += 1
        for i, p in enumerate(self.params):
            self._update(i, p)

    def _update(self, i, p):
        raise NotImplementedError
