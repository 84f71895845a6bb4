"""Ending a whole MPI job from one rank: ``abort(message)`` and the uncaught-exception hook.

``install_abort_hook()`` (``mt.init()`` installs it unless told not to): an uncaught Python
exception on one rank otherwise leaves every other rank blocked in its next collective for ever
(Python's normal exit path waits in MPI_Finalize). The hook prints the traceback tagged with
the rank and calls ``MPI.COMM_WORLD.Abort(1)``, which tears the whole job down with a non-zero
exit. A KeyboardInterrupt (Ctrl-C reaches every rank) is one line from rank 0 and exit code 130
on each rank, without MPI_Finalize (``exit_now``). The bottom of the comm layer: the watchdog's
stall shutdown uses ``abort`` too.
"""
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

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


def exit_now(code):
    """End this process with ``code`` at once, without MPI_Finalize (which would wait for a rank
    still inside a collective); the launcher then ends the other ranks of the job."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def install_abort_hook():
    """Make an uncaught exception on any rank abort the whole MPI job instead of hanging it."""
    if getattr(sys.excepthook, "_mpitrain_abort", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if MPI.COMM_WORLD.Get_size() == 1:
            return previous(exc_type, exc, tb)
        r = MPI.COMM_WORLD.Get_rank()
        if issubclass(exc_type, KeyboardInterrupt):
            if r == 0:
                sys.stderr.write("mpitrain: interrupted (KeyboardInterrupt), ending the job\n")
            exit_now(130)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort(f"[rank {r}] uncaught exception, aborting the MPI job:\n{text}")

    def thread_hook(args):
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    hook._mpitrain_abort = True
    sys.excepthook = hook
    threading.excepthook = thread_hook
