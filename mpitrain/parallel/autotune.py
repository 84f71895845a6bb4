"""Autotune (``MPITRAIN_AUTOTUNE=1``): pick the gradient fusion threshold and ring/MPI on the job.

Horovod's HOROVOD_AUTOTUNE, as a grid: the best bucket size and allreduce path depend on the
model, the number of ranks and the links, so instead of guessing, the first training steps try
them on the real step (data, forward, backward, the overlapped allreduces, the update) and keep
the fastest. ``DistributedOptimizer`` (gradients mode, more than one rank) makes one ``Autotuner``
(on the World of its process set) and calls ``step_done()`` at the end of every ``step()``::

    trial 0   the starting values (the default: what an untuned run uses)
    trial k   fusion threshold t x algorithm a, t in THRESHOLDS, a in ("mpi", "ring")

The first SETTLE_STEPS steps of the run are not part of any trial (JIT compilation, first
touches of buffers: the trainer's step times leave out the first 5 for the same reason); then each
trial runs ``MPITRAIN_AUTOTUNE_WARMUP_STEPS`` untimed steps (the first one rebuilds and
agrees the bucket plan) and ``MPITRAIN_AUTOTUNE_STEPS`` timed ones; a step's time is the wall time
from the end of the previous ``step()`` to the end of this one. The trial's score is the median
of this rank's timed steps, then the maximum over ranks (one allreduce Max per trial): a step is
as slow as its slowest rank. After the last trial every rank picks the smallest score (first one
on ties) -- the same choice everywhere, since every rank has the same scores -- and keeps it;
rank 0 prints it with the environment that pins it, and writes the trials as CSV to
``MPITRAIN_AUTOTUNE_LOG``.

Consistency: a switch happens only at the end of a step, on every rank at the same step (the
schedule is a function of the step count), with nothing in flight; the threshold goes to the
optimizer (its bucket plan is rebuilt and agreed at the next step), the algorithm into the
World's settings (read by comm/engine.py at every allreduce). So every step reduces with the
same plan and path on all ranks and the replicas stay identical. A tuned run is not bitwise
equal to an untuned one (its first steps sum in other orders); for bitwise-reproducible
reruns pin the printed values and leave autotune off.

Thresholds at or above the model's gradient bytes all give the same plan (one bucket, large
gradients alone), so only the smallest of them is tried.
"""
import csv
import dataclasses
import statistics
import sys
import time

from mpitrain import comm

THRESHOLDS = (0, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
ALGORITHMS = ("mpi", "ring")
SETTLE_STEPS = 5
CSV_FIELDS = ("trial", "fusion_threshold_bytes", "algorithm", "warmup_steps", "timed_steps",
              "step_ms_slowest_rank", "chosen")


@dataclasses.dataclass(frozen=True)
class Trial:
    threshold_bytes: int
    algorithm: str

    def pin(self):
        """The environment that makes a later run use these values without autotune."""
        return (f"MPITRAIN_AUTOTUNE=0 MPITRAIN_FUSION_THRESHOLD={self.threshold_bytes} "
                f"MPITRAIN_ALLREDUCE={self.algorithm}")


def candidates(start, gradient_bytes):
    """The trials: ``start`` first, then the grid without repeats (thresholds at or above
    ``gradient_bytes`` plan alike: only the smallest of them)."""
    above = [t for t in THRESHOLDS if t >= gradient_bytes]
    thresholds = [t for t in THRESHOLDS if t < gradient_bytes] + above[:1]
    return [start] + [Trial(t, a) for t in thresholds for a in ALGORITHMS if Trial(t, a) != start]


class Autotuner:
    """Runs the trials on a DistributedOptimizer's steps, then keeps the best.

    state: the World whose ranks average (its settings carry the algorithm); gather(obj): every
    one of those ranks' obj, in rank order (allgather_object on the same ranks);
    set_threshold(bytes): applies a fusion threshold to the optimizer between steps.
    """

    def __init__(self, state, gather, start, gradient_bytes, set_threshold):
        settings = state.settings
        self.state, self.gather = state, gather
        self.trials = candidates(start, gradient_bytes)
        self.warmup = settings.autotune_warmup_steps
        self.timed = settings.autotune_steps
        self.log_path = settings.autotune_log
        self.set_threshold = set_threshold
        self.scores = []                # slowest rank's median step time (s) of each trial done
        self.chosen = None              # the Trial kept, once every trial ran
        self._steps = []                # this trial's step times on this rank (s)
        self._settle = SETTLE_STEPS     # steps still to run before the first trial
        self._last = None               # end of the previous step (perf_counter)
        _check_log_path(self.log_path, state.rank, gather)
        self._apply(self.trials[0])

    @property
    def current(self):
        return self.chosen if self.chosen is not None else self.trials[len(self.scores)]

    def step_done(self):
        """Called by every rank at the end of every step(); switches trials when one is done."""
        now = time.perf_counter()
        if self.chosen is not None:
            return
        if self._settle > 0:
            self._settle -= 1
            self._last = time.perf_counter()
            return
        if self._last is not None:
            self._steps.append(now - self._last)
        if self._last is None or len(self._steps) < self.warmup + self.timed:
            self._last = time.perf_counter()
            return
        mine = statistics.median(self._steps[self.warmup:])
        self.scores.append(max(self.gather(mine)))         # the slowest rank's
        self._steps = []
        if len(self.scores) == len(self.trials):
            best = min(range(len(self.scores)), key=self.scores.__getitem__)
            self.chosen = self.trials[best]
            self._apply(self.chosen)
            self._report(best)
        else:
            self._apply(self.trials[len(self.scores)])
        self._write_log()
        self._last = time.perf_counter()        # the switch itself is not the next step's time

    def _apply(self, trial):
        state = self.state
        if state.settings.algorithm != trial.algorithm:
            # between steps, on every rank at once; cached small-allreduce plans carry the path
            state.settings = dataclasses.replace(state.settings, algorithm=trial.algorithm)
            state.plans.clear()
        self.set_threshold(trial.threshold_bytes)

    def _report(self, best):
        if self.state.rank != 0:
            return
        default = self.scores[0]
        print(f"mpitrain autotune: chose fusion threshold {self.chosen.threshold_bytes} bytes, "
              f"allreduce {self.chosen.algorithm} ({self.scores[best] * 1e3:.2f} ms/step vs "
              f"{default * 1e3:.2f} ms for the default {self.trials[0].threshold_bytes} bytes, "
              f"{self.trials[0].algorithm}; {len(self.trials)} trials); pin it with: "
              f"{self.chosen.pin()}", file=sys.stderr, flush=True)

    def _write_log(self):
        if self.log_path is None or self.state.rank != 0:
            return
        with open(self.log_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(CSV_FIELDS)
            for i, (trial, score) in enumerate(zip(self.trials, self.scores)):
                out.writerow([i, trial.threshold_bytes, trial.algorithm, self.warmup, self.timed,
                              f"{score * 1e3:.4f}", int(trial == self.chosen)])


def _check_log_path(path, rank, gather):
    """An unwritable MPITRAIN_AUTOTUNE_LOG is one ValueError on every rank, before any trial."""
    error = None
    if path is not None and rank == 0:
        try:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(CSV_FIELDS)
        except OSError as exc:
            error = f"MPITRAIN_AUTOTUNE_LOG={path!r}: cannot write it: {exc.strerror or exc}"
    error = gather(error)[0]
    if error is not None:
        raise ValueError(error)


def for_optimizer(state, gather, threshold_bytes, gradient_bytes, set_threshold):
    """The Autotuner for a DistributedOptimizer starting at ``threshold_bytes``, or None when
    MPITRAIN_AUTOTUNE is off or there is one rank (nothing to tune). Arguments as Autotuner's;
    called on every rank of ``state`` (it may make one collective call)."""
    if not state.settings.autotune or state.size == 1:
        return None
    start = Trial(comm.check_threshold(threshold_bytes), state.settings.algorithm)
    return Autotuner(state, gather, start, gradient_bytes, set_threshold)
