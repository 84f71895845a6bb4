"""Cross-rank agreement before a collective: a mismatch becomes CollectiveError on every rank.

MPI cannot tell that rank 0 reduces a (4,) float32 array while rank 1 reduces a (2, 2) one, or a
(5,) one: it would add the wrong elements, truncate, or wait for ever. So every collective first
describes itself -- its kind, and the fields that must match (shape, dtype, op, scale factors,
root, ...) -- plus any local validation error, and the ranks compare those descriptions.

Steady-state cost is one fixed-size MPI_Allgather of a 62-bit fingerprint of the description
(blake2b, cached per description) plus up to INLINE_BYTES of payload: allreduces that small ride
in the same message and are reduced locally (collectives.py), so for them the check costs no
extra MPI call at all. Only when fingerprints differ do the ranks allgather their full
descriptions (pickled; the slow path is the error path) and build the same message naming each
differing field with the ranks that hold each value. Every rank then raises, before any data
moves, so the communicator stays usable. The measured cost is in docs/benchmarks.md.
``MPITRAIN_CHECK=0`` turns the exchange off (a mismatch then hangs or corrupts, as in MPI).
``Prepared`` is the same agreement computed once for a call that repeats (collectives.py's
steady-state allreduce). The exchange is the one place the stall watchdog (watchdog.py) marks as
"in a collective".

Local validation errors (a bad root, a non-array) travel in the description too: if only some
ranks see one, all raise CollectiveError naming those ranks; if all see the same one, all raise
it as ValueError -- never one rank raising while the others wait in the next MPI call.
"""
import hashlib
import math
import os

import numpy as np

from mpitrain.comm import watchdog

enabled = os.environ.get("MPITRAIN_CHECK", "1") != "0"
HEADER_BYTES = 16
INLINE_BYTES = 4096     # payload carried with the check: small allreduces finish in this message
_MASK = (1 << 62) - 1
_ROW = (HEADER_BYTES + INLINE_BYTES) // 8
_send = np.zeros(_ROW, np.int64)                  # [fingerprint, unused, payload...]
_send_payload = _send.view(np.uint8)[HEADER_BYTES:]
_recv = {}                                        # size -> _buffers(size)
_digests = {}


class CollectiveError(RuntimeError):
    """Ranks called a collective with arguments that do not match; raised on every rank."""


def fingerprint(desc, key=None):
    """62-bit digest of a description, identical in every process (no per-process hash seed).

    key: optional hashable stand-in for ``desc`` (cheaper to hash than the description with its
    dict); digests are cached under it, or under the description's items when it is None.
    """
    try:
        if key is None:
            key = (desc[0], tuple(desc[1].items()), desc[2])
        h = _digests.get(key)
    except TypeError:                    # an unhashable field value: digest without caching
        key, h = None, None
    if h is None:
        digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") & _MASK
        if key is not None and len(_digests) < 4096:
            _digests[key] = h
    return h


def agree(comm, kind, fields, error=None, payload=None, key=None):
    """Check that every rank of ``comm`` calls collective ``kind`` with the same ``fields``.

    fields: dict of name -> value (values need a deterministic repr: tuples, str, numbers).
    error: this rank's local validation message or None.
    payload: optional contiguous uint8 array of at most INLINE_BYTES, sent in the same message;
    then the return value is every rank's payload, rows of a (size, len(payload)) array (valid
    until the next check), else None. Without the exchange (one rank, MPITRAIN_CHECK=0) the
    return value is None, so callers always keep a path that does not rely on the payload.
    key: optional hashable summary of (kind, fields, error) for the digest cache (fingerprint).
    Raises CollectiveError (mismatch anywhere) or ValueError (the same local error everywhere).

    Every collective's first MPI call is this fixed-size Allgather, whatever its kind and
    arguments: ranks that disagree still make matching MPI calls, so they can learn that they
    disagree instead of blocking in different collectives.
    """
    size = comm.Get_size()
    if not enabled or size == 1:
        if error is not None:
            raise ValueError(error)
        return None
    desc = (kind, fields, error)
    h = fingerprint(desc, key)
    n = 0
    if payload is not None:
        n = payload.shape[0]
        _send_payload[:n] = payload
    rows, column, payload_rows = _buffers(size)
    _exchange(comm, h, rows, column, desc)
    if error is not None:
        raise ValueError(error)
    return None if payload is None else payload_rows[:, :n]


class Prepared:
    """One collective's agreement, prepared once for calls that repeat with the same arguments.

    The fingerprint and the typed views of the payload (in the send buffer, and in every rank's
    received row) are computed here, so a steady-state call is: write ``send``, call the object
    (one Allgather, one comparison), read the returned rows -- no description, no hashing, no
    slicing (collectives.py caches one per small allreduce). Same message, same fingerprint as
    ``agree`` with the same fields, so ranks may mix both paths. Needs ``usable(comm)``.

    payload: (dtype, shape) of the inline payload, at most INLINE_BYTES, or None.
    """
    __slots__ = ("comm", "desc", "h", "rows", "column", "send", "received")

    def __init__(self, comm, kind, fields, key=None, payload=None):
        self.comm, size = comm, comm.Get_size()
        self.desc = (kind, fields, None)
        self.h = fingerprint(self.desc, key)
        self.rows, self.column, payload_rows = _buffers(size)
        self.send = self.received = None
        if payload is not None:
            dtype, shape = np.dtype(payload[0]), tuple(payload[1])
            nbytes = dtype.itemsize * math.prod(shape)
            self.send = _send_payload[:nbytes].view(dtype).reshape(shape)          # shape
            self.received = payload_rows[:, :nbytes].view(dtype).reshape(
                (size,) + shape)                                                # (size,) + shape

    def __call__(self):
        """Exchange; returns every rank's payload (valid until the next check) or None."""
        _exchange(self.comm, self.h, self.rows, self.column, self.desc)
        return self.received


def usable(comm):
    """Whether agreements on ``comm`` exchange messages (else ``agree`` returns None)."""
    return enabled and comm.Get_size() > 1


def _buffers(size):
    """Receive buffers for ``size`` ranks: rows (size, _ROW) int64, their fingerprint column
    (size,) and their payload bytes (size, INLINE_BYTES)."""
    bufs = _recv.get(size)
    if bufs is None:
        rows = np.empty((size, _ROW), np.int64)
        bufs = _recv[size] = (rows, rows[:, 0], rows.view(np.uint8)[:, HEADER_BYTES:])
    return bufs


def _exchange(comm, h, rows, column, desc):
    """Every collective's first MPI call: fixed-size, whatever the collective and arguments, so
    ranks that disagree still make matching calls and learn it instead of blocking."""
    _send[0] = h
    watchdog.enter(desc)
    try:
        comm.Allgather(_send, rows)
    finally:
        watchdog.leave()
    # Plain Python on N ints: cheaper than NumPy's per-call overhead at this size.
    fingerprints = column.tolist()
    if fingerprints.count(h) != len(fingerprints):
        raise CollectiveError(_explain(comm.allgather(desc)))


def _explain(descs):
    """One line naming what differs, with the ranks holding each value (same on every rank)."""
    kinds = _group([d[0] for d in descs])
    if len(kinds) > 1:
        return "ranks called different collectives: " + _fmt(kinds)
    kind = descs[0][0]
    errors = [(r, d[2]) for r, d in enumerate(descs) if d[2] is not None]
    if errors:
        text = "; ".join(f"rank {r}: {e}" for r, e in errors)
        return f"{kind}: invalid arguments on some ranks ({text})"
    parts = []
    for key in descs[0][1]:
        groups = _group([d[1].get(key) for d in descs])
        if len(groups) > 1:
            parts.append(f"{key} differs across ranks: {_fmt(groups)}")
    return f"{kind}: " + ("; ".join(parts) or "arguments differ across ranks")


def _group(values):
    """value -> ranks, in order of first appearance."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), []).append(r)
    return groups


def _fmt(groups):
    return ", ".join(f"{v} on ranks {ranks}" for v, ranks in groups.items())
