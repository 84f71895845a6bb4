"""Performance model: fit our ring's alpha/beta/gamma, predict step time and efficiency to N=1024.

    python benchmarks/perfmodel.py --allreduce out/bench/allreduce.json \\
        --step out/bench/step.json --scaling out/bench/scaling-weak.json \\
        --link 25Gbps,5us --link 100Gbps,2us --out out/bench

The model (docs/benchmarks.md, "Performance model", says the same with its limits). One ring
allreduce of n bytes over N ranks takes

    T(n, N) = 2(N-1) alpha  +  2(N-1)/N n beta  +  (N-1)/N n gamma

alpha: per-message latency (MPI + our Python per step), beta: seconds per byte on the link,
gamma: seconds per byte of the reduction kernel. A weak-scaling step (per-rank batch b) is

    T_step(N) = T_compute(b) * max(1, R/C)  +  [N > 1] sum over fusion buckets k of
                                                [T(n_k, N)  +  (p_k + 1) n_k mu]

with T_compute from the step benchmark, R ranks sharing a node of C cores (oversubscribed ranks
time-share), n_k the fusion plan's bucket sizes, p_k = 2 for a packed bucket (pack + unpack
copies; 0 for a tensor reduced in place) and one more pass for the 1/N of Average (mu: copy cost
per byte, measured here). At N = 1 DistributedOptimizer skips averaging altogether (no packing
either). That sum is the trainer's ``--no-overlap`` (one 64 MiB fusion plan averaged after
backward), and this script's ``--no-overlap``.

By default the trainer overlaps: gradients in reverse layer order, buckets of <= 4 MiB, each
allreduced on one comm thread as soon as backward has produced it. The model builds the same
plan (``overlap_buckets``) and gives bucket k a ready time r_k T_bwd, r_k = the share of the
backward GEMM FLOPs done when its last layer is finished (ASSUMPTION: backward time goes as
its GEMM FLOPs; T_bwd = bwd_ms / step_ms of the step benchmark times T_compute). The comm thread
runs buckets first in, first out: start_k = max(ready_k, end_(k-1)), end_k = start_k +
T(n_k, N) + n_k mu (the 1/N pass); packing (n_k mu, main thread) delays backward, unpacking
follows the wait. T_step = T_compute + packs + max(0, end_last - backward end) + unpacks.
Where ranks fill the node (fewer than 2 cores per rank, as in the validation on a small box) the
comm thread shares the rank's core with backward (processor sharing, ``comm_thread_shared``),
which stretches backward by the comm work it overlaps; the projections (one rank per node)
give it a core of its own. Efficiency = T_step(1) / T_step(N); throughput = N b / T_step(N).

Identifiability. In T(n, N) beta and gamma always appear as (N-1)/N n (2 beta + gamma): ring
timings alone, at any set of N, determine alpha and 2 beta + gamma, never beta and gamma apart.
So the fit is one least-squares problem over two kinds of observations: ring timings
(rows [2(N-1), 2(N-1)/N n, (N-1)/N n]) and timings of the local reduce kernel alone (rows
[0, 0, n] plus a per-call constant), which pins gamma. Without reduce timings gamma is reported
as unknown and beta as the combined cost / 2 -- predictions on the measured network are the same
(they need only alpha and 2 beta + gamma), but a user link (which replaces beta, not gamma) then
charges the reduction at link speed. With N=2 data only, (N-1)/N is a constant, so nothing else is
lost; alpha comes from the intercept over message sizes, which needs at least two sizes.

Inputs (JSON written by the other benchmarks; read by ``load_*`` below, which accept the key
spellings listed there):
- allreduce (benchmarks/allreduce.py): ``{"results": [{"algo": "ring", "bytes": n, "ranks": N,
  "time_us": t}, ...]}``; ranks may sit at top level; records of other algorithms are ignored;
  optional ``"reduce_kernel": [{"bytes": n, "time_us": t}]``. When absent, the reduce kernel is
  timed here (``mpitrain.kernels.cpu.reduce_into``, float32 sum) unless ``--no-measure``.
- step (benchmarks/step.py): ``{"results": [{"model": m, "batch": b, "step_time_ms": t,
  "threads": k (optional)}]}`` -- forward + backward + update of one process, no communication.
- scaling (benchmarks/scaling.py): its ``points`` (validation only), predicted as the jobs ran:
  the trainer flags it records (``extra``: ``--no-overlap``, ``--fusion-threshold-bytes``)
  choose the plan for the validation, whatever this script's own ``--no-overlap`` says.

``--link BW,LAT`` (repeatable, e.g. 25Gbps,5us or 12.5GB/s,1.5us) replaces the network: alpha =
LAT + the fitted local alpha (our software per message does not go away), beta =
max(1/BW, fitted beta) (the slower of link and local copy); gamma and mu stay local.
"""
import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))           # run as a script from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
from mpitrain.comm.buckets import SOLO_BYTES, plan_buckets  # noqa: E402

MODELS = ("mlp", "lenet", "cifar_cnn")
TARGET_ERROR = 0.15


class ModelError(ValueError):
    """Unusable input to the performance model; the message is one line."""


# --- the ring formula and its fit ---------------------------------------------------------------

def ring_time(n, ranks, alpha, beta, gamma):
    """Seconds for one ring allreduce of n bytes over ``ranks`` ranks (arrays broadcast)."""
    n = np.asarray(n, dtype=float)
    ranks = np.asarray(ranks, dtype=float)
    frac = (ranks - 1) / ranks
    return 2 * (ranks - 1) * alpha + 2 * frac * n * beta + frac * n * gamma


def tree_steps(ranks):
    """Latency steps of MPI's allreduce for large messages (Rabenseifner: recursive halving
    reduce-scatter + recursive doubling allgather): 2 ceil(log2 N)."""
    ranks = np.asarray(ranks, dtype=float)
    return 2 * np.ceil(np.log2(np.maximum(ranks, 1)))


def mpi_time(n, ranks, alpha, combined):
    """Seconds for one MPI_Allreduce of n bytes, modelled as 2 ceil(log2 N) alpha_mpi +
    (N-1)/N n (2 beta + gamma)_mpi -- the ring's bandwidth term, a logarithmic latency term."""
    n = np.asarray(n, dtype=float)
    ranks = np.asarray(ranks, dtype=float)
    return tree_steps(ranks) * alpha + (ranks - 1) / ranks * n * combined


def fit_mpi(obs):
    """alpha_mpi and combined_mpi from (bytes, ranks, seconds) MPI_Allreduce timings (relative
    least squares, >= 0); used for the fusion buckets below the ring threshold, which our
    allreduce hands to MPI."""
    obs = np.asarray(list(obs), dtype=float).reshape(-1, 3)              # (M, 3)
    if len(obs) == 0 or len(np.unique(obs[:, 0])) < 2:
        raise ModelError("MPI_Allreduce timings at two or more sizes are needed")
    n, ranks, t = obs.T
    a = np.column_stack([tree_steps(ranks), (ranks - 1) / ranks * n])
    alpha, combined = _rel_lstsq(a, t)
    pred = mpi_time(n, ranks, alpha, combined)
    return {"alpha": float(alpha), "combined": float(combined), "points": int(len(obs)),
            "rel_rms": float(np.sqrt(np.mean(((pred - t) / t) ** 2)))}


def _rel_lstsq(a, y):
    """Non-negative least squares minimising relative errors: timings span orders of
    magnitude, so every row counts by its % error; columns are conditioned on their own
    magnitude, then scaled back."""
    a_w = a / y[:, None]
    scale = np.abs(a_w).max(axis=0)
    scale[scale == 0] = 1.0
    return _nonneg_lstsq(a_w / scale, np.ones_like(y)) / scale


def _nonneg_lstsq(a, y):
    """Least squares with every coefficient >= 0: fix negative ones at 0 and refit the rest
    (enough for 2-4 unknowns that are physically positive; noise can push a tiny one below 0)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free = [f for f, s in zip(free, sol) if s >= 0] if (sol > 0).any() else []
    return x


def fit(ring_obs, reduce_obs=None):
    """Fit alpha, beta, gamma (seconds, s/byte, s/byte) by relative least squares.

    ring_obs: iterable of (bytes, ranks, seconds) for ring allreduces (ranks >= 2).
    reduce_obs: iterable of (bytes, seconds) for the local reduce kernel alone, or None.
    Returns a dict: alpha, beta, gamma (None when not identifiable), combined (2 beta + gamma),
    reduce_call_s (per-call constant of the reduce kernel), rel_rms (relative RMS residual of the
    ring rows), identifiable (one line).
    """
    ring = np.asarray(list(ring_obs), dtype=float).reshape(-1, 3)        # (M, 3)
    if len(ring) == 0:
        raise ModelError("no ring allreduce timings to fit")
    n, ranks, t = ring.T
    if (ranks < 2).any() or (t <= 0).any() or (n < 0).any():
        raise ModelError("ring timings need ranks >= 2, bytes >= 0 and time > 0")
    if len(np.unique(n)) < 2:
        raise ModelError(f"ring timings at one message size ({n[0]:.0f} bytes) cannot separate "
                         "latency from bandwidth")
    frac = (ranks - 1) / ranks
    red = np.asarray(list(reduce_obs or []), dtype=float).reshape(-1, 2)  # (K, 2)
    if len(red) and len(np.unique(red[:, 0])) < 2:
        raise ModelError("reduce-kernel timings need at least two sizes")
    if len(red):
        # Unknowns: alpha, beta, gamma, reduce per-call constant.
        a_ring = np.column_stack([2 * (ranks - 1), 2 * frac * n, frac * n, np.zeros_like(n)])
        a_red = np.column_stack([np.zeros(len(red)), np.zeros(len(red)), red[:, 0],
                                 np.ones(len(red))])
        a = np.vstack([a_ring, a_red])
        y = np.concatenate([t, red[:, 1]])
    else:
        # Unknowns: alpha, c = 2 beta + gamma.
        a = np.column_stack([2 * (ranks - 1), frac * n])
        y = t
    x = _rel_lstsq(a, y)
    if len(red):
        alpha, beta, gamma, call = x
        combined = 2 * beta + gamma
        note = "alpha, beta, gamma (gamma pinned by the reduce-kernel timings)"
    else:
        alpha, combined = x
        beta, gamma, call = combined / 2, None, None
        note = ("alpha and 2*beta+gamma only (no reduce-kernel timings): beta reported as "
                "(2*beta+gamma)/2, gamma unknown")
    pred = 2 * (ranks - 1) * alpha + frac * n * combined
    rel_rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return {"alpha": float(alpha), "beta": float(beta),
            "gamma": None if gamma is None else float(gamma), "combined": float(combined),
            "reduce_call_s": None if call is None else float(call), "rel_rms": rel_rms,
            "identifiable": note, "ring_points": int(len(ring)), "reduce_points": int(len(red))}


# --- links ------------------------------------------------------------------------------------

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_LAT_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _bad(spec, what, text):
    return ModelError(f"--link {spec!r}: bad {what} {text.strip()!r} (e.g. 25Gbps, 3GB/s; 5us)")


def _bandwidth(text, spec):
    """Bytes per second from '25Gbps', '25Gb/s' (bits) or '3GB/s', '3GBps' (bytes)."""
    m = re.fullmatch(_NUMBER + r"([kKmMgGtT]?)(bps|b/s|B/s|Bps)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise _bad(spec, "bandwidth", text)
    per_unit = 1.0 if m.group(3) in ("B/s", "Bps") else 1 / 8
    return float(m.group(1)) * _PREFIX[m.group(2).lower()] * per_unit


def _latency(text, spec):
    m = re.fullmatch(_NUMBER + r"(ns|us|µs|ms|s)\s*", text)
    if not m or float(m.group(1)) < 0:
        raise _bad(spec, "latency", text)
    return float(m.group(1)) * _LAT_UNITS[m.group(2)]


def parse_link(spec):
    """'25Gbps,5us' -> {"name", "alpha" (s), "beta" (s/byte)}; Gbps and Gb/s are bits, GB/s and
    GBps bytes."""
    parts = spec.split(",")
    if len(parts) != 2:
        raise ModelError(f"--link {spec!r}: expected BANDWIDTH,LATENCY like 25Gbps,5us")
    bytes_per_s = _bandwidth(parts[0], spec)
    latency = _latency(parts[1], spec)
    return {"name": spec.replace(" ", ""), "alpha": latency, "beta": 1.0 / bytes_per_s}


def network_params(fitted, link=None, mpi=None, ring_threshold=0):
    """alpha/beta/gamma of the measured local network, or of a user link on top of our stack.
    With ``mpi`` (from ``fit_mpi``), buckets below ``ring_threshold`` bytes are costed as
    MPI_Allreduce, as our allreduce sends them there."""
    gamma = fitted["gamma"] or 0.0
    if link is None:
        net = {"name": "local (measured)", "alpha": fitted["alpha"], "beta": fitted["beta"],
               "gamma": gamma}
    else:
        net = {"name": link["name"], "alpha": fitted["alpha"] + link["alpha"],
               "beta": max(link["beta"], fitted["beta"]), "gamma": gamma}
    net["ring_threshold"] = int(ring_threshold) if mpi else 0
    if mpi:
        net["mpi_alpha"] = mpi["alpha"] + (link["alpha"] if link else 0.0)
        net["mpi_combined"] = max(mpi["combined"], 2 * link["beta"] + gamma if link else 0.0)
    return net


def allreduce_time(nb, ranks, net):
    """One allreduce of a bucket as our code runs it: the ring from the threshold up, else MPI."""
    if nb >= net.get("ring_threshold", 0):
        return float(ring_time(nb, ranks, net["alpha"], net["beta"], net["gamma"]))
    return float(mpi_time(nb, ranks, net["mpi_alpha"], net["mpi_combined"]))


# --- inputs -----------------------------------------------------------------------------------

def _read_json(path, what):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ModelError(f"{what} JSON {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{what} JSON {path}: not JSON ({e.msg}, line {e.lineno})") from None


def _records(doc):
    if isinstance(doc, list):
        return doc
    for key in ("results", "points", "records", "rows", "data"):
        if isinstance(doc.get(key), list):
            return doc[key]
    return []


def _get(rec, names, default=None):
    for name in names:
        if name in rec and rec[name] is not None:
            return rec[name]
    return default


def _seconds(rec, prefix=""):
    """A time from any of {prefix}time_s/_ms/_us, {prefix}s/ms/us, best_*/median_* spellings."""
    for unit, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        for stem in ("time", "best", "median", "min", "mean", ""):
            key = f"{prefix}{stem}_{unit}" if stem else f"{prefix}{unit}"
            if key in rec and rec[key] is not None:
                return float(rec[key]) * factor
    return None


def _ring_threshold(doc):
    """Smallest message our allreduce sends through the ring under --algo auto."""
    value = _get(doc, ("ring_threshold_bytes", "ring_threshold"))
    if value is None:
        from mpitrain.comm.collectives import RING_THRESHOLD_BYTES as value
    return int(value)


def _pick_time(rec, prefix, stat):
    """Seconds of the ``stat`` ("median" or "min") timing of ``prefix`` in an allreduce record:
    {prefix}s / {prefix}median_s for the median, {prefix}min_s / {prefix}best_s for the minimum
    (also _ms / _us), falling back to the other statistic when only that one was written."""
    stems = {"median": ("", "median_", "time_"), "min": ("min_", "best_")}
    order = stems[stat] + stems["min" if stat == "median" else "median"]
    for stem in order:
        for unit, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
            value = rec.get(f"{prefix}{stem}{unit}")
            if value is not None:
                return float(value) * factor
    return None


def load_allreduce(paths, stat="median"):
    """{"ring": [(bytes, ranks, s)], "mpi": [(bytes, ranks, s)], "reduce": [(bytes, s)] or None}
    from one or more allreduce-benchmark files.

    benchmarks/allreduce.py writes ``{"ranks": N, "algo": "auto"|"ring"|"mpi", "results":
    [{"bytes", "ours_s", "ours_min_s", "mpi_s", "mpi_min_s", ...}]}`` (medians and minima over
    iterations of the slowest rank). ``ours`` is our allreduce, which under "auto" takes the ring
    only from the ring threshold up (smaller sizes ran MPI_Allreduce and are not ring timings);
    under "ring" every size is; under "mpi" none. ``mpi`` is MPI_Allreduce at every size.
    Per-record ``algo`` and ``time_us`` spellings are accepted too.
    """
    out = {"ring": [], "mpi": [], "reduce": None}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        doc = _read_json(path, "allreduce")
        top = doc if isinstance(doc, dict) else {}
        top_ranks = _get(top, ("ranks", "size", "world_size", "nranks"))
        top_algo = str(_get(top, ("algo", "algorithm"), "ring")).lower()
        for rec in _records(doc):
            algo = str(_get(rec, ("algo", "algorithm", "impl", "method"), top_algo)).lower()
            n = _get(rec, ("bytes", "nbytes", "size_bytes", "message_bytes"))
            ranks = _get(rec, ("ranks", "size", "world_size", "nranks"), top_ranks)
            if n is None or ranks is None:
                raise ModelError(f"allreduce JSON {path}: record lacks bytes/ranks: {rec}")
            if int(ranks) < 2:
                continue
            t_mpi = _pick_time(rec, "mpi_", stat)
            if t_mpi is not None:
                out["mpi"].append((float(n), int(ranks), t_mpi))
            if algo == "mpi" or (algo == "auto" and n < _ring_threshold(top)):
                continue
            t = _pick_time(rec, "ours_", stat) or _pick_time(rec, "time_", stat) \
                or _seconds(rec)
            if t is None:
                raise ModelError(f"allreduce JSON {path}: record lacks a time: {rec}")
            out["ring"].append((float(n), int(ranks), t))
        kernel = _get(top, ("reduce_kernel", "reduce", "reduce_into"))
        if isinstance(kernel, list) and kernel:
            out["reduce"] = [(float(_get(r, ("bytes", "nbytes"))), _seconds(r)) for r in kernel]
    if not out["ring"]:
        raise ModelError(f"allreduce JSON {paths}: no ring timings with ranks >= 2 (run it "
                         "under mpiexec -n 2 or more, --algo ring or auto)")
    return out


def load_step(paths, stat="median"):
    """{model: [(batch, seconds per step, threads or None, params or None)]} from one or more
    step-benchmark files (e.g. one per thread count).

    benchmarks/step.py writes ``{"results": [{"model", "batch", "threads", "best": {"step_ms",
    ...}, "median": {"step_ms", ...}}]}``; ``stat`` picks best-of-rounds or the median round.
    A flat ``step_time_ms`` per record is accepted too.
    """
    out = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        doc = _read_json(path, "step")
        for rec in _records(doc):
            model = _get(rec, ("model", "name"))
            batch = _get(rec, ("batch", "batch_size"))
            inner = rec.get(stat) if isinstance(rec.get(stat), dict) else rec
            t = _seconds(inner, "step_") or _seconds(inner)
            if model is None or batch is None or t is None:
                raise ModelError(f"step JSON {path}: record lacks model/batch/step time: "
                                 f"{str(rec)[:120]}")
            out.setdefault(model, []).append(
                (int(batch), t, _get(rec, ("threads", "num_threads")),
                 _get(rec, ("params", "parameters", "n_params"))))
    if not out:
        raise ModelError(f"step JSON {paths}: no step records")
    return out


def load_backward_share(paths, stat="median"):
    """{model: [(batch, threads or None, backward seconds / step seconds)]} from step-benchmark
    files that record ``bwd_ms`` next to ``step_ms`` (benchmarks/step.py does); models without
    it are left out (the overlap model then assumes DEFAULT_BACKWARD_SHARE)."""
    out = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for rec in _records(_read_json(path, "step")):
            inner = rec.get(stat) if isinstance(rec.get(stat), dict) else rec
            bwd, step = _seconds(inner, "bwd_"), _seconds(inner, "step_")
            model, batch = _get(rec, ("model", "name")), _get(rec, ("batch", "batch_size"))
            if bwd and step and model is not None and batch is not None and 0 < bwd <= step:
                out.setdefault(model, []).append(
                    (int(batch), _get(rec, ("threads", "num_threads")), bwd / step))
    return out


def backward_share(records, batch, threads=None):
    """Backward's share of the step for ``batch`` from ``load_backward_share`` records of one
    model: the record at the nearest batch (and the thread count, when recorded)."""
    if not records:
        return DEFAULT_BACKWARD_SHARE
    recs = [r for r in records if threads is None or r[1] in (None, threads)] or records
    return min(recs, key=lambda r: abs(r[0] - batch))[2]


def load_scaling(path):
    doc = _read_json(path, "scaling")
    pts = _records(doc)
    if not pts:
        raise ModelError(f"scaling JSON {path}: no points")
    return doc, pts


# --- local kernel timings -----------------------------------------------------------------------

def _best_time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_local(sizes=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeat=7):
    """Timings of the reduce kernel (float32 sum, as the ring runs it) and of a copy, per size:
    ([(bytes, s)], [(bytes, s)])."""
    from mpitrain.kernels.cpu import copy, reduce_into
    red, cop = [], []
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)                           # (n/4,)
        b = np.ones(nbytes // 4, np.float32)                           # (n/4,)
        reduce_into(a, b, "sum")                                       # JIT outside the clock
        copy(a, b)
        red.append((float(nbytes), _best_time(lambda: reduce_into(a, b, "sum"), repeat)))
        cop.append((float(nbytes), _best_time(lambda: copy(a, b), repeat)))
    return red, cop


def per_byte(obs):
    """Slope of t = c + n * slope over (bytes, s) observations (least squares, slope >= 0)."""
    obs = np.asarray(obs, dtype=float)
    a = np.column_stack([obs[:, 0], np.ones(len(obs))]) / obs[:, 1:2]
    return float(_nonneg_lstsq(a, np.ones(len(obs)))[0])


# --- the model's workload: gradient bytes, fusion plan, compute time ------------------------------

def gradient_tensor_bytes(model):
    """Byte size of each gradient tensor of a zoo model (float32), in declared order."""
    from mpitrain.nn import models
    net = models.get(model)
    return [int(p.data.size) * 4 for p in net.parameters()]


def fusion_plan(tensor_bytes, threshold):
    """[(bucket bytes, tensors in it)] of the fusion plan as comm/fusion.py makes it: a tensor of
    at least SOLO_BYTES travels alone (in place, not packed); the others are packed in order
    into buckets of <= threshold bytes (one larger than the threshold alone)."""
    return _byte_plan(tensor_bytes, threshold, consecutive=False)


def _byte_plan(tensor_bytes, threshold, consecutive):
    """[(bucket bytes, tensors in it)]: the gradients are all float32, so planning their sizes
    in bytes (as one-byte elements) compares bytes with the threshold and SOLO_BYTES exactly as
    planning float32 elements does."""
    buckets = plan_buckets(tensor_bytes, [np.uint8] * len(tensor_bytes), threshold, SOLO_BYTES,
                           consecutive=consecutive)
    return [(b.total, len(b.entries)) for b in buckets]


def compute_time(records, batch, threads=None):
    """Seconds of forward + backward + update at ``batch`` from the step benchmark's records of
    one model: the record at that batch (and thread count, when recorded) if there is one, else a
    line t = t0 + k*b through the measured batches, else proportional scaling of the one batch."""
    recs = [r for r in records if threads is None or r[2] in (None, threads)] or records
    exact = [r[1] for r in recs if r[0] == batch]
    if exact:
        return min(exact)
    bs = np.array([r[0] for r in recs], dtype=float)
    ts = np.array([r[1] for r in recs], dtype=float)
    if len(np.unique(bs)) >= 2:
        k, t0 = np.polyfit(bs, ts, 1)
        if t0 + k * batch > 0 and k >= 0:
            return float(t0 + k * batch)
    near = int(np.argmin(np.abs(bs - batch)))
    return float(ts[near] * batch / bs[near])


# Backward's share of forward + backward + update when the step benchmark did not record it:
# backward costs about twice the forward (two GEMMs per layer against one), the update little.
DEFAULT_BACKWARD_SHARE = 0.6


class OverlapPlan:
    """The overlapped trainer's buckets: ``buckets`` = [(bytes, tensors, ready)], in the order
    the comm thread runs them, ``ready`` = fraction of backward done when the bucket's last
    gradient is final; ``backward_share`` = backward's fraction of the compute time."""

    def __init__(self, buckets, backward_share):
        if not 0 < backward_share <= 1:
            raise ModelError(f"backward share {backward_share!r}: must be in (0, 1]")
        self.buckets = [(float(nb), int(c), float(r)) for nb, c, r in buckets]
        self.backward_share = float(backward_share)

    def __eq__(self, other):
        return (isinstance(other, OverlapPlan) and self.buckets == other.buckets
                and self.backward_share == other.backward_share)

    def __repr__(self):
        return f"OverlapPlan({self.buckets!r}, backward_share={self.backward_share!r})"

    def to_json(self):
        return {"overlap": True, "backward_share": self.backward_share,
                "buckets": [{"bytes": nb, "tensors": c, "ready": r} for nb, c, r in self.buckets]}


def backward_layers(model, batch):
    """[(backward GEMM FLOPs, [gradient bytes of the layer's parameters])] per layer of a zoo
    model, forward order -- the GEMMs benchmarks/step.py's ``gemm_plan`` lists (dW, and dx for
    every layer but the first); layers without GEMMs (pooling, flatten) count 0."""
    from mpitrain.nn import Conv2D, Flatten, Linear, MaxPool2D, models
    net = models.get(model)
    out, shape = [], (batch,) + tuple(net.input_shape)
    for i, layer in enumerate(net.layers):
        flops = 0
        if isinstance(layer, Linear):
            flops = 2 * shape[0] * layer.in_features * layer.out_features      # dW = g^T x
            shape = (shape[0], layer.out_features)
        elif isinstance(layer, Conv2D):
            n, c, h, w = shape
            oh, ow = layer.output_hw(h, w)
            flops = 2 * n * oh * ow * layer.out_channels * c * layer.kernel_size ** 2
            shape = (n, layer.out_channels, oh, ow)
        elif isinstance(layer, MaxPool2D):
            n, c, h, w = shape
            ks, st = layer.kernel_size, layer.stride
            shape = (n, c, (h - ks) // st + 1, (w - ks) // st + 1)
        elif isinstance(layer, Flatten):
            shape = (shape[0], int(np.prod(shape[1:])))
        flops *= 2 if i > 0 else 1                  # dx: the first layer forms none
        out.append((flops, [int(p.data.size) * 4 for p in layer.parameters()]))
    return out


def overlap_buckets(layers, threshold):
    """[(bytes, tensors, ready)] as comm/overlap.py plans them: gradients in reverse layer order
    (the last layer's parameters, last first), packed into buckets of <= threshold bytes (a
    larger tensor, or one of at least SOLO_BYTES, alone). A layer reports all its gradients when
    its backward ends; ``ready`` of a bucket is the share of backward done then, assumed
    proportional to the backward FLOPs of the layers differentiated so far (``layers`` as
    ``backward_layers`` returns them)."""
    total = float(sum(f for f, _ in layers)) or 1.0
    tensors, done = [], 0.0                 # (bytes, ready) in submission order
    for flops, grads in reversed(layers):
        done += flops
        tensors += [(nb, min(1.0, done / total)) for nb in reversed(grads)]
    plan, i = [], 0
    for nb, count in _byte_plan([t[0] for t in tensors], threshold, consecutive=True):
        plan.append((nb, count, max(r for _, r in tensors[i:i + count])))
        i += count
    return plan


def comm_thread(ready, durations):
    """(starts, ends) of buckets on the single comm thread: first in, first out, one at a time;
    a bucket starts at max(its ready time, the previous bucket's end)."""
    starts, ends, end = [], [], 0.0
    for r, d in zip(ready, durations):
        start = max(float(r), end)
        end = start + float(d)
        starts.append(start)
        ends.append(end)
    return starts, ends


def comm_thread_shared(ready_work, durations, backward_work, cores_per_rank):
    """``comm_thread`` when the comm thread has no core of its own: while the main thread
    (backward) and the comm thread both run, each progresses at min(1, cores_per_rank / 2) of
    full speed (processor sharing; MPI's polling and copies are CPU work). Bucket k becomes ready
    when the main thread has done ``ready_work[k]`` seconds of its ``backward_work``. Returns
    (starts, ends, backward_end) in seconds from the start of backward."""
    t = done = 0.0
    starts, ends, backward_end = [], [], None
    k, rem = 0, float(durations[0]) if len(durations) else 0.0
    eps = 1e-15
    while k < len(durations):
        main_on = done < backward_work - eps
        comm_on = ready_work[k] <= done + eps or not main_on
        if comm_on and len(starts) == k:
            starts.append(t)
        rate = min(1.0, cores_per_rank / (int(main_on) + int(comm_on)))
        dt_comm = rem / rate if comm_on else float("inf")
        target = backward_work if comm_on else ready_work[k]
        dt_main = (target - done) / rate if main_on else float("inf")
        dt = min(dt_comm, dt_main)
        t += dt
        if main_on:
            done = target if dt == dt_main else done + rate * dt
            if done >= backward_work - eps and backward_end is None:
                backward_end = t
        if comm_on:
            rem -= rate * dt
            if dt == dt_comm or rem <= eps:
                ends.append(t)
                k += 1
                rem = float(durations[k]) if k < len(durations) else 0.0
    if backward_end is None:
        backward_end = t + (backward_work - done)
    return starts, ends, backward_end


def overlap_schedule(backward_s, plan, ranks, net, mu, cores_per_rank=None):
    """The overlapped step's communication, times from the start of backward (seconds):
    ready/start/end per bucket, backward_end, exposed (wait in synchronize beyond backward),
    pack (main thread, inside backward), unpack (main thread, after the wait), stretch (backward
    slowed by a comm thread sharing its core: ``cores_per_rank`` < 2; None = a core of its own).

    The main thread packs a bucket of several tensors (n mu) when it becomes ready, which
    delays the rest of backward; the comm thread runs allreduce + the 1/N pass (n mu); after
    backward the main thread waits for the last bucket, then unpacks (n mu per packed bucket).
    """
    ready, durations, pack, unpack = [], [], 0.0, 0.0
    for nb, count, frac in plan.buckets:
        copy = nb * mu if count > 1 else 0.0
        pack += copy
        ready.append(frac * backward_s + pack)
        durations.append(allreduce_time(nb, ranks, net) + nb * mu)
        unpack += copy
    if cores_per_rank is None or cores_per_rank >= 2:     # a core of its own
        starts, ends = comm_thread(ready, durations)
        backward_end = backward_s + pack
    else:
        starts, ends, backward_end = comm_thread_shared(ready, durations, backward_s + pack,
                                                        max(1.0, cores_per_rank))
    exposed = max(0.0, ends[-1] - backward_end) if ends else 0.0
    return {"ready": ready, "start": starts, "end": ends, "backward_end": backward_end,
            "exposed": exposed, "pack": pack, "unpack": unpack,
            "stretch": backward_end - backward_s - pack}


def step_time(compute_s, plan, ranks, net, mu, ranks_per_node=1, cores=None):
    """Predicted seconds per step and the communication part of it (see the module docstring).
    plan: [(bucket bytes, tensors in it)] from ``fusion_plan`` (averaged after backward), or an
    ``OverlapPlan`` (allreduce overlapped with backward; comm = what it adds to the step:
    packing, the exposed wait, unpacking, and backward slowed by the comm thread when it shares
    a core). cores: of the node the ranks_per_node ranks share; None = cores to spare."""
    share = 1.0 if cores is None else max(1.0, ranks_per_node / cores)
    comm = 0.0
    if ranks > 1 and isinstance(plan, OverlapPlan):
        per_rank = None if cores is None else cores / ranks_per_node
        s = overlap_schedule(compute_s * share * plan.backward_share, plan, ranks, net, mu,
                             per_rank)
        comm = s["pack"] + s["exposed"] + s["unpack"] + s["stretch"]
    elif ranks > 1:            # one rank: DistributedOptimizer skips averaging, packing included
        for nb, count in plan:
            comm += allreduce_time(nb, ranks, net)
            comm += ((2 if count > 1 else 0) + 1) * nb * mu
    return compute_s * share + comm, comm


# --- the report -------------------------------------------------------------------------------

def parse_range(text):
    """'LO:HI' bytes (either side may be empty) -> (lo, hi)."""
    try:
        lo, hi = text.split(":")
        lo, hi = float(lo or 0), float(hi or "inf")
    except ValueError:
        raise ModelError(f"--fit-bytes {text!r}: expected LO:HI in bytes, e.g. 65536:") from None
    if lo > hi:
        raise ModelError(f"--fit-bytes {text!r}: LO > HI")
    return lo, hi


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def project(models, steps, plans, nets, mu, batch, max_ranks):
    """{net name: {model: {"ranks", "step_ms", "comm_ms", "efficiency", "samples_per_sec"}}}
    for N = 1..max_ranks, one rank per node."""
    ns = np.arange(1, max_ranks + 1)
    out = {}
    for net in nets:
        out[net["name"]] = {}
        for model in models:
            comp = compute_time(steps[model], batch)
            rows = [step_time(comp, plans[model], int(n), net, mu) for n in ns]
            st = np.array([r[0] for r in rows])
            out[net["name"]][model] = {
                "ranks": ns.tolist(), "step_ms": (st * 1e3).round(4).tolist(),
                "comm_ms": (np.array([r[1] for r in rows]) * 1e3).round(4).tolist(),
                "efficiency": (st[0] / st).round(4).tolist(),
                "samples_per_sec": (ns * batch / st).round(2).tolist()}
    return out


def sweep_settings(doc):
    """How the sweep's jobs averaged gradients, from the trainer flags benchmarks/scaling.py
    records (``extra``): {"overlap": bool, "fusion_threshold_bytes": int or None}; None when the
    JSON does not record its flags (then the model's own settings are used)."""
    extra = doc.get("extra") if isinstance(doc, dict) else None
    if not isinstance(extra, list):
        return None
    flags, value = {}, None
    for i, arg in enumerate(extra):
        name, eq, val = str(arg).partition("=")
        if not eq and i + 1 < len(extra):
            val = str(extra[i + 1])
        flags[name] = val
    if "--fusion-threshold-bytes" in flags:
        try:
            value = int(flags["--fusion-threshold-bytes"])
        except ValueError:
            raise ModelError(f"scaling JSON: --fusion-threshold-bytes "
                             f"{flags['--fusion-threshold-bytes']!r} is not an integer") from None
    # overlap applies to gradient averaging only (DistributedOptimizer)
    overlap = "--no-overlap" not in flags and flags.get("--average", "gradients") == "gradients"
    return {"overlap": overlap, "fusion_threshold_bytes": value}


def default_threshold(overlap):
    """The trainer's bucket size: 4 MiB buckets with overlap, the 64 MiB fusion plan without."""
    if overlap:
        from mpitrain.distributed import OVERLAP_BUCKET_BYTES
        return OVERLAP_BUCKET_BYTES
    from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES
    return DEFAULT_THRESHOLD_BYTES


def make_plans(models, overlap, threshold, shares, batch, threads=None):
    """{model: plan} for the trainer with or without overlap (threshold None: its default)."""
    threshold = default_threshold(overlap) if threshold is None else threshold
    if not overlap:
        return {m: fusion_plan(gradient_tensor_bytes(m), threshold) for m in models}
    return {m: OverlapPlan(overlap_buckets(backward_layers(m, batch), threshold),
                           backward_share(shares.get(m), batch, threads)) for m in models}


def calibrate(points, plans, net, mu, cores):
    """Compute-time records taken from the sweep itself: each model's N=1 measured step minus
    the predicted N=1 communication (packing). Validation is then of the communication model
    only, on N >= 2, but is immune to the machine being slower during the sweep than during the
    step benchmark (shared machines)."""
    out = {}
    for p in points:
        if int(p["ranks"]) == 1:
            _, comm = step_time(0.0, plans[p["model"]], 1, net, mu, 1, cores)
            out.setdefault(p["model"], []).append(
                (int(p["per_rank_batch"]), p["step_time_ms"] / 1e3 - comm, p.get("threads"), None))
    return out


def validate(points, steps, plans, net, mu, cores):
    """Predicted vs measured step time for the scaling sweep's points (all ranks on this node)."""
    rows = []
    for p in points:
        model, n, b = p["model"], int(p["ranks"]), int(p["per_rank_batch"])
        if model not in steps or model not in plans:
            continue
        threads = p.get("threads") or max(1, cores // n)
        comp = compute_time(steps[model], b, threads)
        pred, comm = step_time(comp, plans[model], n, net, mu, ranks_per_node=n, cores=cores)
        meas = p["step_time_ms"] / 1e3
        rows.append({"model": model, "ranks": n, "per_rank_batch": b,
                     "measured_ms": meas * 1e3, "predicted_ms": pred * 1e3,
                     "measured_comm_ms": p.get("comm_time_ms"), "predicted_comm_ms": comm * 1e3,
                     "error": (pred - meas) / meas,
                     "oversubscribed": bool(p.get("oversubscribed", n > cores))})
    return rows


def _eng(seconds_per_byte):
    return "inf" if seconds_per_byte <= 0 else f"{1 / seconds_per_byte / 1e9:.2f} GB/s"


def describe_plan(plan, threshold):
    """One line per model: bucket sizes, path (ring or MPI) and, overlapped, when each is ready."""
    def path(nb):
        return "ring" if nb >= threshold else "MPI"
    if isinstance(plan, OverlapPlan):
        return (", ".join(f"{nb / 1e6:.2f} MB ({path(nb)}, ready at {100 * r:.0f}%)"
                          for nb, _, r in plan.buckets)
                + f"; backward = {100 * plan.backward_share:.0f}% of compute")
    return ", ".join(f"{nb / 1e6:.2f} MB ({path(nb)})" for nb, _ in plan)


def _mode(plans):
    plan = next(iter(plans.values()), None)
    if isinstance(plan, OverlapPlan):
        return "allreduce overlapped with backward (buckets in reverse layer order)"
    return "allreduce after backward (fusion plan)"


def format_report(fitted, mu, nets, proj, rows, models, markdown=False, mpi=None, plans=None,
                  val_plans=None):
    lines = []
    gam = fitted["gamma"]
    lines.append(f"ring fit ({fitted['ring_points']} ring + {fitted['reduce_points']} reduce "
                 f"timings, relative RMS residual {100 * fitted['rel_rms']:.1f}%): "
                 f"alpha = {fitted['alpha'] * 1e6:.2f} us, beta = 1/{_eng(fitted['beta'])}, "
                 f"gamma = {'unknown' if gam is None else '1/' + _eng(gam)}, "
                 f"copy mu = 1/{_eng(mu)}")
    lines.append(f"identifiable: {fitted['identifiable']}")
    threshold = nets[0].get("ring_threshold", 0)
    if mpi:
        lines.append(f"MPI_Allreduce fit ({mpi['points']} timings, relative RMS residual "
                     f"{100 * mpi['rel_rms']:.1f}%): alpha_mpi = {mpi['alpha'] * 1e6:.2f} us, "
                     f"2beta+gamma = 1/{_eng(mpi['combined'])}; used for buckets < "
                     f"{threshold} bytes")
    if plans:
        lines.append(f"projection: {_mode(plans)}")
    for model in models if plans else ():
        lines.append(f"{model} gradient buckets: {describe_plan(plans[model], threshold)}")
    pow2 = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
            if n <= len(next(iter(next(iter(proj.values())).values()))["ranks"])]
    head = ["network", "model"] + [f"N={n}" for n in pow2]
    table = []
    for net in nets:
        for model in models:
            eff = proj[net["name"]][model]["efficiency"]
            table.append([net["name"], model] + [f"{eff[n - 1]:.2f}" for n in pow2])
    lines.append("")
    lines.append("predicted weak-scaling efficiency (one rank per node):")
    lines += _table(head, table, markdown)
    if rows:
        lines.append("")
        lines.append("validation against the measured sweep (step time, all ranks on this node)"
                     + (f", as the sweep ran: {_mode(val_plans)}" if val_plans else "") + ":")
        if val_plans and plans and val_plans != plans:
            for model in sorted({r["model"] for r in rows}):
                lines.append(f"{model} buckets as run: "
                             f"{describe_plan(val_plans[model], threshold)}")
        vhead = ["model", "N", "measured ms", "predicted ms", "error", "meas. comm ms",
                 "pred. comm ms"]
        vrows = [[r["model"], f"{r['ranks']}{'*' if r['oversubscribed'] else ''}",
                  f"{r['measured_ms']:.2f}", f"{r['predicted_ms']:.2f}",
                  f"{100 * r['error']:+.1f}%",
                  "-" if r["measured_comm_ms"] is None else f"{r['measured_comm_ms']:.2f}",
                  f"{r['predicted_comm_ms']:.2f}"] for r in rows]
        lines += _table(vhead, vrows, markdown)
        worst = max(abs(r["error"]) for r in rows)
        verdict = "within" if worst <= TARGET_ERROR else "OUTSIDE"
        lines.append(f"worst step-time error {100 * worst:.1f}%: {verdict} the "
                     f"{100 * TARGET_ERROR:.0f}% target" +
                     ("  (* oversubscribed)" if any(r["oversubscribed"] for r in rows) else ""))
    return "\n".join(lines)


def _table(head, rows, markdown):
    if markdown:   # blank lines around: a table must not run into the text next to it
        return (["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                + ["| " + " | ".join(r) + " |" for r in rows] + [""])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return ["  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in [head] + rows]


def plot(proj, rows, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = len(models) + (1 if rows else 0)
    fig, axes = plt.subplots(1, ncol, figsize=(4.2 * ncol, 4))
    axes = np.atleast_1d(axes)
    for ax, model in zip(axes, models):
        for i, (name, per_model) in enumerate(proj.items()):
            d = per_model[model]
            ax.plot(d["ranks"], d["efficiency"], color=f"C{i}", label=name)
        measured = {}
        for r in rows:
            if r["model"] == model:
                measured[r["ranks"]] = r["measured_ms"]
        if 1 in measured:
            ns = sorted(measured)
            ax.plot(ns, [measured[1] / measured[n] for n in ns], "ko", mfc="none",
                    label="measured (this node)")
        ax.set_xscale("log", base=2)
        ticks = [n for n in (1, 4, 16, 64, 256, 1024) if n <= d["ranks"][-1]]
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_ylim(0, 1.05)
        ax.set_title(model)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("efficiency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if rows:
        ax = axes[-1]
        meas = np.array([r["measured_ms"] for r in rows])
        pred = np.array([r["predicted_ms"] for r in rows])
        lim = [0, max(meas.max(), pred.max()) * 1.15]
        ax.plot(lim, lim, "k-", lw=1)
        ax.fill_between(lim, [v * (1 - TARGET_ERROR) for v in lim],
                        [v * (1 + TARGET_ERROR) for v in lim], color="0.9", label="+-15%")
        for i, model in enumerate(models):
            sel = [r for r in rows if r["model"] == model]
            for r in sel:
                ax.plot(r["measured_ms"], r["predicted_ms"], "o", color=f"C{i}",
                        mfc="none" if r["oversubscribed"] else f"C{i}")
                ax.annotate(f"{r['ranks']}", (r["measured_ms"], r["predicted_ms"]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
            if sel:
                ax.plot([], [], "o", color=f"C{i}", label=model)
        ax.set_xlim(lim)
        ax.set_ylim(lim)
        ax.set_xlabel("measured step ms")
        ax.set_ylabel("predicted step ms")
        ax.set_title("validation (label: N)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allreduce", required=True, nargs="+",
                    help="JSON of benchmarks/allreduce.py (several: e.g. --algo auto and ring)")
    ap.add_argument("--allreduce-stat", choices=("median", "min"), default="median",
                    help="which allreduce timing to fit (default median)")
    ap.add_argument("--ring-threshold-bytes", type=int, default=None,
                    help="buckets below this go to MPI_Allreduce (default: our allreduce's)")
    ap.add_argument("--step", required=True, nargs="+",
                    help="JSON of benchmarks/step.py (several: e.g. one per --threads)")
    ap.add_argument("--step-stat", choices=("median", "best"), default="median",
                    help="which round of the step benchmark to use (default median)")
    ap.add_argument("--scaling", help="JSON of benchmarks/scaling.py (validation)")
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batch-size", type=int, default=64, help="per-rank batch of projections")
    ap.add_argument("--link", action="append", default=[], help="BANDWIDTH,LATENCY e.g. "
                    "25Gbps,5us (repeatable)")
    ap.add_argument("--max-ranks", type=int, default=1024)
    ap.add_argument("--fusion-threshold-bytes", type=int, default=None,
                    help="bucket size (default: the trainer's, 4 MiB with overlap, 64 MiB "
                         "without)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="model the trainer's --no-overlap: every bucket averaged after "
                         "backward (default: allreduce overlapped with backward)")
    ap.add_argument("--compute-from", choices=("step", "scaling"), default="step",
                    help="compute time per step: the step benchmark (default), or the sweep's "
                         "N=1 points minus their packing (validates the comm model on N>=2)")
    ap.add_argument("--fit-bytes", default=None, metavar="LO:HI",
                    help="fit only ring timings with LO <= bytes <= HI (e.g. 65536:16777216)")
    ap.add_argument("--cores", type=int, default=None, help="cores of this node (validation)")
    ap.add_argument("--no-measure", action="store_true",
                    help="do not time the local reduce/copy kernels (gamma unknown, mu = 0)")
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--markdown", nargs="?", const="-", default=None, metavar="PATH",
                    help="also write the report with markdown tables (to PATH, default stdout)")
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_ranks < 1:
        ap.error(f"--batch-size and --max-ranks must be >= 1, got {args.batch_size}, "
                 f"{args.max_ranks}")
    return args


def _plan_json(plan):
    if isinstance(plan, OverlapPlan):
        return plan.to_json()
    return {"overlap": False, "buckets": [{"bytes": nb, "tensors": c} for nb, c in plan]}


def main(argv=None):
    args = parse_args(argv)
    try:
        links = [parse_link(s) for s in args.link]
        timings = load_allreduce(args.allreduce, args.allreduce_stat)
        ring_obs, reduce_obs = timings["ring"], timings["reduce"]
        steps = load_step(args.step, args.step_stat)
        missing = [m for m in args.model if m not in steps]
        if missing:
            raise ModelError(f"step JSON {args.step}: no records for {', '.join(missing)}")
        copy_obs = None
        if not args.no_measure:
            measured_red, copy_obs = measure_local()
            reduce_obs = reduce_obs or measured_red
        if args.fit_bytes:
            lo, hi = parse_range(args.fit_bytes)
            ring_obs = [o for o in ring_obs if lo <= o[0] <= hi]
        fitted = fit(ring_obs, reduce_obs)
        mpi = fit_mpi(timings["mpi"]) if len({o[0] for o in timings["mpi"]}) >= 2 else None
        mu = per_byte(copy_obs) if copy_obs else 0.0
        shares = load_backward_share(args.step, args.step_stat)
        plans = make_plans(args.model, not args.no_overlap, args.fusion_threshold_bytes,
                           shares, args.batch_size)
        threshold = args.ring_threshold_bytes
        if threshold is None:
            from mpitrain.comm.collectives import RING_THRESHOLD_BYTES as threshold
        nets = [network_params(fitted, link, mpi, threshold) for link in [None] + links]
        rows, cores = [], args.cores or usable_cores()
        sweep, points = load_scaling(args.scaling) if args.scaling else ({}, [])
        # Like with like: predict the sweep's points as its jobs ran (their recorded flags).
        settings = sweep_settings(sweep)
        val_plans = plans
        if settings is not None and (settings["overlap"] != (not args.no_overlap)
                                     or settings["fusion_threshold_bytes"] is not None):
            batch = int(points[0]["per_rank_batch"]) if points else args.batch_size
            val_plans = make_plans(args.model, settings["overlap"],
                                   settings["fusion_threshold_bytes"], shares, batch)
        if args.compute_from == "scaling":
            if not points:
                raise ModelError("--compute-from scaling needs --scaling")
            steps = calibrate(points, val_plans, nets[0], mu, cores)
            missing = [m for m in args.model if m not in steps]
            if missing:
                raise ModelError(f"--compute-from scaling: no N=1 point for {', '.join(missing)}")
        proj = project(args.model, steps, plans, nets, mu, args.batch_size, args.max_ranks)
        rows = validate(points, steps, val_plans, nets[0], mu, cores)
        if args.compute_from == "scaling":
            rows = [r for r in rows if r["ranks"] > 1]
    except ModelError as e:
        print(f"perfmodel: error: {e}", file=sys.stderr)
        return 2
    print(format_report(fitted, mu, nets, proj, rows, args.model, mpi=mpi, plans=plans,
                        val_plans=val_plans))
    if args.markdown:
        md = (f"`{shlex.join(['python'] + sys.argv)}`\n\n"
              + format_report(fitted, mu, nets, proj, rows, args.model, markdown=True,
                                mpi=mpi, plans=plans, val_plans=val_plans) + "\n")
        if args.markdown == "-":
            print("\n" + md, end="")
        else:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "perfmodel", "fit": fitted, "mpi_fit": mpi, "copy_s_per_byte": mu,
           "networks": nets, "batch_per_rank": args.batch_size, "cores": cores,
           "compute_from": args.compute_from, "overlap": not args.no_overlap,
           "fusion_plans": {m: _plan_json(p) for m, p in plans.items()},
           "validation_plans": {m: _plan_json(p) for m, p in val_plans.items()},
           "inputs": {"allreduce": args.allreduce, "step": args.step, "scaling": args.scaling},
           "validation": rows, "projection": proj}
    (out / "perfmodel.json").write_text(json.dumps(doc) + "\n")
    wrote = [out / "perfmodel.json"]
    if benchdeps.can_plot(out / "perfmodel.png"):       # the results above are kept either way
        plot(proj, rows, args.model, out / "perfmodel.png")
        wrote.append(out / "perfmodel.png")
    print(f"wrote {' and '.join(map(str, wrote))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
