"""The public collectives (Horovod's names): each picks host or device here, and only here.

Host (NumPy) arrays go to host.py, device arrays (anything with ``__cuda_array_interface__``, or
a Numba device array) to device.py, which is imported on first use, so a process without a GPU
never loads CuPy. Both follow the same contract: validate, agree across ranks (a mismatch is a
CollectiveError on every rank), move data. Object collectives and the barrier are host-only.
"""
import numpy as np

from mpitrain.comm import host, world
from mpitrain.comm.check import CollectiveError
from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES
from mpitrain.comm.ops import DTYPES, Average, Max, Min, Product, ReduceOp, Sum, on_device

barrier, broadcast_object, allgather_object = (host.barrier, host.broadcast_object,
                                               host.allgather_object)


def fusion_threshold(value=None, default=DEFAULT_THRESHOLD_BYTES):
    """A bucket size limit in bytes: ``value`` checked (int >= 0), else the settings'
    (MPITRAIN_FUSION_THRESHOLD), else ``default``."""
    return host.fusion_threshold(world.current(), value, default)


def _device():
    """comm/device.py, imported when the first device array arrives."""
    try:
        from mpitrain.comm import device
    except ImportError as exc:
        raise NotImplementedError(
            f"got a device array (__cuda_array_interface__) but device collectives are "
            f"unavailable: {exc}") from None
    return device


def allreduce(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks; returns a new array on every rank (same shape; same dtype,
    except that the Average of integers is a float64 mean)."""
    impl = host if x.__class__ is np.ndarray or not on_device(x) else _device()
    return impl.allreduce(x, op, name, prescale_factor, postscale_factor)


def allreduce_(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place allreduce; returns ``x``."""
    impl = host if x.__class__ is np.ndarray or not on_device(x) else _device()
    return impl.allreduce_(x, op, name, prescale_factor, postscale_factor)


def grouped_allreduce(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      fusion_threshold_bytes=None):
    """Allreduce a list of arrays through the fusion buffer; returns a list of new arrays.

    fusion_threshold_bytes: bucket size limit (0 = one allreduce per array); None takes the
    settings' (MPITRAIN_FUSION_THRESHOLD) or the 64 MiB default. Must agree across ranks.
    """
    xs = list(xs)
    impl = _device() if any(on_device(x) for x in xs) else host
    return impl.grouped_allreduce(xs, op, name, prescale_factor, postscale_factor,
                                  fusion_threshold_bytes)


def grouped_allreduce_(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                       fusion_threshold_bytes=None):
    """In-place grouped allreduce (e.g. gradients); returns the same list."""
    xs = list(xs)
    impl = _device() if any(on_device(x) for x in xs) else host
    return impl.grouped_allreduce_(xs, op, name, prescale_factor, postscale_factor,
                                   fusion_threshold_bytes)


def allgather(x, name=None):
    """Concatenate every rank's ``x`` along axis 0 (first dims may differ; the rest must not)."""
    return (_device() if on_device(x) else host).allgather(x, name=name)


def broadcast(x, root_rank, name=None):
    """Return a new array holding root_rank's ``x`` on every rank."""
    return (_device() if on_device(x) else host).broadcast(x, root_rank, name=name)


def broadcast_(x, root_rank, name=None):
    """Overwrite ``x`` with root_rank's values in place; returns ``x``."""
    return (_device() if on_device(x) else host).broadcast_(x, root_rank, name=name)


def reducescatter(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks and give rank r block r of axis 0 (first len % N get +1 row)."""
    return (_device() if on_device(x) else host).reducescatter(
        x, op=op, name=name, prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def alltoall(x, splits=None, name=None):
    """Send rows splits[j] of ``x`` (in order) to rank j; returns out, or (out, received_splits).

    Without ``splits`` the first dimension must divide evenly by the number of ranks.
    """
    return (_device() if on_device(x) else host).alltoall(x, splits=splits, name=name)


__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "DTYPES", "CollectiveError",
           "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
           "broadcast", "broadcast_", "reducescatter", "alltoall", "barrier",
           "broadcast_object", "allgather_object", "fusion_threshold"]
