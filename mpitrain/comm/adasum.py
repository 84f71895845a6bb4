"""Adasum (Horovod's ``op=Adasum``): every rank's array combined pairwise, not summed.

Two arrays a and b combine as a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b: orthogonal
arrays give their sum, parallel ones their mean, anything between an interpolation (a zero array
counts as orthogonal to everything). The pairs are those of Horovod's recursive halving-doubling
over N = 2^k ranks: level 0 combines ranks (0, 1), (2, 3), ...; level 1 the results of (0, 1)
and (2, 3); and so on. Each combination takes the dot products of the whole arrays, so the result
does not depend on how the ranks split the traffic.

The data move in one checked allgather (host.py: a mismatch is a CollectiveError on every rank),
after one agreement on the call's arguments (a bad argument on one rank is a ValueError on every
rank, never a wait): each rank then evaluates the same tree in float64, in the same order, and
casts back, so every rank holds the same bits. This costs N - 1 arrays received per rank instead
of the 2(N-1)/N of a ring allreduce: Adasum's value is in its combination, at the rank counts
where that is cheap. In a grouped call each array is combined separately (its own dot products),
as Horovod does for the tensors of a fused buffer, after one allgather of all of them.

Host arrays of floating-point dtype only; the number of ranks must be a power of two.
"""
import numpy as np

from mpitrain.comm import host
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import as_array, as_factor, first_error, on_device
from mpitrain.comm.tree import is_power_of_two


class AdasumOp:
    """The op ``mt.Adasum`` (one instance); the string "adasum" means it too."""

    __slots__ = ()

    def __repr__(self):
        return "mt.Adasum"

    def __str__(self):
        return "adasum"

    def __reduce__(self):
        return "Adasum"


Adasum = AdasumOp()


def is_adasum(op):
    return op is Adasum or (isinstance(op, str) and op.lower() == "adasum")


def combine(a, b):
    """The Adasum of two float64 1-D arrays (a new array)."""
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1.0 - dot / (2.0 * aa) if aa > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0.0 else 1.0
    return ca * a + cb * b


def reduce_rows(rows):
    """The Adasum tree over ``rows`` (a power-of-two count of float64 1-D arrays, rank order)."""
    level = list(rows)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def allreduce(state, x, op=Adasum, name=None, prescale_factor=1.0, postscale_factor=1.0):
    return _adasum(state, "allreduce", [x], False, name, prescale_factor, postscale_factor)[0]


def allreduce_(state, x, op=Adasum, name=None, prescale_factor=1.0, postscale_factor=1.0):
    return _adasum(state, "allreduce_", [x], True, name, prescale_factor, postscale_factor)[0]


def grouped_allreduce(state, xs, op=Adasum, name=None, prescale_factor=1.0,
                      postscale_factor=1.0, fusion_threshold_bytes=None):
    return _adasum(state, "grouped_allreduce", list(xs), False, name, prescale_factor,
                   postscale_factor)


def grouped_allreduce_(state, xs, op=Adasum, name=None, prescale_factor=1.0,
                       postscale_factor=1.0, fusion_threshold_bytes=None):
    return _adasum(state, "grouped_allreduce_", list(xs), True, name, prescale_factor,
                   postscale_factor)


def _check(kind, x, in_place, size):
    if on_device(x):
        return None, f"{kind}: Adasum reduces host arrays; this is a device array"
    a, err = as_array(x, kind, in_place)
    if err is None and a.dtype.kind != "f":
        err = f"{kind}: Adasum combines floating-point arrays, not {a.dtype}"
    if err is None and not is_power_of_two(size):
        err = (f"{kind}: Adasum needs a power-of-two number of ranks (recursive "
               f"halving-doubling), got {size}")
    return a, err


def _adasum(state, kind, xs, in_place, name, prescale, postscale):
    checked = [_check(kind, x, in_place, state.size) for x in xs]
    pre, e1 = as_factor(prescale, f"{kind}: prescale_factor")
    post, e2 = as_factor(postscale, f"{kind}: postscale_factor")
    arrays = [a for a, _ in checked]
    fields = {"op": "adasum", "name": name, "prescale_factor": pre, "postscale_factor": post,
              "arrays": tuple(None if a is None else (tuple(a.shape), a.dtype.str)
                              for a in arrays)}
    state.agreement(Kind.ALLREDUCE if len(xs) == 1 and not kind.startswith("grouped")
                    else Kind.GROUPED_ALLREDUCE, fields,
                    first_error(*(e for _, e in checked), e1, e2))
    sizes = [a.size for a in arrays]
    dtypes = {a.dtype for a in arrays}
    wire = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64)
    flat = np.empty((1, sum(sizes)), wire)
    offsets = np.cumsum([0] + sizes)
    for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
        flat[0, lo:hi] = a.reshape(-1)
    rows = host.allgather(state, flat, None if name is None else f"{name}.adasum")
    if rows.shape[0] != state.size:      # a rank that joined sent nothing (comm/join.py)
        raise ValueError(f"{kind}: Adasum needs every rank's array; a rank has joined")
    outs = []
    for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
        got = reduce_rows([rows[r, lo:hi].astype(np.float64) * pre for r in range(state.size)])
        got = (got * post).reshape(a.shape)
        if in_place:
            np.copyto(a, got, casting="unsafe")
            outs.append(a)
        else:
            outs.append(got.astype(a.dtype))
    if in_place:
        return list(xs)
    return outs
