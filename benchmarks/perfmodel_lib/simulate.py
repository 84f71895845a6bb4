"""Predicted step time: compute, plus the buckets' allreduces after backward (fusion plan) or
overlapped with it on one comm thread; projections to N ranks, validation against a sweep."""
import numpy as np

from .network import allreduce_time
from .plans import OverlapPlan


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
    """Predicted seconds per step and the communication part of it (see the package docstring).
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


def calibrate(points, plans, net, mu, cores):
    """Compute-time records taken from the sweep itself: each model's N=1 measured step minus
    the predicted N=1 communication (packing). Validation is then of the communication model
    only, on N >= 2, but is immune to the machine being slower during the sweep than during the
    step benchmark (shared machines). Points of models without a plan (not asked for) are
    skipped, as ``validate`` skips them."""
    out = {}
    for p in points:
        if int(p["ranks"]) == 1 and p["model"] in plans:
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
