"""Cross-rank agreement before a collective: a mismatch becomes CollectiveError on every rank.

MPI cannot tell that rank 0 reduces a (4,) float32 array while rank 1 reduces a (2, 2) one, or a
(5,) one: it would add the wrong elements, truncate, or wait for ever. So every collective first
describes itself -- its kind, and the fields that must match (shape, dtype, op, scale factors,
root, ...) -- plus any local validation error, and the ranks compare those descriptions.

Steady-state cost is one 16-byte MPI_Allreduce (MAX of a 62-bit fingerprint and of its negation,
which gives max and min at once): equal max and min means every rank described the same call.
Only when they differ do the ranks allgather their full descriptions (pickled; the slow path is
the error path) and build the same message naming each differing field with the ranks that hold
each value. Every rank then raises, before any data moves, so the communicator stays usable.
The measured cost is in docs/benchmarks.md. ``MPITRAIN_CHECK=0`` turns the exchange off (a
mismatch then hangs or corrupts, as in plain MPI).

Local validation errors (a bad root, a non-array) travel in the description too: if only some
ranks see one, all raise CollectiveError naming those ranks; if all see the same one, all raise
it as ValueError -- never one rank raising while the others wait in the next MPI call.
"""
import hashlib
import os

import numpy as np
from mpi4py import MPI

enabled = os.environ.get("MPITRAIN_CHECK", "1") != "0"
_MASK = (1 << 62) - 1
_fp = np.zeros(2, np.int64)


class CollectiveError(RuntimeError):
    """Ranks called a collective with arguments that do not match; raised on every rank."""


def agree(comm, kind, fields, error=None):
    """Check that every rank of ``comm`` calls collective ``kind`` with the same ``fields``.

    fields: dict of name -> value (values must have a deterministic repr, e.g. tuples, str,
    numbers). error: this rank's local validation message or None.
    Raises CollectiveError (mismatch anywhere) or ValueError (the same local error everywhere).
    """
    if enabled and comm.Get_size() > 1:
        desc = (kind, fields, error)
        digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") & _MASK
        _fp[0], _fp[1] = h, -h
        comm.Allreduce(MPI.IN_PLACE, _fp, op=MPI.MAX)
        if _fp[0] != -_fp[1]:
            raise CollectiveError(_explain(comm.allgather(desc)))
    if error is not None:
        raise ValueError(error)


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
