"""DistributedOptimizer: the facade. It validates its arguments, picks one strategy at
construction -- gradients.py (Horovod), weights.py (PNNL), deterministic.py, sharded.py
(optimizer-state and gradient sharding) or parameter_sharding.py -- and delegates the backward
hook, ``synchronize``, ``step`` and ``zero_grad`` to it; it makes no MPI calls of its
own. Its public surface is Horovod's (docs/byo_loop.md).
"""
import contextlib
import math
from numbers import Real

import numpy as np

from mpitrain import comm
from mpitrain.parallel.deterministic import DeterministicGradients, check_arguments
from mpitrain.parallel.gradients import (OVERLAP_BUCKET_BYTES, Compression, GradientAveraging,
                                         is_compressor)
from mpitrain.parallel import parameter_sharding, sharded
from mpitrain.parallel.powersgd import PowerSGD
from mpitrain.parallel.sharded_join import ShareServer
from mpitrain.parallel.weights import WeightAveraging, average_weights

AVERAGE_MODES = ("gradients", "weights")


def adasum_arguments(average, deterministic, sharding, process_set):
    """op=mt.Adasum combines each gradient pairwise (comm/adasum.py): whole gradients, after
    backward, over a power-of-two number of ranks. What it cannot be combined with is refused
    here, the same on every rank."""
    if average != "gradients" or deterministic or sharding != "none":
        raise ValueError(f"op=mt.Adasum combines whole gradients: it needs average='gradients', "
                         f"deterministic=False and sharding='none' (got average={average!r}, "
                         f"deterministic={deterministic!r}, sharding={sharding!r})")
    size = comm.group_size(process_set) if process_set.included() else None
    if size is not None and not comm.is_power_of_two(size):
        raise ValueError(f"op=mt.Adasum needs a power-of-two number of ranks (recursive "
                         f"halving-doubling), got {size}")


class DistributedOptimizer:
    """Wraps an optimizer so that N replicas stay one model (wraps, never subclasses).

    ``average="gradients"`` (Horovod; gradients.py): ``step()`` = ``synchronize()`` -- every
    ``.grad`` averaged across ranks -- then the inner optimizer's ``step()``. ``clip_grad_norm``
    C > 0 clips between the two: after every average (``synchronize()``, or the one ``step()``
    makes, whatever the path: overlap, accumulation, deterministic) the averaged gradients are
    scaled to a global 2-norm of at most C (``mt.nn.clip_grad_norm_``, the same on every rank,
    once per step); ``grad_norm`` is then the norm before clipping (None until the first, or
    without C). The same by hand (Horovod's idiom): ``synchronize()``, clip, then ``with
    opt.skip_synchronize(): opt.step()``.
    ``average="weights"`` (PNNL; weights.py): every rank steps on its own gradients; every
    ``average_every`` steps the parameters are averaged across ranks (optimizer state stays
    per rank). ``deterministic=True`` (deterministic.py; gradients mode, no compression, a
    power-of-two process set, ``backward_passes_per_step`` k a power of two): each of the k
    passes runs on one micro-shard and is one leaf of a fixed tree summed across ranks in
    ``step()``: the parameters are bitwise identical for every N with the same micro-shards.

    ``op``: ``mt.Average`` or ``mt.Sum``; ``gradient_predivide_factor`` f divides gradients by f
    before the sum and multiplies by f after it (Horovod's guard against fp16 overflow).
    ``overlap`` (gradients mode): start each bucket's allreduce during backward -- pass
    ``opt.backward_hook`` to ``model.backward`` -- and wait for them in ``synchronize()``.
    ``fusion_threshold_bytes``: size limit of a bucket (0 = one allreduce per tensor); None
    takes the settings' MPITRAIN_FUSION_THRESHOLD, once, here (default 4 MiB with overlap, else
    64 MiB). With MPITRAIN_AUTOTUNE=1 (gradients mode, several ranks) ``autotuner``
    (autotune.py) tries other thresholds and ring/MPI on the first steps and keeps the fastest.
    ``comm_time_s`` accumulates the seconds spent averaging (for the training metrics).

    ``sharding``: "none", "optimizer" (sharded.py, ZeRO stage 1): each rank keeps the
    optimizer state of its 1/N slice of the flat parameters and steps that slice, then the
    slices are allgathered; or "gradients" (stage 2): the gradient buckets are
    reduce-scattered instead of allreduced, and each rank keeps only its chunk of each (the
    rest of every gradient is released). The parameters are the unsharded run's, bit for bit,
    and a checkpoint holds the unsharded state (it loads at any N). With deterministic=True
    both average in the fixed tree, whole, and shard the optimizer state (the bits of the
    unsharded deterministic run at every N). "parameters" (parameter_sharding.py, stage 3):
    as "gradients", and after the first step each rank keeps only its share of the parameters;
    a layer's are allgathered just before its forward and its backward (the next layer's
    prefetched meanwhile) and released after; read them whole in ``with
    opt.full_parameters():``. Weights mode and device parameters are refused; "gradients" and
    "parameters" also refuse a compressor of your own, MPITRAIN_AUTOTUNE, and clip_grad_norm
    with other than float32 parameters (it clips by the exact norm over the slices,
    mt.nn.clip_grad_norm_'s bits).
    ``memory_bytes()`` says what this rank holds.

    ``backward_passes_per_step`` k (accumulation.py): ``step()`` comes after k backward passes,
    whose gradients are summed locally (scale the loss by 1/k for their mean) and averaged once,
    during the k-th pass. ``step()`` at another count raises ValueError (on every rank in
    gradients mode, on each rank alone in weights mode) and drops the accumulated gradients.
    ``with opt.no_sync():`` (PyTorch's idiom) passes inside add to the gradients without being
    counted or averaged; the next pass outside averages them all.
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 op=comm.Average, gradient_predivide_factor=1.0, average="gradients",
                 average_every=1, fusion_threshold_bytes=None, overlap=True,
                 backward_passes_per_step=1,
                 process_set=comm.global_process_set, deterministic=False, clip_grad_norm=None,
                 sharding="none"):
        if isinstance(op, str) and op.lower() == "adasum":
            op = comm.Adasum
        if op not in (comm.Average, comm.Sum, comm.Adasum):
            raise ValueError(f"op {op!r}: DistributedOptimizer supports mt.Average, mt.Sum and "
                             f"mt.Adasum")
        if op is comm.Adasum:
            adasum_arguments(average, deterministic, sharding, process_set)
        if isinstance(compression, PowerSGD) and (
                average != "gradients" or sharding != "none" or op is comm.Adasum
                or gradient_predivide_factor != 1.0):
            raise ValueError(f"compression={compression!r} compresses whole gradients with "
                             f"state: it needs average='gradients', sharding='none', op "
                             f"mt.Average or mt.Sum and gradient_predivide_factor=1.0")
        if compression is Compression.bf16 and sharding in ("gradients", "parameters"):
            raise ValueError(f"compression=mt.Compression.bf16 with sharding={sharding!r}: the "
                             f"reduce-scattered shards are not decoded from bfloat16; use "
                             f"mt.Compression.fp16, or sharding='optimizer'")
        if isinstance(compression, PowerSGD) and compression.used:
            raise ValueError(f"compression={compression!r} holds one optimizer's state; make "
                             f"a new one for each DistributedOptimizer")
        if average not in AVERAGE_MODES:
            raise ValueError(f"average {average!r}: expected one of {', '.join(AVERAGE_MODES)}")
        for name, count in (("average_every", average_every),
                            ("backward_passes_per_step", backward_passes_per_step)):
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
                raise ValueError(f"{name} {count!r}: expected an integer >= 1")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor {gradient_predivide_factor!r}: "
                             f"must be > 0")
        if not is_compressor(compression):
            raise ValueError(f"compression {compression!r}: expected mt.Compression.none, "
                             f".fp16 or an object with compress(array) -> (array, ctx) and "
                             f"decompress(array, ctx) -> array")
        if average == "weights" and compression is not Compression.none:
            raise ValueError(f"compression {compression!r} applies to gradients; "
                             f"average='weights' sends full-precision weights")
        if clip_grad_norm is not None:
            if (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, Real)
                    or not 0 < clip_grad_norm < math.inf):
                raise ValueError(f"clip_grad_norm {clip_grad_norm!r}: expected a finite number "
                                 f"> 0 (the largest global 2-norm of the averaged gradients)")
            if average == "weights":
                raise ValueError(f"clip_grad_norm={clip_grad_norm!r} clips averaged gradients; "
                                 f"average='weights' averages parameters instead")
        if deterministic:
            check_arguments(average, compression, gradient_predivide_factor,
                            backward_passes_per_step, process_set)
        sharded.check_arguments(sharding, average, deterministic, optimizer.params,
                                compression, clip_grad_norm)
        self.sharding = sharding
        self.overlap = bool(overlap)
        self.process_set = process_set    # whose ranks average (others: ValueError at the step)
        default = (OVERLAP_BUCKET_BYTES if self.overlap and average == "gradients"
                   else comm.DEFAULT_THRESHOLD_BYTES)
        self.fusion_threshold_bytes = comm.fusion_threshold(fusion_threshold_bytes, default)
        self.optimizer = optimizer
        self.parameters = list(optimizer.params)
        self.names = _parameter_names(optimizer.params, named_parameters)
        self.compression = compression
        if isinstance(compression, PowerSGD):
            compression.used = True
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.average = average
        self.average_every = int(average_every)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.deterministic = bool(deterministic)
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.grad_norm = None         # the global 2-norm before the last clip (clip_grad_norm)
        self.comm_time_s = 0.0
        self._skip = False
        # the one strategy, for the optimizer's life
        if self.deterministic:
            self.strategy = (DeterministicGradients(self) if sharding == "none"
                             else parameter_sharding.DeterministicParameterSharding(self)
                             if sharding == "parameters"
                             else sharded.DeterministicSharding(self))
        elif sharding == "parameters":
            self.strategy = parameter_sharding.ParameterSharding(self)
        elif sharding == "optimizer":
            self.strategy = sharded.OptimizerSharding(self)
        elif sharding == "gradients":
            self.strategy = sharded.GradientSharding(self)
        elif average == "weights":
            self.strategy = WeightAveraging(self)
        else:
            self.strategy = GradientAveraging(self)

    # -- the inner optimizer's surface --
    @property
    def params(self):
        """Every parameter averaged, in the inner optimizer's order as it was wrapped (a
        sharded inner optimizer then steps pieces of them only)."""
        return self.parameters

    @property
    def lr(self):
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        self.optimizer.lr = value

    @property
    def autotuner(self):
        """The MPITRAIN_AUTOTUNE=1 autotuner (autotune.py), or None."""
        return getattr(self.strategy, "autotuner", None)

    def zero_grad(self, inner=None):
        """Zero every gradient; a partial accumulation is dropped (counting starts again).
        ``inner``: what zeroes them instead of the inner optimizer's ``zero_grad``
        (mpitrain.torch passes torch's, with its ``set_to_none``)."""
        self.strategy.zero_grad()
        (inner or self.optimizer.zero_grad)()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def load_checkpoint_state(self, state):
        """Load what ``checkpoint_state`` returned (of a run at any N), or a sharded
        checkpoint's reader (``read``/``whole``: train/checkpoint_shards.py): the one way a
        checkpoint's optimizer state comes back (mt.checkpoint.load_latest, the CLI)."""
        if hasattr(state, "whole") and not self.strategy.reads_pieces:
            state = state.whole()           # an unsharded optimizer needs all of it
        self.strategy.load_checkpoint_state(state)

    def checkpoint_pieces(self):
        """This rank's piece of the optimizer state, for a checkpoint every rank writes its
        part of (sharded: (scalars, [(parameter, start, stop)], {buffer: values}, shapes)), or
        None where a checkpoint holds ``checkpoint_state()`` instead."""
        return self.strategy.checkpoint_pieces()

    def memory_bytes(self):
        """The bytes this rank holds: {"parameters", "gradients", "optimizer_state"}."""
        return self.strategy.memory_bytes()

    def join_hook(self):
        """What a rank that joins (``mt.join(optimizers=[opt])``) does for this optimizer's
        steps: None, or (sharded: its share is its own) a hook that receives its chunk of each
        averaged gradient, steps its share and sends it (parallel/sharded_join.py)."""
        if isinstance(self.strategy, sharded.ShardedStep) and self.strategy.size > 1:
            return ShareServer(self.strategy)
        return None

    def full_parameters(self):
        """``with opt.full_parameters():`` -- collective: every parameter's ``.data`` whole
        inside the block (read a model's ``state_dict()``, save it, sample from it, load
        into it). Needed only with ``sharding="parameters"``, whose parameters are otherwise
        whole inside their layer's forward and backward only; elsewhere it does nothing."""
        return self.strategy.full_parameters()

    # -- averaging --
    def backward_hook(self, params):
        """Start averaging these parameters' gradients now; pass it to backward as
        ``model.backward(grad, on_layer_done=opt.backward_hook)``. With ``overlap=True`` their
        buckets' allreduces start on the comm thread as soon as complete (gradients.py);
        otherwise it only counts the pass (accumulation.py). Between this hook and ``step()``
        the caller must make no MPI calls (the comm thread owns MPI)."""
        self.strategy.hook(params)

    def no_sync(self):
        """``with opt.no_sync(): ...``: backward passes inside add to ``.grad`` locally, are not
        counted towards ``backward_passes_per_step`` and start no average; the next pass
        outside (with the hook) averages the sum of all of them (PyTorch DDP's idiom)."""
        return self.strategy.no_sync()

    def synchronize(self):
        """Average every parameter's ``.grad`` across ranks, in place (gradients mode); then
        check the count of backward passes (``backward_passes_per_step``) and clip the averages
        to ``clip_grad_norm`` (when set)."""
        self.strategy.synchronize()
        self.strategy.clip()

    @property
    def synchronized(self):
        """True between an average (``synchronize()``) and the next step, pass or zero_grad."""
        return self.strategy.synchronized

    def passes_complete(self):
        """True when this step's ``backward_passes_per_step`` counted passes have all reported
        (the hook): the average may finish now (mpitrain.torch does, as backward ends)."""
        return self.strategy.passes.complete()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (you already did)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def settle(self):
        """Collective: end on one model (weights mode: average unless the last step did)."""
        self.strategy.settle()

    def checkpoint_state(self):
        """Collective: the optimizer state a checkpoint holds; in weights mode the mean of the
        ranks' per-rank moments."""
        return self.strategy.checkpoint_state()

    def average_weights(self):
        """Average every parameter's ``.data`` across ranks now (weights mode does it every k)."""
        average_weights(self)

    def set_fusion_threshold(self, threshold_bytes):
        """Change the bucket size limit between steps, to the same value on every rank (the
        autotuner does); the overlap plan is rebuilt and agreed at the next step."""
        self.strategy.set_fusion_threshold(threshold_bytes)

    def step(self, flags=None, update=None):
        """Average (unless inside ``skip_synchronize``), then update. ``flags``: an int of bits
        this rank raises for this step (a stop request, ...); they ride in the message the
        ranks already exchange to agree on the step, and ``step`` returns their OR over the
        ranks -- or None where the step made no such exchange (one rank, weights mode,
        MPITRAIN_CHECK=0, inside ``skip_synchronize``): exchange them yourself then.
        ``update``: what updates the parameters instead of the inner optimizer's ``step``
        (mpitrain.torch passes torch's, with its closure)."""
        return self.strategy.step(self._skip, flags, update)

    def __repr__(self):
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, average={self.average!r}, "
                f"average_every={self.average_every}, compression={self.compression!r}, "
                f"overlap={self.overlap}, "
                f"backward_passes_per_step={self.backward_passes_per_step}"
                + (", deterministic=True" if self.deterministic else "")
                + (f", sharding={self.sharding!r}" if self.sharding != "none" else "")
                + (f", clip_grad_norm={self.clip_grad_norm}" if self.clip_grad_norm else "")
                + ")")


def _parameter_names(params, named_parameters):
    """Names of ``params`` in optimizer order; ValueError on duplicate, missing or foreign names."""
    if named_parameters is None:
        return [f"param.{i}" for i in range(len(params))]
    pairs = list(named_parameters)
    by_id = {}
    seen = set()
    for name, p in pairs:
        if name in seen:
            raise ValueError(f"duplicate parameter name {name!r} in named_parameters")
        seen.add(name)
        by_id[id(p)] = name
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"optimizer parameters {missing} have no name in named_parameters")
    if len(pairs) != len(params):
        own = {id(p) for p in params}
        extra = [name for name, p in pairs if id(p) not in own]
        raise ValueError(f"named_parameters {extra} are not in the optimizer")
    return [by_id[id(p)] for p in params]
