"""The broadcasts that start every replica from one model: ``broadcast_parameters`` (the
model's tensors, in place) and ``broadcast_optimizer_state`` (any torch optimizer's state).

``broadcast_parameters`` is mpitrain's own (parallel/broadcast.py: the names agreed first, then
one in-place broadcast per tensor) given the tensors' memory: the arrays it writes are views of
the model's tensors, so the model changes. ``broadcast_optimizer_state`` sends the root's
state_dict: its layout and every non-tensor value (hyper-parameters such as ``lr`` and
``betas``, scalar state) as one object, then each tensor in place, and loads the result on
every rank -- so a fresh optimizer (no state yet) ends up identical to a loaded one.

Two rules are Horovod's, one is ours. A fresh optimizer (empty state) is stepped once on zero
gradients first, as Horovod does, so that its state exists (momentum buffers, Adam's moments)
and has the root's values afterwards; unlike Horovod's, that step leaves the parameters as
they were. ``p.grad`` of the parameters that had none stays zero. And every rank must hold an
optimizer of the same class: the root's settings loaded into another optimizer (an Adam's
``betas`` into an SGD) would fail later, far from the cause, so a different class is a
CollectiveError on every rank, before anything moves. A sharded optimizer
(``ZeroRedundancyOptimizer``, ``DistributedOptimizer(..., sharding="optimizer")``) has its state
consolidated on the root first; every rank then keeps its own partition's.
"""
import torch

import mpitrain
from mpitrain import comm
from mpitrain.torch.ops import broadcast_
from mpitrain.torch.optimizer import DistributedMixin
from mpitrain.torch.tensors import Bridge, Problem, refuse, tensor_problem


def broadcast_parameters(params, root_rank=0, process_set=comm.global_process_set):
    """Overwrite every tensor of ``params`` with ``root_rank``'s values, in place.

    params: ``model.state_dict()`` (parameters and buffers; any dict name -> tensor),
    ``model.named_parameters()`` or ``model.parameters()`` (every rank listing them in the same
    order). A tensor that cannot be written in place (not contiguous, an unsupported dtype) is
    an error on every rank, before any data moves; so are names that differ across ranks.
    """
    if isinstance(params, dict):
        pairs = list(params.items())
    else:
        pairs = list(params)
        if pairs and not isinstance(pairs[0], tuple):        # model.parameters(): no names
            pairs = [(f"param.{i}", p) for i, p in enumerate(pairs)]
    arrays, problem = {}, None
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            problem = Problem(ValueError, "broadcast_parameters: expected a dict of tensors, "
                                          "(name, tensor) pairs or tensors")
            break
        name, tensor = pair
        problem = tensor_problem(tensor, f"broadcast_parameters: {name!r}")
        if problem is not None:
            break
        arrays[str(name)] = Bridge(tensor, True, move_only=True).array
    if problem is not None:
        refuse("allgather_object", problem, process_set)  # what the others call first
    mpitrain.broadcast_parameters(arrays, root_rank=root_rank, process_set=process_set)
    if any(t.is_cuda for _, t in pairs):
        torch.cuda.synchronize()


class _Slot:
    """A tensor's place in the root's optimizer state: its shape and dtype."""

    def __init__(self, tensor):
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype


def _skeleton(value):
    """``value`` with every tensor replaced by its _Slot (what travels as one object)."""
    if isinstance(value, torch.Tensor):
        return _Slot(value)
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v) for v in value]
    return value


def _fill(skeleton, mine, tensors, path):
    """The state to load: the root's layout, this rank's tensor where it has one of the same
    shape and dtype (its values are overwritten), else a new one; collects them in order."""
    if isinstance(skeleton, _Slot):
        ok = (isinstance(mine, torch.Tensor) and tuple(mine.shape) == skeleton.shape
              and mine.dtype is skeleton.dtype)
        tensor = (mine.detach().to("cpu", copy=True).contiguous() if ok
                  else torch.zeros(skeleton.shape, dtype=skeleton.dtype))
        tensors.append((path, tensor))
        return tensor
    if isinstance(skeleton, dict):
        mine = mine if isinstance(mine, dict) else {}
        return {k: _fill(v, mine.get(k), tensors, f"{path}.{k}") for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        mine = mine if isinstance(mine, list) and len(mine) == len(skeleton) else []
        return [_fill(v, mine[i] if mine else None, tensors, f"{path}.{i}")
                for i, v in enumerate(skeleton)]
    return skeleton


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=comm.global_process_set):
    """Give every rank ``root_rank``'s optimizer state, for any ``torch.optim.Optimizer``:
    tensor state (momentum buffers, Adam's moments and ``step``), scalar state and every
    ``param_groups`` hyper-parameter (``lr``, ``momentum``, ``betas``, ...)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        refuse("broadcast_object", Problem(TypeError, f"broadcast_optimizer_state: expected a "
                                                      f"torch.optim.Optimizer, got "
                                                      f"{type(optimizer).__name__}"),
               process_set)
    comm.agree(process_set, "broadcast_object", {"optimizer": optimizer_class(optimizer)},
               ordered=True, who="mpitrain.torch.broadcast_optimizer_state")
    sharded = getattr(optimizer, "mt_partition", None) is not None
    if not (optimizer.mt_local_state() if sharded else optimizer.state):
        initialize_state(optimizer)
    if sharded and process_set is not optimizer.process_set:
        raise ValueError("broadcast_optimizer_state: a sharded optimizer's state is "
                         "broadcast over its own process set; pass process_set=its process_set")
    if sharded:
        # a sharded optimizer (ZeroRedundancyOptimizer, sharding="optimizer"): the root's
        # whole state, gathered on it first; each rank keeps its partition's when it loads
        optimizer.consolidate_state_dict(to=root_rank)
        state = (optimizer.state_dict() if process_set.rank() == root_rank
                 else optimizer.mt_local_state_dict())
    else:
        state = optimizer.state_dict()
    skeleton = comm.broadcast_object(_skeleton(state), root_rank=root_rank,
                                     process_set=process_set)
    tensors = []
    new = _fill(skeleton, state, tensors, "state_dict")
    for path, tensor in tensors:
        broadcast_(tensor, root_rank, name=f"broadcast_optimizer_state.{path}",
                   process_set=process_set)
    optimizer.load_state_dict(new)


def optimizer_class(optimizer):
    """The torch optimizer class ``optimizer`` is (a DistributedOptimizer: the one it wraps)."""
    cls = type(optimizer)
    if isinstance(optimizer, DistributedMixin):
        cls = optimizer.mt_optimizer_class()
    return f"{cls.__module__}.{cls.__qualname__}"


def initialize_state(optimizer):
    """Create a fresh optimizer's state as Horovod does: one step of the torch optimizer's own
    on zero gradients (``p.grad`` zero where it was None). Not the distributed step, which
    would start collectives only this caller makes; the parameters are put back after it."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad]
    if not params:
        return
    saved = []
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):    # it takes sparse ones only
                    p.grad = p.grad.to_sparse()
            saved.append(p.detach().clone())
        step = optimizer.inner_step if isinstance(optimizer, DistributedMixin) else \
            optimizer.step
        step()
        for p, value in zip(params, saved):
            p.copy_(value)
