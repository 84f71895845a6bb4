"""Deterministic mode: the same parameter bits for any power-of-two number of ranks.

``DistributedOptimizer(..., deterministic=True)`` and ``python -m mpitrain --deterministic``.
The global batch of G samples is cut into M micro-shards of G/M samples (M a power of two,
``--micro-shards``, default 8), and every forward/backward pass runs on exactly one micro-shard,
so every GEMM has the same shape whatever N is. Rank r owns the contiguous micro-shards
[r*M/N, (r+1)*M/N) and runs k = M/N passes per step. Each pass's gradients are one *leaf*; the
leaves are summed in one fixed binary tree over the M micro-shards (comm/tree.py): each rank
adds its own leaves pairwise as they come (``PairwiseSum``), then the ranks combine their
subtree sums level by level (``tree_allreduce``, recursive halving/doubling). So N = 1, 2, 4, 8
perform the same float additions on the same operands, and the parameters after any number of
steps are bitwise identical::

    M = 8, pass j of step t on micro-shard j:  leaf g_j = d loss(micro-shard j) / d w
    N = 1: one rank, 8 passes    ((g0+g1)+(g2+g3)) + ((g4+g5)+(g6+g7))
    N = 2: rank 0 g0..g3, rank 1 g4..g7, each its half of the line above, then one level across
    N = 4: rank r g2r, g2r+1, then two levels across ranks

Scaling is exact when it is by a power of two (no overflow, no subnormal results), which is why
``op=mt.Average`` (a multiply by 1/N after the tree) and a loss scaled by 1/k may be used; the
CLI scales the loss gradient by 1/M, a factor that does not depend on N, and sums (``op=Sum``),
so even subnormal gradients round the same way for every N.

What a step costs over the default mode: M/N passes on smaller batches instead of one (smaller
GEMMs, each writing a whole weight gradient), about one vector addition per pass (no copy:
``.grad`` is a view into the pass's leaf buffer), and the tree allreduce (2 log2 N messages,
the ring's volume), which runs in ``step()``, after the last pass: no overlap with backward.
docs/benchmarks.md has the measured cost.

This file owns the mode: ``DeterministicGradients`` (the strategy DistributedOptimizer picks for
``deterministic=True``), ``check_arguments`` (what it refuses: N not a power of two, ...),
``GradientTree`` (the leaves of one step and their sum across ranks), ``seed_dropout`` (masks
keyed by step and micro-shard, not by rank), ``BatchNormReplay`` (running statistics updated in
micro-shard order) and ``ShardSums`` (metric sums in micro-shard order).
"""
import time

import numpy as np

from mpitrain import comm
from mpitrain import kernels as _kernels
from mpitrain.timeline import current as current_timeline
from mpitrain.nn.batchnorm import BatchNormBase
from mpitrain.nn.layers import Dropout
from mpitrain.parallel.gradients import Compression
from mpitrain.parallel.strategy import Strategy


def check_arguments(average, compression, predivide, passes, process_set):
    """ValueError (the same on every rank: every input is the same there) unless
    deterministic=True can keep its promise with these arguments."""
    if average != "gradients":
        raise ValueError(f"deterministic=True averages gradients in a fixed tree; "
                         f"average={average!r} is not supported")
    if compression is not Compression.none:
        raise ValueError(f"deterministic=True refuses compression={compression!r}: rounding "
                         f"to a wire format depends on which partial sums a rank sends")
    if predivide != 1.0:
        raise ValueError(f"deterministic=True refuses gradient_predivide_factor="
                         f"{predivide!r} (only exact power-of-two scaling keeps the bits)")
    if passes & (passes - 1):
        raise ValueError(f"deterministic=True needs backward_passes_per_step a power of two, "
                         f"got {passes} (the micro-shards are the leaves of a binary tree)")
    size = process_set.size()
    if size is not None and not comm.is_power_of_two(size):
        raise ValueError(f"deterministic=True needs a power-of-two number of ranks (1, 2, 4, 8, "
                         f"...), got {size}: the fixed reduction tree splits the micro-shards "
                         f"evenly in halves")


class DeterministicGradients(Strategy):
    """``deterministic=True``: each backward pass's gradients are one leaf of the fixed tree;
    ``synchronize()`` agrees on the step, sums the tree across ranks and scales (Average: 1/N,
    exact). No overlap with backward, no ``no_sync()``."""

    def __init__(self, opt):
        super().__init__(opt)
        self.tree = GradientTree(opt.params)

    def hook(self, params):
        super().hook(params)
        self.tree.report(params)      # keep each pass as a leaf

    def no_sync(self):
        raise RuntimeError("no_sync() with deterministic=True: every backward pass is one "
                           "leaf of the fixed tree; use backward_passes_per_step instead")

    def zero_grad(self):
        super().zero_grad()
        self.tree.reset()

    def synchronize(self, flags=None):
        opt, tree, k = self.opt, self.tree, self.opt.backward_passes_per_step
        if tree.passes == 0 and k == 1 and self.passes.passes() == 0:
            tree.add_current()             # no hook: the gradients in .grad are the one leaf
        error = tree.partial() or self.passes.error()
        if error is None and tree.passes != k:
            error = (f"step() after {tree.passes} backward passes; deterministic=True with "
                     f"backward_passes_per_step={k} takes exactly {k} per step")
        size = comm.group_size(opt.process_set)
        start = time.perf_counter()
        # the first MPI call of the step, as for every collective: a wrong count anywhere is an
        # error on every rank (its leaves dropped too), and a rank in mt.join() is refused,
        # never left waiting
        agreed, _ = self.agree("DistributedOptimizer.deterministic",
                               {"backward_passes_per_step": k, "elements": tree.elements,
                                "dtype": str(tree.dtype)}, error, flags=flags)
        self.passes.reset()
        scale = 1.0 / size if opt.op is comm.Average else 1.0
        with current_timeline().span("synchronize", cat="comm"):
            tree.reduce(opt.process_set, size, scale)
        opt.comm_time_s += time.perf_counter() - start
        self.synchronized = True
        return agreed


class GradientTree:
    """The leaves of one optimizer step (one per backward pass) and their sum over the ranks.

    params: the optimizer's Parameters (one dtype). Zero-copy: after ``reset()`` (the
    optimizer's ``zero_grad``) every ``.grad`` is a view into one flat leaf buffer, zeroed
    lazily, so backward writes the pass's gradients straight into the leaf. ``report(params)``
    (from the backward hook) counts parameter gradients done in the current pass; when every
    parameter was reported the pass is complete: its buffer joins the tree (added pairwise at
    once) and ``.grad`` moves to a fresh leaf buffer. ``add_current()`` does the same without the
    hook (one pass; a copy when ``.grad`` is not the views, e.g. no ``zero_grad`` before it).
    ``reduce(comm, scale)`` sums the leaves over ``comm`` in the fixed tree, multiplies by
    ``scale`` and leaves every ``.grad`` a view of the result.
    """

    def __init__(self, params):
        self.params = list(params)
        dtypes = {np.dtype(p.dtype) for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"deterministic=True needs parameters of one dtype, got "
                             f"{sorted(str(d) for d in dtypes)}")
        self.kernels = self.params[0].kernels if self.params else _kernels.get("cpu")
        self.dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        self.sizes = [int(p.size) for p in self.params]
        self.elements = sum(self.sizes)
        self._ids = {id(p) for p in self.params}
        self._reported = set()
        k = self.kernels
        self.leaves = comm.PairwiseSum(lambda: k.empty((self.elements,), self.dtype), self._pack,
                                  k.add)
        self._current = None        # (buffer, views): the leaf .grad writes into now
        self._granted = None        # the last result, which .grad views until the next pass
        self._host = None           # the root on the host (a device backend) and the scratch
        self._scratch = None

    @property
    def passes(self):
        return self.leaves.count

    def _views(self, buf):
        views, off = [], 0
        for p, n in zip(self.params, self.sizes):
            views.append(buf[off:off + n].reshape(p.shape))
            off += n
        return views

    def _begin_pass(self):
        """Point every ``.grad`` at a fresh leaf buffer, zeroed lazily (layers overwrite it)."""
        if self._granted is not None:          # .grad moves off it now: free to reuse
            self.leaves.release(self._granted)
            self._granted = None
        buf = self.leaves.spare()
        views = self._views(buf)
        for p, v in zip(self.params, views):
            p.grad = v
            p.zero_grad()
        self._current = (buf, views)

    def report(self, params):
        """Count ``params`` as done for this pass; on the last one, take the pass as a leaf."""
        for p in params:
            if id(p) in self._ids:
                self._reported.add(id(p))
        if len(self._reported) == len(self.params):
            self.add_current()

    def add_current(self):
        """The gradients of the pass just done become the next leaf; ``.grad`` moves on."""
        current, self._current = self._current, None
        if current is not None and all(p.grad is v for p, v in zip(self.params, current[1])):
            self.leaves.push(current[0])
        else:                                  # .grad is not (all) ours: copy it in
            if current is not None:
                self.leaves.release(current[0])
            self.leaves.add(self.params)
        self._reported.clear()
        self._begin_pass()

    def partial(self):
        """Why the current pass is incomplete (some parameters reported, not all), or None."""
        if not self._reported:
            return None
        return (f"a backward pass reported {len(self._reported)} of {len(self.params)} "
                f"parameters to backward_hook before step(); deterministic=True needs every "
                f"parameter's gradient from every pass")

    def _pack(self, buf, params):
        for v, p in zip(self._views(buf), params):
            self.kernels.copy(v, p.grad)

    def reduce(self, process_set, size, scale):
        """Sum the leaves over the ``size`` ranks of ``process_set`` (the fixed tree), times
        ``scale``; every ``.grad`` is then a view of the sum. The number of leaves must be a
        power of two (the caller checks it on every rank)."""
        root = self.leaves.take()
        k = self.kernels
        host = root
        if k.name != "cpu":            # MPI reads host memory: stage the one vector
            host = self._host if self._host is not None else np.empty(self.elements, self.dtype)
            self._host = host
            host[...] = k.to_host(root)
        if size > 1:
            if self._scratch is None:
                self._scratch = np.empty(max(1, (self.elements + 1) // 2), self.dtype)
            comm.tree_allreduce_(host, _kernels.get("cpu").add, self._scratch, process_set)
        if host is not root:
            k.copy(root, k.to_device(host))
        if scale != 1.0:
            k.scale(root, scale)
        for p, v in zip(self.params, self._views(root)):
            p.grad = v                  # the optimizer reads the sum where it lies
        self._drop_current()
        if self._granted is not None:
            self.leaves.release(self._granted)
        self._granted = root

    def reset(self):
        """Drop this step's leaves (``zero_grad``, an error) and start the next pass."""
        self.leaves.reset()
        self._drop_current()
        self._begin_pass()

    def _drop_current(self):
        """Give the current pass's buffer back unused and forget its reports."""
        if self._current is not None:
            self.leaves.release(self._current[0])
            self._current = None
        self._reported.clear()


def seed_dropout(model, step, micro_shard, micro_shards):
    """Key every Dropout mask of the next pass by (step, micro-shard), not by how many passes
    this rank ran: the mask of micro-shard j at step t is then the same on every N (and after
    a resume)."""
    for layer in model.modules():
        if isinstance(layer, Dropout):
            layer.calls = step * micro_shards + micro_shard


class BatchNormReplay:
    """BatchNorm's running statistics in micro-shard order, whatever N.

    A training forward normalises by its own micro-shard's statistics (N-independent) and moves
    the running mean and variance by them: one rank running all M micro-shards moves them M
    times in order, while N ranks would each move their own copy k times. So: ``begin_step``
    keeps the running statistics, ``after_pass`` records each layer's batch sums of the pass,
    and ``end_step(allgather)`` gathers every rank's sums (rank order = micro-shard order),
    restores the kept statistics and replays the M updates in micro-shard order on every rank
    -- the same updates one rank makes, bit for bit. One small allgather per step; nothing for
    a model without BatchNorm.
    """

    def __init__(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, BatchNormBase)]
        self.kept, self.rows = [], []

    def begin_step(self):
        if self.layers:
            k = self.layers[0].kernels
            self.kept = [(np.array(k.to_host(m.running_mean)), np.array(k.to_host(m.running_var)))
                         for m in self.layers]
            self.rows = []

    def after_pass(self):
        if self.layers:
            self.rows.append(np.concatenate([m.batch_sums() for m in self.layers]))

    def end_step(self, allgather):
        if not self.layers:
            return
        every = allgather(np.stack(self.rows))                  # (M, sum of 2C+1)
        for m, (mean, var) in zip(self.layers, self.kept):
            m.kernels.copy(m.running_mean, m.kernels.to_device(mean))
            m.kernels.copy(m.running_var, m.kernels.to_device(var))
        for row in every:
            off = 0
            for m in self.layers:
                n = 2 * m.num_features + 1
                m.update_running(row[off:off + n])
                off += n
        self.rows = []


class ShardSums:
    """Metric sums (loss x samples, correct, samples) per micro-shard, added in micro-shard
    order over every rank: the records of a deterministic run are the same numbers for any N.

    ``add(rows)``: this rank's (k, 3) rows of one step, in micro-shard order. ``total(
    allgather)``: every rank's rows, gathered in rank order (= micro-shard order), summed in
    one fixed order; clears the rows. allgather: concatenates axis 0 (default ``mt.allgather``).
    """

    def __init__(self):
        self.rows = []

    def add(self, rows):
        self.rows.append(np.asarray(rows, np.float64).reshape(-1, 3))       # (k, 3)

    def total(self, allgather=comm.allgather):
        # (k, steps, 3) per rank -> (M, steps, 3): micro-shard-major, the same array for any N
        mine = (np.stack(self.rows, axis=1) if self.rows else np.zeros((0, 0, 3)))
        every = allgather(np.ascontiguousarray(mine))
        self.rows = []
        total = np.zeros(3)
        for step in range(every.shape[1]):
            for shard in range(every.shape[0]):
                total += every[shard, step]
        return total
