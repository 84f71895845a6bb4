"""The public collectives (Horovod's names): each picks host or device here, and only here.

Host (NumPy) arrays go to host.py, device arrays (anything with ``__cuda_array_interface__``, or
a Numba device array) to device.py, which is imported on first use, so a process without a GPU
never loads CuPy. Both follow the same contract: validate, agree across ranks (a mismatch is a
CollectiveError on every rank), move data. Object collectives and the barrier are host-only.

``process_set=`` (default: every rank) becomes the World the lower layers act on, here and
only here (process_sets.world_of: a rank outside the set gets a ValueError naming it); root
ranks are global ranks, as in Horovod. A blocking call runs on the caller's thread unless
non-blocking collectives are in flight, then behind them (handles.ordered). The ``*_async``
forms return a handle at once and run the same function on the comm thread (handles.py):
``synchronize(h)`` returns exactly what the blocking call returns.
"""
import numpy as np

from mpitrain.comm import adasum, handles, host
from mpitrain.comm.adasum import Adasum, is_adasum
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES
from mpitrain.comm.handles import Handle, poll, synchronize
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import DTYPES, Average, Max, Min, Product, ReduceOp, Sum, on_device
from mpitrain.comm.process_sets import (ProcessSet, add_process_set, global_process_set,
                                        process_sets, remove_process_set, world_of)

GLOBAL = global_process_set


def fusion_threshold(value=None, default=DEFAULT_THRESHOLD_BYTES, process_set=GLOBAL):
    """A bucket size limit in bytes: ``value`` checked (int >= 0), else the settings'
    (MPITRAIN_FUSION_THRESHOLD), else ``default``."""
    return host.fusion_threshold(world_of(process_set, "fusion_threshold"), value, default)


def _device():
    """comm/device.py, imported when the first device array arrives."""
    try:
        from mpitrain.comm import device
    except ImportError as exc:
        raise NotImplementedError(
            f"got a device array (__cuda_array_interface__) but device collectives are "
            f"unavailable: {exc}") from None
    return device


def _impl(x, op=None):
    """host.py or device.py for one array: the one host/device choice of the package (an
    allreduce with ``op`` Adasum: adasum.py, which refuses device arrays on every rank)."""
    if op is not None and op.__class__ is not ReduceOp and is_adasum(op):
        return adasum
    return host if x.__class__ is np.ndarray or not on_device(x) else _device()


def _impl_of_all(xs, op=None):
    if op is not None and op.__class__ is not ReduceOp and is_adasum(op):
        return adasum
    return _device() if any(on_device(x) for x in xs) else host


def _run(fn, kind, process_set, *args):
    """The blocking call: ``fn`` (host.py's or device.py's function of that name) on the set's
    World, in order with handles in flight."""
    return handles.ordered(fn, world_of(process_set, kind), *args)


def _submit(impl, kind, process_set, name, *args):
    """The non-blocking call: the same function on the comm thread; a Handle. A rank outside
    the set, or a ``name`` still in flight, is refused here (ValueError), before anything is
    queued."""
    state = world_of(process_set, kind + "_async")
    if impl is not host and impl is not adasum:
        # Device arrays: CuPy's and Numba's current device and stream are per thread, so the
        # collective runs now, in order, and the handle is complete at once: on this thread, or
        # behind collectives in flight on the comm thread, where device.py binds the GPU first.
        return handles.completed(getattr(impl, kind), state, *args, kind=kind)
    return handles.submit(getattr(impl, kind), state, *args, kind=kind,
                          span=(kind.value, {"tensor_name": name, "process_set": state.set_id}),
                          name=name)


# --- blocking ---------------------------------------------------------------------------------

def allreduce(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=GLOBAL):
    """Reduce ``x`` across ranks; returns a new array on every rank (same shape; same dtype,
    except that the Average of integers is a float64 mean)."""
    return _run(_impl(x, op).allreduce, Kind.ALLREDUCE, process_set, x, op, name,
                prescale_factor, postscale_factor)


def allreduce_(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=GLOBAL):
    """In-place allreduce; returns ``x``."""
    return _run(_impl(x, op).allreduce_, Kind.ALLREDUCE_, process_set, x, op, name,
                prescale_factor, postscale_factor)


def grouped_allreduce(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      fusion_threshold_bytes=None, process_set=GLOBAL):
    """Allreduce a list of arrays through the fusion buffer; returns a list of new arrays.

    fusion_threshold_bytes: bucket size limit (0 = one allreduce per array); None takes the
    settings' (MPITRAIN_FUSION_THRESHOLD) or the 64 MiB default. Must agree across ranks.
    """
    xs = list(xs)
    return _run(_impl_of_all(xs, op).grouped_allreduce, Kind.GROUPED_ALLREDUCE, process_set,
                xs, op, name, prescale_factor, postscale_factor, fusion_threshold_bytes)


def grouped_allreduce_(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                       fusion_threshold_bytes=None, process_set=GLOBAL):
    """In-place grouped allreduce (e.g. gradients); returns the same list."""
    xs = list(xs)
    return _run(_impl_of_all(xs, op).grouped_allreduce_, Kind.GROUPED_ALLREDUCE_, process_set,
                xs, op, name, prescale_factor, postscale_factor, fusion_threshold_bytes)


def allgather(x, name=None, process_set=GLOBAL):
    """Concatenate every rank's ``x`` along axis 0 (first dims may differ; the rest must not)."""
    return _run(_impl(x).allgather, Kind.ALLGATHER, process_set, x, name)


def allgather_shares(x, name=None, process_set=GLOBAL):
    """``allgather`` of host arrays that are a sharded optimizer's shares of its parameters: a
    rank that has joined with that optimizer (``join(optimizers=...)``) sends its own share."""
    return _run(host.allgather_shares, Kind.ALLGATHER_SHARES, process_set, x, name)


def broadcast(x, root_rank, name=None, process_set=GLOBAL):
    """Return a new array holding root_rank's ``x`` on every rank (root_rank: a global rank)."""
    return _run(_impl(x).broadcast, Kind.BROADCAST, process_set, x, root_rank, name)


def broadcast_(x, root_rank, name=None, process_set=GLOBAL):
    """Overwrite ``x`` with root_rank's values in place; returns ``x``."""
    return _run(_impl(x).broadcast_, Kind.BROADCAST_, process_set, x, root_rank, name)


def reducescatter(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=GLOBAL):
    """Reduce ``x`` across ranks and give rank r (of the set) block r of axis 0 (first len % N
    get +1 row)."""
    return _run(_impl(x).reducescatter, Kind.REDUCESCATTER, process_set, x, op, name,
                prescale_factor, postscale_factor)


def alltoall(x, splits=None, name=None, process_set=GLOBAL):
    """Send rows splits[j] of ``x`` (in order) to rank j; returns out, or (out, received_splits).

    Without ``splits`` the first dimension must divide evenly by the number of ranks.
    """
    return _run(_impl(x).alltoall, Kind.ALLTOALL, process_set, x, splits, name)


def barrier(process_set=GLOBAL):
    return _run(host.barrier, Kind.BARRIER, process_set)


def broadcast_object(obj, root_rank=0, process_set=GLOBAL):
    """root_rank's (picklable) ``obj`` on every rank."""
    return _run(host.broadcast_object, Kind.BROADCAST_OBJECT, process_set, obj, root_rank)


def allgather_object(obj, process_set=GLOBAL):
    """List of every rank's (picklable) ``obj``, in rank order."""
    return _run(host.allgather_object, Kind.ALLGATHER_OBJECT, process_set, obj)


# --- non-blocking: a handle now, the result from synchronize(handle) ---------------------------

def allreduce_async(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=GLOBAL):
    """Non-blocking ``allreduce``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x, op), Kind.ALLREDUCE, process_set, name, x, op, name, prescale_factor,
                   postscale_factor)


def allreduce_async_(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=GLOBAL):
    """Non-blocking ``allreduce_``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x, op), Kind.ALLREDUCE_, process_set, name, x, op, name, prescale_factor,
                   postscale_factor)


def grouped_allreduce_async(xs, op=Average, name=None, prescale_factor=1.0,
                            postscale_factor=1.0, fusion_threshold_bytes=None,
                            process_set=GLOBAL):
    """Non-blocking ``grouped_allreduce``: a handle; ``synchronize(handle)`` returns its result."""
    xs = list(xs)
    return _submit(_impl_of_all(xs, op), Kind.GROUPED_ALLREDUCE, process_set, name, xs, op, name,
                   prescale_factor, postscale_factor, fusion_threshold_bytes)


def grouped_allreduce_async_(xs, op=Average, name=None, prescale_factor=1.0,
                             postscale_factor=1.0, fusion_threshold_bytes=None,
                             process_set=GLOBAL):
    """Non-blocking ``grouped_allreduce_``: a handle; ``synchronize(handle)`` returns its result."""
    xs = list(xs)
    return _submit(_impl_of_all(xs, op), Kind.GROUPED_ALLREDUCE_, process_set, name, xs, op, name,
                   prescale_factor, postscale_factor, fusion_threshold_bytes)


def allgather_async(x, name=None, process_set=GLOBAL):
    """Non-blocking ``allgather``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x), Kind.ALLGATHER, process_set, name, x, name)


def allgather_shares_async(x, name=None, process_set=GLOBAL):
    """Non-blocking ``allgather_shares``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(host, Kind.ALLGATHER_SHARES, process_set, name, x, name)


def broadcast_async(x, root_rank, name=None, process_set=GLOBAL):
    """Non-blocking ``broadcast``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x), Kind.BROADCAST, process_set, name, x, root_rank, name)


def broadcast_async_(x, root_rank, name=None, process_set=GLOBAL):
    """Non-blocking ``broadcast_``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x), Kind.BROADCAST_, process_set, name, x, root_rank, name)


def reducescatter_async(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=GLOBAL):
    """Non-blocking ``reducescatter``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x), Kind.REDUCESCATTER, process_set, name, x, op, name, prescale_factor,
                   postscale_factor)


def alltoall_async(x, splits=None, name=None, process_set=GLOBAL):
    """Non-blocking ``alltoall``: a handle; ``synchronize(handle)`` returns its result."""
    return _submit(_impl(x), Kind.ALLTOALL, process_set, name, x, splits, name)


__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "DTYPES",
           "CollectiveError",
           "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
           "allgather_shares", "allgather_shares_async", "broadcast", "broadcast_",
           "reducescatter", "alltoall", "barrier",
           "broadcast_object", "allgather_object", "fusion_threshold",
           "allreduce_async", "allreduce_async_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
           "reducescatter_async", "alltoall_async", "Handle", "poll", "synchronize",
           "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
           "process_sets"]
