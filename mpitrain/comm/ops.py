"""Reduction ops, supported dtypes and the argument checks every collective shares.

The checks return ``(value, error message or None)`` instead of raising: a collective gathers its
errors into the cross-rank agreement (check.py), so a bad argument on one rank raises on every
rank instead of leaving the others waiting. host.py and device.py both use them.
"""
import enum
import math

import numpy as np
from mpi4py import MPI

from mpitrain.kernels.cpu.bfloat16 import BFLOAT16

DTYPES = tuple(np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "int64",
                                     "float16", "float32", "float64"))
DTYPE_SET = frozenset(DTYPES)              # hashed lookup: cheaper than 8 dtype comparisons
# The bf16 compression's wire dtype (kernels/cpu/bfloat16.py): bfloat16 bits, reduced in float32.
# Host arrays only, and not one of DTYPES: no user tensor has it.
WIRE_ONLY = frozenset([BFLOAT16])


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "prod"

    def __repr__(self):
        return f"mt.{self.name.capitalize()}"

    __hash__ = object.__hash__    # members are singletons: not Enum's slower hash (plan keys)


Sum, Average, Min, Max, Product = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)
# What each op reduces with (Average sums, then scales): MPI's op and NumPy's ufunc.
MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


# Open MPI 4.1's vectorised reductions (its op/avx component) saturate 8- and 16-bit integer
# sums instead of wrapping around as C and MPICH do (a known bug upstream left unfixed), so
# under Open MPI our ring reduces those types, whatever the op.
SATURATED_BY_MPI = (frozenset(np.dtype(t) for t in ("uint8", "int8", "int16"))
                    if "Open MPI" in MPI.Get_library_version() else frozenset())


def mpi_can_reduce(dtype):
    """Whether MPI's own reductions take ``dtype``: not float16 or bfloat16, which MPI has no type
    for (our ring reduces them with its own kernels), nor the small integers Open MPI
    saturates (SATURATED_BY_MPI). The one place this is decided."""
    dtype = np.dtype(dtype)
    return dtype != np.float16 and dtype != BFLOAT16 and dtype not in SATURATED_BY_MPI
UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def reduce_kind(op):
    """The elementwise reduction of ``op``: "sum" for Sum and Average, else the op's own."""
    return "sum" if op is Average else op.value


def on_device(x):
    """Whether ``x`` is a device array (comm/device.py's business, not the host path's)."""
    # Numba device arrays mark themselves with __cuda_ndarray__ (the CUDA simulator's too, which
    # have no __cuda_array_interface__)
    return hasattr(x, "__cuda_array_interface__") or bool(getattr(x, "__cuda_ndarray__", False))


def as_array(x, kind, in_place=False, min_ndim=0):
    if in_place and not isinstance(x, np.ndarray):
        return None, f"{kind}: in-place needs a numpy.ndarray, got {type(x).__name__}"
    try:
        a = x if isinstance(x, np.ndarray) else np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is a bad argument
        return None, f"{kind}: cannot convert {type(x).__name__} to an array ({exc})"
    if a.dtype not in DTYPE_SET and a.dtype not in WIRE_ONLY:
        names = ", ".join(d.name for d in DTYPES)
        return None, f"{kind}: dtype {a.dtype} is not supported; use one of {names}"
    if in_place and not a.flags.writeable:
        return None, f"{kind}: in-place needs a writeable array"
    if a.ndim < min_ndim:
        return None, f"{kind}: needs an array with at least {min_ndim} dimension, got shape ()"
    return a, None


def integer_average(dtype, op):
    """True for an Average of integers: a float64 mean out of place, an error in place."""
    return (np.dtype(dtype).kind != "f" and np.dtype(dtype) != BFLOAT16
            and as_op(op, "")[0] is Average)


def integer_average_error(kind, dtype):
    """Why an in-place Average of an integer array is refused (host and device alike)."""
    return (f"{kind}: the Average of {np.dtype(dtype).name} arrays is not an integer and "
            f"cannot be stored in place; use the out-of-place call (float64 result) or "
            f"op=mt.Sum and divide")


def as_op(op, kind):
    if op.__class__ is ReduceOp:
        return op, None
    try:
        return ReduceOp(str(op).lower()), None
    except ValueError:
        return None, (f"{kind}: unknown op {op!r}; "
                      f"use mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product")


def as_factor(value, label):
    if type(value) is float and math.isfinite(value):      # the common case, checked cheaply
        return value, None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        return None, f"{label}={value!r} is not a number"
    if not math.isfinite(float(value)):
        return None, f"{label}={value!r} is not finite"
    return float(value), None


def as_root(root, kind, members):
    """(the root's rank in the communicator, error): ``root`` is a rank of the global set, as in
    Horovod; members: the communicator's ranks as global ranks (World.members: a range for the
    global set, a list for a process set)."""
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        return None, f"{kind}: root_rank={root!r} is not an integer"
    if int(root) not in members:
        if isinstance(members, range):
            return None, f"{kind}: root_rank={root} is out of range for {len(members)} ranks"
        return None, f"{kind}: root_rank={root} is not in the process set (ranks {members})"
    return members.index(int(root)), None


def first_error(*errors):
    return next((e for e in errors if e is not None), None)


def reduce_args(kind, op, prescale, postscale):
    """(op, prescale, postscale, the fields to agree on, error or None) of a reduction."""
    op, e1 = as_op(op, kind)
    pre, e2 = as_factor(prescale, f"{kind}: prescale_factor")
    post, e3 = as_factor(postscale, f"{kind}: postscale_factor")
    fields = {"op": op, "prescale_factor": pre, "postscale_factor": post}
    return op, pre, post, fields, first_error(e1, e2, e3)
