"""Progress: where a run is -- ``step`` (optimizer steps taken), ``epoch`` (epochs completed) and
``position`` (samples of epoch ``epoch``'s permutation consumed) -- and what follows from them:
steps per epoch, steps left, whether the run is done, and the learning rate.

The three counters are all a resume needs (the checkpoint's step, epoch and
epoch_position_samples). The learning rate is a function of them alone: ``LRSchedule.lr_at(t)``
(``--lr`` as given, times N with ``--scale-lr``, its ``--warmup-steps`` ramp and its decay) at
``t = epoch * steps_per_epoch + position / global_batch``, ramped linearly with the epochs done
over ``--warmup-epochs`` -- measured
in samples, so it continues exactly after a resume, on any N with the same global batch.
"""


class Progress:
    """The counters of one run over ``n_train`` samples in global batches of ``global_batch``."""

    def __init__(self, config, n_train, global_batch):
        self.config, self.n_train, self.global_batch = config, n_train, global_batch
        self.step, self.epoch, self.position = 0, 0, 0

    def steps_per_epoch(self):
        if self.config.uneven:                  # the partial last batch is a step too
            return -(-self.n_train // self.global_batch)
        return self.n_train // self.global_batch

    def total_steps(self):
        """Steps of the whole run at this N (the cosine schedule's length)."""
        if self.config.steps is not None:
            return self.config.steps
        return self.config.epochs * self.steps_per_epoch()

    def remaining_steps(self):
        config = self.config
        if config.steps is not None:
            return max(0, config.steps - self.step)
        if self.epoch >= config.epochs:
            return 0
        left = self.n_train - self.position
        left = -(-left // self.global_batch) if config.uneven else left // self.global_batch
        return left + (config.epochs - self.epoch - 1) * self.steps_per_epoch()

    def done(self):
        steps, epochs = self.config.steps, self.config.epochs
        return self.step >= steps if steps is not None else self.epoch >= epochs

    def epochs_done(self):
        """Epochs completed, with the fraction of the current one (the records' "epoch")."""
        return self.epoch + self.position / self.n_train

    def advance(self, samples):
        """Count a step of ``samples`` (global); True if it was the epoch's last (then the next
        begins)."""
        self.step, self.position = self.step + 1, self.position + samples
        # what is left is not a whole global batch (or, with --uneven, nothing is left)
        end = self.position + (1 if self.config.uneven else self.global_batch) > self.n_train
        if end:
            self.epoch, self.position = self.epoch + 1, 0
        return end

    def next_epoch(self):
        """Skip what is left of this epoch (a resume with a larger global batch than it has)."""
        self.epoch, self.position = self.epoch + 1, 0

    def lr(self, schedule):
        """The learning rate of the next step (see the module docstring)."""
        t = self.epoch * self.steps_per_epoch() + self.position / self.global_batch
        lr = schedule.lr_at(t)  # --lr, its warm-up steps and its decay (optim/schedule.py)
        if self.config.warmup_epochs <= 0:
            return lr
        done = self.epoch + (self.position + self.global_batch) / self.n_train
        return lr * min(1.0, done / self.config.warmup_epochs)
