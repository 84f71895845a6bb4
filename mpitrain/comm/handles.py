"""Non-blocking collectives: one ordered communication thread per process, handles, poll, wait.

``mt.allreduce_async(x)`` and its siblings (collectives.py) hand the blocking collective, bound
to its arguments and its World, to ONE communication thread per process and return a ``Handle``
at once; the thread runs what it is given one at a time, in submission order, while the caller
computes (MPI calls, BLAS and our Numba kernels release the GIL). ``poll(h)`` says whether it is
done without blocking; ``synchronize(h)`` waits and returns what the blocking call returns (or
raises what it raised).

Why a thread and not MPI's non-blocking requests: every collective starts with its World's
agreement (check.py) and our ring is a sequence of point-to-point steps -- neither is one MPI
request. The thread runs the very code of the blocking call, so the results are the same bits
and every check is unchanged. One thread for the whole process, not one per process set, gives
one order for every communicator: ranks that submit in the same order make the same MPI calls in
the same order, which is what MPI needs, and overlapping sets cannot deadlock each other.

Rules (docs/architecture.md, "Non-blocking collectives"):
- Ranks submit in the same order, as for blocking calls. A different order or mismatched
  arguments meet in the agreement of the collective the thread runs: a CollectiveError on every
  rank, raised by ``synchronize`` of that handle, before any data moves -- never a hang.
- An exception inside a pending collective is kept in its handle and raised by ``synchronize``
  (on every rank: argument errors travel through the agreement). The collectives after it
  still run: every rank saw the same error, so they stay in step.
- Inputs belong to the collective until ``synchronize`` returns (as in Horovod): do not write
  them meanwhile. In-place results appear in the input array.
- A blocking collective called while anything is in flight queues behind it on the same thread
  (``ordered``), so blocking and non-blocking calls never interleave. With nothing in flight it
  runs on the caller's thread: the hop to the thread and back would cost more than a whole small
  allreduce (docs/benchmarks.md, "Async").
- overlap.py's gradient buckets run on the same thread, hence in the same order.
- A name given to a non-blocking call belongs to it until it finishes: a second call with the
  same name meanwhile is a ValueError at the call, on the rank that makes it (Horovod's rule;
  names are how its users tell their collectives apart). Ranks making the same calls all raise.
- Below ``MPI_THREAD_SERIALIZED`` no second thread may call MPI: collectives then run at
  submission on the caller's thread and the handle is complete at once (same results, no
  overlap). mpi4py asks for MULTIPLE; the mpich wheel grants it.
"""
import concurrent.futures
import threading

from mpi4py import MPI

from mpitrain.comm.kinds import Kind, as_kind
from mpitrain.timeline import current as current_timeline

_executor = None
_lock = threading.Lock()
_submitted = 0            # collectives handed to the thread (under _lock)
_finished = 0             # collectives the thread has finished (written by the thread only)
_names = set()            # the names of the submitted collectives not finished yet (under _lock)


class Handle:
    """A collective in flight: pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("future", "kind")

    def __init__(self, future, kind):
        self.future = future
        self.kind = kind          # a Kind (kinds.py), or None: a blocking call queued in order

    def __repr__(self):
        kind = "collective" if self.kind is None else self.kind
        return f"<mpitrain handle: {kind}, {'done' if self.future.done() else 'pending'}>"


def comm_thread_available():
    """True when MPI allows a second thread to make the calls (SERIALIZED or better)."""
    return MPI.Query_thread() >= MPI.THREAD_SERIALIZED


def _thread():
    """The process's single communication thread (started on first use)."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mpitrain-comm")
    return _executor


def on_comm_thread():
    return threading.current_thread().name.startswith("mpitrain-comm")


def submit(fn, *args, kind=None, span=None, name=None):
    """Run ``fn(*args)`` on the comm thread after everything submitted before; a Handle.

    kind: the collective's Kind (kinds.py) or its exact name, None for a blocking call queued
    in order; another name raises ValueError. span: (name, args dict) of the timeline span
    recording it on the "comm" track, or None. name: the user's name for the collective, or
    None; a name still in flight is a ValueError (nothing is submitted).
    """
    global _submitted
    if kind is not None and kind.__class__ is not Kind:
        kind = as_kind(kind)
    if on_comm_thread() or not comm_thread_available():
        return _now(kind, _call, fn, args, span)      # run here: nothing can overtake it
    with _lock:
        if name.__class__ is not str:
            name = None                               # only names (str) are tracked
        elif name in _names:
            raise ValueError(f"{kind or 'collective'}: a collective named {name!r} is still "
                             f"in flight; give each pending collective its own name")
        else:
            _names.add(name)
        _submitted += 1
        future = _thread().submit(_run, fn, args, span, name)
    return Handle(future, kind)


def completed(fn, *args, kind=None):
    """``fn(*args)`` run now (in order, as a blocking call), as an already finished Handle."""
    return _now(None if kind is None else as_kind(kind), ordered, fn, *args)


def _now(kind, fn, *args):
    """A finished Handle of ``fn(*args)``, run now: its result, or its exception."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - kept for synchronize, as on the thread
        future.set_exception(exc)
    return Handle(future, kind)


def _run(fn, args, span, name=None):
    global _finished
    try:
        return _call(fn, args, span)
    finally:
        if name is not None:
            with _lock:
                _names.discard(name)
        _finished += 1


def _call(fn, args, span):
    if span is None:
        return fn(*args)
    name, fields = span
    with current_timeline().span(name, cat="comm", tid="comm", **fields):
        return fn(*args)


def busy():
    """True while a submitted collective has not finished."""
    return _submitted != _finished


def ordered(fn, *args):
    """``fn(*args)`` -- a blocking collective -- after everything in flight: directly when
    nothing is, else queued behind it on the comm thread (and waited for)."""
    if _submitted == _finished or on_comm_thread():
        return fn(*args)
    return synchronize(submit(fn, *args))


def poll(handle):
    """True once the collective of ``handle`` has finished (result or error); never blocks."""
    return _check(handle).future.done()


def synchronize(handle):
    """Wait for ``handle``'s collective; return its result (what the blocking call returns:
    for in-place calls the input array) or raise its exception."""
    return _check(handle).future.result()


def drain():
    """Wait until everything submitted so far has finished (errors stay in their handles)."""
    if busy() and not on_comm_thread():
        _thread().submit(lambda: None).result()


def _check(handle):
    if not isinstance(handle, Handle):
        raise ValueError(f"expected a handle returned by an mt.*_async call, got "
                         f"{type(handle).__name__}")
    return handle
