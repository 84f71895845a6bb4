"""StepPlan: how each optimizer step reads this rank's samples. The training loop's modes live
here, so ``Trainer.train_step`` runs any step the same way and names none of them:

    plain         one pass over this rank's share of the global batch
    accumulate    --accumulate k: k consecutive micro-batches of --batch-size, the loss gradient
                  x 1/k (DistributedOptimizer averages their sum once, during the k-th pass)
    uneven tail   --uneven: the epoch's partial last global batch of T samples is one more step;
                  each rank's gradient is weighted by ranks x share / T (the average over ranks
                  is then the mean over the T samples), a rank with no share makes no pass, and
                  afterwards every rank waits in ``mt.join`` and takes the model and optimizer
                  state of the rank join returns, so the replicas are one model again (sharded:
                  a rank in join steps its share, so every rank holds the model already; only
                  the BatchNorm statistics come from that rank)
    micro-shards  --deterministic (MicroShardPlan): rank r takes the contiguous slice of M/N
                  micro-shards, one pass each with the loss gradient x 1/M; dropout is keyed by
                  micro-shard, BatchNorm running statistics are replayed in micro-shard order and
                  the metric sums added in micro-shard order: nothing depends on N.

``DistributedSampler`` gives rank r the elements r, r+N, ... of each global batch of a seeded
per-epoch permutation, so global batch t is the same sample set for any N.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpitrain import comm
from mpitrain.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpitrain.parallel.deterministic import BatchNormReplay, ShardSums, seed_dropout
from mpitrain.timeline import current as current_timeline


@dataclass
class Step:
    """One optimizer step: this rank's samples ``idx`` (b,), read in ``passes`` micro-batches
    whose loss gradient is scaled by ``weight``; ``samples`` of the global batch it consumes;
    ``joins``: the ranks meet in ``mt.join`` after it (the uneven tail)."""
    idx: np.ndarray
    passes: int
    weight: float
    samples: int
    joins: bool = False

    def micro_batches(self):
        """(passes, b / passes) sample indices, or none for a rank with no share."""
        return self.idx.reshape(self.passes, -1) if len(self.idx) else ()


class Steps(Sequence):
    """The steps of the rest of an epoch, each made when it is taken: an epoch of millions of
    steps (a large text corpus) is one index array, not one object per step, whatever
    --steps leaves of it. ``shares``: this rank's samples of each step, (steps, b); ``make``
    builds a step from its row; ``last``: the --uneven tail's Step, or None."""

    def __init__(self, shares, make, last=None):
        self.shares, self.make, self.last = shares, make, last

    def __len__(self):
        return len(self.shares) + (self.last is not None)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"step {i} of {n}")
        i %= n
        return self.make(self.shares[i]) if i < len(self.shares) else self.last


class Sums:
    """(loss x samples, correct, samples) added up since the last ``total()``, over every rank."""

    def __init__(self):
        self.local = np.zeros(3)

    def add(self, rows):
        """One step's rows, (passes, 3): added in pass order, then to the running sums."""
        self.local += np.sum(np.asarray(rows, np.float64).reshape(-1, 3), axis=0)

    def total(self):
        sums = comm.allreduce(self.local, op=comm.Sum)
        self.local = np.zeros(3)
        return sums


class StepPlan:
    """Plain steps, --accumulate and the --uneven tail (see the module docstring)."""

    def __init__(self, config, sampler, size, rank):
        self.config, self.sampler, self.size, self.rank = config, sampler, size, rank
        self.passes = config.accumulate
        self.weight = 1.0 / self.passes
        self.global_batch = sampler.global_batch

    def steps(self):
        """This rank's steps over the rest of the sampler's epoch (a Steps sequence)."""
        tail = self.sampler.global_remainder() if self.config.uneven else ()
        last = None
        if len(tail):
            idx = self.sampler.remainder()                  # (0 to b,): this rank's share
            last = Step(idx, 1, self.size * len(idx) / len(tail), len(tail), joins=True)
        return Steps(self.shares(), lambda idx: Step(idx, self.passes, self.weight,
                                                      self.global_batch), last)

    def shares(self):
        """This rank's samples of each remaining global batch of the epoch, (steps, G/N)."""
        return self.sampler.indices()

    def sums(self):
        return Sums()

    def before_step(self):
        pass

    def before_pass(self, model, step, j):
        pass

    def after_pass(self):
        pass

    def after_step(self, step, model, optimizer):
        """After the optimizer's step: an uneven tail ends in ``mt.join``, then every rank takes
        the state of the rank that joined last -- one that stepped."""
        if step.joins:
            with current_timeline().span("join"):
                last = comm.join(optimizers=[optimizer])
                if optimizer.sharding != "none":    # one model already: its share stepped
                    broadcast_parameters(dict(model.named_buffers()), root_rank=last)
                    return
                broadcast_parameters(model.state_dict(), root_rank=last)
                broadcast_optimizer_state(optimizer, root_rank=last)

    def agree_on_buffers(self, model):
        """Per-rank BatchNorm leaves N sets of running statistics, each from its rank's samples;
        before the model is evaluated or written every rank takes their mean (one small
        allreduce), so the ranks hold one model. SyncBatchNorm's are equal already."""
        buffers = model.buffers()
        if self.size > 1 and buffers and not self.config.sync_bn:
            comm.grouped_allreduce_(buffers, op=comm.Average, name="Trainer.buffers")


class MicroShardPlan(StepPlan):
    """--deterministic: M micro-shards per global batch, M/N contiguous ones per rank."""

    def __init__(self, config, sampler, size, rank, model):
        super().__init__(config, sampler, size, rank)
        self.micro_shards = config.micro_shards
        self.passes = self.micro_shards // size
        self.weight = 1.0 / self.micro_shards
        self.bn_replay = BatchNormReplay(model)    # running statistics in micro-shard order

    def shares(self):
        """The contiguous slice [r*G/N, (r+1)*G/N) of each global batch: micro-shards r*M/N ..
        (r+1)*M/N - 1, in order."""
        share = self.global_batch // self.size
        return self.sampler.global_indices()[:, self.rank * share:(self.rank + 1) * share]

    def sums(self):
        """Sums in micro-shard order: the same numbers for any N."""
        return ShardSums()

    def before_step(self):
        self.bn_replay.begin_step()

    def before_pass(self, model, step, j):
        # dropout masks keyed by micro-shard, not by rank
        seed_dropout(model, step, self.rank * self.passes + j, self.micro_shards)

    def after_pass(self):
        self.bn_replay.after_pass()

    def after_step(self, step, model, optimizer):
        self.bn_replay.end_step(comm.allgather)

    def agree_on_buffers(self, model):
        """Equal already (replayed in micro-shard order); a mean of N equal values need not give
        their bits back."""


def make_plan(config, sampler, size, rank, model):
    if config.deterministic:
        return MicroShardPlan(config, sampler, size, rank, model)
    return StepPlan(config, sampler, size, rank)
