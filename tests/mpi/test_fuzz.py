"""Seeded fuzz of the public collectives against MPI itself as the oracle (N = 1..4).

A safety net for reworking mpitrain/comm: every case calls one mt collective and computes the
expected result with mpi4py directly on COMM_WORLD (Allreduce, Reduce_scatter, Allgatherv, Bcast,
Alltoallv) on the same data, never with mpitrain. Case i is drawn from default_rng([SEED, i])
(SEED: DEFAULT_SEED unless MPITRAIN_FUZZ_SEED says otherwise; MPITRAIN_FUZZ_CASES sets the count),
so every rank collects the same cases in the same order and makes the same collective calls; the
data of rank r in case i comes from default_rng([SEED, i, r]). Each case is its own test; its
failure message names the seed, the case and the command that replays it alone.

What a case checks (semantics as documented in mpitrain/comm/collectives.py):
- allreduce, allreduce_, grouped_allreduce(_): every dtype and op, prescale/postscale factors,
  lengths 0, 1, primes, N-1..N+1 and around the 4 KiB inline limit, C-contiguous and strided,
  the ring / MPI / inline paths (forced_path below), fusion thresholds from 0 to one bucket;
  floats within a tolerance of a float64 (float16) or same-dtype oracle and bitwise identical on
  every rank; integers exact (sums wrap, factors truncate toward zero); the Average of integers a
  float64 mean out of place and a ValueError on every rank in place (input untouched);
- reducescatter: rank r's block of axis 0 (the first len % N ranks one row more);
- allgather (first dims differ per rank), broadcast(_), alltoall with and without splits:
  exact bytes (the data are random bit patterns, NaN payloads included).
"""
import contextlib
import hashlib
import math
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import world
from tests.support.comm import comm_settings

COMM = MPI.COMM_WORLD
N = COMM.Get_size()
R = COMM.Get_rank()


@contextlib.contextmanager
def forced_path(path, subchunk_bytes=None, ring_threshold_bytes=None):
    """Run the body with the allreduce path forced: "auto" | "ring" | "mpi".

    The only place in this file that knows how mpitrain is configured: the comm settings of a
    World (mt.init(settings=...), through tests/support/comm.py); the default World is reused
    when nothing differs from it.
    """
    current = world.current().settings
    wanted = {"algorithm": path}
    if subchunk_bytes is not None:
        wanted["ring_subchunk_bytes"] = subchunk_bytes
    if ring_threshold_bytes is not None:
        wanted["ring_threshold_bytes"] = ring_threshold_bytes
    if all(getattr(current, k) == v for k, v in wanted.items()):
        yield
        return
    with comm_settings(**wanted):
        yield


DEFAULT_SEED = 20240611
SEED = int(os.environ.get("MPITRAIN_FUZZ_SEED", DEFAULT_SEED))
CASES = int(os.environ.get("MPITRAIN_FUZZ_CASES", 300))
INLINE_BYTES = 4096         # check.INLINE_BYTES; only steers lengths, so it can never fail a test
DTYPES = [np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "int64",
                                "float16", "float32", "float64")]
OPS = [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product]
MPI_OPS = {mt.Sum: MPI.SUM, mt.Average: MPI.SUM, mt.Min: MPI.MIN, mt.Max: MPI.MAX,
           mt.Product: MPI.PROD}
# (path, subchunk_bytes, ring_threshold_bytes): small sub-chunks pipeline each ring chunk in many
# pieces; a small threshold lets "auto" choose the ring for arrays above 8 KiB.
PATHS = [("auto", None, None)] * 6 + [("ring", None, None)] * 2 + [("mpi", None, None)] * 2 + [
    ("ring", 24, None), ("ring", 200, None), ("auto", 96, 8192)]
SMALL_LENGTHS = [0, 1, 2, 3, 5, 7, 11, 13, 17, 31, 61, 127]
PRIMES = [257, 509, 1021, 2039, 4093, 8191]
TOL = {"float16": 5e-3, "float32": 1e-5, "float64": 1e-5}   # times the magnitude bound


# --- drawing cases: a pure function of (SEED, N), identical on every rank ------------------------

def _length(rng, itemsize, small=False):
    pick = rng.integers(5 if not small else 3)
    if pick == 0:
        return int(rng.choice(SMALL_LENGTHS))
    if pick == 1:
        return max(0, N + int(rng.integers(-1, 3)))
    if pick == 2:                                      # just below, at and above the inline limit
        return INLINE_BYTES // itemsize + int(rng.integers(-1, 2))
    if pick == 3:
        return int(rng.choice(PRIMES))
    return int(rng.integers(0, 3000))


def _shape(rng, n, allow_scalar=True):
    pick = rng.integers(10)
    if pick == 0 and n == 1 and allow_scalar:
        return ()
    if pick == 1:
        return (n, int(rng.integers(1, 4)))
    if pick == 2:
        return (n, 2, 1)
    return (n,)


def _factors(rng, dtypes):
    """(prescale, postscale). Integer arrays scale in float64 and truncate, so their factors keep
    every scaled value in range (inputs are limited to a quarter of the type's range, see
    _data): the oracle would otherwise compare two undefined float->int casts."""
    if rng.random() < 0.6:
        return 1.0, 1.0
    if all(d.kind == "f" for d in dtypes):
        return (float(rng.choice([1.0, 0.5, 2.0, -1.5, 3.0])),
                float(rng.choice([1.0, 0.25, 0.5, 3.0, -2.0])))
    pres = [1.0, 0.5, 2.0, 3.0] + ([-2.0] if all(d.kind != "u" for d in dtypes) else [])
    pre, post = float(rng.choice(pres)), float(rng.choice([1.0, 0.5, 0.25, 0.75]))
    if rng.random() < 0.3:
        pre = int(pre) if pre == int(pre) else pre               # an int factor is accepted too
    return pre, post


def _path(rng, max_elems):
    path, sub, threshold = PATHS[rng.integers(len(PATHS))]
    if sub is not None and max_elems * 8 > 400 * sub:  # keep the number of ring messages small
        sub = None
    return path, sub, threshold


def _reduce_case(rng, kind, dtype=None, op=None):
    grouped = kind.startswith("grouped")
    count = int(rng.integers(1, 6)) if grouped else 1
    same = rng.random() < 0.5
    first = dtype if dtype is not None else DTYPES[rng.integers(len(DTYPES))]
    dtypes = [first if same or i == 0 else DTYPES[rng.integers(len(DTYPES))]
              for i in range(count)]
    if kind == "reducescatter":
        shapes = [_shape(rng, _length(rng, first.itemsize), allow_scalar=False)]
    else:
        shapes = [_shape(rng, _length(rng, d.itemsize, small=grouped)) for d in dtypes]
    op = op if op is not None else OPS[rng.integers(len(OPS))]
    pre, post = _factors(rng, dtypes)
    path = _path(rng, max(math.prod(s) for s in shapes))
    case = dict(kind=kind, dtypes=dtypes, shapes=shapes, op=op, pre=pre, post=post, path=path,
                strided=kind != "reducescatter" and rng.random() < 0.2,
                repeat=kind == "allreduce" and rng.random() < 0.3,
                big=rng.random() < 0.3)                # floats: values up to 4e3 instead of 4
    if grouped:
        case["threshold"] = [None, 0, 16, 100, 4096, 1 << 20][rng.integers(6)]
    return case


def _move_case(rng, kind):
    dtype = DTYPES[rng.integers(len(DTYPES))]
    tail = [(), (), (3,), (2, 2)][rng.integers(4)]
    case = dict(kind=kind, dtypes=[dtype], tail=tail)
    if kind == "allgather":
        case["rows"] = [_length(rng, dtype.itemsize, small=True) for _ in range(N)]
    elif kind.startswith("broadcast"):
        case["shape"] = _shape(rng, _length(rng, dtype.itemsize)) + tail
        case["root"] = int(rng.integers(N))
        case["strided"] = kind == "broadcast_" and len(case["shape"]) > 0 and rng.random() < 0.3
    else:                                                              # alltoall
        case["given"] = bool(rng.random() < 0.6)
        if case["given"]:           # splits[r][j]: rows rank r sends to rank j
            case["splits"] = rng.integers(0, 6, (N, N)).tolist()
            case["as_list"] = bool(rng.random() < 0.5)
        else:
            case["splits"] = [[int(k)] * N for k in rng.integers(0, 5, N)]
    return case


KINDS = ["allreduce"] * 5 + ["allreduce_"] * 3 + ["grouped_allreduce"] * 3 + [
    "grouped_allreduce_"] * 2 + ["reducescatter"] * 3 + ["allgather"] * 2 + [
    "broadcast", "broadcast_"] + ["alltoall"] * 2
SWEEP = [(dtype, op, kind) for dtype in DTYPES for op in OPS
         for kind in ("allreduce", "allreduce_")]


def draw_case(seed, i):
    """Case i has its own generator: it does not depend on the cases before it."""
    rng = np.random.default_rng([seed, i])
    if i < len(SWEEP):              # first every (dtype, op) with both allreduce calls
        dtype, op, kind = SWEEP[i]
        return _reduce_case(rng, kind, dtype, op)
    kind = KINDS[rng.integers(len(KINDS))]
    return _reduce_case(rng, kind) if "reduce" in kind else _move_case(rng, kind)


def _case_id(i, case):
    parts = [f"c{i:03d}", case["kind"], "+".join(sorted({d.name for d in case["dtypes"]}))]
    if "op" in case:
        parts.append(case["op"].name.lower())
        path, sub, threshold = case["path"]
        parts.append(path + (f"/sub{sub}" if sub else "") + (f"/thr{threshold}" if threshold
                                                                else ""))
    return "-".join(parts)


CASE_LIST = [draw_case(SEED, i) for i in range(CASES)]
# A case that finds a real bug in mpitrain is marked here with xfail(strict=True), for the default
# seed only: {(number of ranks, case index): reason}.
KNOWN_BUGS = {}


def _params():
    known = KNOWN_BUGS if SEED == DEFAULT_SEED else {}
    return [pytest.param(i, id=_case_id(i, case),
                         marks=[pytest.mark.xfail(strict=True, reason=known[N, i])]
                         if (N, i) in known else [])
            for i, case in enumerate(CASE_LIST)]


# --- data and oracles ---------------------------------------------------------------------------

def _data(rng, shape, dtype, op, limited, big):
    """Reduction inputs: floats well conditioned (Product near 1 in magnitude), integers over
    their whole range (wrapping), or a quarter of it when factors must not overflow."""
    if dtype.kind == "f":
        if op is mt.Product:
            values = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
        else:
            values = rng.uniform(-4, 4, shape) * (1000.0 if big and dtype.itemsize > 2 else 1.0)
        return np.array(values, dtype=dtype)        # an ndarray even for shape ()
    info = np.iinfo(dtype)
    low, high = (info.min, info.max) if not limited else (-(info.max // 4), info.max // 4)
    return np.array(rng.integers(max(low, info.min), high, shape, dtype=dtype, endpoint=True))


def _bits(rng, shape, dtype):
    """Arbitrary bit patterns (NaNs and all): data movement must be exact to the byte."""
    nbytes = math.prod(shape) * dtype.itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def _strided(x, rng):
    """The same values as a non-contiguous view (every other row of a buffer twice as long)."""
    if x.ndim == 0:
        return x
    base = np.empty((2 * x.shape[0],) + x.shape[1:], x.dtype)
    base[1::2] = _bits(rng, x.shape, x.dtype)                    # filler that must stay untouched
    view = base[::2]
    view[...] = x
    return view


def _scale(x, factor):
    """Factors are floats (an int factor too): integers scale in float64 and truncate."""
    if factor != 1.0:
        np.multiply(x, float(factor), out=x, casting="unsafe")


def _result_dtype(dtype, op):
    return np.dtype(np.float64) if op is mt.Average and dtype.kind != "f" else dtype


def _oracle_dtype(dtype, op):
    """MPI has no float16: reduce float16 in float64 (compared with a tolerance)."""
    dt = _result_dtype(dtype, op)
    return np.dtype(np.float64) if dt == np.float16 else dt


def oracle_allreduce(x, op, pre, post):
    w = np.array(x, dtype=_oracle_dtype(x.dtype, op), order="C", copy=True)
    _scale(w, pre)
    COMM.Allreduce(MPI.IN_PLACE, w.reshape(-1), op=MPI_OPS[op])
    _scale(w, post / N if op is mt.Average else post)
    return w


def oracle_reducescatter(x, op, pre, post):
    w = np.array(x, dtype=_oracle_dtype(x.dtype, op), order="C", copy=True)
    _scale(w, pre)
    base, extra = divmod(x.shape[0], N)
    rows = [base + (r < extra) for r in range(N)]
    row_elems = math.prod(x.shape[1:])
    out = np.empty((rows[R],) + x.shape[1:], w.dtype)
    COMM.Reduce_scatter(w.reshape(-1), out.reshape(-1), [k * row_elems for k in rows],
                        op=MPI_OPS[op])
    _scale(out, post / N if op is mt.Average else post)
    return out


def _bytes(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def oracle_allgather(x, rows):
    row_bytes = x.dtype.itemsize * math.prod(x.shape[1:])
    out = np.empty((sum(rows),) + x.shape[1:], x.dtype)
    counts = [k * row_bytes for k in rows]
    displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
    COMM.Allgatherv([_bytes(x), MPI.BYTE], [_bytes(out), (counts, displs), MPI.BYTE])
    return out


def oracle_alltoall(x, splits):
    """splits[r][j]: rows rank r sends to rank j (every rank knows the whole matrix)."""
    row_bytes = x.dtype.itemsize * math.prod(x.shape[1:])
    send = [k * row_bytes for k in splits[R]]
    recv = [splits[j][R] * row_bytes for j in range(N)]
    out = np.empty((sum(splits[j][R] for j in range(N)),) + x.shape[1:], x.dtype)
    sd = np.concatenate(([0], np.cumsum(send)[:-1])).astype(int).tolist()
    rd = np.concatenate(([0], np.cumsum(recv)[:-1])).astype(int).tolist()
    COMM.Alltoallv([_bytes(x), (send, sd), MPI.BYTE], [_bytes(out), (recv, rd), MPI.BYTE])
    return out


def _bound(case, dtype):
    """An upper bound on the magnitudes in a float result: tolerances are relative to it, so a
    sum that cancels to near zero is not held to a relative error."""
    op, pre = case["op"], abs(float(case["pre"]))
    post = abs(float(case["post"])) / (N if op is mt.Average else 1)
    if dtype.kind != "f":                              # the float64 mean of integers
        return N * pre * post * float(np.iinfo(dtype).max + 1)
    if op is mt.Product:
        return (1.5 * pre) ** N * post
    mag = 4.0 * (1000.0 if case["big"] and dtype.itemsize > 2 else 1.0)
    return (N if op in (mt.Sum, mt.Average) else 1) * mag * pre * post


def _compare(errors, label, got, want, case, dtype):
    """got: mt's result for an input of ``dtype``; want: the oracle's."""
    rdt = _result_dtype(dtype, case["op"]) if "op" in case else dtype
    if got.dtype != rdt or got.shape != want.shape:
        errors.append(f"{label}: got {got.dtype}{got.shape}, want {rdt}{want.shape}")
        return
    if "op" not in case:
        if got.tobytes() != want.tobytes():
            bad = np.flatnonzero(_bytes(got) != _bytes(want))
            errors.append(f"{label}: {bad.size} bytes differ, first at byte {bad[:5].tolist()}")
        return
    if rdt.kind != "f":
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5]
            errors.append(f"{label}: {bad.size}+ elements differ at {bad.tolist()}: got "
                          f"{got.reshape(-1)[bad].tolist()}, want {want.reshape(-1)[bad].tolist()}")
        return
    tol = TOL[rdt.name]
    g, w = got.astype(np.float64), want.astype(np.float64)
    atol = tol * _bound(case, dtype)
    ok = np.abs(g - w) <= atol + tol * np.abs(w)
    if not ok.all():
        bad = np.flatnonzero(~ok.reshape(-1))[:5]
        errors.append(f"{label}: {int((~ok).sum())} elements off (atol {atol:.3g}, rtol {tol}) "
                      f"at {bad.tolist()}: got {g.reshape(-1)[bad].tolist()}, "
                      f"want {w.reshape(-1)[bad].tolist()}")


def _digest(arrays):
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# --- running one case ----------------------------------------------------------------------------
# Every rank makes all of its collective calls first (mt's, the oracle's, the digest allgather),
# then checks locally; the failures are allgathered and raised on every rank together, so a case
# fails (or xfails) the same way everywhere.

def _run_reduce(case, rng, errors, digests):
    kind, op, pre, post = case["kind"], case["op"], case["pre"], case["post"]
    limited = (pre, post) != (1.0, 1.0)
    xs = [_data(rng, s, d, op, limited, case["big"]) for s, d in zip(case["shapes"],
                                                                     case["dtypes"])]
    if case["strided"]:
        xs = [_strided(x, rng) for x in xs]
    before = [np.array(x, copy=True) for x in xs]
    bases = [x.base if x.base is not None else x for x in xs]
    bases_before = [b.tobytes() for b in bases]
    if kind == "reducescatter":
        wants = [oracle_reducescatter(xs[0], op, pre, post)]
    else:
        wants = [oracle_allreduce(x, op, pre, post) for x in xs]
    refused = kind.endswith("_") and any(_result_dtype(d, op) != d for d in case["dtypes"])
    path, sub, threshold = case["path"]
    kwargs = dict(op=op, prescale_factor=pre, postscale_factor=post)
    with forced_path(path, sub, threshold):
        if refused:                     # the Average of integers cannot be stored in place
            call = mt.allreduce_ if kind == "allreduce_" else mt.grouped_allreduce_
            args = xs[0] if kind == "allreduce_" else xs
            if kind != "allreduce_":
                kwargs["fusion_threshold_bytes"] = case["threshold"]
            try:
                call(args, **kwargs)
                errors.append("in-place integer Average: no ValueError")
            except ValueError as exc:
                if "Average" not in str(exc):
                    errors.append(f"in-place integer Average: unexpected message {exc}")
            for j, (b, old) in enumerate(zip(bases, bases_before)):
                if b.tobytes() != old:
                    errors.append(f"array {j}: modified by a refused in-place call")
            digests.append("refused")
            return
        if kind == "allreduce":
            gots = [mt.allreduce(xs[0], **kwargs)]
            if case["repeat"]:          # the same call again (a cached plan): the same bits
                again = mt.allreduce(xs[0], **kwargs)
                if again.tobytes() != gots[0].tobytes():
                    errors.append("repeated allreduce: different bits")
        elif kind == "allreduce_":
            out = mt.allreduce_(xs[0], **kwargs)
            if out is not xs[0]:
                errors.append("allreduce_ did not return its argument")
            gots = [xs[0]]
        elif kind == "reducescatter":
            gots = [mt.reducescatter(xs[0], **kwargs)]
        else:
            fn = mt.grouped_allreduce if kind == "grouped_allreduce" else mt.grouped_allreduce_
            outs = fn(xs, fusion_threshold_bytes=case["threshold"], **kwargs)
            if kind == "grouped_allreduce_":
                if outs is not xs and [id(o) for o in outs] != [id(x) for x in xs]:
                    errors.append("grouped_allreduce_ did not return its arrays")
                outs = xs
            gots = list(outs)
    for j, (got, want) in enumerate(zip(gots, wants)):
        _compare(errors, f"array {j}", np.asarray(got), want, case, case["dtypes"][j])
    if not kind.endswith("_"):
        for j, (x, old) in enumerate(zip(xs, before)):
            if x.tobytes() != old.tobytes():
                errors.append(f"array {j}: input modified by an out-of-place call")
    if case["strided"]:            # the rows between the view's rows are not the view's
        for j, (b, old) in enumerate(zip(bases, bases_before)):
            if b.ndim and b[1::2].tobytes() != np.frombuffer(old, b.dtype).reshape(
                    b.shape)[1::2].tobytes():
                errors.append(f"array {j}: wrote outside its strided view")
    if kind != "reducescatter":
        digests.append(_digest(gots))


def _run_move(case, rng, errors):
    kind, dtype, tail = case["kind"], case["dtypes"][0], case["tail"]
    if kind == "allgather":
        rows = case["rows"]
        x = _bits(rng, (rows[R],) + tail, dtype)
        want = oracle_allgather(x, rows)
        got = mt.allgather(x)
    elif kind.startswith("broadcast"):
        x = _bits(rng, case["shape"], dtype)
        want = np.array(x, copy=True)
        COMM.Bcast([_bytes(want), MPI.BYTE], root=case["root"])
        if kind == "broadcast":
            got = mt.broadcast(x, root_rank=case["root"])
        else:
            if case["strided"]:
                x = _strided(x, rng)
            filler = x.base[1::2].copy() if case["strided"] else None
            out = mt.broadcast_(x, root_rank=case["root"])
            if out is not x:
                errors.append("broadcast_ did not return its argument")
            if filler is not None and x.base[1::2].tobytes() != filler.tobytes():
                errors.append("broadcast_ wrote outside its strided view")
            got = x
    else:
        splits = case["splits"]
        x = _bits(rng, (sum(splits[R]),) + tail, dtype)
        want = oracle_alltoall(x, splits)
        if case["given"]:
            mine = splits[R] if case["as_list"] else np.array(splits[R])
            got, received = mt.alltoall(x, splits=mine)
            if list(np.asarray(received)) != [splits[j][R] for j in range(N)]:
                errors.append(f"alltoall: received splits {list(received)}, want "
                              f"{[splits[j][R] for j in range(N)]}")
        else:
            got = mt.alltoall(x)
    _compare(errors, kind, np.asarray(got), want, case, dtype)


@pytest.mark.parametrize("index", _params())
def test_collective_matches_mpi(index):
    case = CASE_LIST[index]
    rng = np.random.default_rng([SEED, index, R])
    errors, digests = [], []
    if "op" in case:
        _run_reduce(case, rng, errors, digests)
    else:
        _run_move(case, rng, errors)
    if digests:                     # replicas must not drift: the same bits on every rank
        everyone = COMM.allgather(digests)
        if any(d != everyone[0] for d in everyone):
            errors.append(f"results differ across ranks (digests {everyone})")
    failures = [f"rank {r}: {'; '.join(e)}" for r, e in enumerate(COMM.allgather(errors)) if e]
    assert not failures, (
        f"fuzz case {index} of seed {SEED} at N={N}: {_describe(case)}\n" + "\n".join(failures)
        + f"\nreplay: MPITRAIN_FUZZ_SEED={SEED} mpiexec -n {N} python -m pytest "
          f"tests/mpi/test_fuzz.py -k '{_case_id(index, case)}'")


def _describe(case):
    return ", ".join(f"{k}={v}" for k, v in case.items())
