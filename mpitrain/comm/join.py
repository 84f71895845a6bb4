"""``mt.join()``: a rank out of data takes part in the others' collectives until all have joined.

With uneven data one rank runs out of batches while the others still have some; their next
allreduce would wait for it for ever. A rank that calls ``join()`` instead keeps serving: every
collective starts with the agreement exchange (check.py), in which a joined rank sends JOINED
instead of a fingerprint. The active ranks then broadcast their description of the collective,
and every joined rank runs the same collective with a neutral contribution::

    active ranks   allreduce(x)  ------------------------------------------->  result
                   exchange: [h, JOINED, h]  bcast desc  exchange: [h, h, h]  reduce
    joined rank 1  join(): JOINED round  <- desc  replay allreduce(zeros) ---^  (dropped)

Neutral means the op's identity (zeros for Sum and Average, +inf / the largest integer for
Min, -inf / the smallest for Max, ones for Product). kinds.py says what can be served:
the reductions and the barrier. The rest -- allgather, alltoall and broadcast, as in Horovod,
the object collectives, process set changes, device-array reductions -- is a CollectiveError
(a RuntimeError) on every active rank, and the joined ranks keep waiting. ``join()`` returns,
on every rank, once every rank has joined; its value is the rank that joined last (the highest
of those that joined in the same exchange) -- the one whose model saw the most data, to
broadcast from (Horovod's idiom).

Average while ranks are joined divides by the whole set's size, joined ranks included (their
zeros count): PyTorch's Join default (``divide_by_initial_world_size=True``) and what keeps an
average of per-rank means equal to the mean over samples when each rank scales its gradient by
``size * local_samples / global_samples`` (the trainer's --uneven does). Tested against a
single-process reference in tests/mpi/test_join.py.

A joined rank updates nothing of its own: the gradients it helps to average are applied by the
active ranks' optimizers only -- except a sharded optimizer's share (``optimizers=``): its
parameters and optimizer state live on this rank alone, so the joined rank serves that
optimizer's collectives through its join hook (PyTorch's ``Joinable.join_hook``): it receives
its chunk of each averaged gradient, sends its true part of the clipping norm, steps its share
and sends it to the others' allgathers (``allgather_shares``), so the active ranks' step is
the one they would take with this rank's data all zeros. After ``join()`` returns, broadcast
the parameters and the optimizer state from the returned rank (``python -m mpitrain --uneven``
does; a sharded optimizer's ranks hold one model already) so the replicas agree again. The join acts on one process set (default: every rank); collectives on other
sets that contain a joined rank are not served (the stall watchdog names it). Needs the
cross-rank check (``MPITRAIN_CHECK=1``, the default): without the exchange there is nothing to
learn a collective from.
"""
import numpy as np

from mpitrain.comm import handles, host, kinds, overlap
from mpitrain.comm.check import JOINED
from mpitrain.comm.engine import allreduce_flat, reduce_scatter_flat
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import Average, Max, Min, Product, Sum, as_op
from mpitrain.comm.process_sets import global_process_set, world_of
from mpitrain.kernels.cpu import bfloat16


def join(device=-1, process_set=global_process_set, optimizers=()):
    """Serve the other ranks' reductions with neutral contributions until every rank of
    ``process_set`` has called ``join()``; returns the (global) rank that joined last.

    device: Horovod's GPU for the join's own tensor (``hvd.join(hvd.local_rank())``); accepted
    for ported scripts and unused: this join moves no data of its own.
    optimizers: the sharded DistributedOptimizers the other ranks go on stepping (any other is
    accepted and needs nothing): this rank serves their steps with its share (see above).

    A join hook (``optimizer.join_hook()``, or None) has ``serve(kind, fields, run)``: given
    each collective the active ranks start (its Kind and description), it returns True when it
    served it itself, through ``run(contribution)`` (the collective with that contribution --
    None: the neutral one -- returning its result; None for kinds that only agree), and False to
    leave it to the replay; and ``joined_all()``, called when every rank has joined."""
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise ValueError(f"join: device={device!r} is not an integer (Horovod's GPU index; "
                         f"pass process_set= by keyword)")
    hooks = []
    for opt in optimizers:
        if not callable(getattr(opt, "join_hook", None)):
            raise ValueError(f"join: optimizers= takes DistributedOptimizers, not {opt!r}")
        hook = opt.join_hook()
        if hook is not None:
            hooks.append(hook)
    state = world_of(process_set, Kind.JOIN)
    return handles.ordered(_join, state, hooks)  # after this rank's own collectives in flight


def _join(state, hooks=()):
    agreement = state.agreement
    if state.size == 1:
        return state.members[0]
    if not agreement.enabled:
        raise ValueError("mt.join needs the cross-rank check, which MPITRAIN_CHECK=0 turns off "
                         "(a joined rank learns each collective from it)")
    joined_at = agreement.rounds
    while True:
        fingerprints, rounds = agreement.joined_round(joined_at)
        active = [r for r, f in enumerate(fingerprints) if f != JOINED]
        if not active:
            for hook in hooks:
                hook.joined_all()
            last = max(range(state.size), key=lambda r: (int(rounds[r]), r))
            return state.members[last]
        if len({fingerprints[r] for r in active}) > 1:
            state.comm.allgather(None)       # the active ranks' mismatch report (check.py)
            continue
        desc = state.comm.bcast(None, root=active[0])
        joined = [r for r, f in enumerate(fingerprints) if f == JOINED]
        if kinds.refusal(desc, joined) is None:
            _serve(state, desc, hooks)


def _serve(state, desc, hooks=()):
    """Run the collective ``desc`` describes: through a hook that serves it, else with a
    neutral contribution, the result dropped."""
    kind, fields, error = desc
    kind = kinds.as_kind(kind)
    if error is None:
        run = None if kinds.check_only(desc) else RUNS.get(kind)
        for hook in hooks:
            if hook.serve(kind, fields, None if run is None else
                          (lambda contribution=None: run(state, fields, contribution))):
                return
    if kinds.check_only(desc):
        # the agreement is all there is (with an error, every rank raises it there); its
        # payload from this rank is zeros: no flags, no parameters' digest, no gradients
        state.agreement.send_payload[:] = 0
        try:
            state.agreement(kind, fields, error)
        except ValueError:
            pass
        return
    REPLAYS[kind](state, fields)


def _neutral(shape, dtype, op):
    """An array of the identity of ``op``: what a rank without data contributes."""
    dtype = np.dtype(dtype)
    if op in (Sum, Average):
        return np.zeros(shape, dtype)                       # bfloat16's zero bits too
    if dtype.kind == "V":                                    # bfloat16 bits (ops.WIRE_ONLY)
        return bfloat16.encode(_neutral(shape, np.float32, op))
    if op is Product:
        return np.ones(shape, dtype)
    floats = dtype.kind == "f"
    if op is Min:
        return np.full(shape, np.inf if floats else np.iinfo(dtype).max, dtype)
    assert op is Max, op
    return np.full(shape, -np.inf if floats else np.iinfo(dtype).min, dtype)


def _reduction(collective):
    """The replay of a one-array reduction (host.allreduce_, host.reducescatter)."""
    return lambda state, f, mine=None: collective(
        state, _neutral(f["shape"], f["dtype"], f["op"]) if mine is None else mine, f["op"],
        f["name"], f["prescale_factor"], f["postscale_factor"])


def _grouped(state, f, mine=None):
    arrays = [_neutral(shape, dtype, f["op"]) for shape, dtype in f["arrays"]]
    host.grouped_allreduce_(state, arrays, f["op"], f["name"], f["prescale_factor"],
                            f["postscale_factor"], f["threshold_bytes"])
    return arrays


def _buckets(state, f, mine=None):
    """One step of DistributedOptimizer's overlapped buckets (overlap.py), every bucket zeros:
    allreduced, or reduce-scattered (sharded gradients: the joined rank's chunk is its part of
    the result). Returns the buckets' flat arrays (bucket i: overlap.plan's i-th). A bucket
    agreed alone (``agree_each``; ``f["index"]``) is that bucket's flat array alone."""
    each = f.get("agree_each", False)
    state.agreement(Kind.ALLREDUCE_BUCKET if each else Kind.ALLREDUCE_BUCKETS, f)
    op, _ = as_op(f["op"], Kind.ALLREDUCE_BUCKETS)          # described by its value ("average")
    reduce = reduce_scatter_flat if f.get("scatter") else allreduce_flat
    buckets = overlap.plan(f["arrays"], f["wire"], f["threshold_bytes"], f.get("arrival", True))
    flats = []
    for index, bucket in enumerate(buckets):
        if each and index != f["index"]:
            continue
        with overlap.watched(state, index):
            flats.append(reduce(state, np.zeros(bucket.total, bucket.dtype), op,
                                f["prescale_factor"], f["postscale_factor"]))
    return flats[0] if each else flats


# what a join hook's ``run(contribution)`` runs: the collective, with this rank's contribution
# (None: the neutral one), returning its result
RUNS = {
    Kind.ALLREDUCE: _reduction(host.allreduce_),
    Kind.GROUPED_ALLREDUCE: _grouped,
    Kind.ALLREDUCE_BUCKETS: _buckets,
    Kind.ALLREDUCE_BUCKET: _buckets,
    Kind.ALLGATHER_SHARES: lambda state, f, mine: host.allgather_shares(state, mine, f["name"]),
}

def _unserved_shares(state, f):
    """A sharded optimizer's allgather with no hook for it: its share is this rank's alone, so
    every rank raises (the agreement carries the error)."""
    state.agreement(Kind.ALLGATHER_SHARES, f, f"{f.get('name')}: a rank joined (mt.join) while "
                                              f"its sharded optimizer still steps; pass it to "
                                              f"mt.join(optimizers=[...]) on the joining rank")


REPLAYS = {     # every kind a description can carry whose joined behaviour is Joined.REPLAY
    Kind.ALLREDUCE: _reduction(host.allreduce_),
    Kind.GROUPED_ALLREDUCE: _grouped,
    Kind.ALLREDUCE_BUCKETS: _buckets,
    Kind.ALLREDUCE_BUCKET: _buckets,
    Kind.REDUCESCATTER: _reduction(host.reducescatter),
    Kind.ALLGATHER_SHARES: _unserved_shares,
    Kind.BARRIER: lambda state, f: host.barrier(state),
}
