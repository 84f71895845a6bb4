"""``run(config)``: everything before the first step of ``python -m mpitrain``, on every rank --
threads, the launch agreement, backend, data, model, optimizer, the checkpoint to resume, rank 0's
state everywhere, the header -- then ``Trainer.fit`` (loop.py).

Decisions that lead to a collective are taken from values every rank has (the Config, the
dataset sizes, a checkpoint rank 0 read and broadcast); bad input found while setting up goes
through ``_agree``, so it becomes the same UsageError on every rank (exit code 2, no hang).

Recipe: ``--normalize`` picks the inputs' per-channel statistics (applied to train and test);
``--no-decay-bn-bias`` (the default) gives parameters with ``ndim <= 1`` no weight decay;
``--deterministic`` takes one pass per micro-shard with op Sum, so no N appears anywhere.
"""
import os
import sys
import tempfile
import textwrap

import numpy as np

from mpitrain import comm, data, kernels, nn, optim, timeline
from mpitrain.nn import models
from mpitrain.parallel.broadcast import broadcast_optimizer_state, broadcast_parameters
from mpitrain.parallel.gradients import Compression
from mpitrain.parallel.optimizer import DistributedOptimizer
from mpitrain.runtime import env, folder_lock, threads
from mpitrain.runtime.errors import DataError, Interrupted, UsageError, one_line
from mpitrain.train import checkpoint as ckpt
from mpitrain.train import tensorboard
from mpitrain.train.loop import META, Trainer
from mpitrain.train.preempt import Signals
from mpitrain.train.records import Outputs

TEST_FRACTION = 4  # --dataset synthetic: test set = synthetic_samples // 4
DROP_WARNING = 0.05  # warn when more of the training set than this is never trained


def _agree(fn, *args):
    """``fn(*args)`` on every rank; a bad-input error on any rank is raised on every rank."""
    try:
        result, error = fn(*args), None
    except (UsageError, DataError) as exc:
        result, error = None, exc
    messages = comm.allgather_object(None if error is None else str(error))
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise error if error is not None else UsageError(first)
    return result


def _backend(config):
    """The kernel module for --device/--kernels; UsageError if it cannot run here."""
    try:
        if config.device == "cuda":
            comm.select_device(flavour=config.kernels)
        backend = kernels.get(config.device, config.kernels)
        backend.zeros((1,), np.float32)  # fails here, not mid-step, if no device is usable
    except Exception as exc:  # noqa: BLE001 - any import/driver failure is the same bad input
        flavour = f" --kernels {config.kernels}" if config.kernels else ""
        raise UsageError(f"--device {config.device}{flavour}: backend unavailable "
                         f"({one_line(exc)})") from None
    return backend


def _datasets(config):
    """(train, test) with --normalize applied to both (statistics of the training set only);
    for --dataset text: the training windows and the validation windows (--eval-batches global
    batches of them, drawn from --seed alone)."""
    if config.dataset.startswith("text:"):
        return _text_datasets(config, comm.size())
    train_set, test_set = _raw_datasets(config)
    if config.normalize == "train":
        mean, std = data.channel_stats(train_set)  # bitwise the same on every rank
        train_set = data.standardize(train_set, mean, std)
        test_set = data.standardize(test_set, mean, std)
    return train_set, test_set


def _text_datasets(config, size):
    """The text's two splits. Its token cache is built (or validated: the text and the token
    file hashed) by the first rank of each host alone while the host's other ranks wait in an
    agreement: one process streams a large text through memory, not every rank at once; its
    failure (a bad text, no writable folder) is the same one line on every rank. The others
    then take the validated files as they are (data.text.adopt_cache: the same files, unchanged
    since), so they hash nothing, and memory-map the tokens like the first."""
    path = config.dataset.removeprefix("text:")
    kw = dict(block_size=config.block_size, tokens=config.tokens, seed=config.seed)
    global_batch = config.batch_size * size * config.accumulate

    def both():
        return (data.TextDataset(path, split="train", **kw),
                data.TextDataset(path, split="val", windows=config.eval_batches * global_batch,
                                 **kw))

    first = comm.local_rank() == 0
    built = _agree(both if first else lambda: None)
    mine = data.text.cache_record(path, config.tokens) if first else None
    records = comm.allgather_object(mine)
    if first:
        return built
    data.text.adopt_cache(records)
    return both()


def _raw_datasets(config):
    if config.dataset.startswith("npz:"):
        return data.load_npz(config.dataset.removeprefix("npz:"))
    if config.dataset != "synthetic":
        fixed = config.normalize == "fixed"  # "train" restandardises this one; exact either way
        return (data.load(config.dataset, "train", config.data_dir, normalize=fixed),
                data.load(config.dataset, "test", config.data_dir, normalize=fixed))
    n_test = max(1, config.synthetic_samples // TEST_FRACTION)
    shape = config.sample_shape()                       # synthetic: the model's input
    # One draw for both splits, so the test set has the training set's class prototypes.
    full = data.synthetic(config.synthetic_samples + n_test, shape, seed=config.seed)
    cut = config.synthetic_samples
    return tuple(type(full)(full.images[s], full.labels[s], full.classes, "synthetic")
                 for s in (slice(0, cut), slice(cut, None)))


def _check_sizes(config, train_set, test_set, size):
    sizes = comm.allgather_object((len(train_set), len(test_set)))
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
        fits = global_batch & -global_batch     # the largest power of two dividing the batch
        hint = (f"; --micro-shards {fits} does" if fits % size == 0 else
                f"; no power of two that is a multiple of {size} (the ranks) does")
        raise UsageError(f"--deterministic: the global batch of {global_batch} samples does not "
                         f"divide into --micro-shards {m} equal micro-shards{hint}")


def _build_model(config, train_set, backend):
    """The zoo model the flags describe; UsageError when its parameters cannot be allocated
    (--hidden 100000000), before any step."""
    if config.model == "gpt":
        kw = dict(vocab_size=train_set.classes, block_size=config.block_size,
                  n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                  dropout=config.dropout, seed=config.seed, kernels=backend)
    else:
        kw = dict(seed=config.seed, kernels=backend, classes=train_set.classes)
        if config.model == "mlp":
            kw["in_features"] = int(np.prod(train_set.images.shape[1:]))
            if config.hidden is not None:
                kw["hidden"] = tuple(config.hidden)
        if config.model.startswith("resnet"):
            kw["input_shape"] = tuple(train_set.images.shape[1:])   # any (C, H, W)
        if config.dropout:
            kw["dropout"] = config.dropout
    try:
        model = models.get(config.model, **kw)
    except MemoryError as exc:
        hidden = f" --hidden {','.join(map(str, config.hidden))}" if config.hidden else ""
        raise UsageError(f"--model {config.model}{hidden}: its parameters do not fit in memory "
                         f"({one_line(exc)})") from None
    if config.model == "gpt":
        return model
    if config.sync_bn:
        if not any(isinstance(m, nn.BatchNormBase) for m in model.modules()):
            if comm.rank() == 0:
                print(f"mpitrain: warning: --sync-bn has no effect, --model {config.model} has "
                      f"no BatchNorm", file=sys.stderr, flush=True)
        nn.SyncBatchNorm.convert(model)
    return model


def _build_optimizer(config, model, lr):
    params = model.parameters()
    no_decay = None if config.decay_bn_bias else optim.is_bias_or_norm
    if config.optimizer in ("adam", "adamw"):
        kind = optim.AdamW if config.optimizer == "adamw" else optim.Adam
        inner = kind(params, lr=lr, betas=config.betas, weight_decay=config.weight_decay,
                     no_decay=no_decay)
    else:
        inner = optim.SGD(params, lr=lr, momentum=config.momentum,
                             weight_decay=config.weight_decay, no_decay=no_decay)
    compression = Compression.fp16 if config.fp16_allreduce else Compression.none
    passes, exact = config.accumulate, {}
    if config.deterministic:   # one pass per micro-shard, loss x 1/M and summed: no N anywhere
        passes, exact = config.micro_shards // comm.size(), dict(op=comm.Sum, deterministic=True)
    return DistributedOptimizer(inner, model.named_parameters(), compression=compression,
                                average=config.average, average_every=config.average_every,
                                fusion_threshold_bytes=config.fusion_threshold_bytes,
                                overlap=config.overlap, clip_grad_norm=config.clip_grad_norm,
                                backward_passes_per_step=passes, sharding=config.sharding,
                                **exact)


def _read_checkpoint(config):
    """Rank 0: the newest valid checkpoint as plain data (or None); others: None."""
    if comm.rank() != 0:
        return None
    found, skipped = ckpt.read_latest(config.checkpoint_dir, schema=META)
    for reason in skipped:
        print(f"mpitrain: warning: skipping {reason}", file=sys.stderr, flush=True)
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
    if config.tensorboard:
        tensorboard.require()           # the optional package, before any work is done
        if os.path.exists(config.tensorboard) and not os.path.isdir(config.tensorboard):
            raise UsageError(f"--tensorboard {config.tensorboard}: exists and is not a folder")
        _check_creatable("--tensorboard", os.path.abspath(config.tensorboard))
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


def run(config):
    """Set up the job ``config`` describes on every rank, then ``Trainer.fit`` it; returns the
    summary record (the same dict on every rank). Bad input is a UsageError on every rank, a
    file that cannot be written an OutputError, Ctrl-C an Interrupted."""
    try:
        comm.init(threads=None)                   # the budget is config.threads, set below
    except (ValueError, comm.CollectiveError) as exc:
        # A bad MPITRAIN_* setting (the same ValueError on every rank) or settings that differ
        # across ranks (CollectiveError on every rank): bad input, not a crash.
        raise UsageError(str(exc)) from None
    trainer = lock = None
    # --preempt-signals: noted from here on, acted on after the next step (preempt.py)
    signals = Signals(config.preempt_signals).install()
    try:
        trainer, outputs, lock = _start(config, signals)
        # --timeline / MPITRAIN_TIMELINE records per-rank spans (mpitrain/timeline/); the same
        # on every rank.
        trace = timeline.activate(timeline.Timeline(config.timeline or None, trainer.rank))
        try:
            summary = trainer.fit(outputs)
            trace.close(comm.comm())
        finally:
            outputs.close()
            timeline.activate(None)
    except KeyboardInterrupt:
        reached = (None, None) if trainer is None else (trainer.step, trainer.last_checkpoint_step)
        raise Interrupted(*reached, config.checkpoint_dir) from None
    finally:
        signals.restore()
        if lock is not None:
            lock.release()
    return summary


def _start(config, signals=None):
    """Everything before the first step, on every rank: threads, the launch agreement, backend,
    data, model, optimizer, the checkpoint to resume, rank 0's state everywhere, the checkpoint
    folder's lock and the header. Returns (trainer, outputs, the lock or None)."""
    rank, size = comm.rank(), comm.size()
    config = _per_rank_batch(config, size)
    # --deterministic: BLAS results depend on the thread count (OpenBLAS splits some GEMMs
    # differently), so one thread per rank unless --threads says otherwise, for every N
    n_threads = threads.configure(config.threads or (1 if config.deterministic else 0),
                                  comm.local_size())
    try:
        _check_same_launch(config)
        backend = _agree(_backend, config)
        train_set, test_set = _agree(_datasets, config)
        _agree(_check_sizes, config, train_set, test_set, size)
        _agree(_check_outputs, config, rank)
        model = _agree(_build_model, config, train_set, backend)
        base_lr = config.lr * (size if config.scale_lr else 1)
        optimizer = _build_optimizer(config, model, base_lr)
        outputs = Outputs(rank)
        trainer = Trainer(config, backend, train_set, test_set, model, optimizer, base_lr,
                          outputs, signals)
        checkpoint = None
        if config.checkpoint_dir:       # a relaunch resumes from it (cli.py)
            ckpt.note_resumable()
        if config.resuming:
            checkpoint = comm.broadcast_object(_agree(_read_checkpoint, config), root_rank=0)
            if checkpoint is not None:
                _agree(trainer.resume, checkpoint)
        # Every replica starts from rank 0's state (the zoo's seeded init already agrees; a
        # model built or loaded differently on some rank would not).
        broadcast_parameters(model.state_dict(), root_rank=0)    # parameters and buffers
        broadcast_optimizer_state(optimizer, root_rank=0)
    except comm.CollectiveError as exc:
        # before the first step, ranks that disagree were given different input
        raise UsageError(str(exc)) from None

    # From here on the job is valid: files may be written, by this job alone.
    lock = _agree(_lock_folder, config, rank)
    outputs.open_metrics(config.metrics_json, append=checkpoint is not None)
    outputs.open_tensorboard(config.tensorboard)
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
    return trainer, outputs, lock


def _lock_folder(config, rank):
    """Rank 0: --checkpoint-dir's lock (runtime/folder_lock.py), held to the end of the job: a
    second job on the folder is refused (UsageError), the temporary files of a writer killed
    mid-write are removed. None on the other ranks and without --checkpoint-dir."""
    if rank != 0 or not config.checkpoint_dir:
        return None
    return folder_lock.acquire(config.checkpoint_dir)


def _per_rank_batch(config, size):
    """--global-batch-size G: --batch-size G / (ranks x --accumulate), the same G at any N (a
    restart on fewer ranks); one line if it does not divide."""
    if config.global_batch_size is None:
        return config
    share, left = divmod(config.global_batch_size, size * config.accumulate)
    if left or not share:
        accumulate = f" x --accumulate {config.accumulate}" if config.accumulate > 1 else ""
        raise UsageError(f"--global-batch-size {config.global_batch_size} does not divide into "
                         f"{size} ranks{accumulate}: give a multiple of "
                         f"{size * config.accumulate}, or run on a number of ranks dividing it")
    return config.replace(batch_size=share)


def _check_same_launch(config):
    """Every rank was started with the same settings: the resolved Config (flags over
    MPITRAIN_* variables) and every MPITRAIN_* variable mpitrain reads. Ranks launched with
    different hyper-parameters would otherwise train apart without a word (only a different
    model or batch size trips a collective). One line naming each setting and its ranks."""
    mine = {f"--{name.replace('_', '-')}": value for name, value in config.as_dict().items()}
    mine.update(env.snapshot())
    every = comm.allgather_object(mine)
    differ = [f"{key}: {comm.format_groups(comm.group(enumerate(e.get(key) for e in every)))}"
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


__all__ = ["run"]
