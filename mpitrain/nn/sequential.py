"""Sequential: a list of layers run in order, and the model-level API (parameters, state, mode).

Parameter names are ``"<layer index>.<name>"`` in declared order (``"0.weight"``, ``"0.bias"``,
``"3.weight"``, ...), the order a fusion plan and a checkpoint both rely on.
"""
import numpy as np


class Sequential:
    def __init__(self, *layers, kernels=None, input_shape=None):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.layers = list(layers)
        self.kernels = kernels if kernels is not None else self.layers[0].kernels
        for i, layer in enumerate(self.layers):
            if layer.kernels is not self.kernels:
                raise ValueError(f"layer {i} ({layer!r}) uses kernels "
                                 f"{layer.kernels.name!r}, the model uses {self.kernels.name!r}")
        self.input_shape = None if input_shape is None else tuple(input_shape)
        self.training = True

    def forward(self, x):
        """Logits (B, K) for a batch x (B, ...): a fresh array, unlike the layers' workspaces."""
        for layer in self.layers:
            x = layer.forward(x)
        out = self.kernels.empty(tuple(x.shape), x.dtype)
        self.kernels.copy(out, x)
        return out

    __call__ = forward

    def backward(self, grad_logits, on_layer_done=None):
        """Add every parameter's gradient of the loss into ``.grad`` (input gradient not formed).

        on_layer_done(params): called right after each layer that has parameters finished its
        backward, last layer first, with that layer's Parameters, whose ``.grad`` is final for
        this pass -- e.g. ``DistributedOptimizer.backward_hook``, which starts averaging them
        while the earlier layers are still being differentiated.
        """
        g = grad_logits
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            g = layer.backward(g, need_input_grad=i > 0)
            if on_layer_done is not None:
                params = [p for _, p in layer.named_parameters()]
                if params:
                    on_layer_done(params)

    def train(self):
        self.training = True
        for layer in self.layers:
            layer.train()
        return self

    def eval(self):
        self.training = False
        for layer in self.layers:
            layer.eval()
        return self

    def named_parameters(self):
        return [(f"{i}.{name}", p) for i, layer in enumerate(self.layers)
                for name, p in layer.named_parameters()]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def state_dict(self, copy=False):
        """Every parameter by name, in declared order.

        As in PyTorch, the values are the model's live arrays (on its backend), so writing into
        them changes the model: ``mt.broadcast_parameters(model.state_dict(), root_rank=0)``
        makes every replica rank 0's. ``copy=True`` gives host NumPy snapshots instead, which
        later steps do not change (checkpoints, ``--save``, before/after comparisons).
        """
        if copy:
            return {name: np.array(self.kernels.to_host(p.data), copy=True)
                    for name, p in self.named_parameters()}
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state):
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        unexpected = [n for n in state if n not in params]
        if missing or unexpected:
            raise ValueError(f"state_dict mismatch: missing keys {missing}, unexpected keys "
                             f"{unexpected}")
        for name, p in params.items():
            value = np.asarray(state[name])
            if tuple(value.shape) != tuple(p.data.shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, the "
                                 f"parameter has {tuple(p.data.shape)}")
            host = np.ascontiguousarray(value, dtype=p.data.dtype)
            self.kernels.copy(p.data, self.kernels.to_device(host))

    def num_parameters(self):
        return sum(p.size for p in self.parameters())

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __repr__(self):
        inner = "".join(f"\n  ({i}) {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential({inner}\n)"
