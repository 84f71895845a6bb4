"""Sharded data parallel, the optimizer state (ZeRO stage 1) and the gradients too (stage 2):
each rank keeps the optimizer state of its share of the parameters and steps only that share.

``DistributedOptimizer(..., sharding="optimizer")`` (``OptimizerSharding``): the parameters, in
optimizer order, are one flat vector of E elements cut into N contiguous slices (comm's chunk
bounds: the first E % N slices one element longer); rank r owns slice r. Gradients are
averaged as in gradients mode (overlapped buckets, fp16 wire, accumulation, clipping by the
global norm: gradients.py), so every rank holds every averaged gradient; then

    rank r:  the inner optimizer steps its share only     (its state: the share's, 1/N)
    all:     the updated shares are allgathered           (every rank holds every parameter)

``sharding="gradients"`` (``GradientSharding``): the same buckets as the unsharded run's (the
overlapped ones in arrival order, or the fusion buffer's where the unsharded run fuses at the
step), each reduce-scattered on the ring instead of allreduced -- during backward where the
buckets overlap it. Rank r keeps chunk ``comm.owned_chunk(r, N)`` of each bucket, the chunk the
ring's first phase completes on it, in its gradient shard; every gradient is then released
(``Parameter.release_grad``: the next backward allocates it anew), so between steps a rank
holds 1/N of the gradients, and no rank ever holds the whole averaged gradient. Its share of
the parameters is those chunks. ``clip_grad_norm`` adds the ranks' exact sums of squares of
their chunks (nn/exact_sum.py), so the norm is mt.nn.clip_grad_norm_'s, bit for bit.

With Adam that is 8 (stage 1) or 12 (stage 2) of the 16 bytes per parameter divided by N. The
inner optimizer steps ``Piece``s, views of the parts of parameters in the share
(``Optimizer.restrict``); its updates are elementwise, and a ring chunk's sum is the same
additions in the same order whether the ring goes on to allgather it or not, so a sharded run
gives the unsharded run's parameters bit for bit (with the same allreduce algorithm, the ring;
at N = 2 any, the sum of two commutes).

A share is a ``Layout``: per rank, the (parameter, start, stop) element ranges it owns, known to
every rank. ``ShardedStep`` is what sharding adds to an averaging strategy: mixed into gradients
mode's (``OptimizerSharding``, ``GradientSharding``) or into deterministic mode's
(``DeterministicSharding``: the fixed tree sums the gradients whole, then the optimizer state
is sharded, so the bits are the unsharded deterministic run's at every N). After the step the
updated shares are allgathered in rounds of at most a bucket's bytes, straight into the
parameters. A checkpoint is each rank's own piece (``checkpoint_pieces``, no collective: every
rank writes it, train/checkpoint_shards.py), or the unsharded state (``checkpoint_state``,
collective: every rank's pieces of each buffer allgathered into one array per parameter);
``load_checkpoint_state`` takes either, or a sharded checkpoint's reader, written at any N,
and keeps this rank's pieces.
"""
import math
import time

import numpy as np

from mpitrain import comm
from mpitrain.nn.clip import scale_to
from mpitrain.nn.exact_sum import SquareSum
from mpitrain.parallel.deterministic import DeterministicGradients
from mpitrain.parallel.gradients import GRADIENTS, Compressor, GradientAveraging
from mpitrain.timeline import current as current_timeline

SHARDINGS = ("none", "optimizer", "gradients", "parameters")
# the names of the step's allgather of shares and of the clipping norm's allreduce
STEP_SHARES, CLIP = "DistributedOptimizer.sharded", "DistributedOptimizer.clip"


def check_mode(sharding, average, deterministic, clip_grad_norm=None):
    """ValueError (the same on every rank) where ``sharding`` cannot run in this mode; the
    CLI's configuration asks the same (train/config.py)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}: expected one of {', '.join(SHARDINGS)}")
    if sharding == "none":
        return
    if average != "gradients":
        raise ValueError(f"sharding={sharding!r} splits the optimizer state of averaged "
                         f"gradients; average={average!r} has no gradients to shard")


def check_arguments(sharding, average, deterministic, params, compression=None,
                    clip_grad_norm=None):
    """check_mode, then what the parameters and the other arguments must be: one dtype, host
    arrays; for "gradients" a built-in compression, and float32 to clip."""
    check_mode(sharding, average, deterministic, clip_grad_norm)
    if sharding == "none":
        return
    if len({np.dtype(p.dtype) for p in params}) > 1:
        raise ValueError(f"sharding={sharding!r} needs parameters of one dtype (one flat "
                         f"vector), got {sorted({str(np.dtype(p.dtype)) for p in params})}")
    if params and not isinstance(params[0].data, np.ndarray):
        raise ValueError(f"sharding={sharding!r} runs on host arrays; device parameters are "
                         f"not sharded yet")
    if (sharding in ("gradients", "parameters") and clip_grad_norm is not None and params
            and np.dtype(params[0].dtype) != np.float32):
        raise ValueError(f"sharding={sharding!r} with clip_grad_norm sums the slices' squares "
                         f"exactly, which needs float32 parameters, not "
                         f"{np.dtype(params[0].dtype)}")
    if sharding in ("gradients", "parameters") and not isinstance(compression,
                                                                  (Compressor, type(None))):
        raise ValueError(f"sharding={sharding!r} reduce-scatters buckets; compression "
                         f"{compression!r} (a compressor of your own) needs whole "
                         f"gradients: use sharding='optimizer', or mt.Compression.fp16")


class Piece:
    """Elements [start, stop) of a parameter's flattened ``.data`` and ``.grad``, read afresh
    at every access (``.grad`` may be replaced between steps); ``shard``: where the gradient
    lives instead (sharded gradients: this rank's slice of the averaged gradient); ``store``:
    where the values live instead (sharded parameters: parameter_sharding.py)."""

    __slots__ = ("param", "start", "stop", "shard", "store")

    def __init__(self, param, start, stop, shard=None):
        self.param, self.start, self.stop, self.shard = param, start, stop, shard
        self.store = None

    @property
    def data(self):
        if self.store is not None:
            return self.store
        return self.param.data.reshape(-1)[self.start:self.stop]

    @property
    def grad(self):
        if self.shard is not None:
            return self.shard
        return self.param.grad.reshape(-1)[self.start:self.stop]

    @property
    def kernels(self):
        return self.param.kernels


def owned_pieces(buckets, size):
    """Every piece of every rank's chunk ``comm.owned_chunk(r, size)`` of every bucket
    (buckets.Bucket), bucket by bucket, rank by rank, entry by entry: (bucket index, rank r,
    the entry's array index, its elements [start, stop) of the bucket, the entry's offset in
    the bucket, the chunk's start)."""
    for index, b in enumerate(buckets):
        bounds = comm.chunk_bounds(b.total, size)
        for r in range(size):
            c = comm.owned_chunk(r, size)
            lo, hi = bounds[c], bounds[c + 1]
            for i, off, n in b.entries:
                a, z = max(lo, off), min(hi, off + n)
                if z > a:
                    yield index, r, i, a, z, off, lo


class Layout:
    """Which elements each rank owns: ``ranks[r]`` = [(parameter index, start, stop)], element
    ranges of the flattened parameters, every element owned by exactly one rank."""

    def __init__(self, sizes, ranks):
        self.sizes, self.ranks = list(sizes), [list(r) for r in ranks]
        self.lengths = [sum(b - a for _, a, b in pieces) for pieces in self.ranks]

    @classmethod
    def contiguous(cls, sizes, size):
        """Optimizer order's flat vector cut into ``size`` slices (ZeRO-1)."""
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        bounds = comm.chunk_bounds(offsets[-1], size)
        ranks = []
        for r in range(size):
            lo, hi = bounds[r], bounds[r + 1]
            ranks.append([(i, max(lo, a) - a, min(hi, b) - a)
                          for i, (a, b) in enumerate(zip(offsets, offsets[1:]))
                          if min(hi, b) > max(lo, a)])
        return cls(sizes, ranks)

    @classmethod
    def of_buckets(cls, sizes, buckets, param_of, size):
        """Rank r: chunk ``comm.owned_chunk(r, size)`` of every bucket (buckets.Bucket, whose
        entry i is parameter ``param_of[i]``): what the ring's reduce-scatter leaves on it.
        Also returns, per rank, each piece's (bucket index, offset in the bucket's chunk)."""
        ranks, where = [[] for _ in range(size)], [[] for _ in range(size)]
        for index, r, i, a, z, off, lo in owned_pieces(buckets, size):
            ranks[r].append((param_of[i], a - off, z - off))
            where[r].append((index, a - lo))
        return cls(sizes, ranks), where

    def rounds(self, round_elements):
        """The parameters in groups of consecutive ones of at most ``round_elements`` elements
        (a larger parameter alone), each with, per rank, the indices of its pieces in the
        group: an allgather per group keeps the transient copy that small."""
        groups, current, total = [], [], 0
        for i, n in enumerate(self.sizes):
            if current and total + n > round_elements:
                groups.append(current)
                current, total = [], 0
            current.append(i)
            total += n
        if current:
            groups.append(current)
        out = []
        for group in groups:
            members = set(group)
            out.append([[j for j, (i, _, _) in enumerate(pieces) if i in members]
                        for pieces in self.ranks])
        return out

    def gather(self, mine, dtype, process_set):
        """Every rank's values of its pieces (``mine``: this rank's, concatenated in piece
        order), allgathered: one flat array per parameter."""
        every = mine if len(self.ranks) == 1 else comm.allgather(
            np.ascontiguousarray(mine, dtype), name="DistributedOptimizer.sharded",
            process_set=process_set)
        out = [np.empty(n, dtype) for n in self.sizes]
        pos = 0
        for pieces in self.ranks:
            for i, a, b in pieces:
                out[i][a:b] = every[pos:pos + b - a]
                pos += b - a
        return out


class ShardedStep:
    """What every sharded strategy adds to the averaging strategy it is mixed into (gradients
    mode's, or deterministic mode's): the inner optimizer restricted to this rank's share, the
    updated shares allgathered after each step, checkpoints of the whole state or of pieces."""

    def __init__(self, opt, layout=None, shards=None):
        super().__init__(opt)
        params = opt.params
        ps = opt.process_set
        self.size, self.rank = (ps.size(), ps.rank()) if ps.included() else (1, 0)
        self.sizes = [int(p.size) for p in params]
        self.layout = layout or Layout.contiguous(self.sizes, self.size)
        mine = self.layout.ranks[self.rank]
        self.owners = [i for i, _, _ in mine]
        self.pieces = [Piece(params[i], a, b, None if shards is None else shards[j])
                       for j, (i, a, b) in enumerate(mine)]
        self.full_mask = opt.optimizer.no_decay.copy()
        opt.optimizer.restrict(self.pieces, self.owners)
        self.rounds = None          # gather_parameters' groups of parameters
        self.dtype = np.dtype(params[0].dtype) if params else np.dtype(np.float32)

    def step(self, skip, flags=None, update=None):
        agreed = super().step(skip, flags, update)
        self.gather_parameters()
        return agreed

    def settle(self):
        """Every step ends with the whole model on every rank: nothing to do."""

    def step_fields(self):
        """The learning rate too: a rank that has joined steps its share with it
        (sharded_join.py), and the ranks' must agree anyway."""
        return {**super().step_fields(), "lr": float(self.opt.lr)}

    def mine(self, arrays):
        """This rank's pieces of ``arrays`` (one per piece), concatenated."""
        if not arrays:
            return np.empty(0, self.dtype)
        return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])

    def gather_parameters(self):
        """After the shares' update: the whole parameters on every rank (an allgather)."""
        opt = self.opt
        if self.size == 1:
            return
        start = time.perf_counter()
        with current_timeline().span("allgather parameters", cat="comm"):
            # round by round, straight into the parameters
            for index in range(len(self.share_rounds())):
                self.place_round(index, comm.allgather_shares(
                    self.round_share(index), name=STEP_SHARES,
                    process_set=opt.process_set))
        opt.comm_time_s += time.perf_counter() - start

    def share_rounds(self):
        """The parameters in rounds of at most a bucket's bytes (a larger one alone), each
        with per rank its pieces' indices (Layout.rounds)."""
        if self.rounds is None:
            self.rounds = self.layout.rounds(max(1, self.opt.fusion_threshold_bytes
                                                 // self.dtype.itemsize))
        return self.rounds

    def round_share(self, index):
        """This rank's pieces of round ``index``, concatenated: what it sends."""
        members = self.share_rounds()[index]
        return self.mine([self.pieces[j].data for j in members[self.rank]])

    def place_round(self, index, every):
        """Round ``index``'s allgathered pieces (``every``) into the other ranks' parts of
        the parameters' ``.data``."""
        ranks, pos = self.layout.ranks, 0
        targets = [p.data.reshape(-1) for p in self.opt.params]
        for r, indices in enumerate(self.share_rounds()[index]):
            for j in indices:
                i, a, b = ranks[r][j]
                if r != self.rank:
                    targets[i][a:b] = every[pos:pos + b - a]
                pos += b - a

    # -- a rank that has joined (sharded_join.py) ---------------------------------------------
    def receive_average(self, kind, fields, results):
        """The averaged gradients of a step served while joined: every gradient (``results``
        of the buckets' plan, or of the fused allreduce in parameter order) into ``.grad``."""
        params = self.opt.params
        if kind == "allreduce buckets":         # comm's Kind, by its value
            buckets = comm.bucket_plan(fields["arrays"], fields["wire"],
                                       fields["threshold_bytes"], fields.get("arrival", True))
            order = list(reversed(params)) if fields.get("arrival", True) else list(params)
            for bucket, flat in zip(buckets, results):
                for i, off, n in bucket.entries:
                    _into(order[i].grad, flat[off:off + n])
        else:
            for p, array in zip(params, results):
                _into(p.grad, array)

    def clip_joined(self):
        """Before a joined rank steps its share: clip as the active ranks did."""
        self.clip()

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
            flats = self.layout.gather(
                self.mine([mine[f"{name}.{j}"] for j in range(len(self.pieces))]),
                self.dtype, self.opt.process_set)
            for i, (p, flat) in enumerate(zip(self.opt.params, flats)):
                state[f"{name}.{i}"] = flat.reshape(p.shape)
        return state

    reads_pieces = True

    def checkpoint_pieces(self):
        """This rank's piece of the optimizer state (no collective): (the scalars with the
        full no-decay mask, its pieces [(parameter, start, stop)], {buffer: its pieces' values
        concatenated}, the parameters' shapes); None where the process set is not every rank
        (the pieces would not name global ranks: ``checkpoint_state`` gathers then)."""
        if self.opt.process_set.size() != comm.size():
            return None
        inner = self.opt.optimizer
        mine = inner.state_dict()
        scalars = {key: value for key, value in mine.items() if "." not in key}
        scalars["no_decay"] = self.full_mask.copy()
        buffers = {name: self.mine([mine[f"{name}.{j}"] for j in range(len(self.pieces))])
                   for name in inner.state}
        shapes = [tuple(p.shape) for p in self.opt.params]
        return scalars, list(self.layout.ranks[self.rank]), buffers, shapes

    def load_checkpoint_state(self, state):
        """Take an unsharded state (``checkpoint_state``'s, or an unsharded run's), or a
        sharded checkpoint's reader (``scalars``, ``read(buffer, i, start, stop)``), and load
        this rank's pieces of every buffer into the inner optimizer; a state of other
        parameters is a ValueError (checked whole, so the same on every rank)."""
        inner = self.opt.optimizer
        if hasattr(state, "read"):
            if state.sizes != self.sizes or sorted(state.buffers) != sorted(inner.state):
                raise ValueError(f"{type(inner).__name__} state mismatch: the checkpoint's "
                                 f"buffers {sorted(state.buffers)} of {len(state.sizes)} "
                                 f"parameters, this optimizer's {sorted(inner.state)} of "
                                 f"{len(self.sizes)}")
            mine, read = dict(state.scalars), state.read
        else:
            mine, read = {key: value for key, value in state.items() if "." not in key}, None
        mask = np.asarray(mine.get("no_decay", np.zeros(len(self.sizes), np.uint8)))
        if mask.shape != (len(self.sizes),):
            raise ValueError(f"state_dict['no_decay'] has shape {mask.shape}, expected "
                             f"({len(self.sizes)},): one flag per parameter")
        mine["no_decay"] = mask[np.asarray(self.owners, np.int64)]
        if read is None:
            flats = {name: self._whole_buffer(inner, state, name) for name in inner.state}

            def read(name, i, start, stop):
                return flats[name][i][start:stop]
        for name in inner.state:
            for j, (i, piece) in enumerate(zip(self.owners, self.pieces)):
                mine[f"{name}.{j}"] = read(name, i, piece.start, piece.stop)
        inner.load_state_dict(mine)
        self.full_mask = (mask != 0).astype(np.uint8)

    def _whole_buffer(self, inner, state, name):
        """Buffer ``name`` of every parameter in an unsharded ``state``, flattened."""
        flats = []
        for i, size in enumerate(self.sizes):
            value = state.get(f"{name}.{i}")
            if value is None or np.asarray(value).size != size:
                raise ValueError(f"{type(inner).__name__} state_dict mismatch: "
                                 f"{name}.{i} missing or not of parameter {i}'s size")
            flats.append(np.asarray(value).reshape(-1))
        return flats


class OptimizerSharding(ShardedStep, GradientAveraging):
    """``sharding="optimizer"``: gradients averaged whole (gradients.py), the inner optimizer
    restricted to this rank's slice, the updated slices allgathered after each step."""


class DeterministicSharding(ShardedStep, DeterministicGradients):
    """``sharding="optimizer"`` or ``"gradients"`` with ``deterministic=True``: the gradients
    summed whole in the fixed tree (deterministic.py: the same bits for every power-of-two N),
    then as ``OptimizerSharding``, so the parameters are the unsharded deterministic run's at
    every N. The tree's leaves stay whole, so "gradients" shards the optimizer state only."""


class GradientSharding(OptimizerSharding):
    """``sharding="gradients"``: the unsharded run's buckets reduce-scattered; this rank keeps
    its chunk of each in its gradient shard, steps the parameters' elements of those chunks,
    and the updated chunks are allgathered."""

    # other collectives run between the buckets (sharded parameters' gathers): each bucket is
    # agreed alone, so that a rank that has joined learns it where it comes
    gathers_in_backward = False

    def __init__(self, opt):
        ps = opt.process_set
        size = ps.size() if ps.included() else 1
        params = opt.params
        self.scatter = None
        layout = shards = None
        if size > 1 and params:
            self.arrival = self.overlaps(opt)
            order = list(reversed(params)) if self.arrival else list(params)
            specs = [(tuple(p.shape), np.dtype(p.dtype)) for p in order]
            self.wire = [opt.compression.wire_dtype(d) for _, d in specs]
            f = opt.gradient_predivide_factor
            self.scatter = comm.bucket_reduce_scatter(
                ps, specs, opt.fusion_threshold_bytes, opt.op, 1.0 / f, f,
                GRADIENTS, wire_dtypes=self.wire, arrival=self.arrival,
                agree_each=self.gathers_in_backward)
            n = len(params)
            param_of = [n - 1 - i for i in range(n)] if self.arrival else list(range(n))
            buckets = comm.bucket_plan(specs, self.wire, opt.fusion_threshold_bytes,
                                       self.arrival)
            layout, where = Layout.of_buckets([int(p.size) for p in params], buckets,
                                              param_of, size)
            rank = ps.rank()
            dtype = np.dtype(params[0].dtype)
            bounds = [comm.chunk_bounds(b.total, size) for b in buckets]
            c = comm.owned_chunk(rank, size)
            self.chunks = [(lo[c], lo[c + 1]) for lo in bounds]    # this rank's, per bucket
            self.shard = [np.zeros(hi - lo, dtype) for lo, hi in self.chunks]
            shards = [self.shard[index][off:off + (b - a)]
                      for (index, off), (_, a, b) in zip(where[rank], layout.ranks[rank])]
        super().__init__(opt, layout, shards)
        if self.scatter is not None and self.arrival:
            self.buckets = self.scatter         # Strategy.pending() and zero_grad see them
        if self.scatter is not None and self.autotuner is not None:
            raise ValueError(f"sharding={opt.sharding!r} fixes its buckets at construction; "
                             f"MPITRAIN_AUTOTUNE=1 changes them: unset it, or use "
                             f"sharding='optimizer'")

    @staticmethod
    def overlaps(opt):
        """Whether the unsharded run's average overlaps backward in buckets
        (GradientAveraging.bucket_allreduce's rule), else it fuses at the step."""
        grads = [p.data for p in opt.params]
        wire = {opt.compression.wire_dtype(g.dtype) for g in grads}
        one_bucket = (len(wire) == 1 and 0 < opt.fusion_threshold_bytes
                      and sum(g.size for g in grads) * next(iter(wire)).itemsize
                      <= opt.fusion_threshold_bytes)
        return bool(opt.overlap) and not one_bucket

    def bucket_allreduce(self):
        """The overlapping buckets (here reduce-scatters), where the unsharded run has them."""
        if self.scatter is not None and self.arrival:
            return self.scatter
        return None

    def set_fusion_threshold(self, threshold_bytes):
        if self.scatter is not None:
            raise ValueError(f"sharding={self.opt.sharding!r} fixes its buckets (and each "
                             f"rank's share) at construction: pass fusion_threshold_bytes there")
        super().set_fusion_threshold(threshold_bytes)

    def average(self):
        """Reduce-scatter every bucket, keep this rank's chunks (cast back from the wire
        dtype), release every gradient."""
        opt = self.opt
        order = list(reversed(opt.params)) if self.arrival else list(opt.params)
        flats = self.scatter.finish_flat([p.grad for p in order])
        for (_, flat), (lo, hi), shard in zip(flats, self.chunks, self.shard):
            _into(shard, flat[lo:hi])
        self.scatter.release()
        for p in opt.params:
            p.release_grad()

    def clip(self):
        """clip_grad_norm_ over the slices: each rank's exact sum of squares (exact_sum.py),
        the sums added over the ranks (integers: any order), so the norm, the factor and the
        clipped bits are the unsharded run's."""
        max_norm, opt = self.opt.clip_grad_norm, self.opt
        if max_norm is None or self.scatter is None:
            super().clip()
            return
        self.clip_from(comm.allreduce(self.clip_partial(), op=comm.Sum,
                                      name=CLIP,
                                      process_set=opt.process_set))

    def clip_partial(self):
        """This rank's exact sum of squares of its chunks, with its inf and NaN counts."""
        mine = SquareSum()
        for shard in self.shard:
            mine.add_array(shard)
        counts = np.array([mine.flag == 1, mine.flag == 2], np.int64)     # inf, NaN
        return np.concatenate([mine.bins, counts])

    def clip_from(self, every):
        """The global norm from the ranks' summed ``clip_partial``; the chunks scaled to it."""
        opt = self.opt
        total = SquareSum().add(every[:-2], 2 if every[-1] else 1 if every[-2] else 0)
        opt.grad_norm = math.sqrt(total.value())
        kernels = opt.params[0].kernels
        scale_to([(kernels, shard) for shard in self.shard], opt.grad_norm, opt.clip_grad_norm)

    def receive_average(self, kind, fields, results):
        """The reduce-scattered buckets of a step served while joined: this rank's chunks
        (of one bucket where each is agreed alone: ``fields["index"]``)."""
        if fields.get("agree_each"):
            lo, hi = self.chunks[fields["index"]]
            _into(self.shard[fields["index"]], results[lo:hi])
            return
        for flat, (lo, hi), shard in zip(results, self.chunks, self.shard):
            _into(shard, flat[lo:hi])

    def clip_joined(self):
        """Clipped already: the norm's allreduce was served with this rank's part."""

    def zero_grad(self):
        super().zero_grad()
        if self.scatter is not None:
            for p in self.opt.params:
                p.release_grad()

    def memory_bytes(self):
        held = super().memory_bytes()
        if self.scatter is not None:     # the shard, gradients not yet released, buckets
            held["gradients"] = (sum(int(s.nbytes) for s in self.shard)
                                 + sum(int(p.grad.nbytes) for p in self.opt.params
                                       if p.holds_grad)
                                 + sum(int(b.flat.nbytes) for b in self.scatter.buckets or ()
                                       if b.flat is not None))
        return held


def _into(target, values):
    """``values`` (a host array, maybe of the wire dtype) into ``target``, cast, reshaped."""
    values = np.asarray(values).reshape(target.shape)
    if values.dtype == target.dtype:
        np.copyto(target, values)
    elif values.size:
        np.copyto(target, values, casting="unsafe")
