"""The cost of one allreduce: the ring's formula, MPI_Allreduce's, and the network they run on
(the measured one, or a user's ``--link`` on top of our software's per-message costs)."""
import functools
import re

import numpy as np

from .errors import ModelError


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


def network_params(fitted, link=None, mpi=None, ring_threshold=None):
    """alpha/beta/gamma of the measured local network, or of a user link on top of our stack.
    With ``mpi`` (from ``fit_mpi``), buckets below the ring threshold are costed as
    MPI_Allreduce, as our allreduce sends them there: ``ring_threshold`` bytes, or None for
    mpitrain's default at each number of ranks (``CommSettings.ring_threshold``)."""
    gamma = fitted["gamma"] or 0.0
    if link is None:
        net = {"name": "local (measured)", "alpha": fitted["alpha"], "beta": fitted["beta"],
               "gamma": gamma}
    else:
        net = {"name": link["name"], "alpha": fitted["alpha"] + link["alpha"],
               "beta": max(link["beta"], fitted["beta"]), "gamma": gamma}
    net["ring_threshold"] = (None if ring_threshold is None else int(ring_threshold)) if mpi else 0
    if mpi:
        net["mpi_alpha"] = mpi["alpha"] + (link["alpha"] if link else 0.0)
        net["mpi_combined"] = max(mpi["combined"], 2 * link["beta"] + gamma if link else 0.0)
    return net


def allreduce_time(nb, ranks, net):
    """One allreduce of a bucket as our code runs it: the ring from the threshold up, else MPI."""
    if nb >= ring_threshold(net, ranks):
        return float(ring_time(nb, ranks, net["alpha"], net["beta"], net["gamma"]))
    return float(mpi_time(nb, ranks, net["mpi_alpha"], net["mpi_combined"]))


def ring_threshold(net, ranks):
    """The bytes from which ``net``'s allreduce between ``ranks`` ranks takes the ring."""
    threshold = net.get("ring_threshold", 0)
    return default_ring_threshold(ranks) if threshold is None else threshold


def default_ring_threshold(ranks):
    """mpitrain's own switch to the ring between ``ranks`` ranks (CommSettings.ring_threshold)."""
    return _default_settings().ring_threshold(ranks)


@functools.cache
def _default_settings():
    from mpitrain.comm.settings import CommSettings
    return CommSettings()
