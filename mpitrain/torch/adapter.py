"""torch parameters and optimizers as mpitrain's DistributedOptimizer sees its own.

mpitrain's facade (parallel/optimizer.py) and its strategies average gradients of parameters
that have ``.data`` and ``.grad`` arrays, for an optimizer with ``params``, ``lr``, ``step``,
``zero_grad`` and ``state_dict``. These two classes present a torch model and optimizer that
way, so the torch front end reuses the whole gradient path -- the fixed bucket plan agreed
across ranks, the allreduces overlapping backward on the comm thread, accumulation counting,
fp16 wire buffers, join and process sets -- instead of a copy of it.

The arrays are views: a CPU tensor's ``.numpy()`` shares its storage, so the buckets pack
straight from ``p.grad`` and unpack the averages straight into it (a gradient alone in its
bucket is reduced where it lies). They are taken afresh on every access, because torch replaces
``p.grad`` (``zero_grad(set_to_none=True)``) and ``p.data`` (``model.to``) at will.
"""
import torch

from mpitrain import kernels
from mpitrain.torch.tensors import array_of


class TorchParameter:
    """One torch parameter as an mpitrain Parameter: ``.data`` and ``.grad`` arrays.

    A parameter that got no gradient this step (unused by this rank's forward) reads as zeros:
    the first read of its ``.grad`` gives it a zero gradient, so every rank sends the same
    buckets and none waits for a gradient that never comes (Horovod does the same). It tells
    the step so (``has_grad``), and where no rank had a gradient for it the step gives it none
    back (``drop_grad``; parallel/report.py), as at N = 1 and under DDP.
    sparse_as_dense: a sparse gradient (``nn.Embedding(sparse=True)``) is made dense first;
    without it a sparse gradient is a ValueError.
    """

    __slots__ = ("tensor", "name", "sparse_as_dense")

    def __init__(self, tensor, name, sparse_as_dense=False):
        self.tensor = tensor
        self.name = name
        self.sparse_as_dense = sparse_as_dense

    @property
    def kernels(self):
        """The kernel backend of the arrays (fp16 wire casts of a synchronous average)."""
        if self.tensor.is_cuda:
            return kernels.get("cuda", "cupy")
        return kernels.get("cpu")

    @property
    def data(self):
        return array_of(self.tensor.detach())

    @property
    def grad(self):
        tensor = self.tensor
        grad = tensor.grad
        if grad is None:
            grad = tensor.grad = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        elif grad.layout is not torch.strided:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {self.name!r} has a {grad.layout} gradient; "
                                 f"DistributedOptimizer(..., sparse_as_dense=True) averages "
                                 f"it as a dense one")
            grad = tensor.grad = grad.to_dense()
        return array_of(grad.detach())

    @property
    def has_grad(self):
        return self.tensor.grad is not None

    def drop_grad(self):
        self.tensor.grad = None

    @property
    def shape(self):
        return tuple(self.tensor.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self):
        return f"TorchParameter({self.name!r}, shape={self.shape}, dtype={self.tensor.dtype})"


class TorchOptimizer:
    """A torch optimizer as mpitrain's inner optimizer: ``params`` (TorchParameters), ``lr``
    (every group's; reading gives the first group's), ``step``, ``zero_grad``, ``state_dict``.

    ``owner`` is the distributed optimizer; ``step``/``zero_grad`` run the torch optimizer's own
    methods on it (``inner_step``/``inner_zero_grad``) with torch's defaults. The public calls
    hand theirs, with the caller's ``closure`` or ``set_to_none``, to the facade as arguments.
    """

    def __init__(self, owner, params):
        self.owner = owner
        self.params = params

    @property
    def lr(self):
        return self.owner.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for group in self.owner.param_groups:
            group["lr"] = value

    def step(self):
        self.owner.inner_step()

    def zero_grad(self):
        self.owner.inner_zero_grad()

    def state_dict(self):
        return self.owner.state_dict()

    def load_state_dict(self, state):
        self.owner.load_state_dict(state)
