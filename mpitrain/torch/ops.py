"""The collectives on torch.Tensors, with horovod.torch's names and keyword arguments.

Each call checks its tensors (tensors.py), hands the comm layer an array sharing the tensor's
memory (a CPU tensor's zero-copy NumPy view; a CUDA tensor through ``__cuda_array_interface__``)
and turns the result back into a tensor of the input's dtype and device. So everything the comm
layer does for NumPy arrays holds here: the cross-rank agreement (a mismatch is a
CollectiveError on every rank, never a hang), the allreduce paths, process sets, ``join``, the
stall watchdog, the timeline. In-place forms (trailing underscore) return the very tensor they
were given. ``*_async`` forms return a ``Handle`` for ``poll`` and ``synchronize``, which
returns what the blocking call returns.

allreduce, allgather and broadcast are differentiable, as in Horovod: on a tensor that requires
grad they return a tensor whose backward runs the matching collective on the gradient.

The Average of integer tensors stays an integer tensor: the sum times 1/N, truncated toward
zero (Horovod's rule), where mpitrain's own ``mt.allreduce`` gives a float64 mean.
"""
import numpy as np
import torch

from mpitrain import comm
from mpitrain.torch.compression import Compression
from mpitrain.torch.tensors import (Bridge, Problem, is_integer, reduction_problem, refuse,
                                    tensor_problem)

Sum, Average, Min, Max, Product = comm.Sum, comm.Average, comm.Min, comm.Max, comm.Product
global_process_set = comm.global_process_set


class Handle:
    """A collective on tensors in flight: ``poll(handle)``, ``synchronize(handle)``."""

    __slots__ = ("inner", "finish", "done", "result")

    def __init__(self, inner, finish):
        self.inner = inner          # the comm layer's handle
        self.finish = finish        # comm result -> what synchronize returns
        self.done = False
        self.result = None

    def __repr__(self):
        return f"<mpitrain.torch handle: {'done' if poll(self) else 'pending'}>"


def poll(handle):
    """True when ``handle``'s collective has finished (``synchronize`` will not block)."""
    return handle.done or comm.poll(handle.inner)


def synchronize(handle):
    """Wait for ``handle``'s collective; its result (the tensor, or what the blocking call
    returns). Raises what the collective raised, on every rank."""
    if not handle.done:
        result = comm.synchronize(handle.inner)
        handle.result, handle.done, handle.inner = handle.finish(result), True, None
    return handle.result


# --- arguments ------------------------------------------------------------------------------

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
    for i, t in enumerate(tensors):
        problem = tensor_problem(t, kind, None if len(tensors) == 1 else i)
        if problem is None and op is not None:
            problem = reduction_problem(t, op, kind)
        if problem is not None:
            refuse(kind, problem, process_set)


def integer_average(tensor, op, postscale_factor, process_set, kind):
    """(op, postscale) the comm layer runs: an integer Average is a Sum scaled by 1/N."""
    if op is Average and is_integer(tensor):
        return Sum, postscale_factor / comm.group_size(process_set, kind)
    return op, postscale_factor


def wants_grad(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


# --- allreduce ------------------------------------------------------------------------------

def _allreduce(kind, tensor, op, name, prescale_factor, postscale_factor, process_set,
               in_place, asynchronous):
    check_tensors(kind, [tensor], process_set, op)
    bridge = Bridge(tensor, in_place)
    op, post = integer_average(tensor, op, postscale_factor, process_set, kind)
    mine = in_place or bridge.copied            # a private copy is reduced where it lies
    args = (bridge.array, op, name, prescale_factor, post, process_set)
    if asynchronous:
        call = comm.allreduce_async_ if mine else comm.allreduce_async
        return Handle(call(*args), bridge.back)
    call = comm.allreduce_ if mine else comm.allreduce
    return bridge.back(call(*args))


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


# --- grouped allreduce: one fused call for a list ------------------------------------------

def _grouped(kind, tensors, op, name, prescale_factor, postscale_factor, process_set,
             in_place, asynchronous):
    if not isinstance(tensors, (list, tuple)):
        refuse(kind, Problem(TypeError, f"{kind}: expected a list of tensors, got "
                                        f"{type(tensors).__name__}"), process_set)
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
    # every array is reduced in place: in-place calls write the tensors, the others copies
    bridges = [Bridge(t, in_place, private=not in_place) for t in tensors]
    arrays = [b.array for b in bridges]

    def finish(results):
        return [b.back(r) for b, r in zip(bridges, results)]

    args = (arrays, op, name, prescale_factor, postscale_factor, None, process_set)
    if asynchronous:
        return Handle(comm.grouped_allreduce_async_(*args), finish)
    return finish(comm.grouped_allreduce_(*args))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """``allreduce`` of a list of tensors through one fusion buffer; a list of new tensors."""
    op = resolve_op(average, op, "grouped_allreduce", process_set)
    pairs = [compression.compress(t) for t in tensors] if isinstance(tensors, (list, tuple)) \
        else None
    sent = tensors if pairs is None else [t for t, _ in pairs]
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
    """allgather as an autograd op: each rank's gradient is its own rows of the sum of every
    rank's gradient of the concatenation."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return _allgather(tensor, name, process_set, False)

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        summed = _allreduce("allreduce", grad.contiguous(), Sum, None, 1.0, 1.0, ps, False,
                            False)
        rows = _allgather(torch.tensor([ctx.rows], dtype=torch.int64), None, ps, False)
        me = ps.rank()
        start = int(rows[:me].sum())
        return summed[start:start + ctx.rows], None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (first dimensions
    may differ across ranks, the others may not)."""
    if wants_grad(tensor) and tensor.dim() > 0:
        return _AllgatherGrad.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set, False)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Non-blocking ``allgather``: a Handle; ``synchronize(handle)`` returns the tensor."""
    return _allgather(tensor, name, process_set, True)


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
    bridge = Bridge(tensor, False)
    op, post = integer_average(tensor, op, postscale_factor, process_set, "reducescatter")
    args = (bridge.array, op, name, prescale_factor, post, process_set)
    if asynchronous:
        return Handle(comm.reducescatter_async(*args), bridge.back)
    return bridge.back(comm.reducescatter(*args))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """``op`` of every rank's ``tensor``, of which rank r of the set gets block r of
    dimension 0 (the first len % N ranks get one row more)."""
    sent, ctx = compression.compress(tensor)
    out = _reducescatter(sent, op, name, prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Non-blocking ``reducescatter``: a Handle; ``synchronize(handle)`` returns the tensor."""
    return _reducescatter(tensor, op, name, prescale_factor, postscale_factor, process_set,
                          True)


# --- alltoall -------------------------------------------------------------------------------

def _splits(splits):
    """``splits`` as the comm layer takes them (a list of ints), from a tensor or a list."""
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.tolist()]
    return splits


def _alltoall(tensor, splits, name, process_set, asynchronous):
    check_tensors("alltoall", [tensor], process_set)
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


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send rows ``splits[j]`` of ``tensor`` (in order) to rank j of the set; returns the rows
    received, in rank order, and with ``splits`` also the int32 tensor of received counts.
    Without ``splits`` dimension 0 must divide evenly by the number of ranks."""
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
