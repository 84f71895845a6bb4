"""Trainer: one job's model, optimizer and data, and the loop that trains them (``fit``).

Every rank runs this same loop on the same Config; decisions that lead to a collective come from
values every rank has. The loop reads top to bottom and names no mode: how a step reads its
samples (accumulation, the uneven tail, deterministic micro-shards) is the StepPlan's (plan.py),
how gradients or weights are averaged is DistributedOptimizer's strategy (parallel/), where the
run is is Progress's (progress.py), and what it reports is Records' (records.py). Rank 0 alone
prints and writes files; evaluation is sharded and its counts summed across ranks.

Recipe: ``--augment crop,flip`` transforms each training batch on the host after it is gathered
(data/augment.py, keyed by seed, epoch and sample index: the same global batch for any N); the
test set is never augmented.
"""
import math
import sys
import time

import numpy as np

from mpitrain import comm, data, nn, optim
from mpitrain.data.sampler import DistributedSampler
from mpitrain.parallel.evaluation import evaluate
from mpitrain.runtime.errors import (CheckpointError, Interrupted, OutputError, Preempted,
                                     UsageError, one_line)
from mpitrain.timeline import current as current_timeline
from mpitrain.train import checkpoint as ckpt
from mpitrain.train.plan import make_plan
from mpitrain.train.preempt import INTERRUPTED, WRITE_FAILED, StepFlags, signal_name
from mpitrain.train.progress import Progress
from mpitrain.train.records import LOG_RECORDS_PER_EPOCH, Outputs, Records
from mpitrain.train.sample import sample_text

EVAL_BATCH = 500
# The __meta__ keys save_checkpoint writes beside the format's own, as resume relies on them: a
# checkpoint whose keys do not fit is damaged (read_latest skips it for the one before).
META = {"model": ckpt.Key(str), "dataset": ckpt.Key(str), "optimizer": ckpt.Key(str),
        "seed": ckpt.Key(int), "epoch": ckpt.Key(int, minimum=0),
        "epoch_position_samples": ckpt.Key(int, minimum=0),
        "global_batch": ckpt.Key(int, minimum=1, optional=True),
        "ranks_at_save": ckpt.Key(int, minimum=1, optional=True),
        "hidden": ckpt.Key(list, type(None), optional=True),
        "vocabulary": ckpt.Key(str, type(None), optional=True),
        "deterministic_micro_shards": ckpt.Key(int, type(None), minimum=1, optional=True)}


class Trainer:
    """The model, optimizer and data of one job and the recipe that trains them. It alone moves
    ``step``, ``epoch`` and ``position`` (progress.py): ``fit`` as it trains, ``resume`` from a
    checkpoint. ``signals``: the stop signals noted (preempt.Signals; default: none)."""

    def __init__(self, config, backend, train_set, test_set, model, optimizer, base_lr,
                 outputs=None, signals=None):
        self.config, self.backend = config, backend
        self.train_set, self.test_set = train_set, test_set
        self.model, self.optimizer, self.base_lr = model, optimizer, base_lr
        self.rank, self.size = comm.rank(), comm.size()
        self.outputs = Outputs(self.rank) if outputs is None else outputs  # checkpoints, --save
        self.augment = augmentation(config, train_set)
        self.loss_fn = nn.SoftmaxCrossEntropy(kernels=backend)
        self.eval_loss_fn = nn.SoftmaxCrossEntropy(kernels=backend)
        self.sampler = DistributedSampler(len(train_set), self.size, self.rank, seed=config.seed,
                                          batch_size=config.batch_size * config.accumulate)
        self.global_batch = self.sampler.global_batch
        self.plan = make_plan(config, self.sampler, self.size, self.rank, model)
        self.progress = Progress(config, len(train_set), self.global_batch)
        self.schedule = optim.LRSchedule(
            base_lr, config.lr_schedule, total_steps=max(1, self.progress.total_steps()),
            steps_per_epoch=max(1, self.progress.steps_per_epoch()),
            milestones=config.lr_milestones or (), gamma=config.lr_gamma,
            warmup_steps=config.warmup_steps, min_lr=config.min_lr)
        self.records = Records(self)
        self.flags = StepFlags(config, self.outputs, self.size, signals)   # stop requests
        self.last_checkpoint_step = None

    step = property(lambda self: self.progress.step, doc="optimizer steps taken")
    epoch = property(lambda self: self.progress.epoch, doc="epochs completed")
    position = property(lambda self: self.progress.position,
                        doc="samples of epoch ``epoch``'s permutation consumed")

    def resume(self, checkpoint):
        """Continue from ``checkpoint`` (rank 0's, broadcast: path, params, optimizer, meta): the
        model and optimizer state, step, epoch and position. CheckpointError if it does not fit."""
        meta, path, config = checkpoint["meta"], checkpoint["path"], self.config
        for key in ("model", "dataset", "optimizer", "seed"):
            if meta.get(key) != getattr(config, key):
                raise CheckpointError(f"{path} was written with --{key} {meta.get(key)!r}, "
                                      f"not {getattr(config, key)!r}")
        written, mine = meta.get("vocabulary"), vocabulary(self.train_set)
        if written != mine:
            raise CheckpointError(f"{path} was written with another vocabulary "
                                  f"({_describe(written)}, this data has {_describe(mine)})")
        try:
            with self.optimizer.full_parameters():
                self.model.load_state_dict(checkpoint["params"])
            self.optimizer.load_checkpoint_state(checkpoint["optimizer"])
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{path} does not fit this model: {one_line(exc)}") from None
        if meta["epoch_position_samples"] > len(self.train_set):
            raise CheckpointError(f"{path} stopped {meta['epoch_position_samples']} samples into "
                                  f"an epoch, but {config.dataset} has {len(self.train_set)}")
        p = self.progress
        p.step, p.epoch, p.position = meta["step"], meta["epoch"], meta["epoch_position_samples"]
        self.last_checkpoint_step = p.step
        if meta.get("global_batch", self.global_batch) != self.global_batch and self.rank == 0:
            print(f"mpitrain: warning: {path} was written with a global batch of "
                  f"{meta['global_batch']} samples, this job's is {self.global_batch}: the steps "
                  f"that follow are not those of an uninterrupted run (--global-batch-size "
                  f"{meta['global_batch']} keeps it at any number of ranks)", file=sys.stderr,
                  flush=True)
        written = meta.get("deterministic_micro_shards")
        if config.deterministic and written != config.micro_shards and self.rank == 0:
            how = "without --deterministic" if written is None else f"with --micro-shards {written}"
            print(f"mpitrain: warning: {path} was written {how}; continuing with --micro-shards "
                  f"{config.micro_shards}, the parameters are not bitwise those of an "
                  f"uninterrupted --deterministic run", file=sys.stderr, flush=True)

    def fit(self, metrics):
        """Train to --steps or --epochs, end on one model, evaluate; returns the summary record.
        ``metrics``: where the records go (an object with ``write(record)``)."""
        config, progress, records = self.config, self.progress, self.records
        log_every = max(1, progress.steps_per_epoch() // LOG_RECORDS_PER_EPOCH)
        records.open_bar(self.rank == 0 and config.progress and sys.stderr.isatty())
        first_step, wall = self.step, time.perf_counter()
        with self.flags.interrupt:      # Ctrl-C: a flag of the next step (preempt.py)
            self._steps(metrics, log_every)
            self.stop_if_flagged(self.flags.last())
        records.close_bar()
        self.optimizer.settle()     # one model, not N (weights mode), so it may be checkpointed
        if config.checkpoint_dir and self.last_checkpoint_step != self.step:
            self.save_checkpoint(background=False)
        if records.last_eval_step != self.step or records.last_eval is None:
            records.last_eval, records.last_eval_step = self.evaluate(), self.step
        if config.save:
            with self.optimizer.full_parameters():       # collective (sharded parameters)
                state = self.model.state_dict(copy=True) if self.rank == 0 else None
            self.outputs.attempt("--save", config.save,
                                 lambda: ckpt.atomic_savez(config.save, state))
        summary = records.summary(metrics, first_step, wall)
        self.outputs.wait()
        self.outputs.check()
        if config.sample:
            with self.optimizer.full_parameters():       # rank 0 alone runs the model
                if self.rank == 0:
                    text = sample_text(self.model, self.train_set, config.sample,
                                       config.temperature, config.seed)
                    print(f"sample ({config.sample} tokens, temperature "
                          f"{config.temperature:g}):\n{text}", flush=True)
        return summary

    def _steps(self, metrics, log_every):
        """fit's steps, to --steps or --epochs."""
        config, progress, records = self.config, self.progress, self.records
        while not progress.done():
            self.sampler.set_epoch(self.epoch, self.position)  # the rest of the current epoch
            steps = self.plan.steps()
            if not steps:  # resumed with a larger global batch than the epoch has left
                progress.next_epoch()
            for step in steps:
                # a loss gone NaN or inf is one line (--nonfinite-steps), not NumPy's warnings
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    loss, accuracy, flags = self.train_step(step)
                epoch_end = progress.advance(step.samples)
                records.show(loss, accuracy, epoch_end)
                self.stop_if_flagged(self.flags.agree(flags, self.step, step.joins))
                if self.step % log_every == 0 or epoch_end or progress.done():
                    records.log_step(metrics)
                if ((config.eval_every and self.step % config.eval_every == 0)
                        or (epoch_end and not config.eval_every)):
                    records.log_eval(metrics, self.evaluate())
                if epoch_end:
                    records.log_epoch(metrics)
                if (config.checkpoint_dir and config.checkpoint_every
                        and self.step % config.checkpoint_every == 0):
                    self.save_checkpoint()
                if progress.done():
                    break

    def train_step(self, step):
        """One optimizer step (a plan.Step): a forward and backward pass per micro-batch, the
        loss gradient scaled by the step's weight; each layer's gradients start their allreduce
        as soon as the layer is done (the optimizer counts the passes). Returns (mean loss,
        accuracy of the last pass, every rank's stop flags as the step's agreement
        carried them or None: preempt.py); the loss is NaN on a rank with no samples."""
        trace, plan = current_timeline(), self.plan  # disabled unless --timeline names a file
        start, comm_before = time.perf_counter(), self.optimizer.comm_time_s
        self.optimizer.lr = self.progress.lr(self.schedule)
        self.optimizer.zero_grad()
        rows, flags = [], None
        plan.before_step()
        for j, micro in enumerate(step.micro_batches()):                           # (A, b)
            plan.before_pass(self.model, self.step, j)
            with trace.span("data"):
                x = self._to_backend(self.train_set.images, micro, self.model.input_shape,
                                     self.augment)                                 # (b, ...)
                y = self._to_backend(self.train_set.labels, micro,
                                     self.train_set.labels.shape[1:])              # (b,) (b, T)
            with trace.span("forward"):
                logits = self.model.forward(x)                                     # (b, [T,] K)
                loss = self.loss_fn.forward(logits, y)
            with trace.span("backward"):
                grad = self.loss_fn.backward()                                     # (b, [T,] K)
                if step.weight != 1.0:
                    self.backend.scale(grad, step.weight)
                self.model.backward(grad, on_layer_done=self.optimizer.backward_hook)
            # loss and correct answers per label: a sample (classifiers) or a token (text)
            rows.append((loss * y.size, self.loss_fn.correct, y.size))
            plan.after_pass()
        if rows:
            self.flags.loss_finite = math.isfinite(sum(row[0] for row in rows))
            with trace.span("optimizer.step", step=self.step + 1):
                # ranks with no share of an uneven tail make no step: no flags in it
                flags = self.optimizer.step(None if step.joins else self.flags.local())
                self.backend.synchronize()
        plan.after_step(step, self.model, self.optimizer)
        self.records.add_step(time.perf_counter() - start,
                              self.optimizer.comm_time_s - comm_before, rows)
        loss_sum, labels = sum(row[0] for row in rows), sum(row[2] for row in rows)
        return (loss_sum / labels if rows else float("nan"),
                rows[-1][1] / rows[-1][2] if rows else 0.0, flags)

    def _to_backend(self, data, idx, shape, augment=None):
        host = data[idx]                                                      # (b, ...)
        if augment is not None:
            host = augment(host, idx, self.epoch)  # keyed by sample, not by rank or batch
        host = np.ascontiguousarray(host).reshape((len(idx),) + shape)        # (b, ...)
        return host if self.backend.name == "cpu" else self.backend.to_device(host)

    def evaluate(self):
        """(accuracy, mean loss, correct, total) on the test set, sharded and summed."""
        self.plan.agree_on_buffers(self.model)
        with current_timeline().span("evaluate", step=self.step):
            result = evaluate(self.model, self.test_set, EVAL_BATCH, loss_fn=self.eval_loss_fn)
        return result["accuracy"], result["loss"], result["correct"], result["total"]

    def stop_if_flagged(self, flags):
        """After a step, on every rank with the same ``flags`` (preempt.py): rank 0's failed
        write is an OutputError everywhere; --nonfinite-steps steps in a row with a loss that
        is not finite are a UsageError everywhere (no checkpoint: its parameters are likely
        NaN); SIGINT is an Interrupted everywhere (no new checkpoint; rank 0 prints it); a
        stop signal writes a checkpoint (unless this step has one) and raises Preempted."""
        if flags & WRITE_FAILED:
            self.outputs.wait()
            self.outputs.check()
        run, limit = self.flags.nonfinite_run, self.config.nonfinite_steps
        if limit and run >= limit:
            steps = f"step {self.step}" if run == 1 else \
                f"{run} steps in a row, up to step {self.step}"
            raise UsageError(f"the training loss is NaN or infinite on some rank at {steps}; "
                             f"look for NaN/inf in the data or the resumed checkpoint, or lower "
                             f"--lr (--nonfinite-steps 0 trains on)")
        if flags & INTERRUPTED:
            self.flags.interrupt.stopping()
            self.outputs.wait()         # a checkpoint being written is there, or is not named
            raise Interrupted(self.step, self.last_checkpoint_step, self.config.checkpoint_dir,
                              agreed=True)
        name = signal_name(flags)
        if name is None:
            return
        config = self.config
        if config.checkpoint_dir and self.last_checkpoint_step != self.step:
            self.optimizer.settle()
            self.save_checkpoint(background=False)
        self.outputs.wait()
        self.outputs.check()
        raise Preempted(name, self.step, self.last_checkpoint_step, config.checkpoint_dir)

    def save_checkpoint(self, background=None):
        """Collective: rank 0 writes the model, the optimizer state and the position; on the
        writer thread with --checkpoint-async (``background``: None = the config's), after the
        previous write is done."""
        config = self.config
        background = config.checkpoint_async if background is None else background
        self.plan.agree_on_buffers(self.model)
        with self.optimizer.full_parameters():           # collective (sharded parameters)
            model_state = self.model.state_dict(copy=True) if self.rank == 0 else None
        pieces, shards = self.optimizer.checkpoint_pieces(), None
        if pieces is None:
            opt_state = self.optimizer.checkpoint_state()
        else:       # sharded: every rank writes its piece now, rank 0 the manifest after them
            try:
                opt_state, shards = ckpt.write_pieces(config.checkpoint_dir, self.step, pieces)
            except CheckpointError as exc:
                raise OutputError(str(exc)) from None
        if self.rank == 0:
            meta = {"model": config.model, "dataset": config.dataset, "optimizer": config.optimizer,
                    "seed": config.seed, "epoch": self.epoch, "epoch_position_samples":
                    self.position, "global_batch": self.global_batch, "ranks_at_save": self.size,
                    "hidden": list(config.hidden) if config.hidden else None,
                    "vocabulary": vocabulary(self.train_set),
                    "deterministic_micro_shards": (config.micro_shards if config.deterministic
                                                   else None)}
            state, step = model_state, self.step
            self.outputs.wait()
            self.outputs.attempt("a checkpoint into", config.checkpoint_dir,
                                 lambda: ckpt.write(config.checkpoint_dir, step, state,
                                                    opt_state, meta,
                                                    keep=config.keep_checkpoints,
                                                    shards=shards),
                                 background=background)
        self.outputs.check()
        self.last_checkpoint_step = self.step


def vocabulary(dataset):
    """A text dataset's vocabulary as the checkpoint records it: its characters as one string,
    or "bytes"; None for other data."""
    if getattr(dataset, "tokens", None) is None:
        return None
    return "bytes" if dataset.vocab is None else "".join(dataset.vocab)


def _describe(vocab):
    if vocab is None:
        return "no vocabulary"
    return "256 byte values" if vocab == "bytes" else f"{len(vocab)} characters"


def augmentation(config, train_set):
    """The --augment transform of training batches, or None."""
    if config.augment == "none":
        return None
    parts = config.augment.split(",")
    shape = train_set.sample_shape
    if len(shape) != 3:
        raise UsageError(f"--augment {config.augment}: needs image samples (C, H, W), "
                         f"{config.dataset} has {shape}")
    padding = 0
    if "crop" in parts:
        padding = (data.default_crop_padding(shape) if config.crop_padding is None
                   else config.crop_padding)
    fill = 0.0 if train_set.fill is None else train_set.fill
    return data.Augment(padding, "flip" in parts, seed=config.seed, fill=fill)
