"""Sparse gradients in DistributedOptimizer: averaged by allgather, as Horovod does.

``nn.Embedding(sparse=True)`` (and ``EmbeddingBag``, ``F.embedding(..., sparse=True)``) gives
its weight a sparse COO ``.grad``: the rows the batch touched. With ``sparse_as_dense=False``
(Horovod's default) such a gradient is averaged by gathering every rank's indices and values
(``sparse_allreduce_async``), so a step sends the rows touched, not the whole table:

- which parameters take this path is agreed once, when the optimizer's first backward pass
  ends (``decide``): each rank says which of its gradients came out sparse, and the most any
  rank says wins (one small allreduce over the process set, the only cost for models without
  sparse gradients; that first pass's gradients start their allreduces at its end instead of
  during it). A rank that did not use such a parameter in a step sends no rows; one that had a
  dense gradient for it sends that, made sparse;
- the gathered gradient is coalesced (entries of one row summed), then, for ``op=Average``,
  scaled by 1/N as the dense average is: where the sums are exact its bits are those of the
  dense average of the same gradients. ``p.grad`` is then that sparse tensor, on every rank;
- ``backward_passes_per_step`` k: the k passes' sparse gradients sum in ``p.grad`` (torch
  concatenates them) and the sum is gathered once, as Horovod does;
- compression and ``gradient_predivide_factor`` do not apply (Horovod's sparse path ignores
  them too: nothing is reduced on the wire); ``sharding="gradients"`` is refused on every rank
  (a sparse gradient has no chunk to reduce-scatter); a joined rank (``hvd.join()``) cannot
  serve an allgather, so the others' step is a CollectiveError -- ``sparse_as_dense=True``
  averages through the reductions a joined rank serves.

The first pass also compares a CRC-32 of the gathered parameters (host tensors) across ranks:
they are no longer in the buckets' first-step digest (parallel/report.py), and replicas that
start apart must still raise, on every rank.
"""
import zlib

import numpy as np
import torch

from mpitrain import comm
from mpitrain.torch.ops import Average, Sum, sparse_allreduce_async, synchronize


def local_sparse_dim(tensor):
    """The sparse_dim of ``tensor``'s gradient when it is sparse COO, else 0."""
    grad = tensor.grad
    return grad.sparse_dim() if grad is not None and grad.layout is torch.sparse_coo else 0


def decide(adapters, process_set, sharding, who):
    """Collective over ``process_set``, once, after the first backward pass: give
    ``sparse_dim`` to the adapters whose gradient is sparse on some rank (the largest
    sparse_dim any rank has); then check that their parameters are the same on every rank."""
    local = np.array([local_sparse_dim(a.tensor) for a in adapters], np.int64)
    several = process_set.size() > 1
    agreed = local
    if several and adapters:
        agreed = comm.allreduce(local, op=comm.Max, name=f"{who}.sparse_gradients",
                                process_set=process_set)
    gathered = [(a, int(d)) for a, d in zip(adapters, agreed) if d]
    if gathered and sharding == "gradients":
        names = ", ".join(repr(a.name) for a, _ in gathered)
        raise ValueError(f"{who}: sharding='gradients' cannot reduce-scatter the sparse "
                         f"gradients of {names}; use sharding='optimizer', or "
                         f"sparse_as_dense=True")
    for a, d in gathered:
        a.sparse_dim = d
    if several and gathered:
        check_replicas([a for a, _ in gathered], process_set, who)


def check_replicas(adapters, process_set, who):
    """CollectiveError on every rank where the gathered parameters differ across ranks (their
    CRC-32; host tensors only, and not with MPITRAIN_CHECK=0: as the buckets' digest)."""
    if (any(a.tensor.device.type != "cpu" for a in adapters)
            or not comm.world_of(process_set, who).agreement.enabled):
        return
    crc = 0
    for a in adapters:
        data = a.tensor.detach().contiguous()
        crc = zlib.crc32(data.view(-1).view(torch.uint8).numpy(), crc)
    both = comm.allreduce(np.array([crc, -crc], np.int64), op=comm.Max,
                          name=f"{who}.sparse_digest", process_set=process_set)
    if int(both[0]) != -int(both[1]):
        names = ", ".join(repr(a.name) for a in adapters)
        raise comm.CollectiveError(
            f"{who}: the replicas start from different parameters ({names} differ across "
            f"ranks): broadcast them from one rank before training, e.g. "
            f"hvd.broadcast_parameters(model.state_dict(), root_rank=0)")


def local_gradient(adapter):
    """This rank's gradient of a gathered parameter as a sparse COO tensor of its agreed
    sparse_dim: no rows where it has none, a dense one made sparse."""
    tensor, sparse_dim = adapter.tensor, adapter.sparse_dim
    grad = tensor.grad
    if grad is None:
        indices = torch.empty((sparse_dim, 0), dtype=torch.long, device=tensor.device)
        values = tensor.detach().new_empty((0, *tensor.shape[sparse_dim:]))
        return torch.sparse_coo_tensor(indices, values, tensor.shape, check_invariants=False)
    if grad.layout is not torch.sparse_coo or grad.sparse_dim() != sparse_dim:
        grad = grad.to_dense().to_sparse(sparse_dim)
    return grad


def average(adapters, op, process_set, who):
    """Gather and average (or sum) the gradients of the gathered adapters, in place of their
    ``.grad``; those the step's report dropped (no rank used them) stay without one. Every
    collective is waited for before the first error is raised."""
    size = process_set.size()
    todo = [a for a in adapters if a.sparse_dim and not a.dropped]
    if size == 1 or not todo:
        return
    handles = [sparse_allreduce_async(local_gradient(a), name=f"{who}.sparse.{a.name}",
                                      op=Sum, process_set=process_set) for a in todo]
    error = None
    for a, handle in zip(todo, handles):
        try:
            total = synchronize(handle).coalesce()
        except Exception as exc:       # noqa: BLE001 - the first is raised, below
            error = error or exc
            continue
        if op is Average:
            total = total * (1.0 / size)      # the dense average's scale (comm/engine.py)
        a.tensor.grad = total
    if error is not None:
        raise error


def restore(adapters):
    """Make sparse again the gradients the buckets averaged dense (``sparse_as_dense=True``):
    ``torch.optim.SparseAdam`` takes sparse ones only (Horovod does the same)."""
    for a in adapters:
        if a.densified:
            grad = a.tensor.grad
            if grad is not None and grad.layout is torch.strided:
                a.tensor.grad = grad.to_sparse(a.densified)
            a.densified = 0
