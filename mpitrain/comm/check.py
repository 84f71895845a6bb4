"""Cross-rank agreement before a collective: a mismatch becomes CollectiveError on every rank.

MPI cannot tell that rank 0 reduces a (4,) float32 array while rank 1 reduces a (2, 2) one, or a
(5,) one: it would add the wrong elements, truncate, or wait for ever. So every collective first
describes itself -- its kind, and the fields that must match (shape, dtype, op, scale factors,
root, ...) -- plus any local validation error, and the ranks compare those descriptions.

Steady-state cost is one fixed-size MPI_Allgather of a 62-bit fingerprint of the description
(blake2b, cached per description) plus up to INLINE_BYTES of payload: allreduces that small ride
in the same message and are reduced locally (host.py), so for them the check costs no
extra MPI call at all. Only when fingerprints differ do the ranks allgather their full
descriptions (pickled; the slow path is the error path) and build the same message naming each
differing field with the ranks that hold each value. Every rank then raises, before any data
moves, so the communicator stays usable. The measured cost is in docs/benchmarks.md.
``MPITRAIN_CHECK=0`` turns the exchange off (a mismatch then hangs or corrupts, as in MPI).
``Agreement`` is this for one communicator (its state, world.py, owns one: the send and receive
buffers and the digest cache belong to it); ``Prepared`` is the same agreement computed once for
a call that repeats (host.py's steady-state allreduce). The exchange is the one place the stall
watchdog (watchdog.py) marks as "in a collective".

Local validation errors (a bad root, a non-array) travel in the description too: if only some
ranks see one, all raise CollectiveError naming those ranks; if all see the same one, all raise
it as ValueError -- never one rank raising while the others wait in the next MPI call.
"""
import hashlib
import math

import numpy as np

from mpitrain.comm import kinds, watchdog
from mpitrain.comm.kinds import Kind, as_kind
from mpitrain.runtime.errors import CollectiveError

HEADER_BYTES = 16
INLINE_BYTES = 4096     # payload carried with the check: small allreduces finish in this message
_MASK = (1 << 62) - 1
JOINED = 1 << 62        # sent instead of a fingerprint by a joined rank: never a fingerprint
_ROW = (HEADER_BYTES + INLINE_BYTES) // 8


class Agreement:
    """The cross-rank check of one communicator (``enabled=False``: MPITRAIN_CHECK=0).

    record: the stall watchdog's Record of this communicator (watchdog.py), marked around
    every exchange (default: the global set's).
    """

    def __init__(self, comm, enabled=True, record=None):
        self.comm = comm
        self.record = watchdog.record() if record is None else record
        self.size = comm.Get_size()
        self.enabled = bool(enabled)
        self.usable = self.enabled and self.size > 1   # whether agreements exchange messages
        self.send = np.zeros(_ROW, np.int64)         # [fingerprint, join round, payload...]
        self.send_payload = self.send.view(np.uint8)[HEADER_BYTES:]
        rows = np.empty((self.size, _ROW), np.int64)
        # every rank's row, its fingerprint column, its payload bytes
        self.rows, self.column = rows, rows[:, 0]
        self.payload_rows = rows.view(np.uint8)[:, HEADER_BYTES:]       # (size, INLINE_BYTES)
        self.digests = {}
        self.rounds = 0      # Allgathers so far: the same count on every rank (join.py's clock)

    def fingerprint(self, desc, key=None):
        """62-bit digest of a description, identical in every process (no per-process hash
        seed). key: optional hashable stand-in for ``desc`` (cheaper to hash than the
        description with its dict); digests are cached under it, or under the description's
        items when it is None."""
        try:
            if key is None:
                key = (desc[0], tuple(desc[1].items()), desc[2])
            h = self.digests.get(key)
        except TypeError:                    # an unhashable field value: digest without caching
            key, h = None, None
        if h is None:
            h = fingerprint(desc)
            if key is not None and len(self.digests) < 4096:
                self.digests[key] = h
        return h

    def __call__(self, kind, fields, error=None, payload=None, key=None):
        """Check that every rank calls collective ``kind`` with the same ``fields``.

        kind: a Kind (kinds.py) or its exact name; any other name raises ValueError at once.
        fields: dict of name -> value (values need a deterministic repr: tuples, str, numbers).
        error: this rank's local validation message or None.
        payload: optional contiguous uint8 array of at most INLINE_BYTES, sent in the same
        message; then the return value is every rank's payload, rows of a (size, len(payload))
        array (valid until the next check), else None. Without the exchange (one rank,
        MPITRAIN_CHECK=0) the return value is None, so callers always keep a path that does
        not rely on the payload.
        key: optional hashable summary of (kind, fields, error) for the digest cache.
        Raises CollectiveError (mismatch anywhere) or ValueError (the same local error
        everywhere). The exchange itself: ``exchange``.
        """
        if kind.__class__ is not Kind:
            kind = as_kind(kind)                 # a name that is no kind raises here, always
        if not self.usable:
            if error is not None:
                raise ValueError(error)
            return None
        desc = (kind, fields, error)
        h = self.fingerprint(desc, key)
        n = 0
        if payload is not None:
            n = payload.shape[0]
            self.send_payload[:n] = payload
        self.exchange(h, desc)
        if error is not None:
            raise ValueError(error)
        return None if payload is None else self.payload_rows[:, :n]

    def exchange(self, h, desc):
        """Every collective's first MPI call: fixed-size, whatever the collective and arguments,
        so ranks that disagree still make matching calls and learn it instead of blocking.

        Ranks that have joined (join.py) send JOINED instead of a fingerprint: then the lowest
        active rank broadcasts ``desc`` to them, they run the same collective with a neutral
        contribution (or none of them does, and every active rank raises the same refusal,
        kinds.py), and the exchange runs again, now with every fingerprint equal."""
        self.send[0] = h
        record = self.record
        record.enter(desc)
        try:
            while True:
                self.rounds += 1
                self.comm.Allgather(self.send, self.rows)
                # Plain Python on N ints: cheaper than NumPy's per-call overhead at this size.
                fingerprints = self.column.tolist()
                if fingerprints.count(h) == len(fingerprints):
                    return
                joined = [r for r, f in enumerate(fingerprints) if f == JOINED]
                if not joined or fingerprints.count(h) + len(joined) != len(fingerprints):
                    raise CollectiveError(explain(self.comm.allgather(desc)))
                active = next(r for r, f in enumerate(fingerprints) if f != JOINED)
                self.comm.bcast(desc, root=active)       # what the joined ranks are to run
                refused = kinds.refusal(desc, joined)
                if refused is not None:
                    raise CollectiveError(refused)
        finally:
            record.leave()

    def joined_round(self, joined_at):
        """One exchange of a joined rank (join.py): every rank's fingerprint, JOINED where that
        rank has joined too, and every rank's ``joined_at`` (int64 rows, valid where JOINED)."""
        self.send[0] = JOINED
        self.send[1] = joined_at
        self.rounds += 1
        self.comm.Allgather(self.send, self.rows)
        return self.column.tolist(), self.rows[:, 1]


def fingerprint(desc):
    """62-bit digest of a description, identical in every process (no per-process hash seed)."""
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


class Prepared:
    """One collective's agreement, prepared once for calls that repeat with the same arguments.

    The fingerprint and the typed views of the payload (in the send buffer, and in every rank's
    received row) are computed here, so a steady-state call is: write ``send``, call the object
    (one Allgather, one comparison), read the returned rows -- no description, no hashing, no
    slicing (host.py's _Plan keeps one per repeated allreduce). Same message, same fingerprint
    as the Agreement called with the same fields, so ranks may mix both paths. Needs
    ``agreement.usable``.

    payload: (dtype, shape) of the inline payload, at most INLINE_BYTES, or None.
    """
    __slots__ = ("agreement", "desc", "h", "send", "received")

    def __init__(self, agreement, kind, fields, key=None, payload=None):
        self.agreement = agreement
        self.desc = (as_kind(kind), fields, None)
        self.h = agreement.fingerprint(self.desc, key)
        self.send = self.received = None
        if payload is not None:
            dtype, shape = np.dtype(payload[0]), tuple(payload[1])
            nbytes = dtype.itemsize * math.prod(shape)
            self.send = agreement.send_payload[:nbytes].view(dtype).reshape(shape)  # shape
            self.received = agreement.payload_rows[:, :nbytes].view(dtype).reshape(
                (agreement.size,) + shape)                                  # (size,) + shape

    def __call__(self):
        """Exchange; returns every rank's payload (valid until the next check) or None."""
        self.agreement.exchange(self.h, self.desc)
        return self.received


def explain(descs):
    """One line naming what differs, with the ranks holding each value (same on every rank).
    A None description is a joined rank's (join.py): it is left out, ranks keep their numbers."""
    ranked = [(r, d) for r, d in enumerate(descs) if d is not None]
    called = group([(r, str(d[0])) for r, d in ranked])       # "'allreduce' on ranks [0]"
    if len(called) > 1:
        return "ranks called different collectives: " + format_groups(called)
    kind = ranked[0][1][0]
    errors = [(r, d[2]) for r, d in ranked if d[2] is not None]
    if errors:
        text = "; ".join(f"rank {r}: {e}" for r, e in errors)
        return f"{kind}: invalid arguments on some ranks ({text})"
    parts = []
    for key in ranked[0][1][1]:
        groups = group([(r, d[1].get(key)) for r, d in ranked])
        if len(groups) > 1:
            parts.append(f"{key} differs across ranks: {format_groups(groups)}")
    return f"{kind}: " + ("; ".join(parts) or "arguments differ across ranks")


def group(ranked_values):
    """[(rank, value)] -> {repr(value): ranks}, in order of first appearance."""
    groups = {}
    for r, v in ranked_values:
        groups.setdefault(repr(v), []).append(r)
    return groups


def format_groups(groups):
    return ", ".join(f"{v} on ranks {ranks}" for v, ranks in groups.items())
