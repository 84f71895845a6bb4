"""Which collectives a rank that has joined (``mt.join``, join.py) can take part in.

A joined rank has no data of its own left; it learns each collective the others start from their
description (check.py: ``(kind, fields, error)``) and runs it with a neutral contribution. This
file is the one list of what can be served that way, read by both sides -- the active ranks
(check.py, to raise the same CollectiveError on every one of them) and the joined ones (join.py,
to skip what is refused) -- so they always take the same decision from the same description.

Served, as in Horovod: reductions of host arrays (allreduce, grouped, reducescatter, the gradient
buckets and step check of DistributedOptimizer) with the op's identity (zeros for Sum and
Average, +inf / the largest integer for Min, ...), and the barrier.

Refused (a CollectiveError -- a RuntimeError -- on every active rank; the joined ranks go on
waiting): what has no neutral contribution. Horovod refuses allgather, alltoall and broadcast
while a rank has joined ("... is not supported with Join at this time"), and so do we, with the
object collectives; also process set changes, the timeline, the deterministic tree, and
reductions of device arrays, which move through the device's own transport (NCCL, CUDA-aware
MPI) that a joined rank holds no buffer for.
"""

# kinds whose agreement is the whole collective for a joined rank (no data moves after it, or
# it moves in a later, separately described collective)
CHECK_ONLY = frozenset(("DistributedOptimizer.step", "reducescatter (device)"))
# kinds a joined rank replays with a neutral contribution (join.py)
REPLAYED = frozenset(("allreduce", "grouped_allreduce", "allreduce buckets", "reducescatter",
                      "barrier"))


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
        return (f"{kind}: not supported while {who}, as in Horovod; call it before mt.join() "
                f"or after it returns")
    if fields.get("device"):
        return (f"{kind} of device arrays: not supported while {who} (a joined rank takes "
                f"part in host reductions only)")
    return None
