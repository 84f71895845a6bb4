"""DistributedOptimizer for torch: horovod.torch's wrapper, riding on mpitrain's own.

``DistributedOptimizer(optimizer, ...)`` returns an object of a subclass of the optimizer's own
class (as Horovod does: ``isinstance(opt, torch.optim.SGD)`` holds, lr schedulers and GradScaler
take it) that shares the optimizer's ``param_groups`` and ``state``. Underneath, mpitrain's
DistributedOptimizer (parallel/) does the averaging through the adapter (adapter.py):

- each parameter's gradient goes to the gradient buckets as soon as autograd has accumulated
  it (``register_post_accumulate_grad_hook``), so its allreduce runs on the comm thread while
  backward computes the earlier layers;
- when the backward pass that completes the step ends (a callback queued on autograd's engine,
  as DDP does), the buckets are waited for and the averages land in ``p.grad``: as under DDP,
  ``p.grad`` holds the average when ``backward()`` returns, so clipping, unscaling
  (``GradScaler``) or scaling by hand between backward and ``step()`` act on the averaged
  gradients. (In Horovod the average lands at ``step()`` and overwrites such an edit.) Then
  ``step()`` runs the torch optimizer's own step; Horovod's ``synchronize()`` /
  ``skip_synchronize()`` idiom still works (``synchronize()`` after backward has nothing
  left to do);
- ``backward_passes_per_step=k``: the k backward passes sum into ``p.grad`` and the k-th starts
  the average; ``step()`` after another count is a ValueError on every rank (never an error
  inside backward) and drops the gradients;
- a parameter without a gradient this step (unused by this rank's forward) is sent as zeros,
  so no rank waits for it; one that no rank used gets its ``.grad`` back to None (as at N = 1
  and under DDP: the optimizer leaves it alone);
- the first average compares a digest of every rank's parameters and raises on every rank
  where they differ (``broadcast_parameters`` forgotten);
- a sparse gradient (``nn.Embedding(sparse=True)``), with ``sparse_as_dense=False`` (the
  default), is averaged by allgather of its rows and stays sparse (sparse.py); which
  parameters go that way is agreed when the optimizer's first backward pass ends, so that
  pass hands its gradients to the buckets at its end. ``sparse_as_dense=True`` averages it
  dense in the buckets and makes it sparse again (as Horovod: SparseAdam takes sparse ones);
- join (``hvd.join()``), process sets, ``Compression.fp16`` (cast in the buckets) and the stall
  watchdog are mpitrain's; on a rank outside ``process_set`` the optimizer registers no hooks
  and steps on its own gradients (Horovod's behaviour);
- ``step()`` after a ``synchronize()`` of the caller's, outside ``skip_synchronize()``, warns as
  Horovod does (the average is not run twice);
- ``sharding="optimizer"``: the gradients are averaged as above, then each rank steps the
  parameters of its partition only (so its ``state`` holds theirs only) and every rank's updated
  parameters are sent to all (sharding.py); ``consolidate_state_dict(to)`` then ``state_dict()``
  on rank ``to`` give the whole state. ZeroRedundancyOptimizer (zero.py) is this mixin on a
  torch.optim.Optimizer of its own with a local optimizer inside;
- ``sharding="gradients"``: as "optimizer", the buckets reduce-scattered instead of allreduced
  and each averaged gradient kept by its parameter's owner only (``p.grad`` None for the
  others; sharding.GradientShards); ``clip_grad_norm_`` clips by the whole gradients' norm;
- ``memory_bytes()``: the bytes this rank holds for parameters, gradients and optimizer state;
- ``deterministic=True`` (deterministic.py): each backward pass is one micro-shard's leaf of
  the engine's fixed tree, summed across ranks as the step's last pass ends and divided by
  the number of micro-shards; BatchNorm running statistics are replayed in micro-shard order at
  ``step()``: the same bits for any power-of-two N.
"""
import contextlib
import warnings

import torch
from torch.autograd import Variable

from mpitrain import comm
from mpitrain.parallel.optimizer import DistributedOptimizer as ArrayDistributedOptimizer
from mpitrain.torch import sparse
from mpitrain.torch.adapter import TorchOptimizer, TorchParameter
from mpitrain.torch.compression import Compression, builtin, is_compression
from mpitrain.torch.deterministic import (DeterministicParameter, batchnorm_replay,
                                          check_arguments as check_deterministic)
from mpitrain.torch.ops import allgather_object
from mpitrain.torch.sharding import (GradientShards, Partition, check_groups, check_rank,
                                     memory_bytes)

SHARDINGS = ("none", "optimizer", "gradients", "parameters")


# The attribute of a parameter holding the hook of the newest DistributedOptimizer wrapping it:
# wrapping the same parameters again (a new optimizer each epoch) must not leave the old one
# reporting gradients to buckets that no step will ever finish.
HOOK_ATTRIBUTE = "mpitrain_gradient_hook"


class TensorCompressor:
    """A user's tensor compressor (Horovod's protocol) as mpitrain's array one: the gradient
    array is given to it as a tensor sharing its memory, and its tensors come back as arrays."""

    def __init__(self, compression):
        self.compression = compression

    def compress(self, array):
        wire, ctx = self.compression.compress(torch.from_numpy(array))
        return wire.detach().contiguous().numpy(), ctx

    def decompress(self, array, ctx):
        return self.compression.decompress(torch.from_numpy(array), ctx).detach().numpy()

    def __repr__(self):
        return repr(self.compression)


class DistributedMixin:
    """What DistributedOptimizer adds to the optimizer's class (the class it returns is
    ``type(name, (DistributedMixin, type(optimizer)), {})``: ``super()`` below is the
    optimizer's own method)."""

    mt_who = "DistributedOptimizer"     # names the collectives and the errors of sharding

    def setup(self, named_parameters, compression, backward_passes_per_step, op,
              gradient_predivide_factor, process_set, sparse_as_dense, overlap,
              fusion_threshold_bytes, sharding="none", deterministic=False):
        self.mt_named = None if named_parameters is None else list(named_parameters)
        self.mt_arguments = dict(
            compression=compression, backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
            overlap=overlap, fusion_threshold_bytes=fusion_threshold_bytes)
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self.end_queued = False      # the end-of-backward average is queued for this pass
        self.called_synchronize = False   # the caller's own synchronize() since the last step
        self.skipping = False             # inside skip_synchronize()
        self.mt_hooks = []
        self.mt_optimizer = None     # None on a rank outside process_set: it steps alone
        # sharded: which rank steps which parameter (sharding.py), else None
        self.mt_sharding = sharding
        self.mt_partition = (Partition(self.param_groups, process_set, self.mt_who)
                             if sharding in ("optimizer", "gradients") else None)
        self.mt_consolidated = None  # consolidate_state_dict's merged state, on its rank
        self.mt_adapters = []
        self.mt_undecided = False    # which gradients are sparse is agreed after the first pass
        self.mt_held = []            # the first pass's reports, held until then (sparse.py)
        self.mt_held_queued = False
        # deterministic=True: the micro-shards per step (N x k) and the BatchNorm replay
        self.mt_deterministic = bool(deterministic)
        self.mt_micro_shards = None
        self.mt_replay = None
        self.mt_build()

    def mt_build(self, extend_names=False):
        """The gradient averaging of every trained parameter of ``param_groups`` (again after
        ``add_param_group`` of a sharded optimizer: ``extend_names`` names the new ones)."""
        params = trained_parameters(self.param_groups)
        named = self.mt_named
        if named is not None and extend_names:
            known = {id(p) for _, p in named}
            named = named + [(f"param.{i}", p) for i, p in enumerate(params)
                             if id(p) not in known]
        names = parameter_names(params, named)
        arguments = self.mt_arguments
        compression = arguments["compression"]
        process_set = self.process_set
        for p in params:
            if p.dtype is torch.bfloat16:
                raise ValueError(f"{self.mt_who}: parameter {names[id(p)]!r} is "
                                 f"bfloat16, which the gradient buckets do not carry; keep "
                                 f"float32 parameters (torch.autocast computes in bfloat16)")
        deterministic = self.mt_deterministic
        adapter = DeterministicParameter if deterministic else TorchParameter
        adapters = [adapter(p, names[id(p)], arguments["sparse_as_dense"] or deterministic)
                    for p in params]
        self.mt_adapters = adapters
        self.mt_undecided = False
        self.mt_held = []
        self.mt_inner = TorchOptimizer(self, adapters)
        self.on_device = any(p.is_cuda for p in params)
        self.remove_hooks()
        self.mt_optimizer = None
        if not is_compression(compression):
            raise ValueError(f"compression {compression!r}: expected Compression.none, "
                             f".fp16 or an object with compress(tensor) -> (tensor, ctx) and "
                             f"decompress(tensor, ctx) -> tensor")
        wire = builtin(compression)
        if process_set.included() is False:
            return
        self.mt_undecided = not (arguments["sparse_as_dense"] or deterministic)
        # deterministic: the engine sums the leaves in its tree (op Sum); average() divides
        # the sum by the number of micro-shards, once
        self.mt_optimizer = ArrayDistributedOptimizer(
            self.mt_inner, named_parameters=[(a.name, a) for a in adapters],
            compression=wire if wire is not None else TensorCompressor(compression),
            op=comm.Sum if deterministic else arguments["op"],
            gradient_predivide_factor=arguments["gradient_predivide_factor"],
            backward_passes_per_step=arguments["backward_passes_per_step"],
            process_set=process_set, overlap=arguments["overlap"],
            fusion_threshold_bytes=arguments["fusion_threshold_bytes"],
            deterministic=deterministic)
        if deterministic:
            passes = arguments["backward_passes_per_step"]
            self.mt_micro_shards = comm.group_size(process_set) * passes
            self.mt_replay = batchnorm_replay(params, process_set, passes)
        if self.mt_sharding == "gradients":
            # the buckets reduce-scattered, each gradient kept by its parameter's owner only
            self.mt_optimizer.strategy = GradientShards(
                self.mt_optimizer, [self.mt_partition.owner[id(p)] for p in params],
                self.mt_who)
        for p, a in zip(params, adapters):
            previous = getattr(p, HOOK_ATTRIBUTE, None)
            if previous is not None:
                previous.remove()
            handle = p.register_post_accumulate_grad_hook(
                lambda tensor, adapter=a: self.gradient_ready(adapter))
            setattr(p, HOOK_ATTRIBUTE, handle)
            self.mt_hooks.append(handle)

    # -- the hooks ---------------------------------------------------------------------------
    def gradient_ready(self, adapter):
        """A parameter's ``.grad`` is accumulated: hand it to the buckets; in the pass that
        completes the step, queue the average for the end of backward (once per pass). In
        the first pass, until which gradients are sparse is known, hold it for that pass's
        end instead."""
        if self.mt_undecided:
            self.mt_held.append(adapter)
            if not self.mt_held_queued:
                self.mt_held_queued = True
                Variable._execution_engine.queue_callback(self.first_pass_done)
            return
        self.mt_optimizer.backward_hook((adapter,))
        if not self.end_queued and self.mt_optimizer.passes_complete():
            self.end_queued = True
            Variable._execution_engine.queue_callback(self.backward_done)

    def first_pass_done(self):
        """Autograd's engine, as the first backward pass ends: agree on which gradients are
        sparse, then hand the pass's reports to the buckets (and average, if it completes
        the step)."""
        self.mt_held_queued = False
        self.mt_settle_first_pass()
        if self.mt_optimizer.passes_complete():
            self.average()

    def mt_settle_first_pass(self):
        """Collective (sparse.decide), once: which gradients travel gathered; then the held
        reports of the first pass go to the buckets."""
        held, self.mt_held = self.mt_held, []
        self.mt_undecided = False
        sparse.decide(self.mt_adapters, self.process_set, self.mt_sharding, self.mt_who)
        if held:
            self.mt_optimizer.backward_hook(tuple(held))

    def backward_done(self):
        """Autograd's engine, as the backward pass ends: average now (DDP's moment)."""
        self.end_queued = False
        if self.mt_optimizer.passes_complete():
            self.average()

    def average(self):
        """Average every gradient in place now, unless that is done already: the buckets'
        (dense) ones, then the gathered (sparse) ones."""
        if self.mt_optimizer.synchronized:
            return
        if self.mt_undecided:
            self.mt_settle_first_pass()      # no hook ran: gradients set by hand
        adapters = self.mt_adapters
        for a in adapters:
            a.dropped = False
        self.device_barrier()
        try:
            self.mt_optimizer.synchronize()
            if self.mt_micro_shards is not None:      # the tree's sum over M micro-shards
                with torch.no_grad():
                    for a in adapters:
                        a.tensor.grad.mul_(1.0 / self.mt_micro_shards)      # exact: 1/2**j
        finally:
            sparse.restore(adapters)
        sparse.average(adapters, self.mt_arguments["op"], self.process_set, self.mt_who)
        self.device_barrier()

    # -- Horovod's surface -------------------------------------------------------------------
    def synchronize(self):
        """Average every gradient across ranks now (waits for the buckets backward started),
        in place in ``p.grad``; then check the count of backward passes on every rank. Nothing
        to do when the end of backward did it already."""
        if self.mt_optimizer is None:
            return
        self.average()
        self.called_synchronize = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (call ``synchronize()`` first)."""
        if self.mt_optimizer is None:
            yield
            return
        self.skipping = True
        try:
            with self.mt_optimizer.skip_synchronize():
                yield
        finally:
            self.skipping = False

    def step(self, closure=None):
        """Synchronize (unless done already, or inside ``skip_synchronize()``), then the
        optimizer's own step; returns what that returns (the closure's loss)."""
        args = () if closure is None else (closure,)
        if self.mt_optimizer is None:
            return self.inner_step(*args)
        if self.called_synchronize and not self.skipping:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(). This can cause training "
                          "slowdown. You may want to consider using "
                          "optimizer.skip_synchronize() context if you use "
                          "optimizer.synchronize() in your code.")
        self.called_synchronize = False
        replay = self.mt_replay
        try:
            if not self.skipping:
                self.average()                   # unless backward's end did (both kinds)
            self.device_barrier()
            result = []
            self.mt_optimizer.step(update=lambda: result.append(self.inner_step(*args)))
        except BaseException:
            if replay is not None:
                replay.drop()                    # the running statistics of the step's start
            raise
        if replay is not None:
            replay.end_step()                    # BatchNorm statistics in micro-shard order
        if self.mt_partition is not None:
            self.device_barrier()
            self.mt_partition.distribute()       # every rank's updated parameters to all
        return result[0] if result else None

    def zero_grad(self, set_to_none=True):
        """Zero the gradients (``set_to_none`` as torch's); drops a partial accumulation."""
        if self.mt_optimizer is None:
            return self.inner_zero_grad(set_to_none)
        self.mt_optimizer.zero_grad(inner=lambda: self.inner_zero_grad(set_to_none))
        if self.mt_replay is not None:
            self.mt_replay.drop()
        for a in self.mt_adapters:
            a.densified = 0

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``torch.nn.utils.clip_grad_norm_`` over the averaged gradients of every parameter of
        ``param_groups`` (in their order), between backward and ``step()``; returns the total
        norm. Averages first where that is not done yet. With ``sharding="gradients"`` a rank
        holds its partition's gradients only, so torch's own function would see those alone:
        this gathers each gradient's norm from its owner and returns, and clips with, torch's
        total norm over the whole gradients (the same bits, on every rank)."""
        params = trained_parameters(self.param_groups)
        if self.mt_optimizer is not None:
            self.average()
        partition = self.mt_partition
        if self.mt_sharding != "gradients" or partition.size == 1:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                                  error_if_nonfinite)
        norm_type = float(norm_type)
        with torch.no_grad():
            mine = {i: torch.linalg.vector_norm(p.grad, norm_type)
                    for i, p in enumerate(params) if p.grad is not None and partition.owns(p)}
            norms = {}
            for theirs in allgather_object(mine, process_set=self.process_set):
                norms.update(theirs)
            if not norms:
                return torch.tensor(0.0)
            # torch's order: grouped by (device, dtype) in the order they first appear
            groups = {}
            for i in sorted(norms):
                groups.setdefault((params[i].device, params[i].dtype), []).append(norms[i])
            first = params[min(norms)].device
            total = torch.linalg.vector_norm(
                torch.stack([n.to(first) for group in groups.values() for n in group]),
                norm_type)
            if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                                   f"`parameters` is non-finite, so it cannot be clipped; "
                                   f"error_if_nonfinite=False scales by it anyway")
            clamped = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for i in norms:
                p = params[i]
                if partition.owns(p):
                    p.grad.mul_(clamped.to(p.grad.device))
        return total

    def no_sync(self):
        """``with opt.no_sync():`` backward passes inside sum into ``p.grad`` without being
        averaged or counted; the next pass outside averages them all (PyTorch DDP's idiom)."""
        if self.mt_optimizer is None:
            return contextlib.nullcontext()
        return self.mt_optimizer.no_sync()

    def set_backward_passes_per_step(self, passes):
        """Horovod's setter is not offered: the count is fixed at construction."""
        raise NotImplementedError("backward_passes_per_step is fixed when the optimizer is "
                                  "wrapped; wrap it again to change it")

    def remove_hooks(self):
        """Stop reporting gradients to the buckets (the optimizer then averages at step()).
        Wrapping the same parameters in a new DistributedOptimizer does this for the old one."""
        for handle in self.mt_hooks:
            handle.remove()
        self.mt_hooks = []

    # -- the state, sharded or not ------------------------------------------------------------
    def memory_bytes(self):
        """{"parameters", "gradients", "optimizer_state"}: the bytes this rank holds (the
        optimizer state: its optimizer's state tensors; sharded, its partition's only)."""
        return memory_bytes(self.param_groups, self.mt_local_state())

    def consolidate_state_dict(self, to=0):
        """Collective: gather every rank's optimizer state on rank ``to`` of the process set,
        whose ``state_dict()`` then returns the whole state (PyTorch's ZeroRedundancyOptimizer's
        protocol). Unsharded, every rank holds the whole state already: nothing to gather."""
        if self.mt_partition is None:
            included = self.process_set.included() is not False
            check_rank(to, self.process_set.size() if included else 1,
                       f"{self.mt_who}.consolidate_state_dict")
            return
        self.mt_sync_groups()
        self.mt_consolidated = self.mt_partition.consolidate(
            self.mt_local_state_dict()["state"], to)

    def state_dict(self):
        """The optimizer's state_dict; sharded, the state the last ``consolidate_state_dict``
        gathered on this rank (PyTorch's format, every parameter's state) -- a RuntimeError
        on the other ranks and before any consolidation."""
        if self.__dict__.get("mt_partition") is None:
            return super().state_dict()
        if self.mt_consolidated is None:
            raise RuntimeError(f"{self.mt_who}: the sharded optimizer state has not been "
                               f"consolidated on this rank; call consolidate_state_dict("
                               f"to={self.mt_partition.rank}) on every rank first")
        self.mt_sync_groups()
        state = super().state_dict()
        state["state"] = dict(sorted(self.mt_consolidated.items()))
        return state

    def load_state_dict(self, state_dict):
        """Load a state_dict (sharded: a whole state in PyTorch's format, saved at any number
        of ranks, sharded or not; each rank keeps its partition's entries)."""
        if self.__dict__.get("mt_partition") is None:
            return super().load_state_dict(state_dict)
        check_groups(state_dict, self.param_groups, self.mt_who)
        self.mt_load(state_dict)

    def add_param_group(self, param_group):
        """torch's ``add_param_group``; sharded (call it on every rank), the new group is
        partitioned on top of the others and its parameters' gradients are averaged too."""
        super().add_param_group(param_group)
        if self.__dict__.get("mt_partition") is not None:
            self.mt_partition = Partition(self.param_groups, self.process_set, self.mt_who)
            self.mt_partitioned()
            self.mt_build(extend_names=True)

    # -- what a sharded optimizer holds (ZeroRedundancyOptimizer overrides these) -------------
    def mt_local_state(self):
        """{parameter: state} of what this rank's optimizer holds."""
        return self.state

    def mt_local_state_dict(self):
        """PyTorch's format over every parameter, with this rank's state entries."""
        return super().state_dict()

    def mt_load(self, state_dict):
        """Keep the entries of this rank's partition of a whole state."""
        kept = {k: v for k, v in state_dict["state"].items()
                if self.mt_partition.owns_index(k)}
        super().load_state_dict({**state_dict, "state": kept})

    def mt_sync_groups(self):
        """Hyper-parameters set on ``param_groups`` reach the optimizer that steps (none
        apart here)."""

    def mt_partitioned(self):
        """The partition changed (a group was added)."""

    def mt_optimizer_class(self):
        """The torch optimizer class that steps (for broadcast_optimizer_state's check)."""
        cls = type(self)
        return next(c for c in cls.__mro__
                    if c is not cls and not issubclass(c, DistributedMixin))

    # -- what the adapter calls --------------------------------------------------------------
    def inner_step(self, *args):
        if self.__dict__.get("mt_partition") is None:
            return super().step(*args)
        return self.local_step(*args)

    def local_step(self, *args):
        """Sharded: the optimizer's own step on this rank's partition only (each group's
        parameters are its partition's during the step), so state is made for those only."""
        groups = self.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group, mine in zip(groups, self.mt_partition.mine):
                group["params"] = mine
            return super().step(*args)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def inner_zero_grad(self, *args):
        return super().zero_grad(*args)

    def device_barrier(self):
        """CUDA: torch's queued kernels finish before MPI or NCCL touch the gradients."""
        if self.on_device:
            torch.cuda.synchronize()


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=comm.Average,
                         gradient_predivide_factor=1.0, process_set=comm.global_process_set,
                         sparse_as_dense=False, overlap=True, fusion_threshold_bytes=None,
                         sharding="none", deterministic=False):
    """Wrap a ``torch.optim.Optimizer`` so that N replicas train as one model.

    The result is an instance of a subclass of the optimizer's class sharing its param_groups
    and state (use it instead of the original from now on). Arguments as Horovod's;
    ``named_parameters`` (e.g. ``model.named_parameters()``) names the buckets' tensors in error
    messages; op: Average or Sum; ``gradient_predivide_factor`` f divides before the sum and
    multiplies by f after it. mpitrain's own: ``overlap`` (False: average everything at
    ``step()``), ``fusion_threshold_bytes`` (bucket size; default 4 MiB, or
    MPITRAIN_FUSION_THRESHOLD). ``sharding``: "none" (the default), or "optimizer": each rank
    keeps the optimizer state of its partition of the parameters and steps those, then the
    updated parameters reach every rank; bitwise the unsharded parameters for optimizers that
    update each parameter on its own. ``consolidate_state_dict(to=0)`` (every rank) then
    ``state_dict()`` on rank 0 gives the whole state; ``load_state_dict`` takes one saved at
    any N. "gradients": as "optimizer", the gradients reduce-scattered and each kept by its
    parameter's owner only (``p.grad`` is None for the others between steps); clip with
    ``opt.clip_grad_norm_``, not torch's function. "parameters" is not available here yet.
    Sparse gradients (``nn.Embedding(sparse=True)``) are gathered, not reduced, unless
    ``sparse_as_dense=True`` (sparse.py); "gradients" sharding refuses them.
    ``deterministic=True`` (deterministic.py): bitwise the same parameters, buffers and
    optimizer state for any power-of-two N, with the batches of ``hvd.micro_shards``: each of the
    ``backward_passes_per_step`` k passes runs on one micro-shard and is one leaf of a fixed
    tree over the M = N x k micro-shards; ``p.grad`` is then the leaves' sum divided by M
    (do not scale the loss by 1/k); BatchNorm running statistics are replayed in micro-shard
    order at ``step()``. It refuses compression, a predivide factor, op other than Average,
    sharding, and k or N not a power of two (a ValueError, the same on every rank).
    """
    check_sharding(sharding)
    if deterministic:
        check_deterministic(compression, op, gradient_predivide_factor,
                            backward_passes_per_step, process_set, sharding)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DistributedMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (DistributedMixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)        # the same param_groups, state, hooks
    wrapped.setup(named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, process_set, sparse_as_dense, overlap,
                  fusion_threshold_bytes, sharding, deterministic)
    return wrapped


def check_sharding(sharding):
    """ValueError (an argument: the same on every rank) unless ``sharding`` is one this front
    end runs."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}: expected one of "
                         f"{', '.join(repr(s) for s in SHARDINGS)}")
    if sharding == "parameters":
        raise ValueError("sharding='parameters' is not available in mpitrain.torch yet; "
                         "sharding='gradients' shards the optimizer state and the gradients")


def trained_parameters(param_groups):
    """The parameters whose gradients are averaged: every group's, in order, once each, those
    that require grad (as Horovod: frozen ones are not sent)."""
    seen, params = set(), []
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def parameter_names(params, named_parameters):
    """{id(p): name}: from ``named_parameters`` (names of other tensors are ignored, as in
    Horovod; a duplicate name or an optimizer parameter without one is a ValueError), else
    ``param.<i>`` in optimizer order."""
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    pairs = list(named_parameters)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError("named_parameters: expected (name, parameter) pairs, as "
                         "model.named_parameters() gives")
    names, seen = {}, set()
    for name, p in pairs:
        if name in seen:
            raise ValueError(f"named_parameters: duplicate name {name!r}")
        seen.add(name)
        names.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"named_parameters: optimizer parameters {missing} have no name; "
                         f"name every parameter (model.named_parameters())")
    return {id(p): names[id(p)] for p in params}
