"""The collectives on torch.Tensors, with horovod.torch's names and keyword arguments.

Each call checks its tensors (tensors.py), hands the comm layer an array sharing the tensor's
memory (a CPU tensor's zero-copy NumPy view; a CUDA tensor through ``__cuda_array_interface__``)
and turns the result back into a tensor of the input's dtype and device. So everything the comm
layer does for NumPy arrays holds here: the cross-rank agreement (a mismatch is a
CollectiveError on every rank, never a hang), the allreduce paths, process sets, ``join``, the
stall watchdog, the timeline. In-place forms (trailing underscore) return the very tensor they
were given. ``*_async`` forms return a ``Handle`` for ``poll`` and ``synchronize``, which
returns what the blocking call returns.

Every collective that returns a tensor is differentiable, as in Horovod (allreduce, allgather,
broadcast, reducescatter, alltoall and the grouped forms): on a tensor that requires grad it
returns a tensor whose backward runs Horovod's matching collective on the gradient.

float16 CPU tensors are scaled as Horovod scales them: ``prescale_factor``, ``postscale_factor``
and Average's 1/N multiply in float32 and round to float16 once (mpitrain's own ``mt.allreduce``
follows NumPy and rounds the factor to float16 first). A name given to an ``*_async`` call
must not belong to a collective still in flight (ValueError), as in Horovod.

The Average of integer tensors stays an integer tensor: the sum times 1/N, truncated toward
zero (Horovod's rule), where mpitrain's own ``mt.allreduce`` gives a float64 mean.
"""
import math

import numpy as np
import torch

from mpitrain import comm
from mpitrain.torch.compression import Compression
from mpitrain.torch.tensors import (Bridge, Problem, agree_dtypes, is_integer,
                                    reduction_problem, refuse, tensor_problem)

Sum, Average, Min, Max, Product = comm.Sum, comm.Average, comm.Min, comm.Max, comm.Product
global_process_set = comm.global_process_set


class Handle:
    """A collective on tensors in flight: ``poll(handle)``, ``synchronize(handle)``.

    ``inner`` is the comm layer's handle, or a list of them (a group run as one collective per
    tensor): then ``finish`` takes the list of their results."""

    __slots__ = ("inner", "finish", "done", "result")

    def __init__(self, inner, finish):
        self.inner = inner          # the comm layer's handle, or a list of them
        self.finish = finish        # comm result(s) -> what synchronize returns
        self.done = False
        self.result = None

    def __repr__(self):
        return f"<mpitrain.torch handle: {'done' if poll(self) else 'pending'}>"


def poll(handle):
    """True when ``handle``'s collective has finished (``synchronize`` will not block)."""
    if handle.done:
        return True
    if isinstance(handle.inner, list):
        return all(comm.poll(h) for h in handle.inner)
    return comm.poll(handle.inner)


def synchronize(handle):
    """Wait for ``handle``'s collective; its result (the tensor, or what the blocking call
    returns). Raises what the collective raised, on every rank (for a group: the first
    error, once every member has finished, so that no collective is left unwaited)."""
    if not handle.done:
        if isinstance(handle.inner, list):
            result, error = [], None
            for h in handle.inner:
                try:
                    result.append(comm.synchronize(h))
                except Exception as exc:  # noqa: BLE001 - the first is raised, below
                    error = error or exc
            if error is not None:
                raise error
        else:
            result = comm.synchronize(handle.inner)
        handle.result, handle.done, handle.inner = handle.finish(result), True, None
    return handle.result


# --- arguments ------------------------------------------------------------------------------

# Horovod's Adasum op: allreduce and DistributedOptimizer combine with it (comm/adasum.py, a
# power-of-two number of ranks, CPU tensors); the reducescatters refuse it, as Horovod's do.
Adasum = "adasum"


def resolve_op(average, op, kind, process_set):
    """Horovod's rule: ``op`` supersedes the deprecated ``average``; neither means Average."""
    if average is not None and op is not None:
        refuse(kind, Problem(ValueError, f"{kind}: the op parameter supersedes average; "
                                         f"give only one of them"), process_set)
    if op is None:
        return Average if average is None or average else Sum
    return op


def check_tensors(kind, tensors, process_set, op=None):
    """Refuse, on every rank, a call any of whose tensors this rank cannot send."""
    if (isinstance(op, str) and op.lower() == Adasum
            and not kind.startswith(("allreduce", "grouped_allreduce"))):
        # Horovod's RuntimeError where it has no Adasum either (reducescatter)
        refuse(kind, Problem(RuntimeError, f"{kind}: Adasum is not supported; use Average "
                                           f"or Sum"), process_set)
    for i, t in enumerate(tensors):
        problem = tensor_problem(t, kind, None if len(tensors) == 1 else i)
        if problem is None and op is not None:
            problem = reduction_problem(t, op, kind)
        if problem is not None:
            refuse(kind, problem, process_set)
    agree_dtypes(kind, tensors, process_set)


def check_list(kind, tensors, process_set):
    if not isinstance(tensors, (list, tuple)):
        refuse(kind, Problem(TypeError, f"{kind}: expected a list of tensors, got "
                                        f"{type(tensors).__name__}"), process_set)


def integer_average(tensor, op, postscale_factor, process_set, kind):
    """(op, postscale) the comm layer runs: an integer Average is a Sum scaled by 1/N."""
    if op is Average and is_integer(tensor):
        return Sum, postscale_factor / comm.group_size(process_set, kind)
    return op, postscale_factor


def plain_factor(value):
    return (isinstance(value, (int, float, np.floating, np.integer))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


class HalfScaling:
    """Horovod's scaling of float16 CPU tensors: ``pre`` before the reduction and ``post``
    (with Average's 1/N) after it, each a float32 multiply rounded to float16 once. The comm
    layer then runs a plain ``op`` (Sum for Average) without factors; the other tensors of a
    group are scaled here too, as the comm layer would (NumPy's multiply)."""

    def __init__(self, op, pre, post):
        self.op, self.pre, self.post = op, pre, post

    @classmethod
    def of(cls, tensors, op, pre, post, process_set, kind):
        """The scaling to do here, or None (no float16 CPU tensor, nothing to scale, or a bad
        op or factor: the comm layer scales, or refuses on every rank)."""
        if not (any(t.dtype is torch.float16 for t in tensors)
                and all(t.device.type == "cpu" for t in tensors)
                and op.__class__ is comm.ReduceOp and plain_factor(pre) and plain_factor(post)):
            return None
        if op is Average:
            op, post = Sum, post / comm.group_size(process_set, kind)
        if pre == 1.0 and post == 1.0:
            return None
        return cls(op, float(pre), float(post))

    def finish(self, bridge):
        """``bridge.back`` after the postscale of the result."""
        def back(result):
            HalfScaling.scale([result], self.post)
            return bridge.back(result)
        return back

    @staticmethod
    def scale(arrays, factor):
        """Each (private) array times ``factor``, in place."""
        if factor == 1.0:
            return
        for a in arrays:
            np.multiply(a, np.float32(factor) if a.dtype == np.float16 else factor, out=a,
                        casting="unsafe")


def wants_grad(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def any_wants_grad(tensors):
    return isinstance(tensors, (list, tuple)) and any(wants_grad(t) for t in tensors)


def member_names(name, count):
    """The names of a group's members when it runs as one collective per tensor."""
    return [None] * count if name is None else [f"{name}.{i}" for i in range(count)]


# --- allreduce ------------------------------------------------------------------------------

def _allreduce(kind, tensor, op, name, prescale_factor, postscale_factor, process_set,
               in_place, asynchronous):
    check_tensors(kind, [tensor], process_set, op)
    op, post = integer_average(tensor, op, postscale_factor, process_set, kind)
    pre = prescale_factor
    half = HalfScaling.of([tensor], op, pre, post, process_set, kind)
    bridge = Bridge(tensor, in_place, private=half is not None)
    finish = bridge.back
    if half is not None:
        HalfScaling.scale([bridge.array], half.pre)
        op, pre, post, finish = half.op, 1.0, 1.0, half.finish(bridge)
    mine = in_place or bridge.copied            # a private copy is reduced where it lies
    args = (bridge.array, op, name, pre, post, process_set)
    if asynchronous:
        call = comm.allreduce_async_ if mine else comm.allreduce_async
        return Handle(call(*args), finish)
    call = comm.allreduce_ if mine else comm.allreduce
    return finish(call(*args))


class _AllreduceGrad(torch.autograd.Function):
    """allreduce as an autograd op: the gradient is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _allreduce("allreduce", tensor, op, name, prescale_factor, postscale_factor,
                          process_set, False, False)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        out = _allreduce("allreduce", grad.contiguous(), op, None, pre, post, process_set,
                         False, False)
        return out, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """A new tensor (the input's dtype and device): ``op`` of every rank's ``tensor``.

    op: Average (default), Sum, Min, Max, Product; ``average`` is Horovod's deprecated spelling
    (True: Average, False: Sum). prescale/postscale_factor multiply before / after the
    reduction. compression: sent compressed (``Compression.fp16``), returned decompressed.
    """
    op = resolve_op(average, op, "allreduce", process_set)
    sent, ctx = compression.compress(tensor)
    if wants_grad(sent):
        out = _AllreduceGrad.apply(sent, op, name, prescale_factor, postscale_factor,
                                   process_set)
    else:
        out = _allreduce("allreduce", sent, op, name, prescale_factor, postscale_factor,
                         process_set, False, False)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """``allreduce`` in place: ``tensor`` holds the result; returns ``tensor``."""
    op = resolve_op(average, op, "allreduce_", process_set)
    return _allreduce("allreduce_", tensor, op, name, prescale_factor, postscale_factor,
                      process_set, True, False)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Non-blocking ``allreduce``: a Handle; ``synchronize(handle)`` returns the new tensor."""
    op = resolve_op(average, op, "allreduce", process_set)
    return _allreduce("allreduce", tensor, op, name, prescale_factor, postscale_factor,
                      process_set, False, True)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Non-blocking ``allreduce_``: a Handle; ``synchronize(handle)`` returns ``tensor``."""
    op = resolve_op(average, op, "allreduce_", process_set)
    return _allreduce("allreduce_", tensor, op, name, prescale_factor, postscale_factor,
                      process_set, True, True)


class SparseHandle(Handle):
    """``sparse_allreduce_async``'s handle: ``handle()`` (Horovod's spelling), ``poll`` and
    ``synchronize`` give the reduced sparse tensor."""

    __slots__ = ()

    def __call__(self):
        return synchronize(self)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse COO tensor reduced by Horovod's method: every rank's indices and values are
    allgathered, so the result holds every rank's entries (duplicates are summed when it is
    coalesced or made dense); Average divides the values by N. Sum or Average only.
    Returns a SparseHandle: call it, or ``synchronize`` it, for the result."""
    kind = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        refuse("allgather", Problem(TypeError, f"{kind}: expected a sparse COO tensor, got "
                                               f"{got}"), process_set)
    if op is not Sum and op is not Average:
        refuse("allgather", Problem(ValueError, f"{kind}: {op!r} is not supported; use "
                                                f"Average or Sum"), process_set)
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = t.indices().transpose(0, 1).contiguous()
    values = t.values().contiguous()
    handles = [_allgather(values, None if name is None else f"{name}.values", process_set, True),
               _allgather(indices, None if name is None else f"{name}.indices", process_set,
                          True)]
    size = comm.group_size(process_set, kind)

    def finish(results):
        gathered_values, gathered_indices = (h.finish(r) for h, r in zip(handles, results))
        if op is Average:
            gathered_values = gathered_values / size
        # the indices are every rank's valid ones: no invariant check to pay for
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values,
                                       tensor.shape, check_invariants=False)
    return SparseHandle([h.inner for h in handles], finish)


# --- grouped allreduce: one fused call for a list ------------------------------------------

def _grouped(kind, tensors, op, name, prescale_factor, postscale_factor, process_set,
             in_place, asynchronous):
    check_list(kind, tensors, process_set)
    check_tensors(kind, tensors, process_set, op)
    integers = [is_integer(t) for t in tensors]
    if op is Average and any(integers):
        if not all(integers):
            # the Sum-times-1/N rule needs one op for the whole group
            refuse(kind, Problem(ValueError, f"{kind}: the Average of a group that mixes "
                                             f"integer and floating-point tensors; group them "
                                             f"by kind, or use op=Sum"), process_set)
        op, postscale_factor = integer_average(tensors[0], op, postscale_factor, process_set,
                                               kind)
    half = HalfScaling.of(tensors, op, prescale_factor, postscale_factor, process_set, kind)
    # every array is reduced in place: in-place calls write the tensors, the others copies
    bridges = [Bridge(t, in_place, private=not in_place or half is not None) for t in tensors]
    arrays = [b.array for b in bridges]
    if half is not None:
        HalfScaling.scale(arrays, half.pre)
        op, prescale_factor, postscale_factor = half.op, 1.0, 1.0

    def finish(results):
        if half is not None:
            HalfScaling.scale(results, half.post)
        return [b.back(r) for b, r in zip(bridges, results)]

    args = (arrays, op, name, prescale_factor, postscale_factor, None, process_set)
    if asynchronous:
        return Handle(comm.grouped_allreduce_async_(*args), finish)
    return finish(comm.grouped_allreduce_(*args))


class _GroupedAllreduceGrad(torch.autograd.Function):
    """grouped_allreduce as an autograd op: the gradients' grouped allreduce, same op and
    factors (Horovod's)."""

    @staticmethod
    def forward(ctx, op, name, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(_grouped("grouped_allreduce", list(tensors), op, name, prescale_factor,
                              postscale_factor, process_set, False, False))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        out = _grouped("grouped_allreduce", [g.contiguous() for g in grads], op, None, pre,
                       post, process_set, False, False)
        return (None, None, None, None, None, *out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """``allreduce`` of a list of tensors through one fusion buffer; a list of new tensors
    (differentiable)."""
    op = resolve_op(average, op, "grouped_allreduce", process_set)
    pairs = [compression.compress(t) for t in tensors] if isinstance(tensors, (list, tuple)) \
        else None
    sent = tensors if pairs is None else [t for t, _ in pairs]
    if any_wants_grad(sent):
        out = list(_GroupedAllreduceGrad.apply(op, name, prescale_factor, postscale_factor,
                                               process_set, *sent))
    else:
        out = _grouped("grouped_allreduce", sent, op, name, prescale_factor, postscale_factor,
                       process_set, False, False)
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """``grouped_allreduce`` in place; returns the same tensors."""
    op = resolve_op(average, op, "grouped_allreduce_", process_set)
    return _grouped("grouped_allreduce_", tensors, op, name, prescale_factor, postscale_factor,
                    process_set, True, False)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Non-blocking ``grouped_allreduce``: a Handle; ``synchronize`` returns the list."""
    op = resolve_op(average, op, "grouped_allreduce", process_set)
    return _grouped("grouped_allreduce", tensors, op, name, prescale_factor, postscale_factor,
                    process_set, False, True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Non-blocking ``grouped_allreduce_``: a Handle; ``synchronize`` returns the tensors."""
    op = resolve_op(average, op, "grouped_allreduce_", process_set)
    return _grouped("grouped_allreduce_", tensors, op, name, prescale_factor, postscale_factor,
                    process_set, True, True)


# --- allgather ------------------------------------------------------------------------------

def _allgather(tensor, name, process_set, asynchronous):
    check_tensors("allgather", [tensor], process_set)
    bridge = Bridge(tensor, False, move_only=True)
    if asynchronous:
        return Handle(comm.allgather_async(bridge.array, name, process_set), bridge.back)
    return bridge.back(comm.allgather(bridge.array, name, process_set))


class _AllgatherGrad(torch.autograd.Function):
    """allgather as an autograd op: each rank's gradient is its own rows of the average of
    every rank's gradient of the concatenation (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return _allgather(tensor, name, process_set, False)

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        averaged = _allreduce("allreduce", grad.contiguous(), Average, None, 1.0, 1.0, ps,
                              False, False)
        start = own_rows_start(ctx.rows, ps)
        return averaged[start:start + ctx.rows], None, None


def own_rows_start(rows, process_set):
    """Where this rank's ``rows`` rows begin in an allgather of the set (every rank's count
    gathered)."""
    counts = _allgather(torch.tensor([rows], dtype=torch.int64), None, process_set, False)
    return int(counts[:process_set.rank()].sum())


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (first dimensions
    may differ across ranks, the others may not)."""
    if wants_grad(tensor) and tensor.dim() > 0:
        return _AllgatherGrad.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set, False)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Non-blocking ``allgather``: a Handle; ``synchronize(handle)`` returns the tensor."""
    return _allgather(tensor, name, process_set, True)


def _grouped_allgather(tensors, name, process_set, asynchronous):
    """One allgather per tensor, in list order (the same on every rank)."""
    kind = "allgather"
    check_list(kind, tensors, process_set)
    check_tensors(kind, tensors, process_set)
    return _one_handle([_allgather(t, n, process_set, True)
                        for t, n in zip(tensors, member_names(name, len(tensors)))],
                       asynchronous)


def _one_handle(handles, asynchronous):
    """The per-tensor ``handles`` of a grouped call as one Handle (or, synchronously, its
    list of results)."""
    handle = Handle([h.inner for h in handles],
                    lambda results: [h.finish(r) for h, r in zip(handles, results)])
    return handle if asynchronous else synchronize(handle)


class _GroupedAllgatherGrad(torch.autograd.Function):
    """grouped_allgather as an autograd op: each tensor's gradient as allgather's."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(_grouped_allgather(list(tensors), name, process_set, False))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        averaged = _grouped("grouped_allreduce", [g.contiguous() for g in grads], Average,
                            None, 1.0, 1.0, ps, False, False)
        out = []
        for grad, rows in zip(averaged, ctx.rows):
            start = own_rows_start(rows, ps)
            out.append(grad[start:start + rows])
        return (None, None, *out)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """``allgather`` of each tensor of a list; the list of results (differentiable)."""
    if any_wants_grad(tensors) and all(isinstance(t, torch.Tensor) and t.dim() > 0
                                       for t in tensors):
        return list(_GroupedAllgatherGrad.apply(name, process_set, *tensors))
    return _grouped_allgather(tensors, name, process_set, False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Non-blocking ``grouped_allgather``: a Handle; ``synchronize`` returns the list."""
    return _grouped_allgather(tensors, name, process_set, True)


# --- broadcast ------------------------------------------------------------------------------

def _broadcast(kind, tensor, root_rank, name, process_set, in_place, asynchronous):
    check_tensors(kind, [tensor], process_set)
    bridge = Bridge(tensor, in_place, move_only=True)
    args = (bridge.array, root_rank, name, process_set)
    if asynchronous:
        call = comm.broadcast_async_ if in_place else comm.broadcast_async
        return Handle(call(*args), bridge.back)
    call = comm.broadcast_ if in_place else comm.broadcast
    return bridge.back(call(*args))


class _BroadcastGrad(torch.autograd.Function):
    """broadcast as an autograd op (Horovod's): the root's gradient is the ranks' average
    gradient, the others' zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast("broadcast", tensor, root_rank, name, process_set, False, False)

    @staticmethod
    def backward(ctx, grad):
        out = _allreduce("allreduce", grad.contiguous(), Average, None, 1.0, 1.0,
                         ctx.process_set, False, False)
        if comm.rank() != ctx.root_rank:
            out = torch.zeros_like(out)
        return out, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor`` (root_rank: a global rank)."""
    if wants_grad(tensor):
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return _broadcast("broadcast", tensor, root_rank, name, process_set, False, False)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    return _broadcast("broadcast_", tensor, root_rank, name, process_set, True, False)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Non-blocking ``broadcast``: a Handle; ``synchronize(handle)`` returns the new tensor."""
    return _broadcast("broadcast", tensor, root_rank, name, process_set, False, True)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Non-blocking ``broadcast_``: a Handle; ``synchronize(handle)`` returns ``tensor``."""
    return _broadcast("broadcast_", tensor, root_rank, name, process_set, True, True)


# --- reducescatter --------------------------------------------------------------------------

def _reducescatter(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   asynchronous):
    check_tensors("reducescatter", [tensor], process_set, op)
    op, post = integer_average(tensor, op, postscale_factor, process_set, "reducescatter")
    pre = prescale_factor
    half = HalfScaling.of([tensor], op, pre, post, process_set, "reducescatter")
    bridge = Bridge(tensor, False, private=half is not None)
    finish = bridge.back
    if half is not None:
        HalfScaling.scale([bridge.array], half.pre)
        op, pre, post, finish = half.op, 1.0, 1.0, half.finish(bridge)
    args = (bridge.array, op, name, pre, post, process_set)
    if asynchronous:
        return Handle(comm.reducescatter_async(*args), finish)
    return finish(comm.reducescatter(*args))


def reducescatter_grad_scale(op, prescale_factor, postscale_factor, process_set):
    """Horovod's factor on a reducescatter's gradient before it is allgathered: N for a Sum,
    times both scale factors (Horovod's convention, kept for its scripts)."""
    factor = comm.group_size(process_set, "reducescatter") if op is Sum else 1
    return factor * prescale_factor * postscale_factor


class _ReducescatterGrad(torch.autograd.Function):
    """reducescatter as an autograd op: the allgather of the gradient blocks, scaled as
    Horovod scales them (reducescatter_grad_scale)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):
        ctx.factor = reducescatter_grad_scale(op, prescale_factor, postscale_factor,
                                              process_set)
        ctx.process_set = process_set
        return _reducescatter(tensor, op, name, prescale_factor, postscale_factor,
                              process_set, False)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous() if ctx.factor == 1 else grad * ctx.factor
        return _allgather(grad, None, ctx.process_set, False), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """``op`` of every rank's ``tensor``, of which rank r of the set gets block r of
    dimension 0 (the first len % N ranks get one row more). Differentiable."""
    sent, ctx = compression.compress(tensor)
    if wants_grad(sent):
        out = _ReducescatterGrad.apply(sent, op, name, prescale_factor, postscale_factor,
                                       process_set)
    else:
        out = _reducescatter(sent, op, name, prescale_factor, postscale_factor, process_set,
                             False)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Non-blocking ``reducescatter``: a Handle; ``synchronize(handle)`` returns the tensor."""
    return _reducescatter(tensor, op, name, prescale_factor, postscale_factor, process_set,
                          True)


def _grouped_reducescatter(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           asynchronous):
    """One reducescatter per tensor, in list order (the same on every rank)."""
    kind = "reducescatter"
    check_list(kind, tensors, process_set)
    check_tensors(kind, tensors, process_set, op)
    return _one_handle([_reducescatter(t, op, n, prescale_factor, postscale_factor,
                                       process_set, True)
                        for t, n in zip(tensors, member_names(name, len(tensors)))],
                       asynchronous)


class _GroupedReducescatterGrad(torch.autograd.Function):
    """grouped_reducescatter as an autograd op: each gradient as reducescatter's."""

    @staticmethod
    def forward(ctx, op, name, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.factor = reducescatter_grad_scale(op, prescale_factor, postscale_factor,
                                              process_set)
        ctx.process_set = process_set
        return tuple(_grouped_reducescatter(list(tensors), op, name, prescale_factor,
                                            postscale_factor, process_set, False))

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() if ctx.factor == 1 else g * ctx.factor for g in grads]
        return (None, None, None, None, None,
                *_grouped_allgather(grads, None, ctx.process_set, False))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of each tensor of a list; the list of results (differentiable)."""
    pairs = [compression.compress(t) for t in tensors] if isinstance(tensors, (list, tuple)) \
        else None
    sent = tensors if pairs is None else [t for t, _ in pairs]
    if any_wants_grad(sent):
        out = list(_GroupedReducescatterGrad.apply(op, name, prescale_factor,
                                                   postscale_factor, process_set, *sent))
    else:
        out = _grouped_reducescatter(sent, op, name, prescale_factor, postscale_factor,
                                     process_set, False)
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, pairs)]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Non-blocking ``grouped_reducescatter``: a Handle; ``synchronize`` returns the list."""
    return _grouped_reducescatter(tensors, op, name, prescale_factor, postscale_factor,
                                  process_set, True)


# --- alltoall -------------------------------------------------------------------------------

def _splits(splits):
    """``splits`` as the comm layer takes them: a tensor as its values' array, a list as it
    is."""
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    return splits


def splits_problem(splits):
    """Why ``splits`` are not integers, or None. The message names the type, not the values,
    so that every rank given floats raises the same ValueError (Horovod's)."""
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or \
                splits.dtype is torch.bool:
            return Problem(ValueError, f"alltoall: splits must be integers, got a "
                                       f"{str(splits.dtype).replace('torch.', '')} tensor")
    elif isinstance(splits, (list, tuple)):
        bad = [type(s).__name__ for s in splits
               if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer))]
        if bad:
            return Problem(ValueError, f"alltoall: splits must be integers, got "
                                       f"{bad[0]} values")
    return None


def _alltoall(tensor, splits, name, process_set, asynchronous):
    check_tensors("alltoall", [tensor], process_set)
    problem = splits_problem(splits)
    if problem is not None:
        refuse("alltoall", problem, process_set)
    bridge = Bridge(tensor, False, move_only=True)
    given = splits is not None

    def finish(result):
        if not given:
            return bridge.back(result)
        out, received = result
        return bridge.back(out), torch.as_tensor(np.asarray(received), dtype=torch.int32)

    args = (bridge.array, _splits(splits), name, process_set)
    if asynchronous:
        return Handle(comm.alltoall_async(*args), finish)
    return finish(comm.alltoall(*args))


class _AlltoallGrad(torch.autograd.Function):
    """alltoall as an autograd op: the gradient rows go back where they came from (an
    alltoall with the received splits)."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set, ctx.rows = process_set, tensor.shape[0]
        if splits is None:
            ctx.received = None
            return _alltoall(tensor, None, name, process_set, False)
        out, received = _alltoall(tensor, splits, name, process_set, False)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        ps = ctx.process_set
        received = ctx.received
        if received is None:            # equal splits: rank j sent us its rows / N
            counts = _allgather(torch.tensor([ctx.rows], dtype=torch.int64), None, ps, False)
            received = counts // comm.group_size(ps, "alltoall")
        back, _ = _alltoall(grad.contiguous(), received, None, ps, False)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send rows ``splits[j]`` of ``tensor`` (in order) to rank j of the set; returns the rows
    received, in rank order, and with ``splits`` also the int32 tensor of received counts.
    Without ``splits`` dimension 0 must divide evenly by the number of ranks.
    Differentiable."""
    if wants_grad(tensor):
        return _AlltoallGrad.apply(tensor, splits, name, process_set)
    return _alltoall(tensor, splits, name, process_set, False)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Non-blocking ``alltoall``: a Handle; ``synchronize(handle)`` returns what it returns."""
    return _alltoall(tensor, splits, name, process_set, True)


# --- no tensors -----------------------------------------------------------------------------

def barrier(process_set=global_process_set):
    """Wait until every rank of the set gets here."""
    comm.barrier(process_set=process_set)


def join(device=-1, process_set=global_process_set):
    """This rank is out of data: serve the others' reductions (its contribution: zeros, or the
    op's identity) until every rank has joined; returns the rank that joined last.
    ``device`` is accepted for Horovod's scripts; the join moves no tensor of its own."""
    return comm.join(device, process_set=process_set)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s picklable ``obj`` on every rank (``name`` accepted, unused)."""
    return comm.broadcast_object(obj, root_rank=root_rank, process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """The list of every rank's picklable ``obj``, in rank order (``name`` accepted, unused)."""
    return comm.allgather_object(obj, process_set=process_set)
