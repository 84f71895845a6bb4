"""Datasets: IDX (MNIST, Fashion-MNIST), CIFAR-10 binary, your .npz/.npy, synthetic, text.

    ds = mt.data.load("fashion-mnist", "train")     # Dataset: .images (N, 1, 28, 28) float32,
                                                    # .labels (N,) int64, .classes, .name
    ds = mt.data.synthetic(1024, shape=(1, 28, 28), classes=10, seed=0)
    mt.data.locate("fashion-mnist")                 # -> Path, or DataError saying where to put it
    python -m mpitrain.data fetch fashion-mnist     # download + SHA-256 check (info NAME: where)
    mean, std = mt.data.channel_stats(ds); mt.data.standardize(ds, mean, std)   # per channel
    aug = mt.data.Augment(crop_padding=2, flip=True, seed=0, fill=ds.fill)
    x = aug(ds.images[idx], idx, epoch)             # crop + flip keyed by (seed, epoch, index)
    train, test = mt.data.load_npz("mine.npz")      # x float32 (N, ...), y int (N,): memmapped
    ds = mt.data.TextDataset("input.txt", block_size=64)   # next-token windows:
    x, y = ds.images[idx], ds.labels[idx]           # int64 (len(idx), 64), y = x shifted by one
    python -m mpitrain.data fetch tiny-shakespeare  # then TextDataset("tiny-shakespeare")

No MPI here: every rank loads the named datasets' arrays itself (they are small), memory-maps
.npz/.npy files and token caches (each rank touches only what it reads), and the sampler shards
indices. All failures are DataError (a ValueError): one line naming the file and the problem.
"""
from mpitrain.data.augment import AUGMENTATIONS, Augment, default_crop_padding
from mpitrain.data.catalog import SPECS, TEXTS
from mpitrain.data.dataset import Dataset
from mpitrain.runtime.errors import DataError
from mpitrain.data.loader import load
from mpitrain.data.locate import locate
from mpitrain.data.normalize import NORMALIZATIONS, channel_stats, standardize
from mpitrain.data.npz import load_npz
from mpitrain.data.sampler import DistributedSampler, shard
from mpitrain.data.synthetic import synthetic
from mpitrain.data.text import TOKENIZATIONS, TextDataset, locate_text

NAMES = tuple(SPECS)
TEXT_NAMES = tuple(TEXTS)

__all__ = ["Dataset", "DataError", "load", "synthetic", "locate", "NAMES", "DistributedSampler",
           "shard", "Augment", "AUGMENTATIONS", "default_crop_padding", "channel_stats",
           "standardize", "NORMALIZATIONS", "load_npz", "TextDataset", "TOKENIZATIONS",
           "TEXT_NAMES", "locate_text"]
