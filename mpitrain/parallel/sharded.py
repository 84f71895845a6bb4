"""Optimizer-state sharding (ZeRO stage 1): each rank keeps the optimizer state of 1/N of the
parameters and steps only that slice.

``DistributedOptimizer(..., sharding="optimizer")``. The parameters, in optimizer order, are one
flat vector of E elements cut into N contiguous slices (comm's chunk bounds: the first E % N
slices one element longer); rank r owns slice r. Gradients are averaged as in gradients mode
(overlapped buckets, fp16 wire, accumulation, clipping by the global norm: gradients.py), so every
rank holds every averaged gradient; then

    rank r:  the inner optimizer steps its slice only    (its state: the slice's, 1/N)
    all:     the updated slices are allgathered          (every rank holds every parameter)

With Adam that is 8 of the 16 bytes per parameter divided by N. The inner optimizer steps
``Piece``s, views of the parts of parameters inside the slice (``Optimizer.restrict``); its
updates are elementwise, so a slice steps to the bits the whole parameter would, and a sharded run
gives the unsharded run's parameters bit for bit, at any N.

A checkpoint holds the unsharded state (``checkpoint_state``, collective: the slices of each
buffer are allgathered and cut back into one array per parameter), so it loads into a run with
any N, sharded or not; ``load_checkpoint_state`` takes such a state and keeps this rank's slice.
"""
import time

import numpy as np

from mpitrain import comm
from mpitrain.parallel.gradients import GradientAveraging
from mpitrain.timeline import current as current_timeline

SHARDINGS = ("none", "optimizer", "gradients", "parameters")


def check_mode(sharding, average, deterministic):
    """ValueError (the same on every rank) where ``sharding`` cannot run in this mode; the
    CLI's configuration asks the same (train/config.py)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}: expected one of {', '.join(SHARDINGS)}")
    if sharding == "none":
        return
    if sharding in ("gradients", "parameters"):
        raise ValueError(f"sharding={sharding!r} is not available yet; sharding='optimizer' "
                         f"splits the optimizer state (gradients are averaged whole)")
    if average != "gradients":
        raise ValueError(f"sharding={sharding!r} splits the optimizer state of averaged "
                         f"gradients; average={average!r} has no gradients to shard")
    if deterministic:
        raise ValueError(f"sharding={sharding!r} with deterministic=True is not available yet")


def check_arguments(sharding, average, deterministic, params):
    """check_mode, then what the parameters must be: one dtype, host arrays."""
    check_mode(sharding, average, deterministic)
    if sharding == "none":
        return
    if len({np.dtype(p.dtype) for p in params}) > 1:
        raise ValueError(f"sharding={sharding!r} needs parameters of one dtype (one flat "
                         f"vector), got {sorted({str(np.dtype(p.dtype)) for p in params})}")
    if params and not isinstance(params[0].data, np.ndarray):
        raise ValueError(f"sharding={sharding!r} runs on host arrays; device parameters are "
                         f"not sharded yet")


class Piece:
    """Elements [start, stop) of a parameter's flattened ``.data`` and ``.grad``, read afresh
    at every access (``.grad`` may be replaced between steps)."""

    __slots__ = ("param", "start", "stop")

    def __init__(self, param, start, stop):
        self.param, self.start, self.stop = param, start, stop

    @property
    def data(self):
        return self.param.data.reshape(-1)[self.start:self.stop]

    @property
    def grad(self):
        return self.param.grad.reshape(-1)[self.start:self.stop]

    @property
    def kernels(self):
        return self.param.kernels


class OptimizerSharding(GradientAveraging):
    """``sharding="optimizer"``: gradients averaged whole, the inner optimizer restricted to this
    rank's slice, the updated slices allgathered after each step."""

    def __init__(self, opt):
        super().__init__(opt)
        params = opt.params
        ps = opt.process_set
        size, rank = (ps.size(), ps.rank()) if ps.included() else (1, 0)
        self.sizes = [int(p.data.size) for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64).tolist()
        self.bounds = comm.chunk_bounds(self.offsets[-1], size)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.pieces, self.owners = [], []
        for i, p in enumerate(params):
            start = max(self.lo, self.offsets[i]) - self.offsets[i]
            stop = min(self.hi, self.offsets[i + 1]) - self.offsets[i]
            if stop > start:
                self.pieces.append(Piece(p, start, stop))
                self.owners.append(i)
        self.full_mask = opt.optimizer.no_decay.copy()
        opt.optimizer.restrict(self.pieces, self.owners)
        self.dtype = np.dtype(params[0].dtype) if params else np.dtype(np.float32)

    def step(self, skip, flags=None, update=None):
        agreed = super().step(skip, flags, update)
        self.gather_parameters()
        return agreed

    def settle(self):
        """Every step ends with the whole model on every rank: nothing to do."""

    # -- the slice and the whole -------------------------------------------------------------
    def my_slice(self, arrays):
        """This rank's elements of the flat concatenation of ``arrays`` (one per piece)."""
        if not arrays:
            return np.empty(0, self.dtype)
        return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])

    def whole(self, mine):
        """Every rank's slice, allgathered in rank order: the flat vector of E elements."""
        opt = self.opt
        if opt.process_set.size() == 1:
            return mine
        return comm.allgather(np.ascontiguousarray(mine, self.dtype),
                              name="DistributedOptimizer.sharded", process_set=opt.process_set)

    def per_parameter(self, flat):
        return [flat[a:b].reshape(p.data.shape)
                for p, a, b in zip(self.opt.params, self.offsets, self.offsets[1:])]

    def gather_parameters(self):
        """After the slices' update: the whole parameters on every rank (an allgather)."""
        opt = self.opt
        if opt.process_set.size() == 1:
            return
        start = time.perf_counter()
        with current_timeline().span("allgather parameters", cat="comm"):
            flat = self.whole(self.my_slice([piece.data for piece in self.pieces]))
            for p, whole in zip(opt.params, self.per_parameter(flat)):
                np.copyto(p.data, whole)
        opt.comm_time_s += time.perf_counter() - start

    # -- checkpoints: the unsharded state ---------------------------------------------------
    def checkpoint_state(self):
        """Collective: the state an unsharded inner optimizer would have (every buffer whole,
        one array per parameter, the full no-decay mask)."""
        inner = self.opt.optimizer
        mine = inner.state_dict()
        # lr, step and the hyper-parameters; buffers are "<name>.<piece>"
        state = {key: value for key, value in mine.items() if "." not in key}
        state["no_decay"] = self.full_mask.copy()
        for name in inner.state:
            flat = self.whole(self.my_slice([mine[f"{name}.{j}"]
                                             for j in range(len(self.pieces))]))
            for i, array in enumerate(self.per_parameter(flat)):
                state[f"{name}.{i}"] = np.array(array, copy=True)
        return state

    def load_checkpoint_state(self, state):
        """Take an unsharded state (``checkpoint_state``'s, or an unsharded run's) and load this
        rank's slice of every buffer into the inner optimizer; a state of other parameters is a
        ValueError."""
        inner = self.opt.optimizer
        mine = {key: value for key, value in state.items() if "." not in key}
        mask = np.asarray(state.get("no_decay", np.zeros(len(self.sizes), np.uint8)))
        if mask.shape != (len(self.sizes),):
            raise ValueError(f"state_dict['no_decay'] has shape {mask.shape}, expected "
                             f"({len(self.sizes)},): one flag per parameter")
        mine["no_decay"] = mask[np.asarray(self.owners, np.int64)]
        for name in inner.state:
            arrays = []
            for i, size in enumerate(self.sizes):
                value = state.get(f"{name}.{i}")
                if value is None or np.asarray(value).size != size:
                    raise ValueError(f"{type(inner).__name__} state_dict mismatch: "
                                     f"{name}.{i} missing or not of parameter {i}'s size")
                arrays.append(np.asarray(value).reshape(-1))
            flat = np.concatenate(arrays) if arrays else np.empty(0, self.dtype)
            for j, piece in enumerate(self.pieces):
                a = self.offsets[self.owners[j]] + piece.start
                mine[f"{name}.{j}"] = flat[a:a + (piece.stop - piece.start)]
        inner.load_state_dict(mine)
        self.full_mask = (mask != 0).astype(np.uint8)
