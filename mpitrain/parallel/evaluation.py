"""Distributed evaluation: every test sample scored exactly once, the counts summed across ranks.

Horovod's MNIST example scores a DistributedSampler's shard on each rank and averages the ranks'
accuracies. That sampler pads or drops (at N=3 and 10,000 samples: 9,999 or 10,002 scored), and
an average of per-rank accuracies weighs unequal shards equally. Here rank r scores samples r,
r+N, ... (``mt.data.shard``: no padding, no dropping) and the ranks add up correct answers,
losses and sample counts in one allreduce, so the accuracy is the whole test set's, for any N.

The ranks evaluate one model only if they hold one. Parameters stay equal under
DistributedOptimizer, but plain BatchNorm keeps each rank's running statistics of its own samples,
and rank r would score its share with rank r's statistics. So ``evaluate`` first compares them:
one allreduce (Max) of every such buffer and its negation, which gives every rank the elementwise
largest and smallest value across ranks (small: two numbers per channel; SyncBatchNorm's are
equal by construction and left out). Where they differ, rank 0 prints one warning line naming
the first differing buffer and its largest spread, and how to make them agree.
"""
import sys

import numpy as np

from mpitrain import comm
from mpitrain.data.sampler import shard
from mpitrain.nn.batchnorm import BatchNormBase
from mpitrain.nn.loss import SoftmaxCrossEntropy
from mpitrain.nn.sync_batchnorm import SyncBatchNorm


def evaluate(model, dataset, batch_size=1000, loss_fn=None):
    """Accuracy and mean loss of ``model`` on all of ``dataset`` (``.images``, ``.labels``),
    per label: per sample for a classifier, per token for text windows (labels (N, T)).

    Collective: every rank calls it and gets the same dict ``{"accuracy", "loss", "correct",
    "total"}``. Batches go to the model's backend and are reshaped to ``model.input_shape``
    where the model has one; the model runs in eval mode and is put back in its previous mode.
    Plain BatchNorm running statistics that differ across ranks get one warning line (rank 0,
    stderr; see ``check_batchnorm_statistics``).
    loss_fn: a SoftmaxCrossEntropy to reuse (default: a new one on the model's backend).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise ValueError(f"evaluate: batch_size {batch_size!r} must be an integer >= 1")
    kernels = model.kernels
    check_batchnorm_statistics(model)
    loss_fn = SoftmaxCrossEntropy(kernels=kernels) if loss_fn is None else loss_fn
    shape = getattr(model, "input_shape", None)
    mine = shard(len(dataset.labels))
    was_training = getattr(model, "training", True)
    model.eval()
    correct, loss_sum, labels = 0, 0.0, 0
    try:
        for start in range(0, len(mine), batch_size):
            idx = mine[start:start + batch_size]
            x = np.ascontiguousarray(dataset.images[idx])                     # (b, ...)
            if shape is not None:
                x = x.reshape((len(idx),) + tuple(shape))
            y = np.ascontiguousarray(dataset.labels[idx])                     # (b,) (b, T)
            labels += y.size            # a label per sample, or per token of a text window
            if kernels.name != "cpu":
                x, y = kernels.to_device(x), kernels.to_device(y)
            loss_sum += float(loss_fn.forward(model.forward(x), y)) * y.size
            correct += int(loss_fn.correct)
    finally:
        if was_training:
            model.train()
    totals = comm.allreduce(np.array([correct, labels, loss_sum], np.float64),
                                   op=comm.Sum, name="evaluate")
    correct, total, loss_sum = int(totals[0]), int(totals[1]), float(totals[2])
    return {"accuracy": correct / total if total else 0.0,
            "loss": loss_sum / total if total else 0.0, "correct": correct, "total": total}


def check_batchnorm_statistics(model):
    """Collective: whether ``model``'s plain BatchNorm running statistics are the same on every
    rank; where they are not, rank 0 prints one warning line on stderr.

    Every rank makes the same call (none at N=1 or for a model without plain BatchNorm): one
    allreduce (Max) of each buffer and its negation, in float64.
    """
    modules = model.named_modules() if hasattr(model, "named_modules") else []
    named = [(f"{prefix}.{name}" if prefix else name, buffer) for prefix, module in modules
             if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm)
             for name, buffer in module.named_buffers()]
    if comm.size() == 1 or not named:
        return True
    k = model.kernels
    host = [np.asarray(k.to_host(b), np.float64).ravel() for _, b in named]        # (C,) each
    flat = np.concatenate(host)                                                      # (S,)
    bounds = comm.allreduce(np.concatenate([flat, -flat]), op=comm.Max,
                                   name="evaluate.batchnorm_statistics")             # (2S,)
    spread = bounds[:flat.size] + bounds[flat.size:]         # max - min across ranks, per value
    if not (spread > 0).any():
        return True
    if comm.rank() == 0:
        ends = np.cumsum([h.size for h in host])
        first = int(np.searchsorted(ends, int(np.argmax(spread > 0)), side="right"))
        start = ends[first] - host[first].size
        far = float(spread[start:ends[first]].max())
        print(f"mpitrain: warning: evaluate: BatchNorm running statistics differ across ranks "
              f"({named[first][0]!r} up to {far:.3g} apart); average them with "
              f"mt.grouped_allreduce_(model.buffers(), op=mt.Average) or broadcast them with "
              f"mt.broadcast_parameters(model.state_dict(), root_rank=0) before evaluating",
              file=sys.stderr, flush=True)
    return False
