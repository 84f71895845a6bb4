"""Least-squares fits of the cost models to timings: the ring's alpha, beta, gamma (what is
identifiable: the package docstring), MPI_Allreduce's alpha and bandwidth, a copy's cost per
byte."""
import numpy as np

from .errors import ModelError
from .network import mpi_time, tree_steps


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
        alpha, beta, gamma, call = _rel_lstsq(np.vstack([a_ring, a_red]),
                                              np.concatenate([t, red[:, 1]]))
        combined = 2 * beta + gamma
        note = "alpha, beta, gamma (gamma pinned by the reduce-kernel timings)"
    else:
        # Unknowns: alpha, c = 2 beta + gamma.
        alpha, combined = _rel_lstsq(np.column_stack([2 * (ranks - 1), frac * n]), t)
        beta, gamma, call = combined / 2, None, None
        note = ("alpha and 2*beta+gamma only (no reduce-kernel timings): beta reported as "
                "(2*beta+gamma)/2, gamma unknown")
    pred = 2 * (ranks - 1) * alpha + frac * n * combined
    rel_rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return {"alpha": float(alpha), "beta": float(beta),
            "gamma": None if gamma is None else float(gamma), "combined": float(combined),
            "reduce_call_s": None if call is None else float(call), "rel_rms": rel_rms,
            "identifiable": note, "ring_points": int(len(ring)), "reduce_points": int(len(red))}


def per_byte(obs):
    """Slope of t = c + n * slope over (bytes, s) observations (least squares, slope >= 0)."""
    obs = np.asarray(obs, dtype=float)
    a = np.column_stack([obs[:, 0], np.ones(len(obs))]) / obs[:, 1:2]
    return float(_nonneg_lstsq(a, np.ones(len(obs)))[0])
