"""DistributedSampler: which sample indices rank r trains on, so that N never changes the math.

Each epoch has one global permutation of ``range(n)``, seeded by ``(seed, epoch)`` and identical on
every rank. It is cut into global batches of ``G = num_replicas * batch_size`` samples; rank r takes
the elements r, r+N, r+2N, ... of each global batch:

    permutation (epoch e):  p0 p1 p2 p3 p4 p5 p6 p7 | p8 p9 ...        N = 2, batch_size = 2, G = 4
    global batch 0:         p0 p1 p2 p3            rank 0: p0 p2       rank 1: p1 p3
    global batch 1:         p4 p5 p6 p7            rank 0: p4 p6       rank 1: p5 p7

So the *set* of samples in global batch t is ``perm[t*G:(t+1)*G]`` whatever N is: 2 ranks x 32 see
the same 64 samples at step t as 1 rank x 64, and averaged gradients give the same update.

Ragged tail: by default (``drop_last=True``) the last ``n % G`` samples of each epoch's permutation
are dropped, so every rank runs the same number of steps of exactly ``batch_size`` samples and every
sample is seen at most once per epoch (a different permutation next epoch drops different ones).
With ``drop_last=False`` the permutation is padded by wrapping around to its start up to a multiple
of G, so up to G-1 samples are seen twice in that epoch (PyTorch pads at most N-1 and gives the
last batch fewer samples; here every step of every rank has exactly ``batch_size`` samples, so
the global batch stays the same set for any N). That is right for training and wrong for
scoring a test set: evaluate with ``mt.data.shard`` / ``mt.evaluate``, which score every sample
exactly once.

Uneven tail: ``global_remainder()`` / ``remainder()`` give the samples ``drop_last=True`` drops
(fewer than G, strided over the ranks as above, so some ranks may get none): ``--uneven``
trains them as one last, smaller step of the epoch (the ranks with no share call ``mt.join``).

Agreement: when mpitrain is initialised, the constructor is collective (one small
``allgather_object``): the dataset length, ``batch_size``, ``num_replicas``, ``seed``, ``shuffle``
and ``drop_last`` must be the same on every rank, and with ``num_replicas == mt.size()`` the ranks
distinct. A difference would otherwise train silently with unequal weighting (different batch
sizes), on overlapping samples (different seeds), or hang at the epoch end (different step
counts); it is a CollectiveError on every rank instead.

``start`` (samples of this epoch's permutation already consumed, a multiple of nothing in
particular) lets a job resumed with a different N -- so a different G -- continue exactly where the
checkpointed job stopped: the first global batch after resuming is ``perm[start:start+G]``.
"""
import numpy as np


class DistributedSampler:
    """Per-rank sample indices for one epoch (PyTorch's arguments, plus ``batch_size``).

    dataset: a length (int) or anything with ``len()``.
    num_replicas, rank: the world and this rank's place in it (default: ``mt.size()``,
        ``mt.rank()``).
    shuffle: a seeded permutation per epoch (False: 0, 1, 2, ...); seed: its seed, the same on
        every rank.
    drop_last: True drops the last ``n % G`` samples of each epoch (G = num_replicas *
        batch_size); False pads the last global batch by wrapping around (see above).
    batch_size: samples per rank per step.
    ``set_epoch(e, start=0)`` before each epoch; ``num_batches()`` steps left in the epoch (the
    same on every rank); ``batches()`` yields this rank's int64 arrays of ``batch_size``;
    ``indices()`` is them as one (steps, batch_size) array; iterating yields the indices as
    ints, and ``len()`` counts them.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=True, batch_size=1):
        n, num_replicas, rank = _length_and_place(dataset, num_replicas, rank)
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} must be >= 1")
        if n < 0:
            raise ValueError(f"dataset length {n} must be >= 0")
        self.n = int(n)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.batch_size = int(batch_size)
        self.epoch = 0
        self.start = 0
        self._agree()

    def _agree(self):
        """Raise CollectiveError on every rank if the ranks describe different epochs."""
        from mpitrain import comm
        if not comm.is_initialized():
            return
        mine = {"dataset length": self.n, "batch_size": self.batch_size,
                "num_replicas": self.num_replicas, "seed": self.seed,
                "shuffle": bool(self.shuffle), "drop_last": bool(self.drop_last)}
        every = comm.allgather_object((mine, self.rank))
        problems = [f"{key} differs across ranks ("
                    + ", ".join(f"rank {r}: {d[key]}" for r, (d, _) in enumerate(every)) + ")"
                    for key in mine if len({d[key] for d, _ in every}) > 1]
        ranks = [r for _, r in every]
        if not problems and self.num_replicas == len(every) and len(set(ranks)) != len(ranks):
            problems.append(f"two ranks passed the same rank= (ranks given: {ranks})")
        if problems:
            raise comm.CollectiveError("DistributedSampler: " + "; ".join(problems))

    @property
    def global_batch(self):
        return self.num_replicas * self.batch_size

    def set_epoch(self, epoch, start=0):
        """Select epoch ``epoch``'s permutation, skipping its first ``start`` samples."""
        if not 0 <= start <= self.n:
            raise ValueError(f"start {start} is outside the dataset of {self.n} samples")
        self.epoch, self.start = int(epoch), int(start)

    def permutation(self, epoch=None):
        """The global order of epoch ``epoch`` (int64 (n,)), the same on every rank."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        rng = np.random.default_rng([self.seed, int(epoch)])
        return rng.permutation(self.n).astype(np.int64)  # (n,)

    def num_batches(self):
        """Steps left in this epoch (from ``start``); the same number on every rank."""
        left = self.n - self.start
        g = self.global_batch
        return left // g if self.drop_last else -(-left // g)

    def __len__(self):
        return self.num_batches() * self.batch_size

    def global_indices(self):
        """The remaining global batches of this epoch, int64 (steps, G)."""
        steps, g = self.num_batches(), self.global_batch
        order = self.permutation()[self.start:]  # (n - start,)
        if steps * g > len(order):  # drop_last=False: wrap around to pad the last batch
            order = np.resize(self.permutation(), self.start + steps * g)[self.start:]
        return order[: steps * g].reshape(steps, g)  # (steps, G)

    def indices(self):
        """This rank's indices for the rest of the epoch, int64 (steps, batch_size)."""
        return self.global_indices()[:, self.rank::self.num_replicas]  # (steps, b)

    def global_remainder(self):
        """The epoch's last, partial global batch (int64, fewer than G samples, maybe none):
        what ``drop_last=True`` leaves out of the rest of the epoch. Empty with drop_last=False,
        which pads it into a full batch instead."""
        if not self.drop_last:
            return np.zeros(0, np.int64)
        full = (self.n - self.start) // self.global_batch * self.global_batch
        return self.permutation()[self.start + full:]                     # (n - start - full,)

    def remainder(self):
        """This rank's share of ``global_remainder()``: its elements rank, rank+N, ... (between
        0 and batch_size samples; ranks past the remainder's end get none). Training it, with
        each rank's gradient weighted by its share, uses every sample of the epoch once
        (``python -m mpitrain --uneven``; ranks without a share call ``mt.join``)."""
        return self.global_remainder()[self.rank::self.num_replicas]

    def batches(self):
        yield from self.indices()

    def __iter__(self):
        return iter(self.indices().ravel().tolist())


def shard(dataset, num_replicas=None, rank=None):
    """This rank's share of a dataset for evaluation: indices rank, rank+N, ... (int64).

    Every sample belongs to exactly one rank -- no padding, no dropping -- so the ranks' shares
    differ in size by at most one, and sums over them (correct answers, losses, counts) add up
    to the whole dataset's. For training use DistributedSampler (equal steps on every rank).
    """
    n, num_replicas, rank = _length_and_place(dataset, num_replicas, rank)
    return np.arange(rank, int(n), num_replicas, dtype=np.int64)


def _length_and_place(dataset, num_replicas, rank):
    """(dataset length, replicas, this rank), the last two defaulting to mpitrain's world."""
    n = dataset if isinstance(dataset, (int, np.integer)) else len(dataset)
    if num_replicas is None or rank is None:
        from mpitrain import comm          # the only MPI here: who we are
        num_replicas = comm.size() if num_replicas is None else num_replicas
        rank = comm.rank() if rank is None else rank
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in a world of {num_replicas} replicas")
    return n, num_replicas, rank
