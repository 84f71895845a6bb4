"""Optimizer-state sharding for torch optimizers: which rank steps which parameter, and how
the ranks' pieces become one model and one optimizer state again.

Used by ``ZeroRedundancyOptimizer`` (zero.py) and ``DistributedOptimizer(...,
sharding="optimizer")`` (optimizer.py). Both average every gradient as the unsharded
DistributedOptimizer does (``sharding="gradients"`` reduce-scatters them instead:
``GradientShards``, at the end of this file); then

    rank r:  its optimizer steps the parameters of its partition (state for those only)
    all:     every rank's updated parameters reach every rank (one allgather per dtype)

The partition is PyTorch's ``ZeroRedundancyOptimizer``'s: group by group, the parameters in
decreasing size (stable) each go whole to the rank with the fewest elements so far (the lowest
such rank on a tie); a group added later is partitioned on top of the earlier ones, which keep
their ranks. Every rank computes it from the same parameter list, so no message is needed.

A parameter is stepped whole by one rank with the same averaged gradient as unsharded, so for
any torch optimizer that updates each parameter on its own (SGD, Adam, AdamW, RMSprop, ...) a
sharded run has the unsharded run's parameters bit for bit, at any N.

The optimizer state leaves in PyTorch's standard format, indexed over all parameters in group
order (as ``torch.optim.Optimizer.state_dict`` numbers them): ``consolidate`` (collective)
gathers every rank's entries on one rank, so a state saved at one N loads at any other, into a
sharded optimizer (each rank keeps its partition's entries) or an unsharded one.
"""
import numpy as np
import torch

from mpitrain import comm
from mpitrain.parallel.gradients import Compressor, GradientAveraging
from mpitrain.parallel.sharded import GradientSharding, owned_pieces
from mpitrain.torch.ops import allgather, broadcast_object


def greedy_partition(param_groups, size):
    """[rank][group] -> that rank's parameters of that group (PyTorch's sorted greedy)."""
    per_rank = [[] for _ in range(size)]
    sizes = [0] * size
    for group in param_groups:
        mine = [[] for _ in range(size)]
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            mine[rank].append(p)
            sizes[rank] += p.numel()
        for rank in range(size):
            per_rank[rank].append(mine[rank])
    return per_rank


def tensor_bytes(value):
    """The bytes of every tensor in ``value`` (a tensor, or dicts/lists/tuples of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def memory_bytes(param_groups, state):
    """{"parameters", "gradients", "optimizer_state"}: the bytes this rank holds for every
    parameter of ``param_groups``, the gradients it holds now and the tensors of ``state``."""
    seen, params = set(), []
    for group in param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return {"parameters": sum(tensor_bytes(p) for p in params),
            "gradients": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_state": sum(tensor_bytes(v) for v in state.values())}


def snapshot(value):
    """``value`` with every tensor replaced by a detached copy (the state at this moment)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


def check_groups(state_dict, param_groups, who):
    """ValueError (the same on every rank: every rank loads the same state) where
    ``state_dict`` is not a state of these parameter groups; torch's checks, made before any
    rank keeps anything."""
    if not (isinstance(state_dict, dict) and "state" in state_dict
            and "param_groups" in state_dict):
        raise ValueError(f"{who}.load_state_dict: expected a dict with 'state' and "
                         f"'param_groups', as state_dict() returns")
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError(f"{who}.load_state_dict: the state has {len(saved)} parameter "
                         f"groups, the optimizer {len(param_groups)}")
    for k, (s, g) in enumerate(zip(saved, param_groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(f"{who}.load_state_dict: parameter group {k} has "
                             f"{len(s['params'])} parameters in the state, "
                             f"{len(g['params'])} in the optimizer")


class Partition:
    """The parameters of ``param_groups`` partitioned over ``process_set`` (one rank, owning
    everything, on a rank outside it: that rank steps alone)."""

    def __init__(self, param_groups, process_set, who):
        self.process_set = process_set
        self.who = who
        included = process_set.included() is not False
        self.size = process_set.size() if included else 1
        self.rank = process_set.rank() if included else 0
        self.per_rank = greedy_partition(param_groups, self.size)
        self.owner = {id(p): r for r, groups in enumerate(self.per_rank)
                      for params in groups for p in params}
        self.params = [p for group in param_groups for p in group["params"]]
        self.index = {}
        for i, p in enumerate(self.params):
            self.index.setdefault(id(p), i)

    @property
    def mine(self):
        """This rank's parameters, group by group."""
        return self.per_rank[self.rank]

    def owns(self, p):
        return self.owner.get(id(p)) == self.rank

    def owns_index(self, index):
        """True for a state index (over all parameters, in group order) of this rank's."""
        return (isinstance(index, int) and 0 <= index < len(self.params)
                and self.owns(self.params[index]))

    # -- the parameters ------------------------------------------------------------------------
    def distribute(self):
        """Collective: every rank's parameters (updated by its step) onto every rank. One
        allgather per dtype of the flat concatenation of each rank's parameters of it; the
        counts are known from the partition on every rank."""
        if self.size == 1:
            return
        dtypes = sorted({p.dtype for p in self.params}, key=str)
        with torch.no_grad():
            for dtype in dtypes:
                ranks = [[p for params in groups for p in params if p.dtype is dtype]
                         for groups in self.per_rank]
                mine = ranks[self.rank]
                device = self.params[0].device
                flat = (torch.cat([p.detach().reshape(-1) for p in mine]) if mine
                        else torch.empty(0, dtype=dtype, device=device))
                whole = allgather(flat, name=f"{self.who}.parameters.{dtype}",
                                  process_set=self.process_set)
                offset = 0
                for rank, params in enumerate(ranks):
                    for p in params:
                        n = p.numel()
                        if rank != self.rank:
                            p.copy_(whole[offset:offset + n].view(p.shape))
                        offset += n

    # -- the optimizer state -------------------------------------------------------------------
    def consolidate(self, mine, to):
        """Collective: ``mine`` ({state index: per-parameter state} of this rank's parameters)
        of every rank, merged, on rank ``to`` of the process set (None elsewhere). One
        ``broadcast_object`` per rank, as PyTorch's: a rank holds one other rank's entries at
        a time."""
        check_rank(to, self.size, f"{self.who}.consolidate_state_dict")
        if self.size == 1:
            return snapshot(mine)
        merged = {} if self.rank == to else None
        for rank in range(self.size):
            if rank == self.rank:
                sent = broadcast_object(mine, root_rank=rank, process_set=self.process_set)
                if merged is not None:
                    merged.update(snapshot(sent))
            else:
                got = broadcast_object(None, root_rank=rank, process_set=self.process_set)
                if merged is not None:
                    merged.update(got)
        return merged


def check_rank(to, size, who):
    """ValueError unless ``to`` is a rank of a process set of ``size`` ranks (an argument: the
    same on every rank, so every rank raises)."""
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < size:
        raise ValueError(f"{who}: to={to!r} is not a rank of the process set "
                         f"(0..{size - 1})")



# -- sharded gradients ---------------------------------------------------------------------------

class GradientShards(GradientAveraging):
    """``sharding="gradients"``: the gradient averaging strategy of mpitrain's
    DistributedOptimizer (parallel/gradients.py) with the unsharded run's buckets
    reduce-scattered on the ring instead of allreduced; the averaged elements reach the rank
    that owns their parameter, and the gradients of the parameters a rank does not own are
    dropped (``p.grad = None``).

    The buckets are the unsharded run's (the overlapped ones in arrival order, or the fusion
    buffer's plan where the unsharded run fuses at the step), so every element is summed by the
    same ring additions as unsharded: after the reduce-scatter rank r holds chunk
    ``comm.owned_chunk(r, N)`` of each bucket with the unsharded average's bits. The partition
    is of whole parameters (``Partition``), the chunks are not: each chunk holder sends the
    pieces of its chunks to the owners of their parameters (one alltoall per dtype, routes
    known to every rank from the plan), and the owner writes them into ``p.grad``. Each element
    then moved once more (at most 1/N of the gradient per rank), instead of the allreduce's
    second phase.

    Where the buckets do not apply (device tensors, a compressor of the user's own) the
    gradients are allreduced as unsharded and then dropped: the same bits, the memory saved
    between steps, not the traffic (``reduce_scatters`` is False).
    """

    def __init__(self, opt, owners, who):
        super().__init__(opt)
        self.owners = list(owners)     # per parameter of opt.params: the rank stepping it
        self.who = who
        ps = opt.process_set
        included = ps.included() is not False
        self.size = ps.size() if included else 1
        self.rank = ps.rank() if included else 0
        self.scatter = None
        params = opt.params
        if not (self.size > 1 and params and not comm.on_device(params[0].data)
                and isinstance(opt.compression, Compressor)):
            return
        if self.autotuner is not None:
            raise ValueError(f"{who}: sharding='gradients' fixes its buckets at construction; "
                             f"MPITRAIN_AUTOTUNE=1 changes them: unset it, or use "
                             f"sharding='optimizer'")
        self.arrival = GradientSharding.overlaps(opt)   # where the unsharded run overlaps
        n = len(params)
        order = list(reversed(params)) if self.arrival else list(params)
        self.param_of = [n - 1 - i for i in range(n)] if self.arrival else list(range(n))
        specs = [(tuple(p.data.shape), np.dtype(p.dtype)) for p in order]
        wire = [opt.compression.wire_dtype(d) for _, d in specs]
        f = opt.gradient_predivide_factor
        self.scatter = comm.bucket_reduce_scatter(
            ps, specs, opt.fusion_threshold_bytes, opt.op, 1.0 / f, f,
            "DistributedOptimizer.gradients", wire_dtypes=wire, arrival=self.arrival, who=who)
        if self.arrival:
            self.buckets = self.scatter              # the backward hook fills them
        self.dtypes = sorted({np.dtype(p.dtype) for p in params}, key=str)
        self.routes(comm.bucket_plan(specs, wire, opt.fusion_threshold_bytes, self.arrival))

    @property
    def reduce_scatters(self):
        return self.scatter is not None

    def routes(self, buckets):
        """Where each piece of this rank's chunks goes and where each piece it receives
        lands, in the same order on both ends: ``sends[o]`` [(bucket, start, stop, parameter,
        the parameter's offset in the bucket)] (elements of the bucket), ``receives[r]``
        [(parameter, start, stop)] (elements of the flattened parameter)."""
        size, me = self.size, self.rank
        self.sends = [[] for _ in range(size)]
        self.receives = [[] for _ in range(size)]
        for k, r, i, a, z, off, _ in owned_pieces(buckets, size):
            j = self.param_of[i]
            owner = self.owners[j]
            if r == me:
                self.sends[owner].append((k, a, z, j, off))
            if owner == me:
                self.receives[r].append((j, a - off, z - off))

    def bucket_allreduce(self):
        if self.scatter is not None:
            return self.scatter if self.arrival else None
        return super().bucket_allreduce()

    def set_fusion_threshold(self, threshold_bytes):
        if self.scatter is not None:
            raise ValueError(f"{self.who}: sharding='gradients' fixes its buckets (and each "
                             f"rank's chunks) at construction: pass fusion_threshold_bytes "
                             f"there")
        super().set_fusion_threshold(threshold_bytes)

    def average(self):
        if self.scatter is None:
            super().average()
        else:
            self.scatter_average()
        for p, owner in zip(self.opt.params, self.owners):
            if owner != self.rank:
                p.drop_grad()

    def scatter_average(self):
        """Reduce-scatter every bucket, then send each piece of this rank's chunks to its
        parameter's owner, which writes it into ``p.grad``."""
        opt = self.opt
        params = opt.params
        order = [params[j] for j in self.param_of]
        flats = [flat for _, flat in self.scatter.finish_flat([p.grad for p in order])]
        me = self.rank
        owned = {}                         # parameter -> (its gradient, a flat view of it)

        def target(j):
            if j not in owned:
                g = params[j].grad
                owned[j] = (g, g.reshape(-1) if g.flags.c_contiguous else g.flatten())
            return owned[j][1]

        for k, a, z, j, off in self.sends[me]:  # pieces of this rank's own parameters
            target(j)[a - off:z - off] = flats[k][a:z]
        for dtype in self.dtypes:
            out_parts, splits = [], []
            for o in range(self.size):
                parts = ([] if o == me else
                         [flats[k][a:z] for k, a, z, j, _ in self.sends[o]
                          if np.dtype(params[j].dtype) == dtype])
                splits.append(sum(int(p.size) for p in parts))
                out_parts.extend(parts)
            send = np.empty(sum(splits), dtype)
            pos = 0
            for part in out_parts:
                send[pos:pos + part.size] = part           # from the wire dtype (exact)
                pos += part.size
            got, _ = comm.alltoall(send, splits=splits, name=f"{self.who}.gradients.{dtype}",
                                   process_set=opt.process_set)
            pos = 0
            for r in range(self.size):
                if r == me:
                    continue
                for j, a, z in self.receives[r]:
                    if np.dtype(params[j].dtype) == dtype:
                        target(j)[a:z] = got[pos:pos + z - a]
                        pos += z - a
        for g, view in owned.values():
            if not np.shares_memory(view, g):
                g[...] = view.reshape(g.shape)
        self.scatter.release()
