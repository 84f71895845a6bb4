"""Stopping at a step boundary: a preemption signal, or rank 0's failed write, learnt by every
rank after the same step.

A cluster announces the end of a job's time with a signal -- Slurm, Kubernetes and spot VMs
send SIGTERM, then SIGKILL a grace period later -- which may reach one rank, every rank, or the
launcher (mpitrainrun and MPICH's mpiexec forward it to the ranks). ``Signals`` installs a
handler for each of ``--preempt-signals`` that only notes the signal (Python runs it between
bytecodes of the main thread, never inside an MPI call). Before each optimizer step every rank
hands its notes to ``DistributedOptimizer.step(flags=...)``, which carries them in the message
the ranks already exchange to agree on the step (its inline payload: no MPI call of its own)
and returns their OR. So every rank learns after the same step that some rank was signalled;
rank 0 writes a checkpoint (atomic: the old files or the new one, never a torn file) and every
rank raises ``Preempted`` (the CLI's exit code 32).

Where a step makes no agreement to carry them (one rank; weights mode; MPITRAIN_CHECK=0) the
flags are exchanged in one small allreduce of their own, at the steps a checkpoint may be
written: every step, every ``--average-every``-th one in weights mode (between averages the
replicas differ). The ``--uneven`` tail, where ranks without samples make no step, carries none:
the flags wait for the next step.

A write of rank 0's that failed (a checkpoint on the ``--checkpoint-async`` thread, a metrics
line) is a flag too, so every rank stops at the next step with the same OutputError.

So is a training loss that is NaN or infinite on some rank (NaN in the data or in a resumed
checkpoint's parameters, an lr that diverges): ``nonfinite_run`` counts the consecutive steps
whose agreed flags carry it, the same count on every rank, and the loop stops the job after
``--nonfinite-steps`` of them with one line naming the step, instead of training on to
"test loss nan" and exit code 0. In weights mode the flags are exchanged every
``--average-every`` steps, so it counts those.

Ctrl-C (SIGINT) during the steps is a flag too, INTERRUPTED. A real Ctrl-C reaches every rank
(MPICH's mpiexec forwards it), but a ``kill -INT`` of one rank reaches that rank alone, and a
rank that stopped on its own could not know whether rank 0, the one that prints, got it too.
So ``Interrupt`` only notes the first SIGINT, and after the step every rank raises the same
agreed ``Interrupted``: one line from rank 0, exit code 130, no new checkpoint. A second SIGINT
before the step ends raises KeyboardInterrupt at once (a rank stuck in a step still stops), as
does one outside the steps (setting up, the final evaluation). One small exchange after the
last step (``last``) carries a SIGINT noted too late for that step's flags.
"""
import signal

import numpy as np

from mpitrain import comm

WRITE_FAILED = 1 << 40          # above every signal number, which are bits 1 << signum
NONFINITE = 1 << 41             # this rank's loss of the step is NaN or infinite
INTERRUPTED = 1 << 42           # this rank got SIGINT
_BITS = 43


class Signals:
    """The stop signals noted since ``install``: ``noted``, bit ``1 << signum`` per signal."""

    def __init__(self, names):
        names = () if names == "none" else names.split(",")
        self.signals = [getattr(signal, "SIG" + name) for name in names]
        self.noted = 0
        self.previous = {}

    def install(self):
        for number in self.signals:
            try:
                self.previous[number] = signal.signal(number, self._note)
            except ValueError:      # not the main thread (an embedding): no handlers, no stops
                break
        return self

    def _note(self, signum, frame):
        self.noted |= 1 << signum

    def restore(self):
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}


class Interrupt:
    """SIGINT noted (``noted``) while the steps run, inside ``with``: the first one only sets
    the flag, a second raises KeyboardInterrupt. Installed only over Python's own handler, so
    --preempt-signals INT or an embedding's own handler stays as it is. ``stopping``: the job
    ends on an agreed interrupt, and a late SIGINT (the launcher's, forwarded) is ignored so
    that it cannot cut rank 0's line short."""

    def __init__(self):
        self.noted = False
        self.previous = None

    def __enter__(self):
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            try:
                self.previous = signal.signal(signal.SIGINT, self._note)
            except ValueError:      # not the main thread: Python's handler stays
                self.previous = None
        return self

    def _note(self, signum, frame):
        if self.noted:
            raise KeyboardInterrupt
        self.noted = True

    def stopping(self):
        if self.previous is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.previous = None

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
            if self.noted and exc[0] is None:
                raise KeyboardInterrupt     # noted after the last exchange: stop here


class StepFlags:
    """This rank's flags before a step (``local``) and every rank's after it (``agree``)."""

    def __init__(self, config, outputs, size, signals=None):
        self.outputs, self.size = outputs, size
        self.signals = Signals("none") if signals is None else signals
        self.interrupt = Interrupt()
        # the steps a checkpoint may be written at: the replicas are one model there
        self.every = config.average_every if config.average == "weights" else 1
        self.loss_finite = True     # this rank's loss of the step in progress (the loop sets it)
        self.nonfinite_run = 0      # consecutive exchanges of flags carrying NONFINITE

    def local(self):
        """This rank's flags: the signals it noted, WRITE_FAILED when rank 0's write failed,
        NONFINITE when its loss of the step is not finite, INTERRUPTED when it got SIGINT."""
        return (self.signals.noted | (WRITE_FAILED if self.outputs.error is not None else 0)
                | (0 if self.loss_finite else NONFINITE)
                | (INTERRUPTED if self.interrupt.noted else 0))

    def agree(self, agreed, step, joined):
        """The OR of every rank's flags after optimizer step ``step`` (the same on every rank):
        ``agreed`` as the step's agreement carried it, else exchanged here where a checkpoint
        may follow the step; 0 after a step some ranks joined instead of making (``joined``)."""
        if agreed is None:
            if self.size > 1 and (joined or step % self.every):
                return 0                                # nothing exchanged: the run goes on
            agreed = self.local() if self.size == 1 else self._exchange()
        self.nonfinite_run = self.nonfinite_run + 1 if agreed & NONFINITE else 0
        return agreed

    def last(self):
        """After the last step, on every rank: INTERRUPTED when some rank noted a SIGINT too
        late for that step's flags (one small exchange), else 0."""
        mine = self.local() & INTERRUPTED
        return mine if self.size == 1 else self._exchange(mine)

    def _exchange(self, flags=None):
        flags = self.local() if flags is None else flags
        bits = (flags >> np.arange(_BITS, dtype=np.int64)) & 1                  # (bits,)
        every = comm.allreduce(bits.astype(np.int32), op=comm.Max, name="StepFlags")
        return int(np.sum(every.astype(np.int64) << np.arange(_BITS, dtype=np.int64)))


def signal_name(flags):
    """The name of the lowest stop signal among ``flags`` ("SIGTERM"), or None."""
    for number in range(1, 40):
        if flags & (1 << number):
            try:
                return signal.Signals(number).name
            except ValueError:
                return f"signal {number}"
    return None
