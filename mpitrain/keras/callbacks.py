"""horovod.tensorflow.keras's callbacks for Keras 3: broadcast, metric average, lr schedules.

- BroadcastGlobalVariablesCallback(root_rank): after the first batch, every rank's model and
  optimizer variables become ``root_rank``'s (the first update is computed on each rank's own
  initial weights, as in Horovod; from then on the replicas are bitwise equal).
- MetricAverageCallback(): at each epoch's end the logs (``val_`` metrics included) are
  averaged over the ranks, in one allreduce; put it before the callbacks that read them.
- LearningRateScheduleCallback(initial_lr, multiplier, start_epoch, end_epoch, staircase,
  momentum_correction, steps_per_epoch): lr = initial_lr * multiplier(epoch) in
  [start_epoch, end_epoch), at each epoch's start (staircase) or each batch's (epoch + batch /
  steps_per_epoch).
- LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True,
  steps_per_epoch=None, verbose=0): Goyal et al.'s gradual warm-up, Horovod's formula: at
  epoch e (fractional, e + batch / steps_per_epoch, plus 1 / steps_per_epoch) lr =
  initial_lr / N * (e * (N - 1) / warmup_epochs + 1), from initial_lr / N to initial_lr.

Momentum correction (Horovod's) scales an optimizer's ``momentum`` by new_lr / old_lr for
the batch in which the lr changes; Keras 3's SGD holds its momentum as a Python number that
a compiled train step reads when it is traced, so the correction takes effect under
``run_eagerly=True`` (or for a momentum held in a variable) only.
"""
import keras
import numpy as np

from mpitrain import comm
from mpitrain.tensorflow.ops import broadcast_variables, global_process_set


def _get(value):
    return float(np.asarray(keras.ops.convert_to_numpy(value)))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` after the
    first batch."""

    def __init__(self, root_rank, device='', process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        broadcast_variables(self.model.variables, self.root_rank, self.process_set)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.variables:
            broadcast_variables(optimizer.variables, self.root_rank, self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end logs over the ranks (every key, in sorted order, one
    allreduce; ranks with other keys raise CollectiveError on every rank)."""

    def __init__(self, device='', process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)
        values = np.array([float(np.asarray(logs[k])) for k in keys], np.float64)
        averaged = comm.allreduce(values, comm.Average, "MetricAverageCallback:" + ",".join(keys),
                                  process_set=self.process_set)
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) for epochs in [start_epoch, end_epoch) (Horovod's).

    multiplier: a function of the epoch, or a constant. staircase: set at each epoch's first
    batch; else at every batch, with epoch + batch / steps_per_epoch (steps_per_epoch from
    ``fit``'s parameters when not given)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, *args):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError("Could not autodetect the number of steps per epoch; pass "
                         "steps_per_epoch to the callback")

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if momentum is not None and self.momentum_correction and old_lr:
            self.restore_momentum = _get(momentum)
            corrected = _get(momentum) * new_lr / old_lr
            if hasattr(momentum, "assign"):
                momentum.assign(corrected)
            else:
                optimizer.momentum = corrected

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            optimizer = self.model.optimizer
            if hasattr(optimizer.momentum, "assign"):
                optimizer.momentum.assign(self.restore_momentum)
            else:
                optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _get(self.model.optimizer.learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up from initial_lr / N to initial_lr over ``warmup_epochs`` (Horovod's
    formula, batch by batch)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0, process_set=global_process_set):
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose
        self.process_set = process_set

        def multiplier(epoch):
            # shifted by one step, so that each epoch ends on a round number (Horovod's)
            epoch += 1.0 / self.steps_per_epoch
            n = comm.group_size(self.process_set, "LearningRateWarmupCallback")
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get(self.model.optimizer.learning_rate):g}.")
