"""The MPI world as mpitrain sees it: one World object per communicator, made by init().

``init(comm, threads, settings)`` is idempotent and cheap after the first call; every collective
asks ``current()``, which initialises lazily, so ``mt.init()`` is a formality for scripts that
never pass a communicator. init agrees the settings (settings.py) across ranks, derives three
communicators and keeps them in the World, with every buffer and plan the layers above make
(see World); ``shutdown()`` drops the World, so nothing outlives it:

- ``comm`` (``comm()``) the user's communicator (COMM_WORLD by default): checks, objects, MPI paths;
- ``ring``          a private duplicate for the ring's point-to-point traffic, so its messages can
                    never match a receive posted by user code or by another collective;
- ``local`` (``local_comm()``) / ``cross``: ranks on the same host
                    (``Split_type(COMM_TYPE_SHARED)``) and ranks with the same local rank
                    across hosts.

``MPITRAIN_NODE_SIZE=k`` (alias ``MPITRAIN_LOCAL_SIZE``) emulates nodes of k consecutive ranks, so
tests on one machine can exercise the local/cross split (it must divide the world size).
"""
import dataclasses
import sys
import threading

from mpi4py import MPI

from mpitrain.runtime import threads as thread_budget
from mpitrain.comm import abort, check, handles, watchdog
from mpitrain.comm.settings import NODE_SIZE_NAMES, VARIABLES, CommSettings
from mpitrain.runtime import env

_state = None
_lock = threading.Lock()
_warned = False      # unknown MPITRAIN_* variables are reported once per process


class World:
    """Everything mpitrain keeps for one communicator; ``shutdown()`` drops it all at once.

    Communicators: ``comm`` (the user's), ``ring`` (a private duplicate for the ring's
    point-to-point messages), ``local`` / ``cross``; ``settings`` (CommSettings, agreed across
    ranks); ``agreement`` (check.Agreement: the cross-rank check's buffers); ``homogeneous``
    (every node runs ``local_size`` ranks). Owned by the layers
    above, created there on first use and dropped with this object: ``scratch`` (engine.py's
    ring scratch per dtype), ``plans`` (host.py's steady-state allreduces), ``fusion`` (the
    fusion buffer), ``device`` (device.py's GPU, transport, NCCL communicator, fusion buffer).
    Process sets (process_sets.py): ``set_id`` (0: the global set), ``members`` (the ranks as
    global ranks), ``record`` (the stall watchdog's Record of this communicator), and in the
    global World ``sets`` (id -> ProcessSet added on it, each with a World of its own) and
    ``next_set_id``.
    """

    def __init__(self, comm, settings, set_id=0, global_ranks=None):
        self.comm = comm
        self.set_id = set_id
        self.settings = settings
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        k = settings.local_size
        # a process set's emulated nodes are its members' global ones (consecutive global ranks)
        node_rank = self.rank if global_ranks is None else list(global_ranks)[self.rank]
        if k is not None and global_ranks is None and self.size % k:
            raise ValueError(f"{NODE_SIZE_NAMES}={k} must be >= 1 and divide the world size "
                             f"{self.size}")
        self.ring = comm.Dup()
        if k:
            self.local = comm.Split(node_rank // k, self.rank)
        else:
            self.local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        self.cross = comm.Split(self.local_rank, self.rank)
        self.cross_rank = self.cross.Get_rank()
        self.cross_size = self.cross.Get_size()
        # every node runs as many ranks as this one (build_info.is_homogeneous), agreed once
        self.homogeneous = len(set(comm.allgather(self.local_size))) == 1
        # hierarchical.py's private duplicates (local, cross), as ``ring`` is the ring's; None
        # = flat allreduce (not asked for, one level only, or nodes of different sizes)
        self.node_comms = None
        if settings.hierarchical and 1 < self.local_size < self.size:
            if self.homogeneous:
                self.node_comms = (self.local.Dup(), self.cross.Dup())
            elif self.rank == 0:
                print(f"mpitrain: MPITRAIN_HIERARCHICAL_ALLREDUCE=1 ignored, the allreduce stays "
                      f"flat: nodes run different numbers of ranks (rank 0's node: "
                      f"{self.local_size})", file=sys.stderr, flush=True)
        # the ranks as global ranks (root_rank= names those, as in Horovod)
        self.members = range(self.size) if global_ranks is None else list(global_ranks)
        self.record = watchdog.register(set_id, self.members)
        self.agreement = check.Agreement(comm, settings.check, self.record)
        self.scratch = {}
        self.plans = {}
        self.fusion = None
        self.device = {}
        self.sets = {}
        self.next_set_id = 1

    def free(self):
        watchdog.unregister(self.record)
        for c in (self.ring, self.local, self.cross) + (self.node_comms or ()):
            if c != MPI.COMM_NULL:
                c.Free()


def init(comm=None, threads=0, settings=None, abort_on_exception=True):
    """Initialise mpitrain on ``comm`` (default ``MPI.COMM_WORLD``); idempotent.

    Calling it again with a different communicator is an error: collectives in flight would
    otherwise silently change groups. Call ``shutdown()`` first.

    threads: this rank's BLAS thread budget, set when mpitrain initialises (threads.py): 0 =
    ``MPITRAIN_THREADS`` if set, else cores / ranks on this node (what ``python -m mpitrain``
    uses); n >= 1 = n threads; None = leave the thread pools as they are.
    settings: a CommSettings (settings.py) instead of the MPITRAIN_* environment; either way
    every rank must have the same (else CollectiveError on every rank).
    abort_on_exception: install the abort hook (abort.py), so that an uncaught exception on one
    rank ends the whole job with that rank's traceback instead of leaving the others waiting in
    their next collective for ever. False leaves ``sys.excepthook`` as it is (a hook installed
    earlier stays).

    The first initialisation also warns, on rank 0, about ``MPITRAIN_*`` variables that no part
    of mpitrain reads (a misspelled name), with the closest known name (runtime/env.py).
    """
    global _state, _warned
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 0):
        raise ValueError(f"init(threads={threads!r}): expected an integer >= 0 or None")
    if settings is not None and not isinstance(settings, CommSettings):
        raise ValueError(f"init(settings=...) needs a CommSettings, got {settings!r}")
    with _lock:
        if _state is not None:
            if comm is not None and comm is not _state.comm:
                raise RuntimeError("mpitrain already initialised with another communicator; "
                                   "call mt.shutdown() first")
            return
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise ValueError(f"init(comm=...) needs an mpi4py communicator, got {comm!r}")
        # a rank that never gets here (not started, stopped) must not hang the others in
        # these collectives: a timer of this rank's own stall settings watches them
        limits = _startup_limits(settings) if comm.Get_size() > 1 else (0, 0)
        with watchdog.startup("mt.init", *limits, rank=comm.Get_rank()):
            state = World(comm, _agreed_settings(comm, settings))
            try:
                if threads is not None:
                    thread_budget.configure(threads or thread_budget.from_env(),
                                            state.local_size)
                watchdog.start(comm, state.settings.stall_warning_s,
                               state.settings.stall_shutdown_s)
            except Exception:
                state.free()
                raise
        _state = state
    if abort_on_exception:
        abort.install_abort_hook()
    if not _warned and _state.rank == 0:
        _warned = True
        for line in env.unknown():
            print(line, file=sys.stderr, flush=True)


def _startup_limits(settings):
    """(warning, shutdown) seconds of this rank's stall settings, before they are agreed: a bad
    value is the agreement's to report, the defaults watch meanwhile."""
    try:
        mine = CommSettings.from_env() if settings is None else settings
    except ValueError:
        mine = CommSettings()
    return mine.stall_warning_s, mine.stall_shutdown_s


def _agreed_settings(comm, settings):
    """The settings every rank has: compared before they are used (one pickled allgather,
    whatever MPITRAIN_CHECK says), then parsed -- a bad value is the same ValueError on every
    rank, a difference a CollectiveError on every rank."""
    if settings is None:             # the raw variables: a bad value must not hide a difference
        mine = env.snapshot(VARIABLES)
    else:
        mine = dataclasses.asdict(settings)
    every = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    differ = [f"{key} differs across ranks: "
              f"{check.format_groups(check.group(enumerate(e[key] for e in every)))}"
              for key in mine if len({repr(e[key]) for e in every}) > 1]
    if differ:
        raise check.CollectiveError("mt.init: " + "; ".join(differ))
    return CommSettings.from_env() if settings is None else settings


def shutdown():
    """Drop mpitrain's state for its communicator: collectives in flight are waited for, then
    process sets, derived communicators, buffers, plans, device transport and the watchdog go
    (MPI itself is finalised by mpi4py at exit)."""
    global _state
    with _lock:
        if _state is not None:
            handles.drain()
            watchdog.depart()            # a rank still waiting for this one ends the job
            for process_set in list(_state.sets.values()):
                process_set.drop()
            _state.sets.clear()
            watchdog.stop()
            _state.free()
            _state = None


def is_initialized():
    return _state is not None


def current():
    """This process's World (initialised on first use, so mt.init() is optional)."""
    state = _state
    if state is None:
        init()
        state = _state
    return state


def comm():
    """The user-facing communicator (COMM_WORLD unless ``init(comm)`` said otherwise)."""
    return current().comm


def local_comm():
    return current().local


def rank():
    return current().rank


def size():
    return current().size


def local_rank():
    return current().local_rank


def local_size():
    return current().local_size


def cross_rank():
    return current().cross_rank


def cross_size():
    return current().cross_size
