"""Process sets (Horovod's): collectives among a subset of the ranks, each set its own World.

    ps = mt.add_process_set([0, 2])       # every rank calls it, with the same list
    if ps.included():
        y = mt.allreduce(x, process_set=ps)     # ranks 0 and 2 only
    mt.remove_process_set(ps)             # every rank again

A set is the ranks of the global communicator (the one ``mt.init`` was given) it names, sorted.
``add_process_set`` is a collective over the global set: the list is agreed first (check.py:
ranks that pass different lists all raise CollectiveError, a bad list is the same ValueError on
every rank), then the members split off a communicator and build a World on it (world.py): its
own agreement, ring duplicate, local/cross communicators, scratch, plans, fusion buffer, device
transport and stall-watchdog Record. Nothing below collectives.py knows about sets: they act on
the World they are handed, and ``world_of`` is the one place that turns ``process_set=`` into
one -- or into the ValueError naming the set for a rank outside it.

Ids count up from 1 on the global World, identically on every rank (adds are collective), and
are never reused while it lives; ``mt.shutdown()`` drops every set with it, so a set object
kept across a shutdown is refused instead of naming some later set. ``global_process_set`` is
the set of all ranks of whatever communicator is initialised (id 0; its World is the global
one). As in Horovod: ranks are sorted, adding a set whose ranks equal an existing added set's
is a ValueError, and ``remove_process_set`` returns False for the global set. A set may have no
ranks (Horovod's ``add_process_set([])``, e.g. the odd ranks of one process): it is added and
removed as any other, no rank is ever in it (``included()`` False, ``size()`` 0), and a
collective on it is the calling rank's ValueError, as for any rank outside a set.
"""
import numpy as np
from mpi4py import MPI

from mpitrain.comm import handles, world
from mpitrain.comm.kinds import Kind
from mpitrain.comm.watchdog import watched
from mpitrain.comm.world import World


class ProcessSet:
    """A set of ranks that runs collectives together (``process_set=`` of every collective).

    ranks: global ranks, sorted; ``process_set_id``: None until added (and after removal).
    """

    def __init__(self, ranks):
        self.process_set_id = None
        self._ranks = None if ranks is None else sorted(ranks)
        self._world = None           # this rank's World of the set (None: not a member)
        self._owner = None           # the global World the set was added on

    @property
    def ranks(self):
        """The members as ranks of the global communicator (sorted)."""
        if self is global_process_set:
            return list(range(world.size()))
        return None if self._ranks is None else list(self._ranks)

    def size(self):
        """Number of ranks in the set (None before it is added)."""
        ranks = self.ranks
        return None if ranks is None else len(ranks)

    def rank(self):
        """This process's rank within the set; -1 outside it; None before it is added."""
        if self is global_process_set:
            return world.rank()
        if self.process_set_id is None:
            return None
        return self._world.rank if self._world is not None else -1

    def included(self):
        """Whether this process belongs to the set (None before it is added)."""
        if self is global_process_set:
            return True
        return None if self.process_set_id is None else self._world is not None

    def drop(self):
        """Free this rank's World and communicator of the set; the object is invalid after
        (world.shutdown calls it for every set; remove_process_set for one)."""
        state, self._world, self._owner = self._world, None, None
        self.process_set_id = None
        if state is not None:
            comm = state.comm
            state.free()
            if not MPI.Is_finalized():
                comm.Free()

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0


def world_of(process_set, kind):
    """The World a collective ``kind`` acts on for ``process_set``; ValueError, naming the set,
    when this rank is not in it (or the set was removed, or is no ProcessSet)."""
    if process_set is global_process_set:
        return world.current()
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{kind}: process_set={process_set!r} is not a ProcessSet "
                         f"(mt.add_process_set returns one)")
    state = process_set._world
    if state is None:
        if process_set.process_set_id is None:      # drop() clears it: removed or shut down
            raise ValueError(f"{kind}: {process_set!r} is not added (removed, never added, or "
                             f"dropped by mt.shutdown)")
        raise ValueError(f"{kind}: rank {world.rank()} is not in {process_set!r}")
    return state


def add_process_set(process_set):
    """Add a set of ranks (a list of global ranks or a ProcessSet); returns the ProcessSet.

    Collective over the global set: every rank calls it with the same ranks (else
    CollectiveError on every rank). Ranks must be distinct integers in [0, size); the list may
    be empty (a set no rank is in).
    """
    return handles.ordered(_add, process_set)


def _add(process_set):
    owner = world.current()
    ps = process_set if isinstance(process_set, ProcessSet) else None
    ranks, error = _as_ranks(ps.ranks if ps is not None else process_set, owner.size)
    if error is None and ps is not None and ps.process_set_id is not None:
        error = f"add_process_set: {ps!r} is already added"
    if error is None and ranks is not None:
        if any(s.ranks == ranks for s in owner.sets.values()):
            error = f"add_process_set: a process set with ranks {ranks} already exists"
    owner.agreement(Kind.ADD_PROCESS_SET, {"ranks": None if error else tuple(ranks)}, error)
    ps = ps if ps is not None else ProcessSet(ranks)
    set_id = owner.next_set_id
    owner.next_set_id += 1
    member = owner.rank in ranks
    with watched(owner.record, "add_process_set data"):
        comm = owner.comm.Split(0 if member else MPI.UNDEFINED, owner.rank)
        if member:
            ps._world = World(comm, owner.settings, set_id, ranks)
    ps._ranks = ranks
    ps._owner = owner
    ps.process_set_id = set_id
    owner.sets[set_id] = ps
    return ps


def _as_ranks(ranks, size):
    """(sorted list of ints, error or None)."""
    try:
        values = list(ranks)
    except TypeError:
        return None, f"add_process_set: expected a list of ranks, got {type(ranks).__name__}"
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in values):
        return None, f"add_process_set: expected a list of integer ranks, got {values}"
    values = sorted(int(r) for r in values)
    if values and (len(set(values)) != len(values) or values[0] < 0 or values[-1] >= size):
        return None, (f"add_process_set: ranks {values} must be distinct and in [0, {size}) "
                      f"(the global set's ranks)")
    return values, None


def remove_process_set(process_set):
    """Remove an added set (collective over the global set); True if it was removed, False for
    the global set or a set that is not added. Its collectives still in flight finish first."""
    return handles.ordered(_remove, process_set)


def _remove(process_set):
    owner = world.current()
    set_id = None
    if (isinstance(process_set, ProcessSet) and process_set is not global_process_set
            and process_set._owner is owner and owner.sets.get(process_set.process_set_id)
            is process_set):
        set_id = process_set.process_set_id
    owner.agreement(Kind.REMOVE_PROCESS_SET, {"process_set_id": set_id})
    if set_id is None:
        return False
    del owner.sets[set_id]
    process_set.drop()
    return True


def process_sets():
    """The sets added on the current global World, by id, the global set first."""
    owner = world.current()
    return [global_process_set] + [owner.sets[i] for i in sorted(owner.sets)]
