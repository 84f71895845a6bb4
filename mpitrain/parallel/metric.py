"""Metric: a running average of a scalar across ranks and updates (Horovod's example class).

Horovod's ImageNet example averages its loss and accuracy with a ``Metric(name)`` whose
``update(val)`` allreduces the value (named with the metric's name) and adds the ranks' mean to a
running sum. Here ``update(value, n=1)`` sums ``value * n`` and ``n`` over the ranks in one
allreduce, so ``avg`` is the mean over every sample of every update on every rank:

    rank 0: update(2.0, n=3)    rank 1: update(4.0, n=1)    ->  avg = (2*3 + 4*1) / 4 = 2.5
    rank 0: update(1.0)         rank 1: update(3.0)         ->  avg = (6 + 4 + 1 + 3) / 6 = 2.33

With n=1 everywhere (Horovod's shape) that is the mean of the per-update cross-rank means, which
is what Horovod's ``sum / n`` gives. A rank with nothing to add this time (a shorter shard of the
validation set) calls ``update(0.0, n=0)``: every rank must call ``update`` the same number of
times, in the same order across metrics (the name is part of the cross-rank check).

A value that is not a real scalar (a float, an int, a NumPy scalar or a 0-d array) is a
ValueError -- on every rank, after the allreduce, so the others are never left waiting.
"""
import math
import numbers

import numpy as np

from mpitrain import comm


class Metric:
    """``Metric(name)``; ``update(value, n=1)`` (collective); ``avg``, ``sum``, ``count``.

    name: the allreduce's name (it must match across ranks, as in Horovod).
    process_set: the ranks that average (default: all).
    ``avg`` is NaN before any sample has been counted (a mean of nothing).
    """

    def __init__(self, name, process_set=comm.global_process_set):
        if not isinstance(name, str) or not name:
            raise ValueError(f"Metric: name {name!r} must be a non-empty string")
        self.name = name
        self.process_set = process_set
        self.sum = 0.0          # sum over ranks and updates of value * n
        self.count = 0          # sum over ranks and updates of n

    def update(self, value, n=1):
        """Add ``value`` (a mean over ``n`` samples, n >= 0) from every rank; collective."""
        x, error = _as_float(self.name, value, n)
        contribution = 0.0 if error or n == 0 else x * n
        totals = comm.allreduce(
            np.array([contribution, 0 if error else n, 1.0 if error else 0.0], np.float64),
            op=comm.Sum, name=self.name, process_set=self.process_set)   # (3,)
        if error:
            raise ValueError(error)
        if totals[2]:
            raise ValueError(f"Metric {self.name!r}: {int(totals[2])} other rank(s) passed a "
                             f"value that is not a real scalar or a bad n")
        self.sum += float(totals[0])
        self.count += int(totals[1])

    @property
    def avg(self):
        return self.sum / self.count if self.count else math.nan

    def __repr__(self):
        return f"Metric({self.name!r}, avg={self.avg:.6g}, count={self.count})"


def _as_float(name, value, n):
    """(value as a float, None), or (None, a one-line reason why (value, n) cannot be added)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        return None, f"Metric {name!r}: n {n!r} must be an integer >= 0"
    if isinstance(value, (bool, np.bool_)):
        return None, f"Metric {name!r}: value {value!r} is a bool, not a number"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(value, numbers.Real):             # float, int, np.floating, np.integer
        pass
    elif shape == () and getattr(dtype, "kind", None) in ("i", "u", "f"):   # 0-d, host or device
        value = value.item()
    else:
        what = f"an array of shape {shape}" if shape is not None else type(value).__name__
        return None, (f"Metric {name!r}: value must be a real scalar (float, int, NumPy scalar "
                      f"or 0-d array), got {what}")
    try:
        return float(value), None
    except OverflowError:
        return None, f"Metric {name!r}: value {value!r} does not fit a float"
