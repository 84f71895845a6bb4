"""Sequential: a Module whose children run one after the other.

Children are named by index, so parameter names are ``"<layer index>.<name>"`` in declared order
(``"0.weight"``, ``"0.bias"``, ``"3.weight"``, ...), the order a fusion plan and a checkpoint both
rely on. A Sequential can be a whole model (``forward`` copies the logits out) or a child of
another Module (a ResNet stage), which calls ``forward_through``/``backward_through``.
"""
from mpitrain.nn.module import Module, chain_backward, chain_forward


class Sequential(Module):
    def __init__(self, *layers, kernels=None, input_shape=None):
        super().__init__()
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
            self.add_child(str(i), layer)
        self.input_shape = None if input_shape is None else tuple(input_shape)

    def replace_child(self, name, module):
        self.layers[int(name)] = module
        return super().replace_child(name, module)

    def forward_through(self, x):
        return chain_forward(self.layers, x)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        return chain_backward(self.layers, grad_y, need_input_grad, on_layer_done)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __repr__(self):
        inner = "".join(f"\n  ({i}) " + repr(layer).replace("\n", "\n  ")
                        for i, layer in enumerate(self.layers))
        return f"Sequential({inner}\n)"
