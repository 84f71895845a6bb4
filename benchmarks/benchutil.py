"""What the benchmark scripts do the same way: byte sizes on the command line, timing a call,
the slowest rank's time, checking counts, writing JSON, and the machine and launcher they run on.

Standard library only at import: step.py and train_accuracy.py import it before NumPy loads
(NumPy's BLAS reads its thread variables once, at load time).
"""
import json
import os
import shlex
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text):
    """'4', '64K', '1.5M', '2GB' -> bytes (binary units); ValueError for anything else."""
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def timed(fn, before=None, after=None, clock=time.perf_counter):
    """Seconds of ``fn()`` and then ``after()`` (a device's synchronize: the work is done),
    started once ``before()`` (a barrier, or a synchronize) has returned."""
    if before is not None:
        before()
    start = clock()
    fn()
    if after is not None:
        after()
    return clock() - start


def best_time(fn, rounds, repeat=1, sync=None):
    """Best over ``rounds`` of the mean seconds per call of ``repeat`` calls of ``fn()``, after
    one untimed call (JIT, caches); ``sync`` (a device's synchronize) ends the untimed call and
    every timed round."""
    def calls():
        for _ in range(repeat):
            fn()
    fn()
    if sync is not None:
        sync()
    # one call: fn itself, no loop inside the clock (the kernels timed can take microseconds)
    return min(timed(calls if repeat > 1 else fn, after=sync) for _ in range(rounds)) / repeat


def slowest(comm, *seconds):
    """Each value's maximum over the ranks of ``comm`` (a float64 array): a collective step
    ends when its last rank does."""
    import numpy as np
    from mpi4py import MPI
    buf = np.array(seconds, np.float64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return buf


def check_positive(parser, args, names):
    """``parser.error`` (exit 2) for the first of the options ``names`` (dests) below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def write_json(path, doc, indent=1):
    """``doc`` as JSON at ``path``, making its folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)


def write_text(path, text):
    """Print ``text`` (path "-") or write it to ``path``, making its folder first."""
    if path == "-":
        print()
        print(text, end="")
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def set_threads(n):
    """BLAS and Numba threads ``n``: must run before NumPy is imported (BLAS reads these once,
    at load time)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)


def usable_cores():
    """Cores this process may run on (affinity mask when the OS has one, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def mpiexec_argv():
    """The MPI launcher: ``MPIEXEC`` (may carry flags, e.g. "mpirun --oversubscribe"), default
    <repo>/.venv/bin/mpiexec."""
    return shlex.split(os.environ.get("MPIEXEC", str(REPO / ".venv" / "bin" / "mpiexec")))
