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
