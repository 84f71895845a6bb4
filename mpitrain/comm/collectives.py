"""Horovod-style collectives on NumPy arrays: allreduce (our ring), allgather, broadcast, ...

Every collective does the same three things: validate its arguments locally, agree with the other
ranks on them (check.agree: one fixed-size MPI_Allgather of a fingerprint; a mismatch raises
CollectiveError on every rank), then move data. Only allreduce has its own algorithm (ring.py);
the others call MPI's variable-count collectives on raw bytes, which is also why every dtype works
with them.

Allreduce path:
- up to check.INLINE_BYTES (4 KiB) the data travels inside the agreement check's own fixed-size
  allgather and every rank reduces the N rows locally in rank order: one MPI call in all, and the
  same bits on every rank;
- float16 always takes the ring (MPI has no portable float16 reduction);
- messages of at least ``RING_THRESHOLD_BYTES`` (32 MiB, ``MPITRAIN_RING_THRESHOLD``) take the
  ring, smaller ones MPI_Allreduce. Measured at N=2 on one host (docs/benchmarks.md): up to
  16 MB MPICH's allreduce is as fast or faster (0.65-0.95x for the ring at 1-16 MB: each ring
  step is a synchronising shared-memory rendezvous plus Python, MPICH runs in C), while from
  32 MB on the ring is 2-3.5x faster: MPICH allocates its temporary buffer per call, and above
  glibc's mmap threshold (at most 32 MiB) that memory is faulted in afresh every time, where the
  ring reuses its scratch. Integers follow the same rule: MPI's integer sums wrap exactly like
  our Numba kernels, so both paths give identical integers;
- ``MPITRAIN_ALLREDUCE=ring|mpi`` forces one path (comparisons, debugging).
These settings are read once, at mt.init(), and must be the same on every rank (configure).
Average is Sum followed by a scale of postscale_factor/N (on the ring, each rank scales the chunk
it completes, before the allgather: 1/N of a pass instead of a whole one, same bits);
prescale_factor multiplies the input first. The Average of integer arrays is a float64 array
(NumPy's ``mean``: [1, 2] -> 1.5), never a truncated integer; in place, where the result would
have to be stored as integers, it is a ValueError on every rank. Explicit factors on integer
arrays scale in float64 and truncate toward zero (NumPy unsafe casting), as Horovod's do.

Device arrays (anything exposing ``__cuda_array_interface__``) are handed to
mpitrain/comm/device.py at one place, ``_device``; the host code never branches on array types.
"""
import enum
import math
import os
import pickle

import numpy as np
from mpi4py import MPI

from mpitrain.comm import check, world
from mpitrain.comm.fusion import FusionBuffer, check_threshold
from mpitrain.comm.ring import ring_allreduce
from mpitrain.kernels import cpu

# Settings: read from the environment at mt.init() and agreed across ranks (configure).
ALGORITHM = "auto"                  # MPITRAIN_ALLREDUCE: auto (threshold) | ring | mpi
RING_THRESHOLD_BYTES = 32 << 20     # MPITRAIN_RING_THRESHOLD
SUBCHUNK_BYTES = 1 << 20            # MPITRAIN_RING_SUBCHUNK
_SETTINGS = ("MPITRAIN_ALLREDUCE", "MPITRAIN_RING_THRESHOLD", "MPITRAIN_RING_SUBCHUNK",
             "MPITRAIN_CHECK", "MPITRAIN_STALL_WARNING", "MPITRAIN_STALL_SHUTDOWN")
DTYPES = tuple(np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "int64",
                                     "float16", "float32", "float64"))
_DTYPE_SET = frozenset(DTYPES)              # hashed lookup: cheaper than 8 dtype comparisons


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "prod"

    def __repr__(self):
        return f"mt.{self.name.capitalize()}"


Sum, Average, Min, Max, Product = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)
_MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
_REDUCERS = {k: (lambda d, s, _k=k: cpu.reduce_into(d, s, _k)) for k in _MPI_OPS}
_UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
_scratch = {}
_fusion = None


def _reset():
    """Drop persistent buffers (called by world.shutdown)."""
    global _fusion
    _scratch.clear()
    _plans.clear()
    _fusion = None


def configure(comm):
    """Read the settings above (and check.py's MPITRAIN_CHECK) from the environment; mt.init()
    calls this once (the two MPITRAIN_STALL_* are only compared here; watchdog.py reads them).
    Ranks launched with different values would take different paths and make unmatched MPI
    calls, so the raw values are compared first (one pickled allgather, whatever MPITRAIN_CHECK
    says) and a difference is a CollectiveError on every rank; a bad value is then the same
    ValueError everywhere."""
    global ALGORITHM, RING_THRESHOLD_BYTES, SUBCHUNK_BYTES
    env = tuple(os.environ.get(k) for k in _SETTINGS)
    envs = comm.allgather(env) if comm.Get_size() > 1 else [env]
    differ = [f"{k} differs across ranks: {check._fmt(check._group([e[i] for e in envs]))}"
              for i, k in enumerate(_SETTINGS) if len({e[i] for e in envs}) > 1]
    if differ:
        raise check.CollectiveError("mt.init: " + "; ".join(differ))
    algo, threshold, subchunk, enabled = env[:4]
    algo = (algo or "auto").lower()
    if algo not in ("auto", "ring", "mpi"):
        raise ValueError(f"MPITRAIN_ALLREDUCE={algo!r}: expected ring, mpi or auto")
    threshold = _env_bytes("MPITRAIN_RING_THRESHOLD", threshold, 32 << 20, 0)
    subchunk = _env_bytes("MPITRAIN_RING_SUBCHUNK", subchunk, 1 << 20, 1)
    ALGORITHM, RING_THRESHOLD_BYTES, SUBCHUNK_BYTES = algo, threshold, subchunk
    check.enabled = enabled != "0"
    _plans.clear()                            # plans hold the path they were made for


def _env_bytes(name, text, default, minimum):
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer number of bytes") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


# --- the allreduce engine (flat, contiguous, in place) -------------------------------------------

def _reduce_kind(op):
    return "sum" if op is Average else op.value


def _allreduce_flat(flat, op, prescale=1.0, postscale=1.0):
    """Allreduce a contiguous 1-D host array in place: prescale, reduce, then scale."""
    comm = world.ring_comm()
    if prescale != 1.0:
        _scale(flat, prescale)
    kind = _reduce_kind(op)
    algo = ALGORITHM
    use_ring = (flat.dtype == np.float16 or algo == "ring"
                or (algo == "auto" and flat.nbytes >= RING_THRESHOLD_BYTES))
    factor = postscale / comm.Get_size() if op is Average else postscale
    if comm.Get_size() > 1 and flat.size:
        if use_ring:
            # each rank scales the chunk it completes, before the allgather: same bits
            finish = None if factor == 1.0 else (lambda piece: _scale(piece, factor))
            ring_allreduce(comm, flat, _REDUCERS[kind], _scratch_for(flat.dtype),
                           max(1, SUBCHUNK_BYTES // flat.dtype.itemsize), finish)
            return flat
        comm.Allreduce(MPI.IN_PLACE, flat, op=_MPI_OPS[kind])
    if factor != 1.0:
        _scale(flat, factor)
    return flat


def _scratch_for(dtype):
    buf = _scratch.get(dtype)
    if buf is None:
        sub = max(1, SUBCHUNK_BYTES // dtype.itemsize)
        buf = _scratch[dtype] = np.empty(2 * sub, dtype)
    return buf


def _scale(flat, factor):
    if flat.dtype == np.float16 and flat.flags.c_contiguous:
        cpu.scale(flat, factor)            # NumPy's bits, ~10x faster than NumPy's float16
    else:
        np.multiply(flat, factor, out=flat, casting="unsafe")


def _device(fn_name):
    """The single dispatch point for device buffers (mpitrain/comm/device.py)."""
    try:
        from mpitrain.comm import device
    except ImportError as exc:
        raise NotImplementedError(
            f"mt.{fn_name} got a device array (__cuda_array_interface__) but device collectives "
            f"are unavailable: {exc}") from None
    return getattr(device, fn_name)


def _on_device(x):
    # Numba device arrays mark themselves with __cuda_ndarray__ (the CUDA simulator's too, which
    # have no __cuda_array_interface__)
    return hasattr(x, "__cuda_array_interface__") or bool(getattr(x, "__cuda_ndarray__", False))


# --- validation helpers: return an error string instead of raising (see check.py) ----------------

def _as_array(x, kind, in_place=False, min_ndim=0):
    if in_place and not isinstance(x, np.ndarray):
        return None, f"{kind}: in-place needs a numpy.ndarray, got {type(x).__name__}"
    try:
        a = x if isinstance(x, np.ndarray) else np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is a bad argument
        return None, f"{kind}: cannot convert {type(x).__name__} to an array ({exc})"
    if a.dtype not in _DTYPE_SET:
        names = ", ".join(d.name for d in DTYPES)
        return None, f"{kind}: dtype {a.dtype} is not supported; use one of {names}"
    if in_place and not a.flags.writeable:
        return None, f"{kind}: in-place needs a writeable array"
    if a.ndim < min_ndim:
        return None, f"{kind}: needs an array with at least {min_ndim} dimension, got shape ()"
    return a, None


def integer_average(dtype, op):
    """True for an Average of integers: a float64 mean out of place, an error in place."""
    return np.dtype(dtype).kind != "f" and _as_op(op, "")[0] is Average


def integer_average_error(kind, dtype):
    """Why an in-place Average of an integer array is refused (host and device alike)."""
    return (f"{kind}: the Average of {np.dtype(dtype).name} arrays is not an integer and "
            f"cannot be stored in place; use the out-of-place call (float64 result) or "
            f"op=mt.Sum and divide")


def _as_op(op, kind):
    if op.__class__ is ReduceOp:
        return op, None
    try:
        return ReduceOp(str(op).lower()), None
    except ValueError:
        return None, (f"{kind}: unknown op {op!r}; "
                      f"use mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product")


def _as_factor(value, label):
    if type(value) is float and math.isfinite(value):      # the common case, checked cheaply
        return value, None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        return None, f"{label}={value!r} is not a number"
    if not math.isfinite(float(value)):
        return None, f"{label}={value!r} is not finite"
    return float(value), None


def _as_root(root, kind, size):
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        return None, f"{kind}: root_rank={root!r} is not an integer"
    if not 0 <= root < size:
        return None, f"{kind}: root_rank={root} is out of range for {size} ranks"
    return int(root), None


def _first_error(*errors):
    return next((e for e in errors if e is not None), None)


def _reduce_args(kind, op, prescale, postscale):
    op, e1 = _as_op(op, kind)
    pre, e2 = _as_factor(prescale, f"{kind}: prescale_factor")
    post, e3 = _as_factor(postscale, f"{kind}: postscale_factor")
    fields = {"op": op, "prescale_factor": pre, "postscale_factor": post}
    return op, pre, post, fields, _first_error(e1, e2, e3)


# --- allreduce ------------------------------------------------------------------------------------

def allreduce(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks; returns a new array (same shape and dtype) on every rank."""
    if x.__class__ is np.ndarray and x.flags.c_contiguous:
        plan = _plan_for(x, op, name, prescale_factor, postscale_factor)
        if plan is not None:
            return plan.run(x, None)
    if _on_device(x):
        return _device("allreduce")(x, op=op, name=name, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)
    a, err = _as_array(x, "allreduce")
    if a is not None and integer_average(a.dtype, op):
        a = a.astype(np.float64)                # NumPy's mean: an integer mean is a float64
    out = None if a is None else np.array(a, order="C", copy=True)
    return _allreduce_checked("allreduce", a, out, err, op, name, prescale_factor,
                              postscale_factor)


def allreduce_(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place allreduce; returns ``x``."""
    if x.__class__ is np.ndarray:
        flags = x.flags
        if flags.c_contiguous and flags.writeable:
            plan = _plan_for(x, op, name, prescale_factor, postscale_factor)
            if plan is not None:
                return plan.run(x, x)
    if _on_device(x):
        return _device("allreduce_")(x, op=op, name=name, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)
    a, err = _as_array(x, "allreduce_", in_place=True)
    if a is not None and integer_average(a.dtype, op):
        err = err or integer_average_error("allreduce_", a.dtype)
    return _allreduce_checked("allreduce_", a, a, err, op, name, prescale_factor,
                              postscale_factor)


def _allreduce_checked(kind, a, out, err, op, name, prescale, postscale):
    op_arg, pre_arg, post_arg = op, prescale, postscale
    op, pre, post, fields, err2 = _reduce_args(kind, op, prescale, postscale)
    algo = ALGORITHM
    fields.update(name=name, shape=None if a is None else a.shape,
                  dtype=None if a is None else a.dtype.str, path=algo)
    error = err or err2
    src = None if error else (out if out.flags.c_contiguous else np.ascontiguousarray(out))
    flat = None if error else src.reshape(-1)                           # (size,)
    # Small enough to ride in the check's own message: one MPI call in all (see check.py).
    inline = (not error and algo == "auto" and pre == 1.0
              and flat.nbytes <= check.INLINE_BYTES)
    key = None if error else ("allreduce", op.value, a.shape, a.dtype.char, name, pre, post,
                              algo)
    comm = world.comm()
    rows = check.agree(comm, "allreduce", fields, error,
                       flat.view(np.uint8) if inline else None, key)
    if rows is not None:
        _reduce_rows(flat, rows, _reduce_kind(op))
        factor = post / rows.shape[0] if op is Average else post
        if factor != 1.0:
            _scale(flat, factor)
    else:
        _allreduce_flat(flat, op, pre, post)
    if src is not out:
        out[...] = src
    if check.usable(comm) and len(_plans) < _MAX_PLANS:
        plan_key = _plan_key(a, op_arg, name, pre_arg, post_arg)
        try:
            hash(plan_key)
        except TypeError:                               # e.g. an unhashable name: no plan
            plan_key = None
        if plan_key is not None:
            _plans[plan_key] = _Plan(comm, fields, key, a, op, pre, post, inline)
    return out


# --- steady state: repeated allreduce calls ------------------------------------------------------

_MAX_PLANS = 1024
_plans = {}                 # _plan_key(...) -> _Plan


def _plan_key(x, op, name, prescale, postscale):
    """What must be equal for a call to repeat an earlier one (the arguments as given).

    The factors' types are part of it, so that e.g. True never passes for an accepted 1.0; so
    are the path setting and ``check.enabled``: plans exist only while the check runs.
    """
    return (x.shape, x.dtype, op, name, prescale, prescale.__class__, postscale,
            postscale.__class__, ALGORITHM, check.enabled)


def _plan_for(x, op, name, prescale, postscale):
    try:
        return _plans.get(_plan_key(x, op, name, prescale, postscale))
    except TypeError:                                   # e.g. an unhashable name: no plan
        return None


class _Plan:
    """An allreduce whose arguments were validated by an earlier identical call.

    The first call with given (shape, dtype, op, name, factors, path) takes the general path
    above and leaves one of these behind; later identical calls skip argument handling and
    description building: the agreement is prepared (check.Prepared: same fingerprint, same
    message), and a small array is copied straight into the agreement's message and reduced
    from the received rows in rank order. This is what brings the 4 KiB allreduce near MPI's
    own latency (docs/benchmarks.md). Results are the same bits as the general path's.
    """
    __slots__ = ("agreement", "send", "rows", "op", "pre", "post", "ufunc", "factor", "scale")

    def __init__(self, comm, fields, key, a, op, pre, post, inline):
        self.agreement = check.Prepared(comm, "allreduce", dict(fields), key,
                                        (a.dtype, a.shape) if inline else None)
        self.send = self.agreement.send                                 # a.shape, or None
        received = self.agreement.received                              # (size,) + shape
        # received[r, ...]: a view even for 0-d rows (iterating would copy them as scalars)
        self.rows = None if received is None else tuple(received[r, ...]
                                                        for r in range(len(received)))
        self.op, self.pre, self.post = op, pre, post
        self.ufunc = _UFUNCS[_reduce_kind(op)]
        factor = post / comm.Get_size() if op is Average else post
        self.scale = factor != 1.0
        # A float array times a Python float computes in the array's dtype (NEP 50), exactly as
        # times that dtype's scalar, which NumPy takes faster; integers scale in float64 (_scale).
        self.factor = a.dtype.type(factor) if a.dtype.kind == "f" else factor

    def run(self, x, out):
        """x: C-contiguous input; out: x itself (in place) or None (a new array)."""
        send = self.send
        if send is None:
            out = x.copy() if out is None else out
            self.agreement()
            _allreduce_flat(out.reshape(-1), self.op, self.pre, self.post)
            return out
        send[...] = x
        self.agreement()
        rows, ufunc = self.rows, self.ufunc                             # rows: views of (size,)
        out = np.empty(x.shape, x.dtype) if out is None else out
        ufunc(rows[0], rows[1], out=out)
        for row in rows[2:]:
            ufunc(out, row, out=out)
        if self.scale:
            if out.dtype.kind == "f":
                np.multiply(out, self.factor, out=out)
            else:
                _scale(out, self.factor)
        return out


def _reduce_rows(flat, rows, kind):
    """flat = rows[0] op rows[1] op ... in rank order: the same bits on every rank.

    At most 4 KiB per row: NumPy's ufuncs (same wrapping and rounding as the Numba kernels) cost
    less per call here than a Numba dispatch plus a copy.
    """
    dtype, ufunc = flat.dtype, _UFUNCS[kind]
    ufunc(rows[0].view(dtype), rows[1].view(dtype), out=flat)
    for r in range(2, rows.shape[0]):
        ufunc(flat, rows[r].view(dtype), out=flat)


def grouped_allreduce(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      fusion_threshold_bytes=None):
    """Allreduce a list of arrays through the fusion buffer; returns a list of new arrays.

    fusion_threshold_bytes: bucket size limit (0 = one allreduce per array); None takes
    ``MPITRAIN_FUSION_THRESHOLD`` or the 64 MiB default. Must agree across ranks.
    """
    return _grouped("grouped_allreduce", xs, False, op, name, prescale_factor, postscale_factor,
                    fusion_threshold_bytes)


def grouped_allreduce_(xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                       fusion_threshold_bytes=None):
    """In-place grouped allreduce (e.g. gradients); returns the same list."""
    return _grouped("grouped_allreduce_", xs, True, op, name, prescale_factor, postscale_factor,
                    fusion_threshold_bytes)


def _grouped(kind, xs, in_place, op, name, prescale, postscale, threshold=None):
    xs = list(xs)
    if any(_on_device(x) for x in xs):
        return _device(kind)(xs, op=op, name=name, prescale_factor=prescale,
                             postscale_factor=postscale, fusion_threshold_bytes=threshold)
    arrays, errors = zip(*[_as_array(x, kind, in_place) for x in xs]) if xs else ((), ())
    arrays, errors = list(arrays), list(errors)
    for i, a in enumerate(arrays):
        if a is not None and integer_average(a.dtype, op):
            if in_place:
                errors[i] = errors[i] or integer_average_error(kind, a.dtype)
            else:
                arrays[i] = a.astype(np.float64)        # as allreduce: a float64 mean
    op, pre, post, fields, err = _reduce_args(kind, op, prescale, postscale)
    try:  # a bad threshold on one rank must reach the agreement, not leave the others waiting
        threshold, threshold_err = check_threshold(threshold), None
    except ValueError as exc:
        threshold, threshold_err = None, str(exc)
    fields.update(name=name, threshold_bytes=threshold,
                  arrays=tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays))
    check.agree(world.comm(), "grouped_allreduce", fields,
                _first_error(err, threshold_err, *errors))
    fusion = _fusion_buffer(threshold)
    outs = list(arrays) if in_place else [np.empty(a.shape, a.dtype) for a in arrays]
    fusion.allreduce(arrays, outs, lambda flat: _allreduce_flat(flat, op, pre, post))
    return outs


def _fusion_buffer(threshold=None):
    """The persistent fusion buffer; rebuilt only when the threshold (given, else
    MPITRAIN_FUSION_THRESHOLD, else the default) changes."""
    global _fusion
    threshold = check_threshold(threshold)
    if _fusion is None or _fusion.threshold_bytes != threshold:
        _fusion = FusionBuffer(threshold)
    return _fusion


# --- the other collectives (MPI on raw bytes) ----------------------------------------------------

def _bytes(a):
    """Contiguous 1-D uint8 view (or copy, if ``a`` is not contiguous) of an array."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def allgather(x, name=None):
    """Concatenate every rank's ``x`` along axis 0 (first dims may differ; the rest must not)."""
    if _on_device(x):
        return _device("allgather")(x, name=name)
    comm = world.comm()
    a, err = _as_array(x, "allgather", min_ndim=1)
    fields = {"name": name, "shape[1:]": None if a is None else a.shape[1:],
              "dtype": None if a is None else a.dtype.str}
    check.agree(comm, "allgather", fields, err)
    rows = np.array([a.shape[0]], np.int64)
    counts = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(rows, counts)
    row_bytes = a.dtype.itemsize * math.prod(a.shape[1:])
    out = np.empty((int(counts.sum()),) + a.shape[1:], a.dtype)
    nbytes = counts * row_bytes
    displs = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    comm.Allgatherv([_bytes(a), MPI.BYTE], [out.reshape(-1).view(np.uint8), (nbytes, displs),
                                            MPI.BYTE])
    return out


def broadcast(x, root_rank, name=None):
    """Return a new array holding root_rank's ``x`` on every rank."""
    if _on_device(x):
        return _device("broadcast")(x, root_rank, name=name)
    a, err = _as_array(x, "broadcast")
    out = None if a is None else np.array(a, order="C", copy=True)
    return _broadcast_checked("broadcast", out, out, root_rank, name, err)


def broadcast_(x, root_rank, name=None):
    """Overwrite ``x`` with root_rank's values in place; returns ``x``."""
    if _on_device(x):
        return _device("broadcast_")(x, root_rank, name=name)
    a, err = _as_array(x, "broadcast_", in_place=True)
    return _broadcast_checked("broadcast_", a, a, root_rank, name, err)


def _broadcast_checked(kind, a, out, root_rank, name, err):
    comm = world.comm()
    root, err2 = _as_root(root_rank, kind, comm.Get_size())
    fields = {"name": name, "root_rank": root, "shape": None if a is None else a.shape,
              "dtype": None if a is None else a.dtype.str}
    check.agree(comm, "broadcast", fields, err or err2)
    if out.flags.c_contiguous:
        comm.Bcast([out.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
    else:
        tmp = np.ascontiguousarray(out)
        comm.Bcast([tmp.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
        out[...] = tmp
    return out


def reducescatter(x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks and give rank r block r of axis 0 (first len % N get +1 row)."""
    if _on_device(x):
        return _device("reducescatter")(x, op=op, name=name, prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor)
    comm = world.comm()
    a, err = _as_array(x, "reducescatter", min_ndim=1)
    if a is not None and integer_average(a.dtype, op):
        a = a.astype(np.float64)                        # as allreduce: a float64 mean
    op, pre, post, fields, err2 = _reduce_args("reducescatter", op, prescale_factor,
                                               postscale_factor)
    fields.update(name=name, shape=None if a is None else a.shape,
                  dtype=None if a is None else a.dtype.str)
    check.agree(comm, "reducescatter", fields, err or err2)
    size, rank = comm.Get_size(), comm.Get_rank()
    base, extra = divmod(a.shape[0], size)
    rows = [base + (r < extra) for r in range(size)]
    start = sum(rows[:rank])
    row_elems = math.prod(a.shape[1:])
    if a.dtype == np.float16 or size == 1:
        full = np.array(a, order="C", copy=True)
        _allreduce_flat(full.reshape(-1), op, pre, post)
        return full[start:start + rows[rank]].copy()
    send = np.array(a, order="C", copy=True)
    if pre != 1.0:
        _scale(send.reshape(-1), pre)
    out = np.empty((rows[rank],) + a.shape[1:], a.dtype)
    counts = [r * row_elems for r in rows]
    comm.Reduce_scatter(send.reshape(-1), out.reshape(-1), counts, op=_MPI_OPS[_reduce_kind(op)])
    factor = post / size if op is Average else post
    if factor != 1.0:
        _scale(out.reshape(-1), factor)
    return out


def alltoall(x, splits=None, name=None):
    """Send rows splits[j] of ``x`` (in order) to rank j; returns out, or (out, received_splits).

    Without ``splits`` the first dimension must divide evenly by the number of ranks.
    """
    if _on_device(x):
        return _device("alltoall")(x, splits=splits, name=name)
    comm = world.comm()
    size = comm.Get_size()
    a, err = _as_array(x, "alltoall", min_ndim=1)
    send_splits, err2 = (None, None) if a is None else _as_splits(splits, a.shape[0], size)
    fields = {"name": name, "shape[1:]": None if a is None else a.shape[1:],
              "dtype": None if a is None else a.dtype.str, "splits given": splits is not None}
    check.agree(comm, "alltoall", fields, err or err2)
    recv_splits = np.empty(size, np.int64)
    comm.Alltoall(send_splits, recv_splits)
    row_bytes = a.dtype.itemsize * math.prod(a.shape[1:])
    out = np.empty((int(recv_splits.sum()),) + a.shape[1:], a.dtype)
    sb, rb = send_splits * row_bytes, recv_splits * row_bytes
    sd = np.concatenate(([0], np.cumsum(sb)[:-1]))
    rd = np.concatenate(([0], np.cumsum(rb)[:-1]))
    comm.Alltoallv([_bytes(a), (sb, sd), MPI.BYTE],
                   [out.reshape(-1).view(np.uint8), (rb, rd), MPI.BYTE])
    return out if splits is None else (out, recv_splits)


def _as_splits(splits, rows, size):
    if splits is None:
        if rows % size:
            return None, f"alltoall: first dimension {rows} does not divide by {size} ranks; " \
                         f"pass splits"
        return np.full(size, rows // size, np.int64), None
    try:
        s = np.asarray(splits).astype(np.int64, casting="same_kind").reshape(-1)
    except (TypeError, ValueError):
        return None, f"alltoall: splits={splits!r} must be {size} integers"
    if s.size != size or (s < 0).any() or s.sum() != rows:
        return None, (f"alltoall: splits={s.tolist()} must be {size} non-negative integers "
                      f"summing to the first dimension {rows}")
    return s, None


def barrier():
    comm = world.comm()
    check.agree(comm, "barrier", {})
    comm.Barrier()


def broadcast_object(obj, root_rank=0):
    """Pickle ``obj`` on root_rank and return it on every rank.

    Pickling happens before any message, and a failure travels to every rank as the same
    ValueError (mpi4py's bcast would raise on the root alone and leave the others waiting).
    """
    comm = world.comm()
    root, err = _as_root(root_rank, "broadcast_object", comm.Get_size())
    check.agree(comm, "broadcast_object", {"root_rank": root}, err)
    msg = _pickled(obj, "broadcast_object") if comm.Get_rank() == root else None
    payload, error = comm.bcast(msg, root=root)
    if error is not None:
        raise ValueError(f"{error} (on root rank {root})")
    return pickle.loads(payload)


def allgather_object(obj):
    """List of every rank's (picklable) ``obj``, in rank order; a pickling error raises on all."""
    comm = world.comm()
    check.agree(comm, "allgather_object", {})
    gathered = comm.allgather(_pickled(obj, "allgather_object"))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e is not None]
    if errors:
        raise ValueError("; ".join(errors))
    return [pickle.loads(payload) for payload, _ in gathered]


def _pickled(obj, kind):
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported on every rank
        return None, f"{kind}: cannot pickle {type(obj).__name__}: {exc}"
