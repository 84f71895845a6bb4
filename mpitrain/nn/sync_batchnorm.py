"""SyncBatchNorm: BatchNorm whose batch statistics are those of the global batch.

Forward sums the per-channel sums, sums of squares and the element count over every rank (one
allreduce of 2C+1 float64 values); backward sums the two per-channel sums the input gradient
needs (one allreduce of 2C values). N ranks with batch b then compute the same forward and
input gradient as one rank with batch N*b, within float rounding. The weight and bias
gradients stay the local sums, as in PyTorch: the optimizer wrapper averages them with every
other gradient.

No MPI at import: the reduction is a callable ``reduce(array)`` that sums a float64 array in
place across the ranks that share the statistics. The default, resolved at the first training
forward through the public comm API, sums over the world with ``mpitrain.allreduce_`` queued
behind any gradient bucket already on the communication thread (``comm.run_ordered``):
DistributedOptimizer's overlap reduces buckets on that thread during backward, and a collective
issued from the main thread at the same time would race it on the same communicator. Device
arrays reduce on the calling thread (gradient overlap is host-only). ``process_set=`` (a
``mt.ProcessSet``, as DistributedOptimizer's) shares the statistics among that set's ranks only
-- e.g. one set per group of ranks that trains one model; pass your own ``reduce`` for anything
else.
"""
import functools

import numpy as np

from mpitrain.nn.batchnorm import BatchNormBase


def world_sum_(array, process_set=None):
    """Sum ``array`` in place over every rank (or a process set's), ordered after in-flight
    gradient buckets."""
    from mpitrain import comm
    ranks = comm.global_process_set if process_set is None else process_set
    if comm.on_device(array):
        comm.allreduce_(array, op=comm.Sum, name="SyncBatchNorm", process_set=ranks)
        return
    comm.run_ordered(lambda: comm.allreduce_(array, op=comm.Sum, name="SyncBatchNorm",
                                             process_set=ranks))


class SyncBatchNorm(BatchNormBase):
    """BatchNorm over the global batch; input (N, C) or (N, C, H, W).

    ``reduce(array)``: sums a float64 array in place across the ranks (default: the world, or
    ``process_set``'s ranks; safe with gradient overlap; see the module docstring).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, kernels=None,
                 dtype=np.float32, reduce=None, process_set=None):
        super().__init__(num_features, eps, momentum, affine, kernels, dtype)
        if reduce is not None and process_set is not None:
            raise ValueError("SyncBatchNorm: pass reduce= or process_set=, not both")
        self.reduce = (reduce if reduce is not None
                       else functools.partial(world_sum_, process_set=process_set))

    def _reduce_forward(self, packed, count):
        self.reduce(packed)
        return float(self.kernels.to_host(packed[-1:])[0])                 # the global count

    def _reduce_backward(self, stats):
        self.reduce(stats)

    @classmethod
    def convert(cls, model, reduce=None, process_set=None):
        """``model`` with every BatchNorm1d/2d replaced by a SyncBatchNorm that shares its
        Parameters and running statistics (an optimizer built before still holds the right
        arrays); returns the model (or the new layer when ``model`` is itself a BatchNorm).
        ``process_set``: the ranks that share statistics (PyTorch's ``process_group``)."""
        if isinstance(model, BatchNormBase) and not isinstance(model, cls):
            return cls._from(model, reduce, process_set)
        for _, parent in model.named_modules():
            for name, child in parent.named_children():
                if isinstance(child, BatchNormBase) and not isinstance(child, cls):
                    parent.replace_child(name, cls._from(child, reduce, process_set))
        return model

    @classmethod
    def _from(cls, bn, reduce, process_set=None):
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.kernels, bn.dtype, reduce,
                  process_set)
        new.training = bn.training
        if bn.affine:
            new.weight = new._params["weight"] = bn.weight
            new.bias = new._params["bias"] = bn.bias
        new.running_mean = new._buffers["running_mean"] = bn.running_mean
        new.running_var = new._buffers["running_var"] = bn.running_var
        return new
