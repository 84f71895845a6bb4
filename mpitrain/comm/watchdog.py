"""Stall watchdog: a rank kept waiting in a collective names the ranks that never arrived.

When one rank never reaches a collective (it skipped an allreduce, loops, or is deadlocked in
Python), the others block in MPI with nothing on screen. Every collective's first MPI call is
the fixed-size Allgather of the agreement (check.py), so that call alone is watched. Around it
check.py calls its Record's ``enter(desc)`` and ``leave()``: a counter increment and two stores --
about 0.1 us a collective (0.18 us with a ``time.monotonic()`` per call, which is why there is
none), no lock, no MPI call. The description (kind, fields, ...) is kept by reference; its
``name`` field is looked up only when someone asks. The clock is read by the thread instead: an
agreement is timed from the first tick that sees it, so waits are under-counted by at most one
tick (<= 1 s, against a 60 s default warning).
Nothing else happens on the hot path; all the rest is in one daemon thread per rank.

Protocol (the thread wakes every ``tick = min(1 s, warning/4)``):

1. It answers queries. Queries and answers travel on a private duplicate of the communicator
   (``Dup``, tags QUERY_TAG / REPLY_TAG), so they can never match a message of the user or of a
   collective. Incoming messages are found with ``Improbe`` and received as matched messages
   (``Message.Irecv``): no receive stays posted, so there is nothing to cancel at shutdown and
   nothing for the training thread's MPI progress to match against. An answer is this rank's
   state: the number of its last collective, and whether it is inside it (kind, name, seconds).
2. When this rank has been inside the same collective #k for ``MPITRAIN_STALL_WARNING`` seconds
   (default 60), it sends a query to every other rank and collects answers for at most
   ``answer_timeout_s`` (2 s), answering other ranks' queries meanwhile (the waiting ranks all
   ask at about the same time). Ranks inside #k (same kind) are present; every other rank is
   missing, with what it said ("not in a collective, last #k-1", "in broadcast #k for 3 s") or
   "no answer" (a thread that never gets the GIL, a dead process, a rank with the watchdog
   off). The lowest present rank prints ONE line to stderr, again at most every warning period
   while the stall lasts::

       mpitrain: stalled for 60 s in allreduce 'grad.fc1' (collective #512) on ranks [0, 2];
       missing ranks [1] (rank 1: not in a collective, last #511)

3. With ``MPITRAIN_STALL_SHUTDOWN=S`` (default 600; 0: never) a rank stalled for S seconds
   prints that line and calls ``MPI.COMM_WORLD.Abort(1)``, like Horovod's
   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: the training thread is blocked inside MPI and cannot
   raise, so ending the job is the only way out. The default ends a job whose collective one
   rank never reaches (a bug in an own loop: a collective under ``if rank == 0``) after ten
   minutes, as PyTorch's NCCL timeout does, instead of never; a job where one rank works alone
   for longer than that sets it higher or to 0. ``MPITRAIN_STALL_WARNING=0`` turns everything
   off (no thread). The variables should match across ranks; if they do not, nothing hangs:
   a rank without the thread is reported as "no answer".

One Record per communicator (per World, world.py: the global set and each process set), not
per thread: a World's agreement (check.py) shares its send and receive buffers, and the
collectives of one communicator are issued in the same order on every member, so at most one
agreement per World is in flight, whichever thread calls it (handles.py runs asynchronous
collectives and overlap.py's buckets on one comm thread, in submission order; a blocking call
made meanwhile queues behind them). overlap.py's buckets call one agreement per step (before
the first bucket) and mark each bucket allreduce the same way ("allreduce bucket"), so the
record is always the collective running. A rank waiting in ``mt.join`` (join.py) is not in a
collective: it has run out of data, and the others may compute for a long time. ``enter``
replaces the description by one store (atomic under the GIL): the thread reads a consistent
snapshot without a lock.
The sequence number counts a set's agreements and buckets, which its members make in the same
order, so "#k" names the same collective on every member; numbers start at #1 with each World
(each ``mt.init``, each ``add_process_set``). A stall in a process set asks only the set's
members and names its missing ones::

    mpitrain: stalled for 60 s in allreduce 'x' (collective #3 of process set 1 [0, 2]) on
    ranks [0]; missing ranks [2] (rank 2: not in a collective, last #2)

MPI from two threads needs ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it; the ``mpich`` wheel
grants it). Below that the thread still detects the stall on its own rank and prints the line
(and aborts after S seconds), but asks no one: "missing ranks unknown". The thread only makes
non-blocking calls (Improbe, Irecv, Isend, Test), stops at ``world.shutdown()`` or at exit
(before mpi4py's MPI_Finalize), and frees its requests and the duplicate communicator.

Every blocking MPI call of a collective is watched, not only the agreement: the data phase
after it (``watched(record, kind)``: the ring, MPI's own collectives, the fixed tree, the
object collectives' pickles) is marked the same way, as a numbered entry of its own, so a rank
that stops between the agreement and the data (a SIGSTOP, a pickle that never returns) is
named too. A mark inside a mark is none (a bucket's allreduce is the bucket): every member
numbers the same entries. Before the thread exists, ``mt.init``'s own collectives (the
settings' allgather, the communicators' Dup and Split) run under ``startup(...)``: a timer on
this rank alone, which prints the line after the warning time and aborts after the shutdown
time -- a rank that never starts, or stops before it reaches ``mt.init``, ends the job too.

A rank that leaves -- ``mt.shutdown()`` or the end of its script -- tells the others first
(``depart()``: one small message, tag DEPART_TAG, with its count of each set's entries). A rank
waiting in entry #k of a set whose member left after fewer than k entries knows that member
will never arrive, and ends the job at once instead of after S seconds (the lowest waiting rank
prints the line; the others follow after a grace)::

    mpitrain: stalled for 1 s in allreduce 'x' (collective #3) on ranks [0]; missing ranks [1]
    (rank 1: left the job after #2); aborting the job: a rank that left never joins
"""
import atexit
import json
import sys
import threading
import time
from collections import namedtuple

from mpi4py import MPI

from mpitrain.comm.abort import abort as abort_job

QUERY_TAG = 0x5741
REPLY_TAG = 0x5742
DEPART_TAG = 0x5743
ANSWER_TIMEOUT_S = 2.0
LEFT_GRACE_S = 5.0        # a waiting rank other than the lowest aborts this long after it
_NAME_CHARS = 80          # names are cut to this in answers: messages stay small (eager)

_monotonic = time.monotonic
_records = {}             # process set id -> Record of this process (0: the global set)
_round = 0                # query ids, never reset: a late answer never matches a newer query
_watchdog = None
_generation = 0           # watchdogs started by this process: a departure names its own
_sent = []                # departure messages sent (their buffers must outlive the sends)
_lock = threading.Lock()

Stall = namedtuple("Stall", "rank seq kind name waited_s present missing details line")
Stall.__doc__ = """One stall report: this rank has waited ``waited_s`` in collective #seq.

present: ranks inside the same collective (this one included), or None when no one was asked;
missing: the other ranks of the set; details: rank -> what it answered ("no answer" when it
did not). Ranks are ranks of the communicator mpitrain was initialised with.
"""


# --- hot path (called by the agreement (check.py) around its Allgather) -------------------------

class Record:
    """The collectives of one communicator (one per World, world.py), as the thread sees them.

    set_id: the process set (0: the global set); ranks: its members as ranks of the global
    communicator. ``enter``/``leave`` are the hot path: a counter and one store each.
    """

    __slots__ = ("set_id", "ranks", "seq", "current")

    def __init__(self, set_id=0, ranks=()):
        self.set_id = set_id
        self.ranks = list(ranks)
        self.seq = 0              # agreements entered (the same count on every member)
        self.current = None       # the description of the agreement in flight, else None

    def enter(self, desc):
        """This process enters an agreement; desc: (kind, fields dict or None, ...)."""
        self.seq += 1
        self.current = desc

    def leave(self):
        """The agreement entered last is over."""
        self.current = None

    def snapshot(self):
        """(seq, desc or None), a consistent pair: ``enter`` may run on another thread between
        the two reads, and then the counter has moved; the pair is reported as not in flight
        (the next tick sees it again if it really is stuck)."""
        seq = self.seq
        desc = self.current
        return (seq, desc) if self.seq == seq else (seq, None)


def register(set_id, ranks):
    """A fresh Record for process set ``set_id`` (numbers start at #1), watched from now on."""
    rec = _records[set_id] = Record(set_id, ranks)
    return rec


def unregister(record):
    """Stop watching ``record`` (its World was dropped)."""
    if _records.get(record.set_id) is record:
        del _records[record.set_id]


def record(set_id=0):
    """This process's Record of process set ``set_id`` (a detached one if none is registered)."""
    rec = _records.get(set_id)
    return rec if rec is not None else Record(set_id)


def current():
    """(seq, kind, name) of the global set's agreement in flight, or None."""
    seq, desc = record().snapshot()
    return None if desc is None else (seq, *_what(desc))


def _what(desc):
    """(kind, name or None) of a description."""
    fields = desc[1] if len(desc) > 1 else None
    return str(desc[0]), fields.get("name") if isinstance(fields, dict) else None


class watched:
    """``with watched(record, kind, name):`` the blocking MPI calls of a collective's data phase,
    marked in flight on ``record`` as an entry of their own (like an agreement), so a rank that
    never sends its part is named and the stall shutdown ends the job. Inside another mark
    (an overlap bucket, the data phase of a reducescatter) it marks nothing: the outer mark is
    the collective running, and every rank counts the same entries."""

    __slots__ = ("record", "desc", "outer")

    def __init__(self, record, kind, name=None):
        self.record = record
        self.desc = (kind, None if name is None else {"name": name}, None)

    def __enter__(self):
        self.outer = self.record.current is not None
        if not self.outer:
            self.record.enter(self.desc)
        return self

    def __exit__(self, *exc):
        if not self.outer:
            self.record.leave()


# --- start / stop -----------------------------------------------------------------------------

def start(comm, warning_s=60.0, shutdown_s=0.0, report=None, answer_timeout_s=ANSWER_TIMEOUT_S,
          abort=None):
    """Start this rank's watchdog on ``comm`` (collective: every rank of comm calls it).

    One thread watches every Record registered in this process (the global set's and each
    process set's, world.py); it asks the members of a stalled set, over a duplicate of
    ``comm``, whose ranks process sets are given in.
    warning_s / shutdown_s: MPITRAIN_STALL_WARNING / _SHUTDOWN (CommSettings, settings.py;
    0 = off / never). report(stall): called on
    the watchdog thread with every Stall found (default: the lowest present rank prints
    ``stall.line`` to stderr). abort(stall): called after shutdown_s (default: print the line,
    MPI.COMM_WORLD.Abort(1)). The communicator is duplicated whenever it has more than one rank,
    even with the watchdog off, so ranks whose settings differ still make the same MPI calls.
    """
    global _watchdog, _generation
    stop()
    _generation += 1
    if comm.Get_size() == 1:
        return
    dup = comm.Dup()
    with _lock:
        _watchdog = _Watchdog(dup, float(warning_s), float(shutdown_s), report or _print_report,
                              answer_timeout_s, abort or _abort)
        _watchdog.start()


def stop():
    """Stop the thread, release its requests and its communicator; no-op when not running."""
    global _watchdog
    with _lock:
        w, _watchdog = _watchdog, None
    if w is not None:
        w.stop()


def running():
    """True while a watchdog thread is running in this process."""
    w = _watchdog
    return w is not None and w.thread is not None and w.thread.is_alive()


def depart():
    """Tell the other ranks that this one leaves (``mt.shutdown``, the end of the script), with
    its count of each set's entries: a rank waiting in a later entry then ends the job at once.
    Small (eager): the sends are waited for at most a second. No-op without a watchdog."""
    w = _watchdog
    if w is None or MPI.Is_finalized():
        return
    seqs = {str(set_id): rec.seq for set_id, rec in list(_records.items())}
    msg = json.dumps({"gen": _generation, "seqs": seqs}).encode()
    _sent.append(msg)             # the buffer outlives any send still in flight
    requests = [w.comm.Isend([msg, MPI.BYTE], r, DEPART_TAG) for r in range(w.size)
                if r != w.rank]
    deadline = _monotonic() + 1.0
    while not MPI.Request.Testall(requests) and _monotonic() < deadline:
        time.sleep(0.001)
    for req in requests:
        if req != MPI.REQUEST_NULL:
            req.Free()            # an active send may be freed: it completes on its own


def _at_exit():
    depart()
    stop()


atexit.register(_at_exit)  # before mpi4py's MPI_Finalize, while threads may still call MPI


class startup:
    """``with startup(what, warning_s, shutdown_s):`` collectives made before the watchdog
    thread exists (``mt.init``'s). A timer on this rank alone: after ``warning_s`` it prints
    that this rank waits, after ``shutdown_s`` it prints the line and aborts the job (0: off /
    never). Nobody can be asked yet, so the line names no missing rank."""

    def __init__(self, what, warning_s, shutdown_s, rank=0):
        self.what, self.rank = what, rank
        self.warning_s, self.shutdown_s = float(warning_s), float(shutdown_s)
        self.done = threading.Event()
        self.thread = None

    def __enter__(self):
        if self.warning_s > 0 or self.shutdown_s > 0:
            self.thread = threading.Thread(target=self._run, name="mpitrain-startup",
                                           daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread is not None:
            self.thread.join(5)

    def line(self, waited):
        return (f"mpitrain: stalled for {waited:.0f} s in {self.what} on rank {self.rank}; "
                f"missing ranks unknown (some rank has not started, or stopped before it)")

    def _run(self):
        began = _monotonic()
        warn_at = self.warning_s if self.warning_s > 0 else None
        end_at = self.shutdown_s if self.shutdown_s > 0 else None
        while True:
            due = [t for t in (warn_at, end_at) if t is not None]
            if not due or self.done.wait(max(0.0, min(due) - (_monotonic() - began))):
                return
            waited = _monotonic() - began
            if end_at is not None and waited >= end_at:
                abort_job(f"{self.line(waited)}; aborting the job (MPITRAIN_STALL_SHUTDOWN)")
                return
            if warn_at is not None and waited >= warn_at:
                sys.stderr.write(self.line(waited) + "\n")
                sys.stderr.flush()
                warn_at += self.warning_s


# --- the thread -------------------------------------------------------------------------------

class _Watchdog:
    def __init__(self, comm, warning_s, shutdown_s, report, answer_timeout_s, abort):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self.report = report
        self.abort = abort
        self.answer_timeout_s = answer_timeout_s
        self.ask = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        limits = [s for s in (warning_s, shutdown_s) if s > 0]
        self.tick = min([1.0] + [s / 4 for s in limits])
        self.requests = []            # (request, buffer) of sends and receives in flight
        self.last = {}                # Record -> (seq, time) of its last report
        self.seen = {}                # Record -> (seq, time this thread first saw it in flight)
        self.halt = threading.Event()
        self.thread = None
        self.departed = {}            # rank -> {set id: entries it had made} once it has left
        self.left_seen = {}           # Record -> when a departure first made it fatal here

    def start(self):
        if self.warning_s > 0:
            self.thread = threading.Thread(target=self._run, name="mpitrain-watchdog",
                                           daemon=True)
            self.thread.start()

    def stop(self):
        self.halt.set()
        if self.thread is not None:
            self.thread.join(self.tick + self.answer_timeout_s + 5)
            if self.thread.is_alive():        # stuck inside MPI: leave its communicator alone
                sys.stderr.write("mpitrain: stall watchdog did not stop; not freeing it\n")
                return
        if MPI.Is_finalized():
            return
        self._close()
        self.comm.Free()

    def _run(self):
        try:
            while not self.halt.wait(self.tick):
                if MPI.Is_finalized():
                    return
                if self.ask:
                    self._answer()
                    self._note_departures()
                    self._reap()
                self._check()
        except Exception as exc:  # noqa: BLE001 - a monitor must never take the job down
            sys.stderr.write(f"mpitrain: stall watchdog stopped: {exc!r}\n")

    def _observe(self, rec):
        """(seq, desc or None, seconds inside it): ``rec``'s agreement in flight, timed from
        the first time this thread saw it."""
        seq, desc = rec.snapshot()
        now = _monotonic()
        if desc is None:
            self.seen[rec] = (None, now)
            return seq, None, 0.0
        if self.seen.get(rec, (None,))[0] != seq:
            self.seen[rec] = (seq, now)
        return seq, desc, now - self.seen[rec][1]

    def _check(self):
        records = list(_records.values())
        for gone in [r for r in self.seen if r not in records]:    # dropped Worlds
            self.seen.pop(gone, None)
            self.last.pop(gone, None)
        for rec in records:
            self._check_record(rec)

    def _note_departures(self):
        for src, msg in self._receive(DEPART_TAG):
            if msg.get("gen") == _generation and isinstance(msg.get("seqs"), dict):
                self.departed[src] = {int(k): int(v) for k, v in msg["seqs"].items()}

    def _left(self, rec, seq):
        """rank -> entries made, of the members of ``rec``'s set that left before entry #seq."""
        members = rec.ranks or range(self.size)
        return {r: self.departed[r].get(rec.set_id, 0) for r in members
                if r in self.departed and self.departed[r].get(rec.set_id, 0) < seq}

    def _check_record(self, rec):
        seq, desc, waited = self._observe(rec)
        if desc is None:
            self.left_seen.pop(rec, None)
            return
        left = self._left(rec, seq) if self.departed else {}
        if left:
            self._end_for_departure(rec, seq, desc, left)
            return
        fatal = 0 < self.shutdown_s <= waited
        if not fatal:
            if waited < self.warning_s:
                return
            last = self.last.get(rec, (None, 0.0))
            if last[0] == seq and _monotonic() - last[1] < self.warning_s:
                return
        answers = self._query(rec) if self.ask else None
        now_seq, now_desc, waited = self._observe(rec)
        if now_seq != seq or now_desc is None:        # it finished while we asked
            return
        self.last[rec] = (seq, _monotonic())          # repeats are timed from the report
        stall = make_stall(self.rank, self.size, seq, desc, waited, answers,
                           members=rec.ranks or None, set_id=rec.set_id)
        if fatal:
            self.abort(stall)
        else:
            self.report(stall)

    def _end_for_departure(self, rec, seq, desc, left):
        """Entry #seq waits for members that have left: end the job, the lowest waiting rank at
        once and with the line, the others after LEFT_GRACE_S (if the job is still there)."""
        noticed = self.left_seen.setdefault(rec, (seq, _monotonic()))
        if noticed[0] != seq:
            noticed = self.left_seen[rec] = (seq, _monotonic())
        answers = self._query(rec, skip=left) if self.ask else {}
        now_seq, now_desc, waited = self._observe(rec)
        if now_seq != seq or now_desc is None:        # it finished while we asked
            return
        answers.update({r: {"left": True, "seq": s} for r, s in left.items()})
        stall = make_stall(self.rank, self.size, seq, desc, waited, answers,
                           members=rec.ranks or None, set_id=rec.set_id)
        lowest = stall.present is None or stall.rank == stall.present[0]
        if lowest or _monotonic() - noticed[1] >= LEFT_GRACE_S:
            abort_job(f"{stall.line}; aborting the job: a rank that left never joins")

    def _query(self, rec, skip=()):
        """Ask the other ranks of ``rec``'s set (but those in ``skip``) where they are in it;
        rank -> answer dict (missing: no answer)."""
        global _round
        _round += 1
        qid = _round
        query = json.dumps({"q": qid, "set": rec.set_id}).encode()
        members = [r for r in (rec.ranks or range(self.size)) if r not in skip]
        for r in members:
            if r != self.rank:
                self._send(query, r, QUERY_TAG)
        answers = {}
        deadline = _monotonic() + self.answer_timeout_s
        while len(answers) < len(members) - 1 and _monotonic() < deadline:
            self._answer()        # the other waiting ranks are asking us at the same time
            for src, msg in self._receive(REPLY_TAG):
                if msg.get("q") == qid:
                    answers[src] = msg
            if self.halt.is_set():
                break
            time.sleep(0.005)
        self._reap()
        return answers

    def _answer(self):
        for src, msg in self._receive(QUERY_TAG):
            answer = self._state(msg.get("q"), msg.get("set", 0))
            self._send(json.dumps(answer).encode(), src, REPLY_TAG)

    def _state(self, qid, set_id):
        """This rank's answer to query ``qid`` about process set ``set_id``."""
        rec = _records.get(set_id)
        if rec is None:               # removed here already, or not made yet
            return {"q": qid, "seq": 0, "in": False}
        seq, desc, waited = self._observe(rec)
        if desc is None:
            return {"q": qid, "seq": seq, "in": False}
        kind, name = _what(desc)
        name = None if name is None else str(name)[:_NAME_CHARS]
        return {"q": qid, "seq": seq, "in": True, "kind": kind, "name": name,
                "waited": round(waited, 1)}

    # -- non-blocking MPI only ------------------------------------------------------------------
    def _send(self, data, dest, tag):
        self.requests.append((self.comm.Isend([data, MPI.BYTE], dest, tag), data))

    def _receive(self, tag):
        """Every message with ``tag`` that has arrived: [(source, decoded dict)]."""
        out = []
        status = MPI.Status()
        while True:
            msg = self.comm.Improbe(MPI.ANY_SOURCE, tag, status)
            if msg is None:
                return out
            src = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            req = msg.Irecv([buf, MPI.BYTE])
            # matched and small (eager): the data is already here; never wait for ever anyway
            deadline = _monotonic() + 1.0
            while not req.Test():
                if _monotonic() > deadline:
                    self.requests.append((req, buf))
                    break
                time.sleep(0.001)
            else:
                try:
                    out.append((src, json.loads(bytes(buf))))
                except ValueError:
                    pass                  # not ours (cannot happen on a private communicator)

    def _reap(self):
        self.requests = [(r, b) for r, b in self.requests if not r.Test()]

    def _close(self):
        """Finish or drop requests in flight and drain unread messages (caller: any thread,
        after the watchdog thread has exited)."""
        deadline = _monotonic() + 1.0
        while self.requests and _monotonic() < deadline:
            self._reap()
            time.sleep(0.001)
        for req, _ in self.requests:
            req.Free()            # an active request may be freed: it completes on its own
        self.requests = []
        for tag in (QUERY_TAG, REPLY_TAG, DEPART_TAG):
            self._receive(tag)
        self._reap()


# --- the report -------------------------------------------------------------------------------

def make_stall(rank, size, seq, desc, waited_s, answers, members=None, set_id=0):
    """A Stall: this rank has waited ``waited_s`` in agreement #seq described by ``desc``;
    answers: rank -> answer dict from the others (None: no one was asked); members: the ranks
    of process set ``set_id`` (default: all ``size`` ranks, the global set)."""
    kind, name = _what(desc)
    members = list(range(size)) if members is None else list(members)
    if answers is None:
        present, missing, details = None, None, {}
    else:
        present = sorted([rank] + [r for r, a in answers.items()
                                   if a.get("in") and (a.get("seq"), a.get("kind")) == (seq, kind)])
        missing = [r for r in members if r not in present]
        details = {r: describe(answers.get(r)) for r in missing}
    what = kind if name is None else f"{kind} {name!r}"
    where = f"collective #{seq}" if not set_id else (
        f"collective #{seq} of process set {set_id} {members}")
    line = f"mpitrain: stalled for {waited_s:.0f} s in {what} ({where}) "
    if present is None:
        line += (f"on rank {rank}; missing ranks unknown (MPI thread level is below "
                 f"MULTIPLE: no rank was asked)")
    else:
        text = "; ".join(f"rank {r}: {details[r]}" for r in missing)
        line += f"on ranks {present}; missing ranks {missing}" + (f" ({text})" if text else "")
    return Stall(rank, seq, kind, name, waited_s, present, missing, details, line)


def describe(answer):
    """One rank's answer as words."""
    if answer is None:
        return "no answer"
    if answer.get("left"):
        seq = answer.get("seq", 0)
        return f"left the job after #{seq}" if seq else "left the job before its first collective"
    if not answer.get("in"):
        seq = answer.get("seq", 0)
        return f"not in a collective, last #{seq}" if seq else "not in a collective yet"
    kind, name = answer.get("kind"), answer.get("name")
    what = kind if name is None else f"{kind} {name!r}"
    return f"in {what} #{answer.get('seq')} for {answer.get('waited', 0):.0f} s"


def _print_report(stall):
    if stall.present is None or stall.rank == stall.present[0]:
        sys.stderr.write(stall.line + "\n")
        sys.stderr.flush()


def _abort(stall):
    abort_job(f"{stall.line}; aborting the job (MPITRAIN_STALL_SHUTDOWN)")
