"""TextDataset under DistributedSampler: the ranks together read exactly the global batch.

For N = 1..4 ranks: every rank opens the same text file at the same moment (so they all build
the token cache concurrently: identical bytes, atomic renames, no temp file left), then trains
through two epochs of DistributedSampler batches. At each step the ranks' windows, gathered and
put back at their global positions (rank r holds positions r, r+N, ...), must equal what one
process reads for the whole global batch (a 1-replica sampler with batch N*b), token for token;
and every window must be the direct slice of the split's tokens at its start.
"""
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.data import DistributedSampler, TextDataset

mt.init()
N, R = mt.size(), mt.rank()
B = 3                       # windows per rank per step
T = 12                      # block_size
WINDOWS = 40


def _text():
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis",
             "nobler", "in", "mind", "suffer", "ünïcode", "—", "\n"]
    return " ".join(rng.choice(words, 3000).tolist())


@pytest.fixture(scope="module")
def corpus():
    folder = mt.broadcast_object(tempfile.mkdtemp(prefix="text-windows-") if R == 0 else None)
    path = Path(folder) / "corpus.txt"
    if R == 0:
        path.write_text(_text(), encoding="utf-8")
    mt.barrier()
    yield path
    mt.barrier()
    if R == 0:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("tokens", ["chars", "bytes"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_ranks_read_the_global_batch(corpus, tokens, split):
    mt.barrier()
    ds = TextDataset(corpus, split=split, block_size=T, tokens=tokens, seed=4, windows=WINDOWS)
    mt.barrier()
    assert not list(corpus.parent.rglob("*.part"))
    every = mt.allgather_object((ds.checksum, ds.vocab, ds.starts(np.arange(len(ds))).tolist()))
    assert all(e == every[0] for e in every)

    sampler = DistributedSampler(ds, seed=7, batch_size=B)
    one = DistributedSampler(len(ds), num_replicas=1, rank=0, seed=7, batch_size=N * B)
    tokens_of_split = np.asarray(ds.data, np.int64)                          # (n_split,)
    steps = 0
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        one.set_epoch(epoch)
        assert sampler.num_batches() == one.num_batches() >= 1
        for idx, whole in zip(sampler.batches(), one.indices()):
            x, y = ds.images[idx], ds.labels[idx]                            # (B, T) each
            starts = ds.starts(idx)                                          # (B,)
            for row, s in enumerate(starts):
                np.testing.assert_array_equal(x[row], tokens_of_split[s:s + T])
                np.testing.assert_array_equal(y[row], tokens_of_split[s + 1:s + T + 1])
            gathered = mt.allgather_object((idx, x, y))
            got_idx = np.empty(N * B, np.int64)
            got_x = np.empty((N * B, T), np.int64)
            got_y = np.empty((N * B, T), np.int64)
            for r, (i_r, x_r, y_r) in enumerate(gathered):
                got_idx[r::N], got_x[r::N], got_y[r::N] = i_r, x_r, y_r
            np.testing.assert_array_equal(got_idx, whole)
            np.testing.assert_array_equal(got_x, ds.images[whole])
            np.testing.assert_array_equal(got_y, ds.labels[whole])
            steps += 1
    assert steps == 2 * (WINDOWS // (N * B))
