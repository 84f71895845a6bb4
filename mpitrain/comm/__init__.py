"""Collectives over MPI. mpitrain/__init__.py exports the public names (its ``__all__``: the one
list); docs/architecture.md draws the layers.

Bottom to top (each module imports only those before it): abort, watchdog, settings,
kinds (every collective kind, with what a rank that has joined does: no imports), check,
handles (the comm thread of non-blocking collectives), world (init/shutdown and the
per-communicator World), process_sets, build_info (what can run here), ops, ring, tree,
hierarchical, buckets, fusion, engine, host, overlap, device, collectives (the public API: host
or device, chosen in one place), join (a rank out of data serving the others).
"""


# What the layer above (mpitrain/parallel) needs beyond the collectives: the cross-rank agreement
# of a step, the fixed-tree sum and the bucketed allreduce that overlaps backward. Imported
# lazily, so that importing any comm module stays as cheap as it was.

def agree(process_set, kind, fields, error=None, ordered=False, who="DistributedOptimizer"):
    """Check that every rank of ``process_set`` calls ``kind`` with the same ``fields`` (dict),
    raising on every rank: CollectiveError on a difference, ValueError when a rank has an
    ``error``. ``ordered``: behind whatever collectives are in flight (on the comm thread).
    ``who`` names the caller when this rank is not in ``process_set`` (ValueError)."""
    from mpitrain.comm import handles
    from mpitrain.comm.process_sets import world_of
    agreement = world_of(process_set, who).agreement
    if ordered:
        return handles.ordered(agreement, kind, fields, error)
    return agreement(kind, fields, error=error)


def group_size(process_set, who="DistributedOptimizer"):
    """The number of ranks in ``process_set`` (ValueError, naming ``who``, from outside it)."""
    from mpitrain.comm.process_sets import world_of
    return world_of(process_set, who).size


def tree_allreduce_(array, add, scratch, process_set, who="DistributedOptimizer"):
    """Sum the contiguous 1-D host ``array`` in place over ``process_set`` in the fixed binary
    tree (comm/tree.py): the same additions in the same order for any power-of-two size."""
    from mpitrain.comm.process_sets import world_of
    from mpitrain.comm.tree import tree_allreduce
    tree_allreduce(world_of(process_set, who).ring, array, add, scratch)


def bucket_allreduce(process_set, layout, threshold_bytes, op, prescale, postscale, name,
                     wire_dtypes=None, who="DistributedOptimizer"):
    """A comm/overlap.py BucketAllreduce over ``process_set``: ``layout`` [(shape, dtype)] in
    submission order, fused into buckets of ``threshold_bytes``, each allreduced (``op``,
    ``prescale``, ``postscale``) on the comm thread as soon as its arrays are ready."""
    from mpitrain.comm.engine import allreduce_flat
    from mpitrain.comm.overlap import BucketAllreduce
    from mpitrain.comm.process_sets import world_of
    state = world_of(process_set, who)
    return BucketAllreduce(
        layout, threshold_bytes, lambda flat: allreduce_flat(state, flat, op, prescale, postscale),
        {"name": name, "op": op.value, "prescale_factor": prescale, "postscale_factor": postscale},
        wire_dtypes=wire_dtypes, state=state)
