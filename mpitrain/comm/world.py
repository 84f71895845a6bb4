"""The MPI world as mpitrain sees it: one communicator, its rank/size, local and cross groups.

``init(comm)`` is idempotent and cheap after the first call; every collective calls ``comm()``,
which initialises lazily, so ``mt.init()`` is a formality for scripts that never pass a
communicator. Three communicators are derived once and kept:

- ``comm()``        the user's communicator (COMM_WORLD by default): checks, objects, MPI paths;
- ``ring_comm()``   a private duplicate for the ring's point-to-point traffic, so its messages can
                    never match a receive posted by user code or by another collective;
- ``local_comm()`` / ``cross_comm()``: ranks on the same host (``Split_type(COMM_TYPE_SHARED)``)
                    and ranks with the same local rank across hosts.

``MPITRAIN_LOCAL_SIZE=k`` fakes hosts of k consecutive ranks, so tests on one machine can exercise
the local/cross split (it must divide the world size).

``install_abort_hook()``: an uncaught Python exception on one rank otherwise leaves every other
rank blocked in its next collective for ever (Python's normal exit path waits in MPI_Finalize).
The hook prints the traceback tagged with the rank and calls ``MPI.COMM_WORLD.Abort(1)``, which
tears the whole job down with a non-zero exit.
"""
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from mpitrain import threads as thread_budget
from mpitrain.comm import watchdog

_state = None
_lock = threading.Lock()


class _World:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        forced = os.environ.get("MPITRAIN_LOCAL_SIZE")
        k = _parse_local_size(forced, self.size) if forced else None
        self.ring = comm.Dup()
        if k:
            self.local = comm.Split(self.rank // k, self.rank)
        else:
            self.local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        self.cross = comm.Split(self.local_rank, self.rank)
        self.cross_rank = self.cross.Get_rank()
        self.cross_size = self.cross.Get_size()

    def free(self):
        for c in (self.ring, self.local, self.cross):
            if c != MPI.COMM_NULL:
                c.Free()


def _parse_local_size(text, size):
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"MPITRAIN_LOCAL_SIZE={text!r} is not an integer") from None
    if k < 1 or size % k:
        raise ValueError(f"MPITRAIN_LOCAL_SIZE={k} must be >= 1 and divide the world size {size}")
    return k


def init(comm=None, threads=0):
    """Initialise mpitrain on ``comm`` (default ``MPI.COMM_WORLD``); idempotent.

    Calling it again with a different communicator is an error: collectives in flight would
    otherwise silently change groups. Call ``shutdown()`` first.

    threads: this rank's BLAS thread budget, set when mpitrain initialises (threads.py): 0 =
    ``MPITRAIN_THREADS`` if set, else cores / ranks on this node (what ``python -m mpitrain``
    uses); n >= 1 = n threads; None = leave the thread pools as they are.
    """
    global _state
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 0):
        raise ValueError(f"init(threads={threads!r}): expected an integer >= 0 or None")
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
        state = _World(comm)
        try:
            from mpitrain.comm import collectives       # imports this module: import here
            collectives.configure(comm)                 # env settings, agreed across ranks
            if threads is not None:
                thread_budget.configure(threads or thread_budget.from_env(), state.local_size)
            watchdog.start(comm)                        # stall reports (watchdog.py)
        except Exception:
            state.free()
            raise
        _state = state


def shutdown():
    """Free mpitrain's derived communicators (MPI itself is finalised by mpi4py at exit)."""
    global _state
    with _lock:
        if _state is not None:
            watchdog.stop()
            _state.free()
            _state = None
    from mpitrain.comm import collectives
    collectives._reset()


def is_initialized():
    return _state is not None


def _world():
    if _state is None:
        init()
    return _state


def comm():
    """The user-facing communicator (COMM_WORLD unless ``init(comm)`` said otherwise)."""
    return _world().comm


def ring_comm():
    """Private duplicate used only by the ring's point-to-point messages."""
    return _world().ring


def local_comm():
    return _world().local


def cross_comm():
    return _world().cross


def rank():
    return _world().rank


def size():
    return _world().size


def local_rank():
    return _world().local_rank


def local_size():
    return _world().local_size


def cross_rank():
    return _world().cross_rank


def cross_size():
    return _world().cross_size


ABORT_GRACE_S = 0.5


def abort(message):
    """Print ``message`` on stderr and end the whole MPI job (exit code 1 from the launcher).

    The pause lets the launcher forward the message first: Abort tears every process down at
    once, and a loaded machine otherwise loses the one line that says why (seen with mpich's
    hydra: the job ended non-zero with empty output).
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)


def install_abort_hook():
    """Make an uncaught exception on any rank abort the whole MPI job instead of hanging it."""
    if getattr(sys.excepthook, "_mpitrain_abort", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if MPI.COMM_WORLD.Get_size() == 1:
            return previous(exc_type, exc, tb)
        r = MPI.COMM_WORLD.Get_rank()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort(f"[rank {r}] uncaught exception, aborting the MPI job:\n{text}")

    def thread_hook(args):
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    hook._mpitrain_abort = True
    sys.excepthook = hook
    threading.excepthook = thread_hook
