"""What a step tells the other ranks beyond its description, in the message of its agreement.

Every step of DistributedOptimizer already exchanges one message to agree on itself (the count
of backward passes; comm.agree). Three small facts ride in it as its payload, so none of them
costs an MPI call of its own:

- the caller's step flags (an int of bits: a stop request, ...), OR-ed over the ranks;
- on the first step only, a digest (CRC-32) of this rank's parameters: replicas that start
  different (``broadcast_parameters`` forgotten; PyTorch's DDP broadcasts for you, Horovod
  does not) never become one model, so the first step raises on every rank, naming the call;
- where the parameters can tell (mpitrain.torch's: a tensor's ``.grad`` may be None), one bit
  per parameter: did it get a gradient on this rank. Their OR says which parameters no rank
  used this step; those get their ``.grad`` back to None after the average (the buckets sent
  zeros for them so that no rank waited), as at N = 1 and under DDP, so that an optimizer
  leaves them alone (AdamW would otherwise decay them and build state).

The layout (which parts, how many bits) is part of the agreed fields: ranks that would read
each other's bytes differently raise instead. Where no message is exchanged (one rank,
MPITRAIN_CHECK=0) nothing is read: flags and the digest are not compared, and gradients stay as
the average left them.

A parameter tells the last through two optional members, which the engine's own ``Parameter``
has not: ``has_grad`` (False: no gradient this step) and ``drop_grad()`` (back to none).
"""
import zlib

import numpy as np

from mpitrain import comm

_FLAGS_BYTES = 8
_DIGEST_BYTES = 8
# the digest travels with bit 32 set: a joined rank's neutral payload (zeros) is "no digest"
_DIGEST_MARK = 1 << 32


def used(params):
    """Per parameter, whether it has a gradient this step; None where parameters do not tell."""
    if not params or not hasattr(params[0], "has_grad"):
        return None
    return [bool(p.has_grad) for p in params]


def digest(params):
    """CRC-32 of the parameters' bytes in order (host arrays); None for device arrays, which
    would have to be copied to the host for it."""
    crc = 0
    for p in params:
        data = p.data
        if not isinstance(data, np.ndarray):
            return None
        crc = zlib.crc32(np.ascontiguousarray(data).view(np.uint8).reshape(-1), crc)
    return crc


class StepReport:
    """One step's payload: ``flags`` (int or None), ``digest`` (int or None), ``used`` (list of
    bools or None). ``fields()`` is its layout, for the agreement; ``payload()`` its bytes, or
    None when it carries nothing or would not fit (then ``used`` is left out: the gradients
    stay as averaged, zeros for parameters no rank used)."""

    def __init__(self, flags=None, digest=None, used=None):
        self.flags = flags
        self.digest = digest
        self.used = used
        if used is not None and self.nbytes() > comm.INLINE_BYTES:
            self.used = None

    def nbytes(self):
        return ((_FLAGS_BYTES if self.flags is not None else 0)
                + (_DIGEST_BYTES if self.digest is not None else 0)
                + (0 if self.used is None else (len(self.used) + 7) // 8))

    def fields(self):
        return {"payload": (self.flags is not None, self.digest is not None,
                            None if self.used is None else len(self.used))}

    def payload(self):
        if not self.nbytes():
            return None
        parts = []
        if self.flags is not None:
            parts.append(np.array([self.flags], np.int64).view(np.uint8))
        if self.digest is not None:
            parts.append(np.array([self.digest | _DIGEST_MARK], np.uint64).view(np.uint8))
        if self.used is not None:
            parts.append(np.packbits(np.array(self.used, bool), bitorder="little"))
        return np.concatenate(parts)

    def read(self, rows, kind):
        """Every rank's payload (a (size, nbytes) array) -> (the flags' OR or None, per
        parameter whether any rank had its gradient, or None); raises CollectiveError on every
        rank where the replicas' parameters differ (every rank reads the same rows)."""
        at, flags, any_used = 0, None, None
        if self.flags is not None:
            flags = int(np.bitwise_or.reduce(
                np.ascontiguousarray(rows[:, :_FLAGS_BYTES]).view(np.int64)[:, 0]))
            at = _FLAGS_BYTES
        if self.digest is not None:
            digests = np.ascontiguousarray(rows[:, at:at + _DIGEST_BYTES]).view(np.uint64)[:, 0]
            at += _DIGEST_BYTES
            ranked = [(r, int(d) ^ _DIGEST_MARK) for r, d in enumerate(digests.tolist()) if d]
            if len({d for _, d in ranked}) > 1:
                groups = comm.group((r, f"{d:08x}") for r, d in ranked)
                raise comm.CollectiveError(
                    f"{kind}: the replicas start from different parameters (CRC-32 "
                    f"{comm.format_groups(groups)}): broadcast them from one rank before "
                    f"training, e.g. hvd.broadcast_parameters(model.state_dict(), "
                    f"root_rank=0) (mt.broadcast_parameters(params, root_rank=0))")
        if self.used is not None:
            bits = np.bitwise_or.reduce(rows[:, at:], axis=0)
            any_used = np.unpackbits(bits, count=len(self.used), bitorder="little").astype(bool)
        return flags, any_used
