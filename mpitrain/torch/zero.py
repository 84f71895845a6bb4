"""ZeroRedundancyOptimizer: PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer`` over
mpitrain, gradients averaged by the optimizer itself.

    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    loss.backward()        # the gradients are averaged across the process set, as under
    opt.step()             # DistributedOptimizer; then this rank steps its partition and
                           # every rank's updated parameters reach every rank

As PyTorch's: the parameters are partitioned across the ranks of the process set (its sorted
greedy partition, whole parameters; sharding.py) and ``optim``, this rank's ``optimizer_class``
instance, holds the state of its partition only; ``param_groups`` are every parameter's, and
hyper-parameters set there (an lr scheduler's) reach ``optim`` at the next step;
``consolidate_state_dict(to)`` (collective) then ``state_dict()`` on rank ``to`` gives the
whole state in PyTorch's standard format (a RuntimeError elsewhere and before consolidating);
``load_state_dict`` takes such a state, saved at any number of ranks or by an unsharded
optimizer, and each rank keeps what its partition needs; ``add_param_group`` (on every rank)
partitions the new group on top of the others.

Unlike PyTorch's, where DDP averages the gradients, this optimizer averages them: the hooks,
buckets and allreduces of ``hvd.DistributedOptimizer`` (optimizer.py), so the averages are
bitwise those of the unsharded optimizer and the parameters after any number of steps are too,
for any optimizer that updates each parameter on its own. As there, ``p.grad`` holds the average
when ``backward()`` returns, and ``synchronize()`` / ``skip_synchronize()`` / ``no_sync()``
work. ``parameters_as_bucket_view=True`` and ``overlap_with_ddp=True`` (which needs DDP's
buckets) are refused.
"""
import torch

from mpitrain import comm
from mpitrain.torch.compression import Compression
from mpitrain.torch.optimizer import DistributedMixin


class ZeroRedundancyOptimizer(DistributedMixin, torch.optim.Optimizer):
    """Optimizer state sharded across ``process_set`` (PyTorch's ZeroRedundancyOptimizer's
    arguments; ``process_set`` instead of ``process_group``); ``**defaults`` go to
    ``optimizer_class``."""

    mt_who = "ZeroRedundancyOptimizer"

    def __init__(self, params, optimizer_class, process_set=comm.global_process_set,
                 parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults):
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True is not supported "
                             "(there is no DDP: the optimizer averages the gradients itself)")
        if parameters_as_bucket_view:
            raise ValueError("ZeroRedundancyOptimizer: parameters_as_bucket_view=True is not "
                             "supported; each parameter keeps its own storage")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be a "
                            f"torch.optim.Optimizer class, got {optimizer_class!r}")
        params = verified(params)
        self.mt_ready = False
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = False
        self.mt_defaults = defaults
        self.setup(None, Compression.none, 1, comm.Average, 1.0, process_set, False, True,
                   None, sharding="optimizer")
        self.optim = optimizer_class(self.local_groups(), **defaults)
        sync_groups(self.optim.param_groups, self.param_groups)
        self.mt_ready = True

    @property
    def world_size(self):
        return self.mt_partition.size

    @property
    def rank(self):
        return self.mt_partition.rank

    def local_groups(self):
        """This rank's parameter groups: each of ``param_groups`` with its partition's
        parameters (possibly none)."""
        return [{**group, "params": mine}
                for group, mine in zip(self.param_groups, self.mt_partition.mine)]

    # -- what DistributedMixin calls ---------------------------------------------------------
    def local_step(self, *args):
        """The local optimizer's step on this rank's partition; hyper-parameters go to it
        first and back after (as PyTorch's)."""
        sync_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(*args)
        sync_groups(self.optim.param_groups, self.param_groups)
        return loss

    def mt_local_state(self):
        return self.optim.state

    def mt_local_state_dict(self):
        """PyTorch's format over every parameter, with this rank's entries (the local
        optimizer's, renumbered)."""
        state = torch.optim.Optimizer.state_dict(self)
        local = self.optim.state_dict()
        mine = [p for params in self.mt_partition.mine for p in params]
        index = self.mt_partition.index
        state["state"] = {index[id(mine[k])]: v for k, v in local["state"].items()}
        return state

    def mt_load(self, state_dict):
        """The hyper-parameters of every group, and this rank's entries into ``optim``."""
        saved_groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        mine = [p for params in self.mt_partition.mine for p in params]
        index = self.mt_partition.index
        saved_state = state_dict["state"]
        local_state = {k: saved_state[index[id(p)]] for k, p in enumerate(mine)
                       if index[id(p)] in saved_state}
        local_groups, start = [], 0
        for group, params in zip(self.param_groups, self.mt_partition.mine):
            local_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(start, start + len(params)))})
            start += len(params)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        sync_groups(self.param_groups, self.optim.param_groups)

    def mt_sync_groups(self):
        sync_groups(self.param_groups, self.optim.param_groups)

    def mt_partitioned(self):
        """A group was added: ``optim`` gets this rank's part of it (maybe no parameters)."""
        if self.mt_ready:
            self.optim.add_param_group({**self.param_groups[-1],
                                        "params": self.mt_partition.mine[-1]})
            sync_groups(self.optim.param_groups, self.param_groups)

    def add_param_group(self, param_group):
        if not self.__dict__.get("mt_ready"):
            # torch.optim.Optimizer.__init__'s groups: partitioned once they are all there
            return torch.optim.Optimizer.add_param_group(self, param_group)
        return super().add_param_group(param_group)

    def mt_optimizer_class(self):
        return type(self.optim)

    def __repr__(self):
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} "
                f"of {self.world_size}, {sum(len(g['params']) for g in self.optim.param_groups)}"
                f" of {sum(len(g['params']) for g in self.param_groups)} parameters)")


def verified(params):
    """``params`` as a list of tensors or of groups, checked as PyTorch's (the same on every
    rank: every rank passes the same model's parameters)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"ZeroRedundancyOptimizer: params should be an iterable of Tensors, "
                        f"got {torch.typename(params)}")
    params = list(params)
    if not params:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, dict) for p in params):
        if any("params" not in g for g in params):
            raise ValueError("ZeroRedundancyOptimizer: each parameter group must have a "
                             "'params' key")
        tensors = [p for g in params for p in (list(g["params"]) if not isinstance(
            g["params"], torch.Tensor) else [g["params"]])]
    elif all(isinstance(p, torch.Tensor) for p in params):
        tensors = params
    else:
        raise TypeError("ZeroRedundancyOptimizer: params should be an iterable of Tensors or "
                        "of dicts")
    kinds = {torch.typename(p) for p in tensors}
    if any(p.is_sparse for p in tensors) or len(kinds) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer only supports parameters of one dense "
                         f"type, got {', '.join(sorted(kinds))}")
    return params


def sync_groups(source, target):
    """Every hyper-parameter (all but ``params``) of ``source``'s groups onto ``target``'s."""
    for src, dst in zip(source, target):
        for key, value in src.items():
            if key != "params":
                dst[key] = value
