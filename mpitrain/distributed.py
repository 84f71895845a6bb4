"""Bridge between the model side (nn, optim) and the collectives (comm): no MPI calls of its own.

broadcast_parameters makes every replica start from root_rank's weights, so ranks that initialised
differently (other seeds, a checkpoint loaded only on rank 0) agree before the first step.
"""
import contextlib
import time

import numpy as np

from mpitrain import autotune
from mpitrain.accumulation import PassCount
from mpitrain.comm import collectives, handles, overlap
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.engine import allreduce_flat
from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES, check_threshold
from mpitrain.comm.handles import current_timeline
# ops.on_device, not comm/device.py's test: importing device.py here would load it in every
# process, GPU or not
from mpitrain.comm.ops import on_device
from mpitrain.comm.process_sets import global_process_set, world_of
from mpitrain.deterministic import GradientTree, check_ranks

# Gradient bucket size when overlapping: small enough that the last layers' allreduce starts
# early in backward, large enough that per-call latency stays small (PyTorch DDP: 25 MB).
OVERLAP_BUCKET_BYTES = 4 * 1024 * 1024


def broadcast_parameters(params, root_rank=0, process_set=global_process_set):
    """Overwrite every parameter in place with root_rank's values (Horovod's spellings).

    params, any of:
    - ``model.state_dict()`` or any dict name -> array (host or device) or Parameter: the arrays
      are written in place, so the model they belong to changes (broadcast in sorted name order);
    - ``model.named_parameters()``: an iterable of (name, Parameter or array) pairs;
    - ``model.parameters()``: an iterable of Parameters (or arrays), named by position -- every
      rank must list them in the same order, as a model's own ``parameters()`` does.
    Anything that cannot be written back (a list, a scalar, a read-only array, a pair that is not
    (name, array)) is a ValueError, and a difference in names across ranks a CollectiveError:
    raised on every rank, before any data moves, never ignored. process_set: the ranks that
    take part (root_rank is a global rank among them).
    """
    items, error = _writable_arrays(params)
    names = [name for name, _ in items]
    # One agreement first: a rank whose input is bad must not leave the others in a broadcast.
    reports = collectives.allgather_object((error, names), process_set=process_set)
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None]
    if errors:
        raise ValueError("broadcast_parameters: " + "; ".join(errors))
    if any(other != names for _, other in reports):
        differ = [r for r, (_, other) in enumerate(reports) if other != reports[0][1]]
        raise CollectiveError(
            f"broadcast_parameters: the parameter names of ranks {differ} differ from rank 0's "
            f"({len(reports[0][1])} names starting {reports[0][1][:3]})")
    for name, array in items:
        collectives.broadcast_(array, root_rank, name=f"broadcast_parameters.{name}",
                               process_set=process_set)


def _writable_arrays(params):
    """``([(name, array)], error)``: the arrays broadcast_parameters writes into, or why not."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    else:
        try:
            pairs = list(params)
        except TypeError:
            return [], (f"expected a dict of arrays, (name, parameter) pairs or parameters, got "
                        f"{type(params).__name__}")
        if pairs and not isinstance(pairs[0], tuple):      # model.parameters(): no names
            pairs = [(f"param.{i}", p) for i, p in enumerate(pairs)]
    items = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            return [], (f"expected (name, parameter) pairs; got {type(pair).__name__} "
                        f"among them")
        name, value = pair
        # an array as is (NumPy's, CuPy's and Numba's .data are buffers), else a Parameter's .data
        array = (value if isinstance(value, np.ndarray) or on_device(value)
                 else getattr(value, "data", value))
        if not on_device(array):
            if not isinstance(array, np.ndarray):
                return [], (f"{name!r} is a {type(value).__name__}, which cannot be written "
                            f"back in place; pass the model's arrays (model.state_dict()) or "
                            f"Parameters")
            if not array.flags.writeable:
                return [], f"{name!r} is a read-only array; it cannot be written back in place"
        items.append((str(name), array))
    return items, None


# --- Horovod-style optimizer wrapper and PNNL weight averaging -----------------------------------

class Compressor:
    """A built-in compression: ``wire_dtype(dtype)`` is the dtype sent for arrays of ``dtype``.

    It also speaks Horovod's protocol (``compress(array) -> (array, ctx)``,
    ``decompress(array, ctx) -> array``), but DistributedOptimizer does not call it: it casts
    into persistent wire buffers (or inside the overlap buckets) instead of allocating per step.
    """

    def __init__(self, name, wire):
        self.name = name
        self._wire = wire  # {float dtype: dtype on the wire}

    def wire_dtype(self, dtype):
        return np.dtype(self._wire.get(np.dtype(dtype), dtype))

    def compress(self, array):
        wire = self.wire_dtype(array.dtype)
        return (array if wire == array.dtype else array.astype(wire)), array.dtype

    def decompress(self, array, ctx):
        return array if array.dtype == ctx else array.astype(ctx)

    def __repr__(self):
        return f"mt.Compression.{self.name}"


class Compression:
    """``none``: gradients travel as they are; ``fp16``: float32 travels as float16 (half the bytes,
    ~3 significant digits; restored to float32 after the average).

    Any other object with Horovod's protocol is accepted too (a class with static methods, as in
    Horovod, or an instance): ``compress(array) -> (wire_array, ctx)`` on each gradient,
    the wire arrays averaged across ranks (fused, like the gradients themselves), then
    ``decompress(wire_array, ctx) -> array`` of the gradient's shape, written back into ``.grad``.
    Wire arrays must have the same shape and dtype on every rank (else CollectiveError on every
    rank); such a compressor runs after backward (no overlap with it).
    """

    none = Compressor("none", {})
    fp16 = Compressor("fp16", {np.dtype(np.float32): np.dtype(np.float16)})


def is_compressor(obj):
    """True for mt.Compression.none/.fp16 and any object with compress() and decompress()."""
    return (isinstance(obj, Compressor) or (callable(getattr(obj, "compress", None))
                                            and callable(getattr(obj, "decompress", None))))


AVERAGE_MODES = ("gradients", "weights")


class DistributedOptimizer:
    """Wraps an optimizer so that N replicas stay one model (wraps, never subclasses).

    ``average="gradients"`` (Horovod): ``step()`` = ``synchronize()`` -- every ``.grad`` averaged
    across ranks through the fusion buffer and our ring -- then the inner optimizer's ``step()``.
    To clip between the two, call ``synchronize()``, clip, then ``with opt.skip_synchronize():
    opt.step()``.

    ``average="weights"`` (PNNL): every rank steps on its own gradients; every ``average_every``
    steps the parameters are averaged across ranks. With plain SGD and ``average_every=1`` this is
    the same update as gradient averaging (the mean of ``w - lr*g_r`` is ``w - lr*mean(g_r)``).
    Optimizer state (momentum, Adam moments) stays per rank in this mode, as in PNNL.

    ``op``: ``mt.Average`` or ``mt.Sum``; ``gradient_predivide_factor`` f divides gradients by f
    before the sum and multiplies by f after it (Horovod's guard against fp16 overflow).
    ``overlap`` (gradients mode): start each bucket's allreduce during backward, as soon as its
    gradients are done -- pass ``opt.backward_hook`` to ``model.backward`` -- and wait for them
    in ``synchronize()``; without the hook (or with ``overlap=False``) everything is averaged
    in ``synchronize()``.
    ``fusion_threshold_bytes``: size limit of a bucket (0 = one allreduce per tensor); None
    takes the settings' MPITRAIN_FUSION_THRESHOLD, once, here (default 4 MiB with overlap, else
    64 MiB). With MPITRAIN_AUTOTUNE=1 (gradients mode, several ranks) ``autotuner``
    (autotune.py) tries other thresholds and ring/MPI on the first steps and keeps the fastest.
    ``comm_time_s`` accumulates the seconds spent averaging (for the training metrics).

    ``backward_passes_per_step`` k (accumulation.py): ``step()`` comes after k backward passes,
    whose gradients are summed locally (scale the loss by 1/k for their mean) and, in gradients
    mode, averaged across ranks once, during the k-th pass (overlapped with it). The hook counts
    the passes (needed for k > 1); ``step()`` at another count raises ValueError (on every rank:
    the count is agreed after the average, one small exchange per step, also for k = 1 -- two
    hooked passes before a step, say) and drops the accumulated gradients.
    ``with opt.no_sync():`` (PyTorch's idiom) passes inside add to the gradients without being
    counted or averaged; the next pass outside averages them all. In weights mode the k passes
    make one local step (nothing is sent per pass anyway; the weights are still averaged every
    ``average_every`` steps) and the count is checked on each rank alone.

    ``deterministic=True`` (deterministic.py; gradients mode, no compression, a power-of-two
    process set, ``backward_passes_per_step`` k a power of two): each of the k passes must run
    on one micro-shard of the global batch -- rank r the micro-shards [r*k, (r+1)*k) of N*k,
    in order -- and report every parameter to ``backward_hook``; each pass's gradients become
    one leaf of a fixed binary tree over the N*k micro-shards, and ``step()`` sums the tree
    across ranks (no overlap with backward), divides by N for ``mt.Average``, and updates.
    The parameters are then bitwise identical for every N with the same micro-shards. With
    k = 1 the hook may be left out (``.grad`` at ``step()`` is the one leaf).
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 op=collectives.Average, gradient_predivide_factor=1.0, average="gradients",
                 average_every=1, fusion_threshold_bytes=None, overlap=True,
                 backward_passes_per_step=1,
                 process_set=global_process_set, deterministic=False):
        if op not in (collectives.Average, collectives.Sum):
            raise ValueError(f"op {op!r}: DistributedOptimizer supports mt.Average and mt.Sum")
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
        if deterministic:
            _check_deterministic(average, compression, gradient_predivide_factor,
                                 backward_passes_per_step, process_set)
        self.overlap = bool(overlap)
        self.process_set = process_set    # whose ranks average (others: ValueError at the step)
        default = (OVERLAP_BUCKET_BYTES if self.overlap and average == "gradients"
                   else DEFAULT_THRESHOLD_BYTES)
        self.fusion_threshold_bytes = collectives.fusion_threshold(fusion_threshold_bytes, default)
        self.optimizer = optimizer
        self.names = _parameter_names(optimizer.params, named_parameters)
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.average = average
        self.average_every = int(average_every)
        self.comm_time_s = 0.0
        self._synchronized = False
        self._skip = False
        self._wire = None  # fp16 buffers, allocated at the first synchronize
        self._buckets = None  # overlap.BucketAllreduce, built at the first step
        # submission slot of each parameter: the reverse of optimizer order, which for a
        # Sequential is the order backward finishes them
        n = len(self.params)
        self._slot = {id(p): n - 1 - i for i, p in enumerate(self.params)}
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._passes = PassCount(n, self.backward_passes_per_step)
        # deterministic=True: the passes' gradients as leaves of the fixed tree (deterministic.py)
        self.deterministic = bool(deterministic)
        self._tree = GradientTree(self.params) if self.deterministic else None
        # MPITRAIN_AUTOTUNE=1: the first steps try thresholds and paths (autotune.py)
        self.autotuner = None
        if average == "gradients" and process_set.included() and not self.deterministic:
            self.autotuner = autotune.for_optimizer(
                world_of(process_set, "DistributedOptimizer"),
                lambda obj: collectives.allgather_object(obj, process_set=process_set),
                self.fusion_threshold_bytes, sum(p.data.nbytes for p in self.params),
                self.set_fusion_threshold)

    # -- the inner optimizer's surface --
    @property
    def params(self):
        return self.optimizer.params

    @property
    def lr(self):
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        self.optimizer.lr = value

    def zero_grad(self):
        """Zero every gradient; a partial accumulation is dropped (counting starts again)."""
        if self._buckets is not None and self._buckets.pending():
            # averages already running (the k-th pass happened, no step): let them finish, as
            # every rank's do, before the gradients they write into are zeroed
            self._buckets.finish([p.grad for p in reversed(self.params)])
        self._passes.reset()
        if self._tree is not None:
            self._tree.reset()
        self._synchronized = False
        self.optimizer.zero_grad()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    # -- averaging --
    def backward_hook(self, params):
        """Start averaging these parameters' gradients now; pass it to backward as
        ``model.backward(grad, on_layer_done=opt.backward_hook)``.

        With ``overlap=True`` (gradients mode, several ranks, host arrays) the gradients go into
        fixed buckets (reverse layer order, ``fusion_threshold_bytes`` each, the same plan on
        every rank); a bucket's allreduce starts on the communication thread as soon as all of
        its gradients were reported, and ``synchronize()`` (called by ``step()``) waits for them.
        Otherwise it only counts and ``synchronize()`` averages everything. With
        ``backward_passes_per_step=k`` a gradient's average starts at its k-th report, and
        reports inside ``no_sync()`` are not counted (accumulation.py). Between this hook and
        ``step()`` the caller must make no MPI calls (the comm thread owns MPI).
        """
        buckets = self._bucket_allreduce()      # None with deterministic=True
        for p in params:
            slot = self._slot.get(id(p))
            if slot is not None and self._passes.report(slot) and buckets is not None:
                buckets.ready(slot, p.grad)
        if self._tree is not None:        # deterministic: keep each pass as a leaf
            self._tree.report(params)

    def no_sync(self):
        """``with opt.no_sync(): ...``: backward passes inside add to ``.grad`` locally, are not
        counted towards ``backward_passes_per_step`` and start no average; the next pass
        outside (with the hook) averages the sum of all of them (PyTorch DDP's idiom)."""
        if self.deterministic:
            raise RuntimeError("no_sync() with deterministic=True: every backward pass is one "
                               "leaf of the fixed tree; use backward_passes_per_step instead")
        return self._passes.no_sync()

    def _bucket_allreduce(self):
        """The overlapping bucket allreduce, or None where it does not apply."""
        if self._buckets is not None:
            return self._buckets
        if (not self.overlap or self.average != "gradients" or self.process_set.size() == 1
                or self.deterministic
                or not self.params or on_device(self.params[0].data)
                or not isinstance(self.compression, Compressor)):
            return None
        # shapes from .data: reading a stale .grad would zero-fill it (see Parameter)
        grads = [p.data for p in reversed(self.params)]
        f, op = self.gradient_predivide_factor, self.op
        state = world_of(self.process_set, "DistributedOptimizer")
        self._buckets = overlap.BucketAllreduce(
            [(tuple(g.shape), g.dtype) for g in grads], self.fusion_threshold_bytes,
            lambda flat: allreduce_flat(state, flat, op, 1.0 / f, f),
            {"name": "DistributedOptimizer.gradients", "op": op.value, "prescale_factor": 1.0 / f,
             "postscale_factor": f},
            wire_dtypes=[self.compression.wire_dtype(g.dtype) for g in grads], state=state)
        return self._buckets

    def synchronize(self):
        """Average every parameter's ``.grad`` across ranks, in place (gradients mode); then
        check the count of backward passes (``backward_passes_per_step``)."""
        if self.average != "gradients":
            return
        if self._tree is not None:
            self._reduce_tree()
            return
        error = self._passes.error()
        several = self.process_set.size() > 1   # the average of one: nothing to do
        if several:
            start = time.perf_counter()
            current_timeline().cycle()           # mt.start_timeline(path, mark_cycles=True)
            with current_timeline().span("synchronize", cat="comm"):
                self._average_gradients()
            self.comm_time_s += time.perf_counter() - start
        # checked after the average, so that ranks at different counts made the same calls
        self._passes.reset()
        try:
            if several:
                # behind whatever is in flight (another optimizer's buckets)
                handles.ordered(world_of(self.process_set, "DistributedOptimizer").agreement,
                                "DistributedOptimizer.step",
                                {"backward_passes_per_step": self.backward_passes_per_step},
                                error)
            elif error is not None:
                raise ValueError(error)
        except (ValueError, CollectiveError):
            self.zero_grad()               # a wrong count summed the wrong gradients
            raise
        self._synchronized = True

    def _reduce_tree(self):
        """deterministic=True: agree on the step (and on any rank's wrong pass count), then sum
        the leaves in the fixed tree across ranks and scale (Average: 1/N, exact)."""
        tree, k = self._tree, self.backward_passes_per_step
        if tree.passes == 0 and k == 1 and self._passes.passes() == 0:
            tree.add_current()             # no hook: the gradients in .grad are the one leaf
        error = tree.partial() or self._passes.error()
        if error is None and tree.passes != k:
            error = (f"step() after {tree.passes} backward passes; deterministic=True with "
                     f"backward_passes_per_step={k} takes exactly {k} per step")
        state = world_of(self.process_set, "DistributedOptimizer")
        start = time.perf_counter()
        try:
            # the first MPI call of the step, as for every collective: a wrong count anywhere is
            # an error on every rank, and a rank in mt.join() is refused, never left waiting
            state.agreement("DistributedOptimizer.deterministic",
                            {"backward_passes_per_step": k, "elements": tree.elements,
                             "dtype": str(tree.dtype)}, error=error)
        except (ValueError, CollectiveError):
            self.zero_grad()               # drops the leaves too
            raise
        self._passes.reset()
        scale = 1.0 / state.size if self.op is collectives.Average else 1.0
        with current_timeline().span("synchronize", cat="comm"):
            tree.reduce(state.ring, scale)
        self.comm_time_s += time.perf_counter() - start
        self._synchronized = True

    def _average_gradients(self):
        buckets = self._bucket_allreduce()
        if buckets is not None:
            buckets.finish([p.grad for p in reversed(self.params)])
            return
        if not isinstance(self.compression, Compressor):
            self._average_with_compressor()
            return
        grads = [p.grad for p in self.params]
        kernels = self.params[0].kernels
        if self._wire is None:
            self._wire = [None if self.compression.wire_dtype(g.dtype) == g.dtype
                          else kernels.empty(tuple(g.shape), self.compression.wire_dtype(g.dtype))
                          for g in grads]
        for g, w in zip(grads, self._wire):
            if w is not None:
                kernels.cast(w, g)
        wire = [g if w is None else w for g, w in zip(grads, self._wire)]
        self._grouped_allreduce(wire)
        for g, w in zip(grads, self._wire):
            if w is not None:
                kernels.cast(g, w)

    def _average_with_compressor(self):
        """A user's compressor (Horovod's protocol): compress each gradient, average the wire
        arrays (fused), decompress into ``.grad``."""
        grads = [p.grad for p in self.params]
        kernels = self.params[0].kernels
        wire, contexts = [], []
        for g in grads:
            w, ctx = self.compression.compress(g)
            if isinstance(w, np.ndarray) and not (w.flags.writeable and w.flags.c_contiguous):
                w = np.array(w, order="C")   # averaged in place: needs its own writable copy
            wire.append(w)
            contexts.append(ctx)
        self._grouped_allreduce(wire)
        for name, g, w, ctx in zip(self.names, grads, wire, contexts):
            out = self.compression.decompress(w, ctx)
            if tuple(out.shape) != tuple(g.shape):
                raise ValueError(f"compression {self.compression!r}: decompress gave shape "
                                 f"{tuple(out.shape)} for {name!r}, whose gradient has "
                                 f"{tuple(g.shape)}")
            if out is g:
                continue
            if isinstance(g, np.ndarray):
                np.copyto(g, out, casting="unsafe")
            else:
                kernels.copy(g, out if out.dtype == g.dtype else out.astype(g.dtype))

    def _grouped_allreduce(self, arrays):
        f = self.gradient_predivide_factor
        collectives.grouped_allreduce_(arrays, op=self.op, name="DistributedOptimizer.gradients",
                                       prescale_factor=1.0 / f, postscale_factor=f,
                                       fusion_threshold_bytes=self.fusion_threshold_bytes,
                                       process_set=self.process_set)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (you already did)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def average_weights(self):
        """Average every parameter's ``.data`` across ranks now (weights mode does it every k)."""
        if self.process_set.size() == 1:
            return
        start = time.perf_counter()
        with current_timeline().span("average_weights", cat="comm"):
            collectives.grouped_allreduce_([p.data for p in self.params], op=collectives.Average,
                                           name="DistributedOptimizer.weights",
                                           fusion_threshold_bytes=self.fusion_threshold_bytes,
                                           process_set=self.process_set)
        self.comm_time_s += time.perf_counter() - start

    def set_fusion_threshold(self, threshold_bytes):
        """Change the bucket size limit between steps, to the same value on every rank (the
        autotuner does); the overlap plan is rebuilt and agreed at the next step."""
        if self._buckets is not None and self._buckets.pending():
            raise RuntimeError("set_fusion_threshold() while gradient allreduces are pending: "
                               "call it between step() and the next backward")
        self.fusion_threshold_bytes = check_threshold(threshold_bytes)
        self._buckets = None

    def step(self):
        if self.average == "gradients":
            if self._skip and self._buckets is not None and self._buckets.pending():
                # The comm thread may still be reducing these gradients (and owns MPI).
                raise RuntimeError("step() inside skip_synchronize() while backward_hook's "
                                   "allreduces are pending: call opt.synchronize() first")
            if not (self._skip or self._synchronized):
                self.synchronize()
            self.optimizer.step()
            self._synchronized = False
            if self.autotuner is not None:
                self.autotuner.step_done()
            return
        error = self._passes.error()
        self._passes.reset()
        if error is not None:       # weights mode: each rank checks its own count
            self.optimizer.zero_grad()
            raise ValueError(error)
        self.optimizer.step()
        # The inner optimizer's step count travels in its state_dict, so a resumed job keeps
        # averaging on the same global steps as an uninterrupted one.
        if self.optimizer.steps % self.average_every == 0:
            self.average_weights()

    def __repr__(self):
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, average={self.average!r}, "
                f"average_every={self.average_every}, compression={self.compression!r}, "
                f"overlap={self.overlap}, "
                f"backward_passes_per_step={self.backward_passes_per_step}"
                + (", deterministic=True)" if self.deterministic else ")"))


def _check_deterministic(average, compression, predivide, passes, process_set):
    """ValueError (the same on every rank: every input is the same there) unless
    deterministic=True can keep its promise with these arguments."""
    if average != "gradients":
        raise ValueError(f"deterministic=True averages gradients in a fixed tree; "
                         f"average={average!r} is not supported")
    if compression is not Compression.none:
        raise ValueError(f"deterministic=True refuses compression={compression!r}: rounding "
                         f"to a wire format depends on which partial sums a rank sends")
    if predivide != 1.0:
        raise ValueError(f"deterministic=True refuses gradient_predivide_factor="
                         f"{predivide!r} (only exact power-of-two scaling keeps the bits)")
    if passes & (passes - 1):
        raise ValueError(f"deterministic=True needs backward_passes_per_step a power of two, "
                         f"got {passes} (the micro-shards are the leaves of a binary tree)")
    size = process_set.size()
    if size is not None:
        check_ranks(size)


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


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set):
    """Give every rank root_rank's optimizer state (hyper-parameters, step, buffers), in place.

    The root's state layout travels first (as an object), so ranks whose state differs in shape
    or keys (a fresh optimizer vs a loaded one) still end up identical instead of mismatching.
    """
    state = optimizer.state_dict()
    arrays = {k: (v.shape, v.dtype.str) for k, v in state.items() if isinstance(v, np.ndarray)}
    values = {k: v for k, v in state.items() if k not in arrays}
    arrays, values = collectives.broadcast_object((arrays, values), root_rank=root_rank,
                                                  process_set=process_set)
    new = dict(values)
    for k in sorted(arrays):
        shape, dtype = arrays[k]
        mine = state.get(k)
        ok = isinstance(mine, np.ndarray) and mine.shape == shape and mine.dtype.str == dtype
        new[k] = np.ascontiguousarray(mine) if ok else np.zeros(shape, dtype)
        collectives.broadcast_(new[k], root_rank, name=f"broadcast_optimizer_state.{k}",
                               process_set=process_set)
    optimizer.load_state_dict(new)
