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
of G, so a few samples are seen twice in that epoch.

``start`` (samples of this epoch's permutation already consumed, a multiple of nothing in
particular) lets a job resumed with a different N -- so a different G -- continue exactly where the
checkpointed job stopped: the first global batch after resuming is ``perm[start:start+G]``.
"""
import numpy as np


class DistributedSampler:
    """Per-rank sample indices for one epoch.

    dataset: a length (int) or anything with ``len()``; num_replicas/rank default to the
    mpitrain world. Iterating yields this rank's sample indices (ints) in training order;
    ``batches()`` yields them as int64 arrays of ``batch_size``.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=True, batch_size=1):
        n = dataset if isinstance(dataset, (int, np.integer)) else len(dataset)
        if num_replicas is None or rank is None:
            import mpitrain as mt
            num_replicas = mt.size() if num_replicas is None else num_replicas
            rank = mt.rank() if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in a world of {num_replicas} replicas")
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

    def batches(self):
        yield from self.indices()

    def __iter__(self):
        return iter(self.indices().ravel().tolist())
