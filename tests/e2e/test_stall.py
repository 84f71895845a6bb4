"""A rank that never reaches a collective: the waiting rank names it, then ends the job.

Launches ``mpiexec -n 2`` (MPIEXEC env var, default .venv/bin/mpiexec) under a hard ``timeout``
on a script where rank 1 sleeps instead of calling the allreduce. With
MPITRAIN_STALL_WARNING=1 and MPITRAIN_STALL_SHUTDOWN=4, rank 0's watchdog must print the stall
line naming missing rank 1 after about 1 s and abort the job after about 4 s.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MPIEXEC = os.environ.get("MPIEXEC", ".venv/bin/mpiexec")
MPIEXEC = _MPIEXEC if os.path.isabs(_MPIEXEC) or os.sep not in _MPIEXEC else str(ROOT / _MPIEXEC)
HANG_LIMIT_S = 60
SLEEP_S = 45              # rank 1's nap: far beyond the shutdown time, well within the limit

needs_mpiexec = pytest.mark.skipif(shutil.which(MPIEXEC) is None and not Path(MPIEXEC).exists(),
                                   reason=f"no mpiexec at {MPIEXEC}")


@needs_mpiexec
@pytest.mark.timeout(HANG_LIMIT_S + 30)
def test_stalled_allreduce_names_missing_rank_and_aborts(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import numpy as np
        import mpitrain as mt
        mt.init()
        if mt.rank() == 1:
            time.sleep({SLEEP_S})          # never joins: a bug in the user's loop
        mt.allreduce(np.ones(4), name="never")
        print("allreduce finished", flush=True)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               MPITRAIN_STALL_WARNING="1", MPITRAIN_STALL_SHUTDOWN="4",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "-k", "5", str(HANG_LIMIT_S), MPIEXEC, "-n", "2",
                           sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out
    assert elapsed < SLEEP_S, f"took {elapsed:.0f}s: the stall did not end the job"
    assert "allreduce finished" not in out
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpitrain: stalled")]
    # warnings from about 1 s on, then the shutdown line
    assert len(lines) >= 2, out
    for ln in lines:
        assert "in allreduce 'never' (collective #" in ln, ln
        assert "on ranks [0]; missing ranks [1] (rank 1: not in a collective" in ln, ln
    assert "aborting the job (MPITRAIN_STALL_SHUTDOWN)" in lines[-1], out


# --- every kind of blocking call: a rank that stops inside (or before) it ends the job -----------
# Rank 1 sleeps at the point named, so the others wait in that very MPI call: the tree's
# Sendrecv, the ring's receives, the pickled allgather's data phase, mt.init's start-up
# collectives. Its nap (KIND_SLEEP_S) is far beyond the shutdown time and the start-up of a
# loaded machine: had nothing watched the call, the job would finish after it ("finished").
KIND_SLEEP_S = 60
KIND_LIMIT_S = 100

_PRELUDE = """
import sys, time
import numpy as np
import mpitrain as mt
from mpitrain import comm
SLEEP_S = float(sys.argv[1])
"""

KINDS = {
    "tree": """
mt.init()
x, scratch = np.ones(4096, np.float32), np.empty(2048, np.float32)
if mt.rank() == 1:
    time.sleep(SLEEP_S)
comm.tree_allreduce_(x, lambda d, s: np.add(d, s, out=d), scratch, mt.global_process_set)
""",
    "ring": """
mt.init()
x = np.ones(1 << 16, np.float32)
if mt.rank() == 1:
    time.sleep(SLEEP_S)
comm.allreduce_flat(comm.world_of(mt.global_process_set, "test"), x, mt.Sum)
""",
    "object": """
class Slow:                    # its pickle never comes back: rank 1 stops after the agreement
    def __reduce__(self):
        time.sleep(SLEEP_S)
        return (int, (1,))
mt.init()
mt.allgather_object(Slow() if mt.rank() == 1 else 1)
""",
    "start-up": """
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(SLEEP_S)        # a rank that is late to start: the others wait in mt.init
mt.init()
""",
}


@needs_mpiexec
@pytest.mark.timeout(KIND_LIMIT_S + 30)
@pytest.mark.parametrize("kind, n", [("tree", 2), ("ring", 2), ("ring", 3), ("object", 2),
                                     ("object", 3), ("start-up", 2), ("start-up", 3)])
def test_a_rank_stopped_inside_any_blocking_call_ends_the_job(tmp_path, kind, n):
    script = tmp_path / "stall.py"
    script.write_text(_PRELUDE + KINDS[kind] + 'print("finished", flush=True)\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MPITRAIN_ALLREDUCE="ring",
               MPITRAIN_STALL_WARNING="1", MPITRAIN_STALL_SHUTDOWN="4",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "-k", "5", str(KIND_LIMIT_S), MPIEXEC, "-n", str(n),
                           sys.executable, str(script), str(KIND_SLEEP_S)], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out
    assert "finished" not in out, f"the job waited for rank 1 ({elapsed:.0f} s):\n{out}"
    assert elapsed < KIND_SLEEP_S, out
    ends = [ln for ln in proc.stderr.splitlines()
            if ln.startswith("mpitrain: stalled") and ln.endswith("(MPITRAIN_STALL_SHUTDOWN)")]
    assert 1 <= len(ends) <= n - 1, out          # each waiting rank at most, nobody else
    if kind == "start-up":
        assert all(" in mt.init on rank " in ln for ln in ends), ends
    else:
        # rank 1 is named; a waiting rank whose watchdog missed the answer window may be too
        assert all("; missing ranks [1" in ln and "(rank 1: not in a collective" in ln
                   and "(collective #" in ln for ln in ends), ends


# --- a rank that leaves: the others hear it and end the job within seconds ---------------------
LEAVE_LIMIT_S = 60


@needs_mpiexec
@pytest.mark.timeout(LEAVE_LIMIT_S + 30)
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_left_is_named_within_seconds(tmp_path, n):
    """``if rank == 0: allreduce``: the other ranks' scripts end. With the default stall
    settings (a 10-minute shutdown) rank 0 must still end the job at once, naming them."""
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import mpitrain as mt
        mt.init()
        mt.allreduce(np.ones(4), name="everyone")
        if mt.rank() == 0:
            mt.allreduce(np.ones(4), name="only rank 0")
            print("rank 0 finished", flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["timeout", "-k", "5", str(LEAVE_LIMIT_S), MPIEXEC, "-n", str(n),
                           sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out
    assert "rank 0 finished" not in out
    lines = [ln for ln in proc.stderr.splitlines() if "a rank that left never joins" in ln]
    assert len(lines) == 1, out
    left = ", ".join(str(r) for r in range(1, n))
    assert "in allreduce 'only rank 0' (collective #" in lines[0], lines[0]
    assert f"on ranks [0]; missing ranks [{left}] (rank 1: left the job after #" in lines[0], out


@needs_mpiexec
@pytest.mark.timeout(LEAVE_LIMIT_S + 30)
def test_ranks_that_end_at_different_times_end_cleanly(tmp_path):
    """Leaving after the last collective is no fault: the others finish theirs and exit 0."""
    script = tmp_path / "ends.py"
    script.write_text(textwrap.dedent("""
        import time
        import numpy as np
        import mpitrain as mt
        mt.init()
        for i in range(20):
            mt.allreduce(np.ones(1 << 14), name="last")
        if mt.rank() != 1:
            time.sleep(3)                  # rank 1 has long left: nothing more is asked of it
        print(f"rank {mt.rank()} finished", flush=True)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MPITRAIN_STALL_WARNING="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["timeout", "-k", "5", str(LEAVE_LIMIT_S), MPIEXEC, "-n", "3",
                           sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"rank {r} finished" in proc.stdout for r in range(3))
    assert "mpitrain:" not in proc.stderr, proc.stderr
