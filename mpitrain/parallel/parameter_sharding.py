"""Sharded parameters (ZeRO stage 3): ``DistributedOptimizer(..., sharding="parameters")``.

On top of sharded gradients (sharded.py's ``GradientSharding``; with ``deterministic=True``
``DeterministicSharding``) the parameters live sharded too: each rank keeps only its share of
them -- the elements its optimizer steps, in one flat array (``store``) -- and every
``Parameter.data`` is released (``Parameter.release_data``). A layer's whole parameters are
allgathered just before its forward and again just before its backward and released right
after each (``Gate``; ``Layer.forward_through`` asks it through ``Parameter.gate``), and the
next layer's allgather is started before the current one's arithmetic (prefetch), so it travels
while this layer computes. Between steps a rank holds 1/N of the parameters, gradients and
optimizer state, plus BatchNorm's buffers.

The first step runs as stage 2 does, on whole parameters (so ``broadcast_parameters`` and a
checkpoint's load may come before it, and the first step's digest compares whole replicas); it
records the order in which layers gather in forward and in backward (every rank runs the same
layers in the same order: that order is what prefetching follows), and its end keeps this
rank's share and releases the rest. The parameters that a gather brings are the owners' bytes,
and the update is stage 2's, so the model is the unsharded run's bit for bit.

Everything that reads whole parameters outside a layer's call -- a checkpoint of the model,
``--save``, sampling text, a user's ``model.state_dict()`` -- does it inside ``with
opt.full_parameters():`` on every rank (collective: PyTorch FSDP's ``summon_full_params``);
what is written into the parameters there is kept (this rank's share is copied back). Reading
a released ``.data`` elsewhere is a RuntimeError saying so.
"""
import contextlib
import time

import numpy as np

from mpitrain import comm
from mpitrain.parallel.sharded import DeterministicSharding, GradientSharding
from mpitrain.timeline import current as current_timeline

PHASES = ("forward", "backward")
GATHER = "DistributedOptimizer.parameters."      # + the group's parameter indices


def group_of(name):
    """The group of parameter indices a layer's gather named ``name`` carries, or None."""
    if not (isinstance(name, str) and name.startswith(GATHER)):
        return None
    return tuple(int(i) for i in name[len(GATHER):].split("."))


class Gate:
    """Gathers and releases the sharded parameters of one optimizer as layers use them.

    ``gather(params, phase)``: the whole values of ``params`` (a layer's) in their ``.data``,
    until the matching ``release(params)``; the next group of the phase's recorded order is
    prefetched. Each parameter counts its holders, so a parameter used by two layers (tied
    embeddings) or held by ``full_parameters`` is released only when the last lets it go.
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.params = strategy.opt.params
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.count = [0] * len(self.params)
        self.active = False             # parameters released: gathers happen
        self.order = {phase: [] for phase in PHASES}    # recorded in the first step
        self.recording = {phase: True for phase in PHASES}
        self.position = {phase: {} for phase in PHASES}
        self.cursor = {phase: 0 for phase in PHASES}
        self.members = {}               # group -> per rank, its pieces' indices
        self.inflight = {}              # group -> (handle of its allgather)
        self.gathers = self.prefetched = 0

    def key(self, params):
        return tuple(self.index[id(p)] for p in params if id(p) in self.index)

    def gather(self, params, phase):
        key = self.key(params)
        if not key:
            return
        if not self.active:
            self._record(key, phase)
            return
        wait = None
        if key in self.inflight:
            wait = self.inflight.pop(key)
        elif any(self.count[i] == 0 for i in key):
            wait = self._start(key)
        nxt = self._next(key, phase)
        if nxt is not None:
            self.inflight[nxt] = self._start(nxt)
            self.prefetched += 1
        if wait is None:
            for i in key:
                self.count[i] += 1
        else:
            self._finish(key, wait)

    def release(self, params):
        if not self.active:
            return
        for i in self.key(params):
            self.count[i] -= 1
            if self.count[i] == 0:
                self.params[i].release_data()

    def discard(self):
        """Wait for prefetched gathers and drop them (the parameters are about to change)."""
        while self.inflight:
            _, handle = self.inflight.popitem()
            comm.synchronize(handle)

    # -- the order layers gather in (recorded in the first step) ----------------------------
    def _record(self, key, phase):
        order = self.order[phase]
        if not self.recording[phase]:
            return
        if order and key == order[0]:           # the next pass begins: the order is complete
            self.recording[phase] = False
            return
        self.position[phase].setdefault(key, len(order))
        order.append(key)

    def _next(self, key, phase):
        """The group after ``key`` in ``phase``'s order, when it is worth starting now."""
        order, c = self.order[phase], self.cursor[phase]
        pos = c if c < len(order) and order[c] == key else self.position[phase].get(key)
        if pos is None:
            return None
        self.cursor[phase] = pos + 1
        if pos + 1 >= len(order):
            return None
        nxt = order[pos + 1]
        if nxt in self.inflight or nxt == key or any(self.count[i] for i in nxt):
            return None
        return nxt

    # -- one group's allgather --------------------------------------------------------------
    def _members(self, key):
        members = self.members.get(key)
        if members is None:
            wanted = set(key)
            members = [[j for j, (i, _, _) in enumerate(pieces) if i in wanted]
                       for pieces in self.strategy.layout.ranks]
            self.members[key] = members
        return members

    def mine(self, key):
        """This rank's pieces of the group ``key``, concatenated: what it sends."""
        s = self.strategy
        return s.mine([s.pieces[j].data for j in self._members(key)[s.rank]])

    def _start(self, key):
        self.gathers += 1
        return comm.allgather_shares_async(
            self.mine(key), name=GATHER + ".".join(map(str, key)),
            process_set=self.strategy.opt.process_set)

    def _finish(self, key, handle):
        s = self.strategy
        start = time.perf_counter()
        with current_timeline().span("gather parameters", cat="comm"):
            every = comm.synchronize(handle)
        s.opt.comm_time_s += time.perf_counter() - start
        targets = {i: np.empty(s.sizes[i], s.dtype) for i in key if self.count[i] == 0}
        ranks, pos = s.layout.ranks, 0
        for r, indices in enumerate(self._members(key)):
            for j in indices:
                i, a, b = ranks[r][j]
                if i in targets:
                    targets[i][a:b] = every[pos:pos + b - a]
                pos += b - a
        for i in key:
            if i in targets:
                self.params[i].data = targets[i].reshape(self.params[i].shape)
            self.count[i] += 1


class ShardedParameters:
    """What sharding the parameters adds to a sharded strategy (mixed in before it): the
    share kept in ``store`` after the first step, the layers' gate, ``full_parameters``."""

    def __init__(self, opt):
        super().__init__(opt)
        self.gate = None
        if self.size > 1 and opt.params:
            self.gate = Gate(self)
            for p in opt.params:
                p.gate = self.gate

    @property
    def parameters_sharded(self):
        return self.gate is not None and self.gate.active

    def step(self, skip, flags=None, update=None):
        if self.parameters_sharded:
            self.gate.discard()         # prefetched values would be the old ones
        return super().step(skip, flags, update)

    def gather_parameters(self):
        """After the update: nothing (the parameters stay sharded); after the first step's,
        whole on every rank once more, then this rank keeps its share and releases them."""
        if self.gate is None or self.gate.active:
            return
        super().gather_parameters()
        self.keep_share()

    def keep_share(self):
        """From now on: this rank's share in ``store``, every ``.data`` released."""
        mine = self.mine([piece.data for piece in self.pieces])
        self.store = mine if mine.base is None else mine.copy()
        pos = 0
        for piece in self.pieces:
            n = piece.stop - piece.start
            piece.store = self.store[pos:pos + n]
            pos += n
        for p in self.opt.params:
            p.release_data()
        self.gate.active = True
        self.gate.recording = {phase: False for phase in PHASES}

    @contextlib.contextmanager
    def full_parameters(self):
        """Collective: every parameter whole in ``.data`` inside the block; what is written
        into this rank's share there is kept."""
        if not self.parameters_sharded:
            yield
            return
        gate, params = self.gate, self.opt.params
        gate.discard()
        for i, p in enumerate(params):
            if gate.count[i] == 0:
                p.data = np.empty(p.shape, p.dtype)
        for piece in self.pieces:           # this rank's own share, then everyone's
            piece.param.data.reshape(-1)[piece.start:piece.stop] = piece.store
        super().gather_parameters()     # sharded.ShardedStep's: every share into .data
        for i in range(len(params)):
            gate.count[i] += 1
        try:
            yield
        finally:
            for piece in self.pieces:
                np.copyto(piece.store, piece.param.data.reshape(-1)[piece.start:piece.stop])
            gate.release(params)

    def memory_bytes(self):
        held = super().memory_bytes()
        if self.parameters_sharded:     # the share, and what layers hold gathered right now
            held["parameters"] = int(self.store.nbytes) + sum(
                int(p.data.nbytes) for p in self.opt.params if p.holds_data)
        return held


class ParameterSharding(ShardedParameters, GradientSharding):
    """``sharding="parameters"``: the gradients reduce-scattered as in stage 2, each rank's
    share of the parameters kept, the layers' parameters gathered as they run."""

    gathers_in_backward = True


class DeterministicParameterSharding(ShardedParameters, DeterministicSharding):
    """``sharding="parameters"`` with ``deterministic=True``: the gradients summed whole in
    the fixed tree, the optimizer state and the parameters sharded."""
