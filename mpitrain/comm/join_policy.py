"""Which collectives a rank that has joined (``mt.join``, join.py) can take part in.

A joined rank has no data of its own left; it learns each collective the others start from their
description (check.py: ``(kind, fields, error)``) and runs it with a neutral contribution. This
file is the one list of what can be served that way, read by both sides -- the active ranks
(check.py, to raise the same CollectiveError on every one of them) and the joined ones (join.py,
to skip what is refused) -- so they always take the same decision from the same description.

- reductions on host arrays (allreduce, grouped, reducescatter, the gradient buckets of
  DistributedOptimizer): the op's identity (zeros for Sum and Average, +inf / the largest
  integer for Min, ...);
- allgather and alltoall: no rows;
- broadcast and broadcast_object: received and dropped, unless the root itself has joined;
- barrier, and agreements that move no data (a gradient plan's check, the step count check,
  the argument checks that come before a device one-off staged through the host).

Refused (a CollectiveError on every active rank; the joined ranks go on waiting): anything
else -- the object gather (``allgather_object`` has no neutral object), process set changes,
the timeline, and reductions of device arrays, which move through the device's own transport
(NCCL, CUDA-aware MPI) that a joined rank does not hold a buffer for.
"""

# kinds whose agreement is the whole collective for a joined rank (no data moves after it,
# or the data moves in a later, separately described collective)
CHECK_ONLY = frozenset(("DistributedOptimizer.step", "allgather (device)", "broadcast (device)",
                        "broadcast_ (device)", "reducescatter (device)", "alltoall (device)"))
# kinds a joined rank replays with a neutral contribution (join.py)
REPLAYED = frozenset(("allreduce", "grouped_allreduce", "allreduce buckets", "allgather",
                      "broadcast", "reducescatter", "alltoall", "barrier", "broadcast_object"))


def check_only(desc):
    """True when a joined rank takes part in ``desc`` by its agreement alone: a kind that moves
    no data, the plan check of overlapped gradient buckets (their steps are described
    separately, overlap.py), or a description with an error (every rank raises it there)."""
    kind, fields, error = desc
    return (error is not None or kind in CHECK_ONLY
            or (kind == "grouped_allreduce" and bool(fields.get("overlap"))))


def refusal(desc, joined):
    """Why the collective ``desc`` cannot run while the ranks ``joined`` (communicator ranks)
    have joined, or None when they can take part."""
    kind, fields, _ = desc
    who = f"rank{'s' if len(joined) > 1 else ''} {list(joined)} joined (mt.join)"
    if kind not in CHECK_ONLY and kind not in REPLAYED:
        return f"{kind}: cannot run while {who}; call it before mt.join() or after it returns"
    if fields.get("device"):
        return (f"{kind} of device arrays: cannot run while {who} (a joined rank takes part "
                f"in host collectives only)")
    if kind in ("broadcast", "broadcast_object") and fields.get("root_rank") in joined:
        return f"{kind}: the root rank has joined ({who}); it has nothing to send"
    return None
