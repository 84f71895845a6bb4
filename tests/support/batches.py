"""The sampler's global batches over as many epochs as a reference run needs (MPI oracles)."""
from mpitrain.data.sampler import DistributedSampler


def global_batches(n, batch, steps, seed):
    """The first ``steps`` global batches of ``batch`` samples out of ``n``, epoch after epoch,
    in DistributedSampler's seeded order (drop_last): int64 arrays of ``batch`` indices."""
    sampler = DistributedSampler(n, 1, 0, seed=seed, batch_size=batch)
    out, epoch = [], 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        out.extend(sampler.global_indices())
        epoch += 1
    return out[:steps]
