"""The job of ``python -m mpitrain``: ``run`` sets it up, ``Trainer.fit`` trains and reports it.

Every rank runs this same code on the same Config. The rules that keep N processes one job:

- Decisions that lead to a collective are taken from values every rank has (the Config, the
  dataset sizes, a checkpoint rank 0 read and broadcast); bad input found while setting up goes
  through ``_agree``, so it becomes the same UsageError on every rank (exit code 2, no hang).
- Data: ``DistributedSampler`` gives rank r the elements r, r+N, ... of each global batch of a
  seeded per-epoch permutation, so global batch t is the same sample set for any N, and every rank
  runs the same number of steps. The ragged tail of an epoch is dropped, or with ``--uneven``
  trained as one smaller last step: each rank's gradient weighted by its share of it, the ranks
  with no share in ``mt.join`` (serving the others with zeros), then the replicas made one again
  by broadcasting the model and optimizer state from the rank ``join`` returns.
- Averaging: ``DistributedOptimizer`` (gradients through the fusion buffer and our ring, or PNNL
  weight averaging every k steps); its ``comm_time_s`` is the communication time we report.
- Rank 0 alone prints (config once, a tqdm bar, the test accuracy) and writes files (metrics,
  checkpoints, --save); evaluation is sharded and its counts summed across ranks.

Timing: the first ``min(TIMING_WARMUP_STEPS, steps // 2)`` steps of a job (JIT compilation, cold
caches) are excluded from samples_per_sec / step_time_ms / comm_time_ms; evaluation and checkpoint
time are never in them. samples_per_sec is global: all ranks' samples per second of step time.

Learning rate: ``--lr`` as given (times N with ``--scale-lr``); with ``--warmup-epochs w`` it ramps
linearly with the fraction of epochs done, ``lr * min(1, epochs_done / w)`` -- a function of the
data position only, so a resumed job (on any N with the same global batch) continues the ramp.
``--lr-schedule step|cosine`` multiplies that by ``LRSchedule.decay(t)`` (optim/schedule.py) at
``t = epoch * steps_per_epoch + position / global_batch``, the steps taken so far (exact under
resume; measured in samples, so also continuous after resuming on another N).

Recipe: ``--normalize`` picks the inputs' per-channel statistics (applied to train and test), and
``--augment crop,flip`` transforms each training batch on the host after it is gathered
(data/augment.py, keyed by seed, epoch and sample index: the same global batch for any N); the
test set is never augmented. ``--no-decay-bn-bias`` (the default) gives parameters with
``ndim <= 1`` no weight decay.
"""
import json
import os
import sys
import tempfile
import textwrap
import time

import numpy as np

import mpitrain as mt
from mpitrain import checkpoint as ckpt
from mpitrain import threads, timeline
from mpitrain.comm.check import format_groups, group
from mpitrain.config import UsageError
from mpitrain.data import DataError
from mpitrain.data.sampler import DistributedSampler
from mpitrain.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpitrain.parallel.deterministic import BatchNormReplay, ShardSums, seed_dropout
from mpitrain.parallel.gradients import Compression
from mpitrain.parallel.optimizer import DistributedOptimizer
from mpitrain.runtime import env

TIMING_WARMUP_STEPS = 5
EVAL_BATCH = 500
LOG_RECORDS_PER_EPOCH = 10
TEST_FRACTION = 4  # --dataset synthetic: test set = synthetic_samples // 4
DROP_WARNING = 0.05  # warn when more of the training set than this is never trained


def _agree(fn, *args):
    """``fn(*args)`` on every rank; a bad-input error on any rank is raised on every rank."""
    try:
        result, error = fn(*args), None
    except (UsageError, DataError) as exc:
        result, error = None, exc
    messages = mt.allgather_object(None if error is None else str(error))
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise error if error is not None else UsageError(first)
    return result


def _backend(config):
    """The kernel module for --device/--kernels; UsageError if it cannot run here."""
    try:
        if config.device == "cuda":
            from mpitrain.comm import device
            device.select_device(flavour=config.kernels)
        backend = mt.kernels.get(config.device, config.kernels)
        backend.zeros((1,), np.float32)  # fails here, not mid-step, if no device is usable
    except Exception as exc:  # noqa: BLE001 - any import/driver failure is the same bad input
        flavour = f" --kernels {config.kernels}" if config.kernels else ""
        raise UsageError(f"--device {config.device}{flavour}: backend unavailable "
                         f"({_one_line(exc)})") from None
    return backend


def _datasets(config):
    """(train, test) with --normalize applied to both (statistics of the training set only)."""
    train_set, test_set = _raw_datasets(config)
    if config.normalize == "train":
        mean, std = mt.data.channel_stats(train_set)  # bitwise the same on every rank
        train_set = mt.data.standardize(train_set, mean, std)
        test_set = mt.data.standardize(test_set, mean, std)
    return train_set, test_set


def _raw_datasets(config):
    if config.dataset != "synthetic":
        fixed = config.normalize == "fixed"  # "train" restandardises this one; exact either way
        return (mt.data.load(config.dataset, "train", config.data_dir, normalize=fixed),
                mt.data.load(config.dataset, "test", config.data_dir, normalize=fixed))
    n_test = max(1, config.synthetic_samples // TEST_FRACTION)
    shape = config.sample_shape()                       # synthetic: the model's input
    # One draw for both splits, so the test set has the training set's class prototypes.
    full = mt.data.synthetic(config.synthetic_samples + n_test, shape, seed=config.seed)
    cut = config.synthetic_samples
    return tuple(type(full)(full.images[s], full.labels[s], full.classes, "synthetic")
                 for s in (slice(0, cut), slice(cut, None)))


def _check_sizes(config, train_set, test_set, size):
    sizes = mt.allgather_object((len(train_set), len(test_set)))
    if len(set(sizes)) > 1:  # a decision every rank must take identically: compare first
        raise UsageError(f"ranks see different {config.dataset} datasets (train, test sizes per "
                         f"rank: {sizes}); give every rank the same files")
    global_batch = config.batch_size * size * config.accumulate
    if global_batch > len(train_set):
        accumulate = f" x --accumulate {config.accumulate}" if config.accumulate > 1 else ""
        raise UsageError(f"--batch-size {config.batch_size} x {size} ranks{accumulate} = "
                         f"{global_batch} "
                         f"exceeds the {len(train_set)} training samples of {config.dataset}")
    if size > len(test_set):
        raise UsageError(f"{size} ranks but the {config.dataset} test set has only "
                         f"{len(test_set)} samples (each rank scores at least one)")
    if config.deterministic:
        _check_micro_shards(config.micro_shards, size, global_batch)


def _check_micro_shards(m, size, global_batch):
    """--deterministic: N a power of two dividing M, and M micro-shards of equal size."""
    if size & (size - 1) or m % size:
        raise UsageError(f"--deterministic needs a power-of-two number of ranks dividing "
                         f"--micro-shards {m}, got {size} ranks (the fixed tree splits the "
                         f"micro-shards in halves)")
    if global_batch % m:
        raise UsageError(f"--deterministic: the global batch of {global_batch} samples does not "
                         f"divide into --micro-shards {m} equal micro-shards")


def _build_model(config, train_set, backend):
    kw = dict(seed=config.seed, kernels=backend, classes=train_set.classes)
    if config.model == "mlp":
        kw["in_features"] = int(np.prod(train_set.images.shape[1:]))
        if config.hidden is not None:
            kw["hidden"] = tuple(config.hidden)
    if config.model.startswith("resnet"):
        kw["input_shape"] = tuple(train_set.images.shape[1:])   # any (C, H, W)
    if config.dropout:
        kw["dropout"] = config.dropout
    model = mt.models.get(config.model, **kw)
    if config.sync_bn:
        if not any(isinstance(m, mt.nn.BatchNormBase) for m in model.modules()):
            if mt.rank() == 0:
                print(f"mpitrain: warning: --sync-bn has no effect, --model {config.model} has "
                      f"no BatchNorm", file=sys.stderr, flush=True)
        mt.nn.SyncBatchNorm.convert(model)
    return model


def _build_optimizer(config, model, lr):
    params = model.parameters()
    no_decay = None if config.decay_bn_bias else mt.optim.is_bias_or_norm
    if config.optimizer == "adam":
        inner = mt.optim.Adam(params, lr=lr, weight_decay=config.weight_decay, no_decay=no_decay)
    else:
        inner = mt.optim.SGD(params, lr=lr, momentum=config.momentum,
                             weight_decay=config.weight_decay, no_decay=no_decay)
    compression = Compression.fp16 if config.fp16_allreduce else Compression.none
    passes, exact = config.accumulate, {}
    if config.deterministic:   # one pass per micro-shard, loss x 1/M and summed: no N anywhere
        passes, exact = config.micro_shards // mt.size(), dict(op=mt.Sum, deterministic=True)
    return DistributedOptimizer(inner, model.named_parameters(), compression=compression,
                                average=config.average, average_every=config.average_every,
                                fusion_threshold_bytes=config.fusion_threshold_bytes,
                                overlap=config.overlap,
                                backward_passes_per_step=passes, **exact)


def _read_checkpoint(config):
    """Rank 0: the newest valid checkpoint as plain data (or None); others: None."""
    if mt.rank() != 0:
        return None
    found, skipped = ckpt.read_latest(config.checkpoint_dir)
    for reason in skipped:
        print(f"mpitrain: skipping {reason}", file=sys.stderr, flush=True)
    if found is None:
        return None
    return {"path": found.path, "params": found.params, "optimizer": found.optimizer_state,
            "meta": found.meta}


def _check_outputs(config, rank):
    """Rank 0: every path the job will write is writable, and a fresh run does not share a folder
    with another run's checkpoints (their higher steps would prune ours and win a later
    --resume). Checked before training, so a bad path is one line and exit 2, not an abort after
    the work is done; nothing is created here."""
    if rank != 0:
        return
    files = {"--metrics-json": config.metrics_json, "--save": config.save,
             "--timeline": config.timeline}
    for flag, path in files.items():
        if path:
            if os.path.isdir(path):
                raise UsageError(f"{flag} {path}: is a folder, expected a file path")
            _check_creatable(flag, os.path.dirname(os.path.abspath(path)))
    folder = config.checkpoint_dir
    if folder:
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise UsageError(f"--checkpoint-dir {folder}: exists and is not a folder")
        _check_creatable("--checkpoint-dir", os.path.abspath(folder))
        if config.resume and not os.path.isdir(folder):
            raise UsageError(f"--resume: --checkpoint-dir {folder} does not exist (a typo? "
                             f"--resume-if-exists starts at step 0 when there is nothing to "
                             f"resume)")
        if not config.resuming and os.path.isdir(folder) and ckpt.list_checkpoints(folder):
            raise UsageError(f"--checkpoint-dir {folder} already holds checkpoints of another "
                             f"run; pass --resume to continue it, or use an empty folder")


def _check_creatable(flag, folder):
    """``folder`` exists and takes files, or its nearest existing ancestor does. Probed with a
    temporary file that vanishes at once (os.access says yes to root even on /proc)."""
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(f"{probe} is not a folder")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"{flag}: cannot write into {folder} ({reason})") from None


class OutputError(RuntimeError):
    """A file the job writes could not be written (a full disk, a vanished folder): one line and
    exit code 1; what was written before is intact (checkpoints and --save are atomic)."""


class _Outputs:
    """Rank 0's files: the JSON-lines metrics (opened only once the job is known to be valid),
    checkpoints and --save. A write that fails is kept, not raised (the other ranks would wait
    for rank 0 in their next collective), nothing more is written, and ``check()`` -- a
    collective every rank calls at the same point of the loop -- raises it as the same
    OutputError on every rank."""

    def __init__(self, rank):
        self.rank, self.path, self.fd, self.error = rank, None, None, None

    def open_metrics(self, path, append):
        """Rank 0: start the --metrics-json file (appended to when resuming)."""
        if path and self.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
            self.path, self.fd = path, os.open(path, flags, 0o644)

    def write(self, record):
        """Append one metrics record (rank 0, with --metrics-json)."""
        if self.fd is not None:
            self.attempt("--metrics-json", self.path, lambda: self._append(record))

    def _append(self, record):
        """One line, whole or not at all: a write cut short (a full disk) is taken back."""
        line = memoryview((json.dumps(record) + "\n").encode())
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while line:
                line = line[os.write(self.fd, line):]
        except OSError:
            os.ftruncate(self.fd, end)
            raise

    def attempt(self, what, path, write):
        """Rank 0: ``write()``, keeping an OSError as this job's output error."""
        if self.rank != 0 or self.error is not None:
            return
        try:
            write()
        except OSError as exc:
            self.error = f"cannot write {what} {path}: {exc.strerror or _one_line(exc)}"

    def check(self):
        """Collective: raise rank 0's output error, if any, on every rank."""
        error = mt.broadcast_object(self.error, root_rank=0)
        if error is not None:
            raise OutputError(error)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


class Trainer:
    """One job's model, optimizer and data, and the recipe that trains them (``fit``). It alone
    moves ``step`` (optimizer steps taken), ``epoch`` (epochs completed) and ``position`` (samples
    of epoch ``epoch``'s permutation consumed): ``fit`` as it trains, ``resume`` from a checkpoint.
    """

    def __init__(self, config, backend, train_set, test_set, model, optimizer, base_lr,
                 outputs=None):
        self.config, self.backend = config, backend
        self.train_set, self.test_set = train_set, test_set
        self.model, self.optimizer, self.base_lr = model, optimizer, base_lr
        self.rank, self.size = mt.rank(), mt.size()
        self.outputs = _Outputs(self.rank) if outputs is None else outputs  # checkpoints, --save
        self.accumulate = config.accumulate  # backward passes (micro-batches) per step
        self.global_batch = config.batch_size * self.size * self.accumulate
        # --deterministic (deterministic.py): this rank's contiguous M/N micro-shards, one pass
        # each, the loss gradient x 1/M; metric sums in micro-shard order (ShardSums)
        self.passes, self.pass_weight = self.accumulate, 1.0 / self.accumulate
        self.interval_shards = self.epoch_shards = self.bn_replay = None
        if config.deterministic:
            self.bn_replay = BatchNormReplay(model)    # running statistics in micro-shard order
            self.passes = config.micro_shards // self.size
            self.pass_weight = 1.0 / config.micro_shards
            self.interval_shards, self.epoch_shards = ShardSums(), ShardSums()
        self.loss_fn = mt.nn.SoftmaxCrossEntropy(kernels=backend)
        self.eval_loss_fn = mt.nn.SoftmaxCrossEntropy(kernels=backend)
        self.sampler = DistributedSampler(len(train_set), self.size, self.rank, seed=config.seed,
                                          batch_size=config.batch_size * self.accumulate)
        self.augment = _augmentation(config, train_set)
        self.schedule = mt.optim.LRSchedule(
            base_lr, config.lr_schedule, total_steps=max(1, self.total_steps()),
            steps_per_epoch=max(1, self.steps_per_epoch()), milestones=config.lr_milestones or (),
            gamma=config.lr_gamma)
        self.step, self.epoch, self.position = 0, 0, 0
        self.step_times, self.comm_times = [], []
        self.interval = np.zeros(3)  # loss sum, correct, samples since the last step record
        self.interval_start = 0      # index into step_times where that interval began
        self.epoch_stats = np.zeros(3)
        self.last_eval = self.last_eval_step = self.last_checkpoint_step = None

    def resume(self, checkpoint):
        """Continue from ``checkpoint`` (rank 0's, broadcast: path, params, optimizer, meta): the
        model and optimizer state, step, epoch and position. CheckpointError if it does not fit."""
        meta, path = checkpoint["meta"], checkpoint["path"]
        for key in ("model", "dataset", "optimizer", "seed"):
            if meta.get(key) != getattr(self.config, key):
                raise ckpt.CheckpointError(f"{path} was written with --{key} {meta.get(key)!r}, "
                                           f"not {getattr(self.config, key)!r}")
        try:
            self.model.load_state_dict(checkpoint["params"])
            self.optimizer.optimizer.load_state_dict(checkpoint["optimizer"])
        except ValueError as exc:
            raise ckpt.CheckpointError(f"{path} does not fit this model: {exc}") from None
        self.step, self.epoch = meta["step"], meta["epoch"]
        self.position = meta["epoch_position_samples"]
        self.last_checkpoint_step = self.step
        written = meta.get("deterministic_micro_shards")
        if self.config.deterministic and written != self.config.micro_shards and self.rank == 0:
            how = "without --deterministic" if written is None else f"with --micro-shards {written}"
            print(f"mpitrain: warning: {path} was written {how}; continuing with --micro-shards "
                  f"{self.config.micro_shards}, the parameters are not bitwise those of an "
                  f"uninterrupted --deterministic run", file=sys.stderr, flush=True)

    def fit(self, metrics):
        """Train to --steps or --epochs, end on one model, evaluate; returns the summary record."""
        config = self.config
        log_every = max(1, self.steps_per_epoch() // LOG_RECORDS_PER_EPOCH)
        bar = None
        if self.rank == 0 and config.progress and sys.stderr.isatty():
            from tqdm import tqdm
            bar = tqdm(total=self.remaining_steps(), unit="step", dynamic_ncols=True,
                       file=sys.stderr, desc=f"epoch {self.epoch + 1}")
        first_step, wall = self.step, time.perf_counter()
        while not self.done():
            self.sampler.set_epoch(self.epoch, self.position)  # the rest of the current epoch
            self.epoch_stats[:] = 0
            batches = list(self.shares())  # steps x (b,)
            tail = self.sampler.global_remainder() if config.uneven else ()
            if len(tail):
                batches.append(self.sampler.remainder())  # (0 to b,): this rank's share
            if len(batches) == 0:  # resumed with a larger global batch than the epoch has left
                self.epoch, self.position = self.epoch + 1, 0
            for i, batch in enumerate(batches):
                last = len(tail) > 0 and i == len(batches) - 1
                loss = self.train_step(batch, len(tail) if last else None)
                epoch_end = self._advance(len(tail) if last else self.global_batch)
                self._show_progress(bar, loss, epoch_end)
                if self.step % log_every == 0 or epoch_end or self.done():
                    self._log_step(metrics)
                if ((config.eval_every and self.step % config.eval_every == 0)
                        or (epoch_end and not config.eval_every)):
                    self._log_eval(metrics, bar)
                if epoch_end:
                    self._log_epoch(metrics)
                if (config.checkpoint_dir and config.checkpoint_every
                        and self.step % config.checkpoint_every == 0):
                    self.save_checkpoint()
                if self.done():
                    break
        if bar is not None:
            bar.close()
        if config.average == "weights" and self.step % config.average_every != 0:
            self.optimizer.average_weights()  # end on one model, not N, so it may be checkpointed
        if config.checkpoint_dir and self.last_checkpoint_step != self.step:
            self.save_checkpoint()
        return self._finish(metrics, first_step, wall)

    # -- schedule ------------------------------------------------------------------------------
    def steps_per_epoch(self):
        if self.config.uneven:                  # the partial last batch is a step too
            return -(-len(self.train_set) // self.global_batch)
        return len(self.train_set) // self.global_batch

    def remaining_steps(self):
        config = self.config
        if config.steps is not None:
            return max(0, config.steps - self.step)
        if self.epoch >= config.epochs:
            return 0
        left = len(self.train_set) - self.position
        left = -(-left // self.global_batch) if config.uneven else left // self.global_batch
        return left + (config.epochs - self.epoch - 1) * self.steps_per_epoch()

    def done(self):
        steps, epochs = self.config.steps, self.config.epochs
        return self.step >= steps if steps is not None else self.epoch >= epochs

    def epochs_done(self):
        """Epochs completed, with the fraction of the current one (the records' "epoch")."""
        return self.epoch + self.position / len(self.train_set)

    def total_steps(self):
        """Steps of the whole run at this N (the cosine schedule's length)."""
        if self.config.steps is not None:
            return self.config.steps
        return self.config.epochs * self.steps_per_epoch()

    def lr_now(self):
        t = self.epoch * self.steps_per_epoch() + self.position / self.global_batch
        decay = self.schedule.decay(t)  # 1.0 for --lr-schedule constant
        if self.config.warmup_epochs <= 0:
            return self.base_lr * decay
        done = self.epoch + (self.position + self.global_batch) / len(self.train_set)
        return self.base_lr * min(1.0, done / self.config.warmup_epochs) * decay

    def _advance(self, samples):
        """Count the step of ``samples`` just taken; True if it was the epoch's last (then the
        next begins)."""
        self.step, self.position = self.step + 1, self.position + samples
        # what is left is not a whole global batch (or, with --uneven, nothing is left)
        epoch_end = self.position + (1 if self.config.uneven else self.global_batch) > len(
            self.train_set)
        if epoch_end:
            self.epoch, self.position = self.epoch + 1, 0
        return epoch_end

    # -- one step ------------------------------------------------------------------------------
    def _to_backend(self, data, idx, shape, augment=None):
        host = data[idx]                                                      # (b, ...)
        if augment is not None:
            host = augment(host, idx, self.epoch)  # keyed by sample, not by rank or batch
        host = np.ascontiguousarray(host).reshape((len(idx),) + shape)        # (b, ...)
        return host if self.backend.name == "cpu" else self.backend.to_device(host)

    def train_step(self, idx, tail=None):
        """One optimizer step on this rank's share ``idx`` of the global batch: --accumulate
        consecutive slices of it (micro-batches of --batch-size), one forward and backward pass
        each with the loss scaled by 1/accumulate, so the summed gradients are the share's mean
        (the optimizer averages them across ranks during the last pass). Returns the mean loss.

        tail: the size of a partial last global batch (--uneven) that ``idx`` is a share of:
        the gradient is scaled by ranks x len(idx) / tail, so the average over ranks is the
        mean over the tail's samples; a rank with no share waits in ``mt.join`` meanwhile, and
        then every rank takes the model and optimizer state of the rank ``join`` returns."""
        trace = timeline.current()  # disabled unless --timeline names a file
        start = time.perf_counter()
        comm_before = self.optimizer.comm_time_s
        self.optimizer.lr = self.lr_now()
        self.optimizer.zero_grad()
        if tail is not None and len(idx) == 0:
            return self._join_step(start, comm_before)
        weight = self.pass_weight if tail is None else self.size * len(idx) / tail
        loss_sum, correct, rows = 0.0, 0, []
        if self.bn_replay is not None:
            self.bn_replay.begin_step()
        for j, micro in enumerate(idx.reshape(self.passes, -1)):                  # (A, b)
            if self.config.deterministic:   # dropout masks keyed by micro-shard, not by rank
                seed_dropout(self.model, self.step, self.rank * self.passes + j,
                             self.config.micro_shards)
            with trace.span("data"):
                x = self._to_backend(self.train_set.images, micro, self.model.input_shape,
                                     self.augment)                                # (b, ...)
                y = self._to_backend(self.train_set.labels, micro, ())            # (b,)
            with trace.span("forward"):
                logits = self.model.forward(x)                                    # (b, K)
                loss = self.loss_fn.forward(logits, y)
            with trace.span("backward"):
                grad = self.loss_fn.backward()                                    # (b, K)
                if weight != 1.0:
                    self.backend.scale(grad, weight)
                # each layer's gradients start their allreduce as soon as that layer is done
                # (on the last micro-batch: the optimizer counts the passes)
                self.model.backward(grad, on_layer_done=self.optimizer.backward_hook)
            loss_sum += loss * len(micro)
            correct += self.loss_fn.correct
            rows.append((loss * len(micro), self.loss_fn.correct, len(micro)))
            if self.bn_replay is not None:
                self.bn_replay.after_pass()
        with trace.span("optimizer.step", step=self.step + 1):
            self.optimizer.step()
            if self.bn_replay is not None:
                self.bn_replay.end_step(mt.allgather)
            self.backend.synchronize()
        if tail is not None:
            self._join_step(start, comm_before)
        else:
            self._record(start, comm_before)
        stats = (loss_sum, correct, len(idx))
        self.interval += stats
        self.epoch_stats += stats
        if self.config.deterministic:
            self.interval_shards.add(rows)
            self.epoch_shards.add(rows)
        return loss_sum / len(idx)

    def shares(self):
        """This rank's samples of each remaining global batch of the epoch, (steps, G/N): the
        sampler's strided share, or with --deterministic the contiguous slice [r*G/N,
        (r+1)*G/N), its micro-shards r*M/N .. (r+1)*M/N - 1 in order."""
        if not self.config.deterministic:
            return self.sampler.indices()
        share = self.global_batch // self.size
        return self.sampler.global_indices()[:, self.rank * share:(self.rank + 1) * share]

    def _global_means(self, local, shards):
        """The records' "loss" and "accuracy" of (loss sum, correct, samples) summed over every
        rank: one allreduce, or with --deterministic the micro-shards' rows added in micro-shard
        order (the same for any N)."""
        sums = mt.allreduce(local, op=mt.Sum) if shards is None else shards.total(mt.allgather)
        return {"loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2]}

    def _join_step(self, start, comm_before):
        """End of an --uneven tail step (on a rank with no share: the whole of it): wait in
        ``mt.join`` until every rank is done, then take the model and optimizer state of the
        rank that joined last -- one that stepped -- so the replicas are one model again.
        Returns NaN, the mean loss of no samples."""
        with timeline.current().span("join", step=self.step + 1):
            last = mt.join()
            broadcast_parameters(self.model.state_dict(), root_rank=last)
            broadcast_optimizer_state(self.optimizer, root_rank=last)
        self._record(start, comm_before)
        return float("nan")

    def _record(self, start, comm_before):
        self.step_times.append(time.perf_counter() - start)
        self.comm_times.append(self.optimizer.comm_time_s - comm_before)

    # -- records (rank 0 writes them; the sums and evaluation are collectives) ------------------
    def _show_progress(self, bar, loss, epoch_end):
        if bar is not None:
            samples_s = self.global_batch / max(self.step_times[-1], 1e-9)
            accuracy = self.loss_fn.correct / self.config.batch_size
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.2f}",
                            samples_s=f"{samples_s:.0f}", refresh=False)
            bar.set_description(f"epoch {self.epoch + (0 if epoch_end else 1)}", refresh=False)
            bar.update(1)

    def _log_step(self, metrics):
        means = self._global_means(self.interval, self.interval_shards)
        samples_s, step_ms, comm_ms = self.timing(first=self.interval_start)
        metrics.write({"event": "step", "step": self.step, "epoch": self.epochs_done(), **means,
                       "lr": self.optimizer.lr, "samples_per_sec": samples_s,
                       "step_time_ms": step_ms, "comm_time_ms": comm_ms})
        self.interval[:] = 0
        self.interval_start = len(self.step_times)
        self.outputs.check()        # a metrics line that could not be written ends the job

    def _log_eval(self, metrics, bar):
        accuracy, test_loss, _, _ = self.evaluate()
        metrics.write({"event": "eval", "step": self.step, "epoch": self.epochs_done(),
                       "test_accuracy": accuracy, "test_loss": test_loss})
        line = f"step {self.step}: test accuracy {accuracy:.4f}, test loss {test_loss:.4f}"
        if bar is not None:
            bar.write(line)             # above the bar, which stays at the bottom
        elif self.rank == 0:
            print(line, flush=True)

    def _log_epoch(self, metrics):
        record = {"event": "epoch", "epoch": self.epoch, "step": self.step,
                  **self._global_means(self.epoch_stats, self.epoch_shards)}
        if self.last_eval_step == self.step:
            record.update(test_accuracy=self.last_eval[0], test_loss=self.last_eval[1])
        metrics.write(record)

    def _finish(self, metrics, first_step, wall):
        """Final evaluation (unless this step has one), --save, the summary record and line."""
        config = self.config
        if self.last_eval_step != self.step or self.last_eval is None:
            self.evaluate()
        accuracy, test_loss, correct, total = self.last_eval
        samples_s, step_ms, comm_ms = self.timing()
        if config.save:
            state = self.model.state_dict(copy=True) if self.rank == 0 else None
            self.outputs.attempt("--save", config.save, lambda: ckpt.atomic_savez(config.save,
                                                                                  state))
        summary = {"event": "summary", "test_accuracy": accuracy, "test_loss": test_loss,
                   "test_correct": correct, "test_samples": total,
                   "samples_per_sec": samples_s, "step_time_ms": step_ms, "comm_time_ms": comm_ms,
                   "comm_share": comm_ms / step_ms if step_ms else 0.0,
                   "ranks": self.size, "steps": self.step, "steps_run": self.step - first_step,
                   "epoch": self.epochs_done(), "global_batch": self.global_batch,
                   "model": config.model, "dataset": config.dataset, "average": config.average,
                   "wall_time_s": time.perf_counter() - wall}
        metrics.write(summary)
        if self.rank == 0:
            print(f"test accuracy: {accuracy:.4f} ({correct}/{total}), test loss {test_loss:.4f}; "
                  f"{self.step} steps, {samples_s:.0f} samples/s over {self.size} rank(s), "
                  f"step {step_ms:.1f} ms, comm {comm_ms:.1f} ms", flush=True)
        self.outputs.check()
        return summary

    def evaluate(self):
        """(accuracy, mean loss, correct, total) on the test set, sharded and summed."""
        self.agree_on_buffers()
        with timeline.current().span("evaluate", step=self.step):
            result = mt.evaluate(self.model, self.test_set, EVAL_BATCH, loss_fn=self.eval_loss_fn)
        self.last_eval = (result["accuracy"], result["loss"], result["correct"], result["total"])
        self.last_eval_step = self.step
        return self.last_eval

    # -- checkpoints ---------------------------------------------------------------------------
    def agree_on_buffers(self):
        """Per-rank BatchNorm leaves N sets of running statistics, each from its rank's samples;
        before the model is evaluated or written every rank takes their mean (one small
        allreduce), so the ranks hold one model. SyncBatchNorm's are equal already: untouched."""
        buffers = self.model.buffers()
        # --deterministic: equal already (replayed in micro-shard order); a mean of N equal
        # values need not give their bits back
        if self.size > 1 and buffers and not (self.config.sync_bn or self.config.deterministic):
            mt.grouped_allreduce_(buffers, op=mt.Average, name="Trainer.buffers")

    def save_checkpoint(self):
        config = self.config
        self.agree_on_buffers()
        opt_state = self.optimizer.state_dict()
        if config.average == "weights" and self.size > 1:
            # PNNL keeps momentum / Adam moments per rank; a checkpoint holds one state: their
            # mean (a collective, so every rank calls save_checkpoint).
            for key, value in opt_state.items():
                if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                    opt_state[key] = mt.allreduce(value, op=mt.Average)
        if self.rank == 0:
            meta = {"model": config.model, "dataset": config.dataset, "optimizer": config.optimizer,
                    "seed": config.seed, "epoch": self.epoch, "epoch_position_samples":
                    self.position, "global_batch": self.global_batch, "ranks_at_save": self.size,
                    "hidden": list(config.hidden) if config.hidden else None,
                    "deterministic_micro_shards": (config.micro_shards if config.deterministic
                                                   else None)}
            state = self.model.state_dict(copy=True)
            self.outputs.attempt("a checkpoint into", config.checkpoint_dir,
                                 lambda: ckpt.write(config.checkpoint_dir, self.step, state,
                                                    opt_state, meta,
                                                    keep=config.keep_checkpoints))
        self.outputs.check()
        self.last_checkpoint_step = self.step

    # -- timing --------------------------------------------------------------------------------
    def timing(self, first=None):
        """(samples/s global, step ms, comm ms), averaged over ranks, over this job's steps from
        index ``first`` (a log interval) or, by default, all but the warm-up steps."""
        if first is None:
            first = min(TIMING_WARMUP_STEPS, len(self.step_times) // 2)
        elif len(self.step_times) > TIMING_WARMUP_STEPS:
            first = max(first, TIMING_WARMUP_STEPS)  # an interval never counts warm-up steps
        times, comms = self.step_times[first:], self.comm_times[first:]
        n = len(times)
        local = np.array([sum(times), sum(comms)], np.float64)
        total_s, comm_s = mt.allreduce(local, op=mt.Average)
        if n <= 0 or total_s <= 0:
            return 0.0, 0.0, 0.0
        return n * self.global_batch / total_s, 1e3 * total_s / n, 1e3 * comm_s / n


def _augmentation(config, train_set):
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
        padding = (mt.data.default_crop_padding(shape) if config.crop_padding is None
                   else config.crop_padding)
    fill = 0.0 if train_set.fill is None else train_set.fill
    return mt.data.Augment(padding, "flip" in parts, seed=config.seed, fill=fill)


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during a run: where it stopped, and what a --resume would continue."""

    def __init__(self, step, checkpoint_step, folder):
        super().__init__(step, checkpoint_step, folder)
        self.step, self.checkpoint_step, self.folder = step, checkpoint_step, folder

    def __str__(self):
        if self.step is None:
            return "interrupted while starting, before the first step"
        if self.checkpoint_step is None:
            return f"interrupted at step {self.step}; no checkpoint was written"
        return (f"interrupted at step {self.step}; the last checkpoint is step "
                f"{self.checkpoint_step} in {self.folder} (--resume continues from it)")


def run(config):
    """Set up the job ``config`` describes on every rank, then ``Trainer.fit`` it; returns the
    summary record (the same dict on every rank). Bad input is a UsageError on every rank, a
    file that cannot be written an OutputError, Ctrl-C an Interrupted."""
    try:
        mt.init(threads=None)                   # the budget is config.threads, set below
    except (ValueError, mt.CollectiveError) as exc:
        # A bad MPITRAIN_* setting (the same ValueError on every rank) or settings that differ
        # across ranks (CollectiveError on every rank): bad input, not a crash.
        raise UsageError(str(exc)) from None
    trainer = None
    try:
        trainer, outputs = _start(config)
        # --timeline / MPITRAIN_TIMELINE records per-rank spans (timeline.py); the same on
        # every rank.
        trace = timeline.activate(timeline.Timeline(config.timeline or None, trainer.rank))
        try:
            summary = trainer.fit(outputs)
            trace.close(mt.comm.world.comm())
        finally:
            outputs.close()
            timeline.activate(None)
    except KeyboardInterrupt:
        if trainer is None:
            raise Interrupted(None, None, config.checkpoint_dir) from None
        raise Interrupted(trainer.step, trainer.last_checkpoint_step,
                          config.checkpoint_dir) from None
    return summary


def _start(config):
    """Everything before the first step, on every rank: threads, the launch agreement, backend,
    data, model, optimizer, the checkpoint to resume, rank 0's state everywhere and the header.
    Returns (trainer, outputs)."""
    rank, size = mt.rank(), mt.size()
    # --deterministic: BLAS results depend on the thread count (OpenBLAS splits some GEMMs
    # differently), so one thread per rank unless --threads says otherwise, for every N
    n_threads = threads.configure(config.threads or (1 if config.deterministic else 0),
                                  mt.local_size())
    try:
        _check_same_launch(config)
        backend = _agree(_backend, config)
        train_set, test_set = _agree(_datasets, config)
        _agree(_check_sizes, config, train_set, test_set, size)
        _agree(_check_outputs, config, rank)
        model = _build_model(config, train_set, backend)
        base_lr = config.lr * (size if config.scale_lr else 1)
        optimizer = _build_optimizer(config, model, base_lr)
        outputs = _Outputs(rank)
        trainer = Trainer(config, backend, train_set, test_set, model, optimizer, base_lr,
                          outputs)
        checkpoint = None
        if config.resuming:
            checkpoint = mt.broadcast_object(_agree(_read_checkpoint, config), root_rank=0)
            if checkpoint is not None:
                _agree(trainer.resume, checkpoint)
        # Every replica starts from rank 0's state (the zoo's seeded init already agrees; a
        # model built or loaded differently on some rank would not).
        broadcast_parameters(model.state_dict(), root_rank=0)    # parameters and buffers
        broadcast_optimizer_state(optimizer, root_rank=0)
    except mt.CollectiveError as exc:
        # before the first step, ranks that disagree were given different input
        raise UsageError(str(exc)) from None

    # From here on the job is valid: files may be written.
    outputs.open_metrics(config.metrics_json, append=checkpoint is not None)
    if rank == 0:
        _warn_dropped(config, len(train_set), trainer.global_batch)
        resolved = config.replace(threads=n_threads)     # what 0 (the default) came to
        settings = " ".join(f"{key}={value}" for key, value in resolved.as_dict().items())
        print(f"mpitrain: {size} rank(s) x {n_threads} thread(s), backend {backend.name}, "
              f"{model.num_parameters()} parameters",
              *textwrap.wrap(settings, 98, initial_indent="  ", subsequent_indent="  "),
              sep="\n", flush=True)
        if config.resuming:
            print(f"mpitrain: resumed from {checkpoint['path']} at step {trainer.step}"
                  if checkpoint else f"mpitrain: no checkpoint in {config.checkpoint_dir}; "
                                     f"starting at step 0", flush=True)
    return trainer, outputs


def _check_same_launch(config):
    """Every rank was started with the same settings: the resolved Config (flags over
    MPITRAIN_* variables) and every MPITRAIN_* variable mpitrain reads. Ranks launched with
    different hyper-parameters would otherwise train apart without a word (only a different
    model or batch size trips a collective). One line naming each setting and its ranks."""
    mine = {f"--{name.replace('_', '-')}": value for name, value in config.as_dict().items()}
    mine.update(env.snapshot())
    every = mt.allgather_object(mine)
    differ = [f"{key}: {format_groups(group(enumerate(e.get(key) for e in every)))}"
              for key in mine if len({repr(e.get(key)) for e in every}) > 1]
    if differ:
        raise UsageError("ranks were started with different settings: " + "; ".join(differ))


def _warn_dropped(config, n_train, global_batch):
    """Rank 0: one line when the ragged end of every epoch that is not trained (without
    --uneven) is more than DROP_WARNING of the training set."""
    dropped = n_train % global_batch
    if not config.uneven and dropped > DROP_WARNING * n_train:
        print(f"mpitrain: warning: a global batch of {global_batch} samples leaves {dropped} of "
              f"the {n_train} training samples ({dropped / n_train:.0%}) untrained every epoch; "
              f"--uneven trains them too", file=sys.stderr, flush=True)


__all__ = ["run", "Trainer", "Interrupted", "OutputError", "TIMING_WARMUP_STEPS"]
