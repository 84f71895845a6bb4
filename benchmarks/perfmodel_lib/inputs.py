"""What the model reads: JSON written by the other benchmarks (``load_*`` below accept the key
spellings listed there), and timings of the local reduce and copy kernels (``measure_local``):
- allreduce (benchmarks/allreduce.py): ``{"results": [{"algo": "ring", "bytes": n, "ranks": N,
  "time_us": t}, ...]}``; ranks may sit at top level; records of other algorithms are ignored;
  optional ``"reduce_kernel": [{"bytes": n, "time_us": t}]``. When absent, the reduce kernel is
  timed here (``mpitrain.kernels.cpu.reduce_into``, float32 sum) unless ``--no-measure``.
- step (benchmarks/step.py): ``{"results": [{"model": m, "batch": b, "step_time_ms": t,
  "threads": k (optional)}]}`` -- forward + backward + update of one process, no communication.
- scaling (benchmarks/scaling.py): its ``points`` (validation only), predicted as the jobs ran:
  the trainer flags it records (``extra``: ``--no-overlap``, ``--fusion-threshold-bytes``)
  choose the plan for the validation, whatever perfmodel.py's own ``--no-overlap`` says.
"""
import json
from pathlib import Path

import numpy as np

import benchutil

from .errors import ModelError
from .network import default_ring_threshold


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


def _ring_threshold(doc, ranks):
    """Smallest message our allreduce sends through the ring between ``ranks`` under auto."""
    value = _get(doc, ("ring_threshold_bytes", "ring_threshold"))
    return int(default_ring_threshold(ranks) if value is None else value)


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
            if algo == "mpi" or (algo == "auto" and n < _ring_threshold(top, int(ranks))):
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


# Backward's share of forward + backward + update when the step benchmark did not record it:
# backward costs about twice the forward (two GEMMs per layer against one), the update little.
DEFAULT_BACKWARD_SHARE = 0.6


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


def measure_local(sizes=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeat=7):
    """Timings of the reduce kernel (float32 sum, as the ring runs it) and of a copy, per size:
    ([(bytes, s)], [(bytes, s)])."""
    from mpitrain.kernels.cpu import copy, reduce_into
    red, cop = [], []
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)                           # (n/4,)
        b = np.ones(nbytes // 4, np.float32)                           # (n/4,)
        red.append((float(nbytes), benchutil.best_time(lambda: reduce_into(a, b, "sum"), repeat)))
        cop.append((float(nbytes), benchutil.best_time(lambda: copy(a, b), repeat)))
    return red, cop
