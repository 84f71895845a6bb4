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
    A sparse gradient (``nn.Embedding(sparse=True)``) takes one of two paths (optimizer.py):
    ``sparse_dim`` > 0 (``sparse_as_dense=False``, the default, once the first backward pass
    has shown the gradient sparse on some rank): it travels by allgather of its indices and
    values, and the buckets see a zero-size array in its place (``data`` and ``grad``), so the
    agreed plan, the pass count and the gradient report stay as for any parameter. Otherwise
    (``sparse_as_dense=True``, or a parameter that got no gradient on any rank in that first
    pass) it is made dense for the buckets; ``densified`` keeps its sparse_dim so that the
    average is made sparse again after (Horovod's behaviour: ``torch.optim.SparseAdam`` takes
    sparse gradients only). ``dropped``: ``drop_grad`` ran in this step's average.
    """

    __slots__ = ("tensor", "name", "sparse_as_dense", "sparse_dim", "densified", "dropped")

    def __init__(self, tensor, name, sparse_as_dense=False):
        self.tensor = tensor
        self.name = name
        self.sparse_as_dense = sparse_as_dense
        self.sparse_dim = 0
        self.densified = 0
        self.dropped = False

    @property
    def kernels(self):
        """The kernel backend of the arrays (fp16 wire casts of a synchronous average)."""
        if self.tensor.is_cuda:
            return kernels.get("cuda", "cupy")
        return kernels.get("cpu")

    def empty(self):
        """The zero-size array a gathered (sparse) parameter shows the buckets."""
        return array_of(self.tensor.detach().new_empty(0))

    @property
    def data(self):
        if self.sparse_dim:
            return self.empty()
        return array_of(self.tensor.detach())

    @property
    def grad(self):
        if self.sparse_dim:
            return self.empty()
        tensor = self.tensor
        grad = tensor.grad
        if grad is None:
            grad = tensor.grad = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        elif grad.layout is not torch.strided:
            self.densified = grad.sparse_dim() if grad.layout is torch.sparse_coo else 0
            grad = tensor.grad = grad.to_dense()
        return array_of(grad.detach())

    @property
    def has_grad(self):
        return self.tensor.grad is not None

    def drop_grad(self):
        self.tensor.grad = None
        self.dropped = True

    @property
    def shape(self):
        return (0,) if self.sparse_dim else tuple(self.tensor.shape)

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
