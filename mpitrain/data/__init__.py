"""Datasets: IDX (MNIST, Fashion-MNIST), CIFAR-10 binary, synthetic; locating and fetching.

    ds = mt.data.load("fashion-mnist", "train")     # Dataset: .images (N, 1, 28, 28) float32,
                                                    # .labels (N,) int64, .classes, .name
    ds = mt.data.synthetic(1024, shape=(1, 28, 28), classes=10, seed=0)
    mt.data.locate("fashion-mnist")                 # -> Path, or DataError saying where to put it
    python -m mpitrain.data fetch fashion-mnist     # download + SHA-256 check (info NAME: where)
    mean, std = mt.data.channel_stats(ds); mt.data.standardize(ds, mean, std)   # per channel
    aug = mt.data.Augment(crop_padding=2, flip=True, seed=0, fill=ds.fill)
    x = aug(ds.images[idx], idx, epoch)             # crop + flip keyed by (seed, epoch, index)

No MPI here: every rank loads the full arrays itself (they are small) and the sampler shards
indices. All failures are DataError (a ValueError): one line naming the file and the problem.
"""
from mpitrain.data.augment import AUGMENTATIONS, Augment, default_crop_padding
from mpitrain.data.catalog import SPECS
from mpitrain.data.dataset import Dataset
from mpitrain.runtime.errors import DataError
from mpitrain.data.loader import load
from mpitrain.data.locate import locate
from mpitrain.data.normalize import NORMALIZATIONS, channel_stats, standardize
from mpitrain.data.sampler import DistributedSampler, shard
from mpitrain.data.synthetic import synthetic

NAMES = tuple(SPECS)

__all__ = ["Dataset", "DataError", "load", "synthetic", "locate", "NAMES", "DistributedSampler",
           "shard", "Augment", "AUGMENTATIONS", "default_crop_padding", "channel_stats",
           "standardize", "NORMALIZATIONS"]
