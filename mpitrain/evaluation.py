"""Distributed evaluation: every test sample scored exactly once, the counts summed across ranks.

Horovod's MNIST example scores a DistributedSampler's shard on each rank and averages the ranks'
accuracies. That sampler pads or drops (at N=3 and 10,000 samples: 9,999 or 10,002 scored), and
an average of per-rank accuracies weighs unequal shards equally. Here rank r scores samples r,
r+N, ... (``mt.data.shard``: no padding, no dropping) and the ranks add up correct answers,
losses and sample counts in one allreduce, so the accuracy is the whole test set's, for any N.
"""
import numpy as np

from mpitrain.comm import collectives
from mpitrain.data.sampler import shard
from mpitrain.nn.loss import SoftmaxCrossEntropy


def evaluate(model, dataset, batch_size=1000, loss_fn=None):
    """Accuracy and mean loss of ``model`` on all of ``dataset`` (``.images``, ``.labels``).

    Collective: every rank calls it and gets the same dict ``{"accuracy", "loss", "correct",
    "total"}``. Batches go to the model's backend and are reshaped to ``model.input_shape``
    where the model has one; the model runs in eval mode and is put back in its previous mode.
    loss_fn: a SoftmaxCrossEntropy to reuse (default: a new one on the model's backend).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise ValueError(f"evaluate: batch_size {batch_size!r} must be an integer >= 1")
    kernels = model.kernels
    loss_fn = SoftmaxCrossEntropy(kernels=kernels) if loss_fn is None else loss_fn
    shape = getattr(model, "input_shape", None)
    mine = shard(len(dataset.labels))
    was_training = getattr(model, "training", True)
    model.eval()
    correct, loss_sum = 0, 0.0
    try:
        for start in range(0, len(mine), batch_size):
            idx = mine[start:start + batch_size]
            x = np.ascontiguousarray(dataset.images[idx])                     # (b, ...)
            if shape is not None:
                x = x.reshape((len(idx),) + tuple(shape))
            y = np.ascontiguousarray(dataset.labels[idx])                     # (b,)
            if kernels.name != "cpu":
                x, y = kernels.to_device(x), kernels.to_device(y)
            loss_sum += float(loss_fn.forward(model.forward(x), y)) * len(idx)
            correct += int(loss_fn.correct)
    finally:
        if was_training:
            model.train()
    totals = collectives.allreduce(np.array([correct, len(mine), loss_sum], np.float64),
                                   op=collectives.Sum, name="evaluate")
    correct, total, loss_sum = int(totals[0]), int(totals[1]), float(totals[2])
    return {"accuracy": correct / total if total else 0.0,
            "loss": loss_sum / total if total else 0.0, "correct": correct, "total": total}
