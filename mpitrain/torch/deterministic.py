"""Deterministic mode for torch: the same parameter and buffer bits for any power-of-two N.

    for step in range(steps):
        opt.zero_grad()
        for x, y in hvd.micro_shards(x_global, y_global, micro_shards=M, seed=0, step=step):
            loss_fn(model(x), y).backward()          # one micro-shard: one leaf of the tree
        opt.step()                                   # opt: DistributedOptimizer(...,
                                                     #   backward_passes_per_step=M // N,
                                                     #   deterministic=True)

The engine's mode (parallel/deterministic.py) on torch tensors. The global batch of G samples
(the same tensors on every rank) is cut into M micro-shards of G/M samples, M and N powers of
two; rank r runs the k = M/N micro-shards [r*k, (r+1)*k), one forward and backward each, so
every kernel sees the same shapes whatever N is. What makes the bits independent of N:

- gradients: each backward pass's gradients are one leaf of the engine's fixed binary tree
  over the M micro-shards (comm/tree.py; the engine's DeterministicGradients strategy, to
  which the optimizer's adapters hand each pass as a copy: ``DeterministicParameter``); the
  tree's root, the sum of the M leaves, is multiplied by 1/M (exact: a power of two), once.
  So ``p.grad`` holds the mean over the global batch of the micro-shards' mean losses' gradients
  -- do not scale the loss by 1/k;
- dropout: ``micro_shards`` seeds torch's generator from (seed, step, micro-shard) before each
  micro-batch (``micro_shard_seed``), so masks do not depend on which rank runs a micro-shard;
- BatchNorm (``torch.nn.BatchNorm1d/2d/3d`` in training mode, under autograd): each training
  forward records its micro-batch's mean and unbiased variance and leaves the running
  statistics as they were at the start of the step; ``step()`` gathers every rank's records
  (rank order = micro-shard order) and replays the M updates in order on every rank, as
  PyTorch makes them, one micro-batch after the other (``BatchNormReplay``). The running mean
  is PyTorch's own bits; PyTorch's CPU kernel rounds the variance's update from a float64
  statistic that is not kept, so the running variance may differ from one process running the
  M micro-batches in sequence in the last bit -- never between ranks or between values of N.

What the user sets (hvd.init's docstring): ``torch.use_deterministic_algorithms(True)`` and the
same, fixed torch thread count for every N (a reduction's blocking follows the thread count).
``check_arguments`` refuses what breaks the promise.
"""
import numbers
import weakref

import numpy as np
import torch

from mpitrain import comm
from mpitrain.torch.adapter import TorchParameter
from mpitrain.torch.compression import Compression

BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
IDLE = object()         # a LayerRecord's momentum outside a recording forward


def check_arguments(compression, op, gradient_predivide_factor, backward_passes_per_step,
                    process_set, sharding):
    """ValueError, before any MPI call, unless deterministic=True can keep its promise with
    these arguments. Every rank passes the same ones, so every rank raises the same error."""
    who = "DistributedOptimizer(deterministic=True)"
    if compression is not Compression.none:
        raise ValueError(f"{who} refuses compression={compression!r}: rounding to a wire "
                         f"format depends on which partial sums a rank sends; use "
                         f"Compression.none")
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"{who} refuses gradient_predivide_factor="
                         f"{gradient_predivide_factor!r}: the sum of the micro-shards is "
                         f"divided by their number once, after the fixed tree")
    if op is not comm.Average:
        raise ValueError(f"{who} refuses op={op!r}: it averages, over the M micro-shards "
                         f"(op=hvd.Average)")
    if sharding != "none":
        raise ValueError(f"{who} refuses sharding={sharding!r}: the torch front end's "
                         f"deterministic mode averages unsharded (sharding='none')")
    k = backward_passes_per_step
    if not is_count(k) or not comm.is_power_of_two(int(k)):
        raise ValueError(f"{who} needs backward_passes_per_step a power of two (1, 2, 4, ...), "
                         f"got {k!r}: M = N x backward_passes_per_step micro-shards are the "
                         f"leaves of one binary tree")
    size = process_set.size()
    if size and not comm.is_power_of_two(size):
        raise ValueError(f"{who} needs a power-of-two number of ranks (1, 2, 4, 8, ...), got "
                         f"{size}: the fixed reduction tree splits the micro-shards evenly in "
                         f"halves")


def is_count(value):
    """An integer >= 1 (a Python or NumPy one, not a bool)."""
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and int(value) >= 1)


class DeterministicParameter(TorchParameter):
    """A torch parameter as the engine's deterministic tree sees one: its size, a settable
    ``.grad`` (the tree points it at the sum, ``reduce``) and ``zero_grad`` (torch's default:
    the gradient is set to None, so the next backward pass writes a fresh one, exactly the
    pass's gradient, which the tree copies into its leaf when the pass ends)."""

    __slots__ = ()

    @property
    def size(self):
        return self.tensor.numel()

    @property
    def grad(self):
        return TorchParameter.grad.fget(self)

    @grad.setter
    def grad(self, array):
        tensor = self.tensor
        tensor.grad = torch.as_tensor(array, device=tensor.device).view(tensor.shape)

    def zero_grad(self):
        self.tensor.grad = None


def micro_shard_seed(seed, step, micro_shard):
    """The seed of torch's generator for micro-shard ``micro_shard`` of step ``step``: the same
    on every rank that runs it, for any N (NumPy's SeedSequence of the three, 63 bits)."""
    words = np.random.SeedSequence([int(seed), int(step), int(micro_shard)]).generate_state(
        2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def micro_shards(*tensors, micro_shards, seed=0, step=0, process_set=comm.global_process_set):
    """This rank's micro-batches of one step's global batch, in order.

    tensors: the step's global batch, the same on every rank, each with first dimension G
    (divisible by ``micro_shards`` M). M and the number of ranks N of ``process_set`` are
    powers of two, N <= M; rank r gets micro-shards r*M/N ... (r+1)*M/N - 1, each a tuple of
    views ``t[j*G/M:(j+1)*G/M]`` of the tensors. Before yielding micro-shard j it seeds torch's
    generator (``torch.manual_seed``) with ``micro_shard_seed(seed, step, j)``, so dropout masks
    (and any other draw of the pass) are those of micro-shard j whatever N is. ValueError (the
    same on every rank) for a bad count or shape."""
    m = micro_shards
    if not is_count(m) or not comm.is_power_of_two(int(m)):
        raise ValueError(f"micro_shards={m!r}: expected a power of two (1, 2, 4, ...)")
    if not tensors:
        raise ValueError("micro_shards() needs at least one tensor (the global batch)")
    for name, value in (("seed", seed), ("step", step)):
        if not (is_count(value) or (is_count(value + 1) and value == 0)):
            raise ValueError(f"micro_shards: {name}={value!r}: expected an integer >= 0")
    if process_set.included() is False:
        raise ValueError(f"micro_shards: this rank is not in process set {process_set!r}")
    n, rank = process_set.size(), process_set.rank()
    if not comm.is_power_of_two(n) or n > m:
        raise ValueError(f"micro_shards={m} over {n} ranks: the number of ranks must be a "
                         f"power of two, at most the number of micro-shards")
    sizes = {int(t.shape[0]) if len(t.shape) else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"micro_shards: every tensor needs the same first dimension (the "
                         f"global batch), got {[tuple(t.shape) for t in tensors]}")
    g = sizes.pop()
    if g % m:
        raise ValueError(f"micro_shards: a global batch of {g} samples does not split into "
                         f"{m} micro-shards of equal size")
    m = int(m)
    return _micro_batches(tensors, m, g // m, m // n, rank, int(seed), int(step))


def _micro_batches(tensors, m, b, k, rank, seed, step):
    for j in range(rank * k, (rank + 1) * k):
        torch.manual_seed(micro_shard_seed(seed, step, j))
        yield tuple(t[j * b:(j + 1) * b] for t in tensors)


class LayerRecord:
    """One BatchNorm layer within a step: its running statistics at the step's start and the
    statistics of each micro-batch it normalised since."""

    def __init__(self, module):
        self.module = module
        self.mean = module.running_mean.detach().clone()
        self.var = module.running_var.detach().clone()
        nbt = module.num_batches_tracked
        self.tracked = None if nbt is None else nbt.detach().clone()
        self.rows = []
        self.momentum = IDLE        # the module's own (None too), during a recording forward
        self.buffers = None         # its running buffers, aside during a recording forward

    def put_back(self):
        """The running buffers back in place of a recording forward's stand-ins."""
        if self.buffers is not None:
            self.module.running_mean, self.module.running_var = self.buffers
            self.buffers = None

    def restore(self):
        m = self.module
        with torch.no_grad():
            m.running_mean.copy_(self.mean)
            m.running_var.copy_(self.var)
            if self.tracked is not None:
                m.num_batches_tracked.copy_(self.tracked)


class BatchNormReplay:
    """BatchNorm running statistics in micro-shard order for one deterministic optimizer.

    The recorder's hooks (``Recorder``) call ``begin(module)`` before a training forward of a
    BatchNorm layer this optimizer owns (its weight is one of the optimizer's parameters, or it
    has none) and ``end(module)`` after it. ``begin`` keeps the statistics of the step's start
    the first time and makes the forward write the micro-batch's own statistics into zeroed
    stand-ins for the running buffers (momentum 1: running = 1 x batch statistic + 0 x 0);
    ``end`` keeps those and puts the buffers back, so between the passes the layer holds the
    running statistics of the previous step. ``end_step()`` (collective over the process
    set, in ``step()``): every rank's records are gathered, rank order being micro-shard
    order, and every layer replays the M updates in order as PyTorch's ``batch_norm`` makes
    them (running = momentum x batch + (1 - momentum) x running, in the buffers' dtype;
    momentum None: 1 / num_batches_tracked), and ``num_batches_tracked`` grows by M.
    """

    def __init__(self, params, process_set, passes):
        self.ids = {id(p) for p in params}
        self.process_set = process_set
        self.passes = passes
        self.layers = {}            # module -> LayerRecord, in first-forward order
        self.ever = False           # a BatchNorm was recorded once: every step gathers then

    def owns(self, module):
        weight = module.weight
        return weight is None or id(weight) in self.ids

    def begin(self, module):
        record = self.layers.get(module)
        if record is None:
            record = self.layers[module] = LayerRecord(module)
        self.ever = True
        record.momentum = module.momentum
        module.momentum = 1.0
        # zeroed stand-ins: the buffers themselves are not written (autograd may have saved
        # them for an earlier pass's backward)
        record.buffers = (module.running_mean, module.running_var)
        module.running_mean = torch.zeros_like(record.buffers[0])
        module.running_var = torch.zeros_like(record.buffers[1])

    def end(self, module):
        record = self.layers.get(module)
        if record is None or record.momentum is IDLE:
            return
        module.momentum, record.momentum = record.momentum, IDLE
        record.rows.append(torch.cat([module.running_mean.detach(),
                                      module.running_var.detach()]).cpu().double().numpy())
        record.put_back()
        if record.tracked is not None:
            with torch.no_grad():
                module.num_batches_tracked.copy_(record.tracked)

    def drop(self):
        """Forget this step's records (zero_grad, a failed step): every layer keeps the
        running statistics of the step's start."""
        for record in self.layers.values():
            if record.momentum is not IDLE:          # a forward that raised
                record.module.momentum, record.momentum = record.momentum, IDLE
            record.put_back()
            record.restore()
        self.layers = {}

    def end_step(self):
        """Collective: replay every rank's records in micro-shard order (see the class)."""
        if not self.ever:
            return
        records = list(self.layers.values())
        self.layers = {}
        k = self.passes
        counts = sorted({len(r.rows) for r in records})
        width = sum(2 * r.module.num_features for r in records)
        problem = 0 if counts in ([], [k]) else 1
        header = np.array([[problem, width, len(records)]], np.int64)
        every = comm.allgather(header, process_set=self.process_set)
        if every[:, 0].any() or len({(int(w), int(n)) for _, w, n in every}) != 1:
            bad = [int(i) for i, row in enumerate(every) if row[0]]
            for r in records:
                r.restore()
            raise ValueError(
                f"deterministic=True: the BatchNorm layers' training forwards differ from one "
                f"per backward pass ({k} per step) on rank(s) {bad}, or the ranks ran "
                f"different BatchNorm layers ({[tuple(map(int, row[1:])) for row in every]} "
                f"(features x 2, layers) per rank); the running statistics keep the step's "
                f"start")
        if not records:
            return
        mine = np.stack([np.concatenate([r.rows[i] for r in records]) for i in range(k)])
        rows = comm.allgather(mine, process_set=self.process_set)       # (M, width)
        off = 0
        for r in records:
            c = r.module.num_features
            self.replay(r, rows[:, off:off + 2 * c])
            off += 2 * c

    @staticmethod
    def replay(record, rows):
        m = record.module
        record.restore()
        mean, var = m.running_mean, m.running_var
        c = m.num_features
        with torch.no_grad():
            stats = torch.from_numpy(np.ascontiguousarray(rows)).to(device=mean.device,
                                                                    dtype=mean.dtype)
            tracked = m.num_batches_tracked
            for row in stats:
                if tracked is not None:
                    tracked.add_(1)
                if m.momentum is None:
                    factor = 1.0 / float(tracked) if tracked is not None else 0.0
                else:
                    factor = m.momentum
                mean.copy_(factor * row[:c] + (1 - factor) * mean)
                var.copy_(factor * row[c:] + (1 - factor) * var)


class Recorder:
    """The process's two module hooks (installed with the first deterministic optimizer): a
    BatchNorm layer's training forward under autograd goes to the replay of the live
    deterministic optimizer that owns it; every other module call returns at once."""

    def __init__(self):
        self.replays = weakref.WeakSet()
        self.handles = None

    def add(self, replay):
        self.replays.add(replay)
        if self.handles is None:
            module = torch.nn.modules.module
            self.handles = (module.register_module_forward_pre_hook(self.before),
                            module.register_module_forward_hook(self.after, always_call=True))

    def owner(self, module):
        if (not isinstance(module, BATCH_NORMS) or not module.training
                or not module.track_running_stats or module.running_mean is None
                or module.running_var is None or not torch.is_grad_enabled()):
            return None
        return next((r for r in self.replays if r.owns(module)), None)

    def before(self, module, args):
        replay = self.owner(module)
        if replay is not None:
            replay.begin(module)

    def after(self, module, args, output):
        if isinstance(module, BATCH_NORMS):
            for replay in self.replays:
                replay.end(module)


RECORDER = Recorder()


def batchnorm_replay(params, process_set, passes):
    """A BatchNormReplay for a deterministic optimizer's parameters, its hooks installed."""
    replay = BatchNormReplay(params, process_set, passes)
    RECORDER.add(replay)
    return replay
