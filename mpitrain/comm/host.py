"""The collectives on host (NumPy) arrays: validate, agree across ranks, move the data.

Every collective does the same three things: validate its arguments locally (ops.py), agree
with the other ranks on them (check.py: one fixed-size MPI_Allgather of a fingerprint; a mismatch
raises CollectiveError on every rank), then move data. Allreduce runs the engine (engine.py: MPI
or our ring); small ones ride inside the agreement itself and are reduced locally, and a
repeated one reuses the plan its first call left (_Plan). The other collectives call MPI's
variable-count collectives on raw bytes, which is also why every dtype works with them.

The Average of integer arrays is a float64 array (NumPy's ``mean``: [1, 2] -> 1.5, as in
Horovod's TensorFlow API), never a truncated integer; in place, where the result would have to
be stored as integers, it is a ValueError on every rank. Explicit factors on integer arrays
scale in float64 and truncate toward zero (NumPy unsafe casting), as Horovod's do. Device arrays
follow the same rules through the same code: ``allreduce_checked`` and ``grouped`` take an array
family, HOST here, a CuPy or Numba one from device.py (which collectives.py sends them to).

Every function acts on the World it is given as ``state`` (world.py): the global set's or a
process set's (process_sets.py); collectives.py resolves ``process_set=`` to it, so nothing here
knows about process sets. What each returns is its public twin's docstring (collectives.py);
only what is particular to the host is written here.
"""
import math
import pickle

import numpy as np
from mpi4py import MPI

from mpitrain.comm import check
from mpitrain.comm.engine import allreduce_flat, reduce_scatter_flat, scale
from mpitrain.comm.fusion import (DEFAULT_THRESHOLD_BYTES, FusionBuffer, NumpyArrays,
                                  check_threshold)
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import (MPI_OPS, UFUNCS, Average, as_array, as_root, first_error,
                               integer_average, integer_average_error, mpi_can_reduce,
                               reduce_args, reduce_kind)
from mpitrain.comm.ring import chunk_bounds, owned_chunk
from mpitrain.comm.watchdog import watched


# --- allreduce ------------------------------------------------------------------------------------

class HostArrays(NumpyArrays):
    """NumPy arrays as an array family: fusion.py's, plus what ``allreduce_checked`` and
    ``grouped`` need (device.py's families have the same attributes). ``fields``: what the
    family adds to the agreed description; ``home(state)``: where its World keeps its fusion
    buffer (``state.fusion`` here)."""

    fields = {}
    home = staticmethod(vars)
    allreduce_flat = staticmethod(allreduce_flat)
    as_float64 = staticmethod(lambda a: a.astype(np.float64, order="C"))    # NumPy's mean


HOST = HostArrays


def allreduce(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks; returns a new array (same shape and dtype) on every rank."""
    if x.__class__ is np.ndarray and x.flags.c_contiguous:
        plan = _plan_for(state, x, op, name, prescale_factor, postscale_factor)
        if plan is not None:
            return plan.run(x, None)
    a, err = as_array(x, Kind.ALLREDUCE)
    return allreduce_checked(state, HOST, Kind.ALLREDUCE, a, err, op, name, prescale_factor,
                             postscale_factor)


def allreduce_(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    if x.__class__ is np.ndarray:
        flags = x.flags
        if flags.c_contiguous and flags.writeable:
            plan = _plan_for(state, x, op, name, prescale_factor, postscale_factor)
            if plan is not None and not plan.to_float64:    # an integer Average: refused below
                return plan.run(x, x)
    a, err = as_array(x, Kind.ALLREDUCE_, in_place=True)
    return allreduce_checked(state, HOST, Kind.ALLREDUCE_, a, err, op, name, prescale_factor,
                             postscale_factor)


def allreduce_checked(state, family, kind, a, err, op, name, prescale, postscale):
    """The allreduce (``kind``: in place or not) of ``a``, this rank's argument as its family
    checked it (None, or with ``err``, when unusable); returns the result. family: HOST, or a
    device family (device.py); on the host alone a small array rides in the agreement, and the
    call leaves a plan for the next identical one."""
    in_place, out, given = kind is Kind.ALLREDUCE_, a, a
    if a is not None and err is None:
        if integer_average(a.dtype, op):
            if in_place:
                err = integer_average_error(kind, a.dtype)
            else:
                a = out = family.as_float64(a)              # a float64 mean (NumPy's)
        elif not in_place:
            out = family.empty(a.shape, a.dtype)                # C-contiguous
            family.copy(out, a)
    op_arg, pre_arg, post_arg = op, prescale, postscale
    op, pre, post, fields, err2 = reduce_args(kind, op, prescale, postscale)
    fields.update(name=name, shape=None if a is None else tuple(a.shape),
                  dtype=None if a is None else np.dtype(a.dtype).str, **family.fields)
    error = err or err2
    if family is HOST:
        fields["path"] = state.settings.algorithm
    agreement = state.agreement
    if error or family is not HOST or not agreement.usable:
        agreement(Kind.ALLREDUCE, fields, error)            # an error: raised on every rank
        flat = family.flat(out)                             # (size,)
        family.allreduce_flat(state, flat, op, pre, post)
        if not family.contiguous(out):
            family.copy(out, flat)
        return out
    # Checked on the host: the plan this call leaves for the next identical one does the work
    # (same message, same bits); small enough, the data ride in the check's own message.
    inline = (fields["path"] == "auto" and pre == 1.0 and a.nbytes <= check.INLINE_BYTES
              and a.dtype.kind != "V")                # bfloat16 bits: not NumPy's ufuncs
    key = (Kind.ALLREDUCE, op.value, a.shape, a.dtype.char, name, pre, post, fields["path"])
    plan = _Plan(state, agreement, fields, key, a, op, pre, post, inline)
    src = out if out.flags.c_contiguous else np.ascontiguousarray(out)
    plan.run(src, src)
    if src is not out:
        out[...] = src
    plan.to_float64 = a is not given                   # later calls cast as this one did
    if len(state.plans) < _MAX_PLANS:
        try:
            state.plans[_plan_key(given, op_arg, name, pre_arg, post_arg)] = plan
        except TypeError:                               # e.g. an unhashable name: no plan
            pass
    return out


# --- steady state: repeated allreduce calls ------------------------------------------------------

_MAX_PLANS = 1024          # per World (world.py): World.plans maps _plan_key(...) -> _Plan


def _plan_key(x, op, name, prescale, postscale):
    """What must be equal for a call to repeat an earlier one (the arguments as given).

    The factors' types are part of it, so that e.g. True never passes for an accepted 1.0. The
    settings are not: plans belong to the World, and allreduce_flat reads its settings.
    """
    return (x.shape, x.dtype, op, name, prescale, prescale.__class__, postscale,
            postscale.__class__)


def _plan_for(state, x, op, name, prescale, postscale):
    try:
        return state.plans.get(_plan_key(x, op, name, prescale, postscale))
    except TypeError:                                   # e.g. an unhashable name: no plan
        return None


class _Plan:
    """An allreduce whose arguments were validated (by the first call with them).

    The first call with given (shape, dtype, op, name, factors, path) validates them, builds
    one of these, runs it and leaves it behind; later identical calls skip argument handling
    and description building: the agreement is prepared (check.Prepared: same fingerprint,
    same message as the Agreement's), and a small array is copied straight into the
    agreement's message and reduced from the received rows in rank order. This is what brings
    the 4 KiB allreduce near MPI's own latency (docs/benchmarks.md). ``to_float64``: the plan
    of an integer Average, whose input is cast first (a float64 mean, as on the first call).
    """
    __slots__ = ("state", "agreement", "send", "rows", "op", "pre", "post", "ufunc", "factor",
                 "scale", "to_float64")

    def __init__(self, state, agreement, fields, key, a, op, pre, post, inline):
        self.state, self.to_float64 = state, False
        self.agreement = check.Prepared(agreement, Kind.ALLREDUCE, dict(fields), key,
                                        (a.dtype, a.shape) if inline else None)
        self.send = self.agreement.send                                 # a.shape, or None
        received = self.agreement.received                              # (size,) + shape
        # received[r, ...]: a view even for 0-d rows (iterating would copy them as scalars)
        self.rows = None if received is None else tuple(received[r, ...]
                                                        for r in range(len(received)))
        self.op, self.pre, self.post = op, pre, post
        self.ufunc = UFUNCS[reduce_kind(op)]
        factor = post / agreement.size if op is Average else post
        self.scale = factor != 1.0
        # A float array times a Python float computes in the array's dtype (NEP 50), exactly as
        # times that dtype's scalar, which NumPy takes faster; integers scale in float64 (scale).
        self.factor = a.dtype.type(factor) if a.dtype.kind == "f" else factor

    def run(self, x, out):
        """x: C-contiguous input; out: x itself (in place) or None (a new array)."""
        if self.to_float64:                             # out of place only (allreduce_)
            x = out = x.astype(np.float64)
        send = self.send
        if send is None:
            out = x.copy() if out is None else out
            self.agreement()
            allreduce_flat(self.state, out.reshape(-1), self.op, self.pre, self.post)
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
                scale(out, self.factor)
        return out


def grouped_allreduce(state, xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      fusion_threshold_bytes=None):
    return _grouped(state, Kind.GROUPED_ALLREDUCE, xs, False, op, name, prescale_factor,
                    postscale_factor, fusion_threshold_bytes)


def grouped_allreduce_(state, xs, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                       fusion_threshold_bytes=None):
    return _grouped(state, Kind.GROUPED_ALLREDUCE_, xs, True, op, name, prescale_factor,
                    postscale_factor, fusion_threshold_bytes)


def _grouped(state, kind, xs, in_place, op, name, prescale, postscale, threshold=None):
    checked = [as_array(x, kind, in_place) for x in xs]
    return grouped(state, HOST, kind, [a for a, _ in checked], [e for _, e in checked], in_place,
                   op, name, prescale, postscale, threshold)


def grouped(state, family, kind, arrays, errors, in_place, op, name, prescale, postscale,
            threshold=None, error=None):
    """The grouped allreduce of ``arrays`` of one family (HOST, or device.py's) through its fusion
    buffer; errors[i]: why the caller found arrays[i] unusable, or None; ``error``: one more.
    Integer means as in ``allreduce_checked``. Returns the outputs (in place: ``arrays``)."""
    arrays, errors = list(arrays), list(errors)
    for i, a in enumerate(arrays):
        if a is not None and errors[i] is None and integer_average(a.dtype, op):
            if in_place:
                errors[i] = integer_average_error(kind, a.dtype)
            else:
                arrays[i] = family.as_float64(a)        # as allreduce: a float64 mean
    op, pre, post, fields, err = reduce_args(kind, op, prescale, postscale)
    try:  # a bad threshold on one rank must reach the agreement, not leave the others waiting
        threshold, threshold_err = fusion_threshold(state, threshold), None
    except ValueError as exc:
        threshold, threshold_err = None, str(exc)
    fields.update(name=name, threshold_bytes=threshold,
                  arrays=tuple(None if a is None else (tuple(a.shape), np.dtype(a.dtype).str)
                               for a in arrays), **family.fields)
    state.agreement(Kind.GROUPED_ALLREDUCE, fields,
                    first_error(err, threshold_err, error, *errors))
    home = family.home(state)                  # the buffer persists, rebuilt on a new size
    fusion = home.get("fusion")
    if fusion is None or fusion.family is not family or fusion.threshold_bytes != threshold:
        fusion = home["fusion"] = FusionBuffer(threshold, family)
    outs = arrays if in_place else [family.empty(a.shape, a.dtype) for a in arrays]
    fusion.allreduce(arrays, outs, lambda flat: family.allreduce_flat(state, flat, op, pre, post))
    return outs


def fusion_threshold(state, value=None, default=DEFAULT_THRESHOLD_BYTES):
    """A bucket size limit: ``value`` checked, else the World's setting, else ``default``."""
    return state.settings.fusion_threshold(default) if value is None else check_threshold(value)


# --- the other collectives (MPI on raw bytes) ----------------------------------------------------

def _bytes(a):
    """Contiguous 1-D uint8 view (or copy, if ``a`` is not contiguous) of an array."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _blocks(a, rows):
    """(byte counts, byte displacements) of consecutive blocks of rows[j] rows like ``a``'s."""
    nbytes = rows * (a.dtype.itemsize * math.prod(a.shape[1:]))
    return nbytes, np.concatenate(([0], np.cumsum(nbytes)[:-1]))


def allgather(state, x, name=None, kind=Kind.ALLGATHER):
    comm = state.comm
    a, err = as_array(x, kind, min_ndim=1)
    fields = {"name": name, "shape[1:]": None if a is None else a.shape[1:],
              "dtype": None if a is None else a.dtype.str}
    state.agreement(kind, fields, err)
    rows = np.array([a.shape[0]], np.int64)
    counts = np.empty(comm.Get_size(), np.int64)
    with watched(state.record, "allgather data", name):
        comm.Allgather(rows, counts)
        out = np.empty((int(counts.sum()),) + a.shape[1:], a.dtype)
        comm.Allgatherv([_bytes(a), MPI.BYTE],
                        [out.reshape(-1).view(np.uint8), _blocks(a, counts), MPI.BYTE])
    return out


def allgather_shares(state, x, name=None):
    """``allgather`` of a sharded optimizer's shares, which a joined rank serves (kinds.py)."""
    return allgather(state, x, name, Kind.ALLGATHER_SHARES)


def broadcast(state, x, root_rank, name=None):
    """Return a new array holding root_rank's ``x`` on every rank."""
    a, err = as_array(x, Kind.BROADCAST)
    out = None if a is None else np.array(a, order="C", copy=True)
    return _broadcast_checked(state, Kind.BROADCAST, out, root_rank, name, err)


def broadcast_(state, x, root_rank, name=None):
    a, err = as_array(x, Kind.BROADCAST_, in_place=True)
    return _broadcast_checked(state, Kind.BROADCAST_, a, root_rank, name, err)


def _broadcast_checked(state, kind, a, root_rank, name, err):
    """Broadcast into ``a`` (None when the argument was bad: ``err`` says why) in place."""
    root, err2 = as_root(root_rank, kind, state.members)
    fields = {"name": name, "root_rank": root, "shape": None if a is None else a.shape,
              "dtype": None if a is None else a.dtype.str}
    state.agreement(Kind.BROADCAST, fields, err or err2)
    buf = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    with watched(state.record, "broadcast data", name):
        state.comm.Bcast([buf.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
    if buf is not a:
        a[...] = buf
    return a


def reducescatter(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``x`` across ranks and give rank r block r of axis 0 (first len % N get +1 row)."""
    comm = state.comm
    a, err = as_array(x, Kind.REDUCESCATTER, min_ndim=1)
    if a is not None and integer_average(a.dtype, op):
        a = a.astype(np.float64)                        # as allreduce: a float64 mean
    op, pre, post, fields, err2 = reduce_args(Kind.REDUCESCATTER, op, prescale_factor,
                                               postscale_factor)
    fields.update(name=name, shape=None if a is None else a.shape,
                  dtype=None if a is None else a.dtype.str)
    state.agreement(Kind.REDUCESCATTER, fields, err or err2)
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(a.shape[0], size)           # rank r's rows: bounds[r]:bounds[r + 1]
    lo, hi = bounds[rank], bounds[rank + 1]
    row_elems = math.prod(a.shape[1:])
    if size == 1:
        send = np.array(a, order="C", copy=True)
        allreduce_flat(state, send.reshape(-1), op, pre, post)
        return send
    if not mpi_can_reduce(a.dtype):     # our ring's first phase: half an allreduce's traffic
        return _ring_reducescatter(state, a, op, pre, post, bounds, row_elems)
    send = np.array(a, order="C", copy=True)
    if pre != 1.0:
        scale(send.reshape(-1), pre)
    out = np.empty((hi - lo,) + a.shape[1:], a.dtype)
    counts = [(end - start) * row_elems for start, end in zip(bounds, bounds[1:])]
    with watched(state.record, "reducescatter data", name):
        comm.Reduce_scatter(send.reshape(-1), out.reshape(-1), counts,
                            op=MPI_OPS[reduce_kind(op)])
    factor = post / size if op is Average else post
    if factor != 1.0:
        scale(out.reshape(-1), factor)
    return out


def _ring_reducescatter(state, a, op, pre, post, bounds, row_elems):
    """reducescatter on the ring (a dtype MPI cannot reduce): the blocks laid out so that the
    chunk the ring completes on rank r, ``owned_chunk(r)`` = r + 1, is block r."""
    size, rank = state.comm.Get_size(), state.comm.Get_rank()
    order = [size - 1] + list(range(size - 1))          # ring chunk c holds block c - 1
    flat = np.ascontiguousarray(a).reshape(-1)
    ring = np.concatenate([flat[bounds[k] * row_elems:bounds[k + 1] * row_elems]
                           for k in order])
    offsets = np.concatenate([[0], np.cumsum([(bounds[k + 1] - bounds[k]) * row_elems
                                              for k in order])]).tolist()
    reduce_scatter_flat(state, ring, op, pre, post, bounds=offsets)
    c = owned_chunk(rank, size)
    rows = bounds[rank + 1] - bounds[rank]
    return ring[offsets[c]:offsets[c + 1]].reshape((rows,) + a.shape[1:]).copy()


def alltoall(state, x, splits=None, name=None):
    comm = state.comm
    size = comm.Get_size()
    a, err = as_array(x, Kind.ALLTOALL, min_ndim=1)
    send_splits, err2 = (None, None) if a is None else _as_splits(splits, a.shape[0], size)
    fields = {"name": name, "shape[1:]": None if a is None else a.shape[1:],
              "dtype": None if a is None else a.dtype.str, "splits given": splits is not None}
    state.agreement(Kind.ALLTOALL, fields, err or err2)
    recv_splits = np.empty(size, np.int64)
    with watched(state.record, "alltoall data", name):
        comm.Alltoall(send_splits, recv_splits)
        out = np.empty((int(recv_splits.sum()),) + a.shape[1:], a.dtype)
        comm.Alltoallv([_bytes(a), _blocks(a, send_splits), MPI.BYTE],
                       [out.reshape(-1).view(np.uint8), _blocks(a, recv_splits), MPI.BYTE])
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


def barrier(state):
    state.agreement(Kind.BARRIER, {})
    with watched(state.record, "barrier data"):
        state.comm.Barrier()


def broadcast_object(state, obj, root_rank=0):
    """Pickle ``obj`` on root_rank and return it on every rank.

    Pickling happens before any message, and a failure travels to every rank as the same
    ValueError (mpi4py's bcast would raise on the root alone and leave the others waiting).
    """
    comm = state.comm
    root, err = as_root(root_rank, Kind.BROADCAST_OBJECT, state.members)
    state.agreement(Kind.BROADCAST_OBJECT, {"root_rank": root}, err)
    msg = _pickled(obj, Kind.BROADCAST_OBJECT) if comm.Get_rank() == root else None
    with watched(state.record, "broadcast_object data"):
        payload, error = comm.bcast(msg, root=root)
    if error is not None:
        raise ValueError(f"{error} (on root rank {root})")
    return pickle.loads(payload)


def allgather_object(state, obj):
    """List of every rank's (picklable) ``obj``, in rank order; a pickling error raises on all."""
    state.agreement(Kind.ALLGATHER_OBJECT, {})
    mine = _pickled(obj, Kind.ALLGATHER_OBJECT)     # this rank's work: not a wait for others
    with watched(state.record, "allgather_object data"):
        gathered = state.comm.allgather(mine)
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e is not None]
    if errors:
        raise ValueError("; ".join(errors))
    return [pickle.loads(payload) for payload, _ in gathered]


def _pickled(obj, kind):
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported on every rank
        return None, f"{kind}: cannot pickle {type(obj).__name__}: {exc}"
