"""Module: the composition base -- children, dotted names, buffers, mode, state.

A model is a tree. Leaves are layers (layers.py: they own Parameters, buffers and workspaces and
do the arithmetic); inner nodes (Sequential, BasicBlock, ResNet) own children and say how data
flows between them. Names are dotted paths in registration order: a child registered as
``stage1`` holding a Sequential whose block ``0`` has ``conv1`` gives
``stage1.0.conv1.weight``. Registration order is also the order of ``parameters()``, which the
optimizer, a checkpoint and the overlapped gradient buckets rely on.

Buffers are arrays that belong to the model but are not trained (BatchNorm's running mean and
variance): they are in ``state_dict()`` and checkpoints and are broadcast with the parameters,
but never given to the optimizer.

The composition protocol, which every node implements:
    forward_through(x)                    output of this node; may be a workspace of a layer,
                                          valid until that layer's next call
    backward_through(grad_y, need_input_grad, on_layer_done)
                                          parameter gradients into ``.grad``, the input gradient
                                          returned (None when not needed); ``on_layer_done(params)``
                                          is called after each leaf that has parameters, in the
                                          order backward finishes them
The model-level calls are ``forward(x)`` (a fresh copy of the logits) and
``backward(grad_logits, on_layer_done=None)`` (no input gradient formed).
"""
import numpy as np


def chain_forward(modules, x):
    """``x`` through ``modules`` one after the other (each one's ``forward_through``)."""
    for module in modules:
        x = module.forward_through(x)
    return x


def chain_backward(modules, grad_y, need_input_grad, on_layer_done):
    """``grad_y`` back through ``modules``, last first; the first forms its input gradient only
    when ``need_input_grad`` (the first layer of a model skips that GEMM and the col2im)."""
    for i in range(len(modules) - 1, -1, -1):
        grad_y = modules[i].backward_through(grad_y, need_input_grad or i > 0, on_layer_done)
    return grad_y


class Module:
    """Base of every layer and model: children, parameters, buffers, mode and state."""

    def __init__(self):
        self.training = True
        self._params = {}
        self._buffers = {}
        self._children = {}

    # -- tree ------------------------------------------------------------------------------------
    def add_child(self, name, module):
        """Register ``module`` under ``name`` (also set as an attribute when it is a valid one)."""
        name = str(name)
        if not isinstance(module, Module):
            raise TypeError(f"child {name!r} is a {type(module).__name__}, not a Module")
        if not name or "." in name:
            raise ValueError(f"child name {name!r} must be non-empty and contain no '.'")
        self._children[name] = module
        if name.isidentifier():
            setattr(self, name, module)
        return module

    def replace_child(self, name, module):
        """Put ``module`` in the place of child ``name`` (same position, same name)."""
        if name not in self._children:
            raise KeyError(f"{type(self).__name__} has no child {name!r}")
        return self.add_child(name, module)

    def named_children(self):
        return list(self._children.items())

    def children(self):
        return list(self._children.values())

    def named_modules(self, prefix=""):
        """(dotted name, module) for this module ("" for itself) and every descendant."""
        out = [(prefix, self)]
        for name, child in self._children.items():
            out.extend(child.named_modules(f"{prefix}.{name}" if prefix else name))
        return out

    def modules(self):
        return [m for _, m in self.named_modules()]

    # -- parameters and buffers ----------------------------------------------------------------
    def _named(self, attr, prefix):
        """(dotted name, value) of dict ``attr``: this module's first, then each child's."""
        out = [(f"{prefix}{name}", v) for name, v in getattr(self, attr).items()]
        for cname, child in self._children.items():
            out.extend(child._named(attr, f"{prefix}{cname}."))
        return out

    def named_parameters(self, prefix=""):
        """(dotted name, Parameter): own parameters first, then each child's, in order."""
        return self._named("_params", prefix)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix=""):
        """(dotted name, array) for every buffer (running statistics), in the same order."""
        return self._named("_buffers", prefix)

    def buffers(self):
        return [b for _, b in self.named_buffers()]

    def zero_grad(self):
        for p in self.parameters():
            p.zero_grad()

    def num_parameters(self):
        return sum(p.size for p in self.parameters())

    # -- mode ------------------------------------------------------------------------------------
    def train(self, mode=True):
        """Training mode for this module and every descendant (BatchNorm, Dropout differ)."""
        for m in self.modules():
            m.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- state -----------------------------------------------------------------------------------
    def _kernels(self):
        # its own (every layer and built-in model has one: no walk per forward), else a parameter's
        k = getattr(self, "kernels", None)
        return k if k is not None else next((p.kernels for p in self.parameters()), None)

    def state_dict(self, copy=False):
        """Every parameter, then every buffer, by dotted name.

        As in PyTorch, the values are the model's live arrays (on its backend), so writing into
        them changes the model: ``mt.broadcast_parameters(model.state_dict(), root_rank=0)``
        makes every replica rank 0's, running statistics included. ``copy=True`` gives host
        NumPy snapshots instead, which later steps do not change (checkpoints, ``--save``).
        """
        items = [(n, p.data) for n, p in self.named_parameters()] + self.named_buffers()
        if not copy:
            return dict(items)
        k = self._kernels()
        return {n: np.array(a if k is None else k.to_host(a), copy=True) for n, a in items}

    def load_state_dict(self, state):
        """Copy ``state`` (name -> array) into the parameters and buffers, in place.

        The keys must be exactly this model's: a checkpoint written without running statistics
        into a model with BatchNorm (or the reverse) names the missing and unexpected keys.
        """
        targets = dict([(n, p.data) for n, p in self.named_parameters()] + self.named_buffers())
        missing = [n for n in targets if n not in state]
        unexpected = [n for n in state if n not in targets]
        if missing or unexpected:
            raise ValueError(f"state_dict mismatch: missing keys {missing}, unexpected keys "
                             f"{unexpected}")
        for name, array in targets.items():
            value = np.asarray(state[name])
            if tuple(value.shape) != tuple(array.shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, the "
                                 f"model has {tuple(array.shape)}")
        k = self._kernels()
        for name, array in targets.items():
            host = np.ascontiguousarray(np.asarray(state[name]), dtype=array.dtype)
            k.copy(array, k.to_device(host))

    # -- composition protocol --------------------------------------------------------------------
    def forward_through(self, x):
        raise NotImplementedError(f"{type(self).__name__} does not define forward_through")

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        raise NotImplementedError(f"{type(self).__name__} does not define backward_through")

    def forward(self, x):
        """Logits (B, K) for a batch x (B, ...): a fresh array, unlike the layers' workspaces."""
        y = self.forward_through(x)
        k = self._kernels()
        out = k.empty(tuple(y.shape), y.dtype)
        k.copy(out, y)
        return out

    def __call__(self, x):
        return self.forward(x)

    def backward(self, grad_logits, on_layer_done=None):
        """Add every parameter's gradient of the loss into ``.grad`` (input gradient not formed).

        on_layer_done(params): called right after each layer that has parameters finished its
        backward, with that layer's Parameters, whose ``.grad`` is final for this pass -- e.g.
        ``DistributedOptimizer.backward_hook``, which starts averaging them while the earlier
        layers are still being differentiated. Layers finish in the reverse of ``parameters()``
        order.
        """
        self.backward_through(grad_logits, False, on_layer_done)

    def extra_repr(self):
        return ""

    def __repr__(self):
        if not self._children:
            return f"{type(self).__name__}({self.extra_repr()})"
        inner = "".join(f"\n  ({n}) " + repr(c).replace("\n", "\n  ")
                        for n, c in self._children.items())
        return f"{type(self).__name__}({self.extra_repr()}{inner}\n)"
