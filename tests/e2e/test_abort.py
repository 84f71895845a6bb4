"""No hangs across processes: a failing rank ends the whole MPI job quickly, with its traceback.

These launch ``mpiexec -n 2`` themselves (MPIEXEC env var, default .venv/bin/mpiexec) under a
hard ``timeout``: exit code 124 would mean the job hung and had to be killed.
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
# A relative path (the Makefile passes .venv/bin/mpiexec) is relative to the repository root,
# since the pytest harness test runs with its temporary folder as working directory.
MPIEXEC = _MPIEXEC if os.path.isabs(_MPIEXEC) or os.sep not in _MPIEXEC else str(ROOT / _MPIEXEC)
HANG_LIMIT_S = 60


def run_mpi(args, n=2, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "-k", "5", str(HANG_LIMIT_S), MPIEXEC, "-n", str(n),
                           sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True)
    return proc, time.monotonic() - t0


needs_mpiexec = pytest.mark.skipif(shutil.which(MPIEXEC) is None and not Path(MPIEXEC).exists(),
                                   reason=f"no mpiexec at {MPIEXEC}")


@needs_mpiexec
def test_uncaught_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import mpitrain as mt
        from mpitrain.comm.abort import install_abort_hook
        install_abort_hook()
        mt.init()
        if mt.rank() == 1:
            raise RuntimeError("rank one exploded")
        mt.allreduce(np.ones(4))          # rank 0 would wait here for ever without the hook
        print("rank 0 should never get here")
    """))
    proc, elapsed = run_mpi([str(script)])
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out
    assert elapsed < HANG_LIMIT_S - 5, f"took {elapsed:.0f}s: the job hung"
    assert "[rank 1] uncaught exception" in out and "rank one exploded" in out, out
    assert "should never get here" not in out


@needs_mpiexec
def test_pytest_harness_aborts_when_one_rank_fails(tmp_path):
    """tests/mpi/conftest.py: a test failing on rank 1 only must end the job, naming rank 1."""
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_one_rank_fails.py").write_text(textwrap.dedent("""
        import numpy as np
        import mpitrain as mt

        def test_fails_on_rank_one():
            assert mt.rank() != 1, "only rank 1 fails"

        def test_next_collective():
            mt.allreduce(np.ones(3))     # rank 0 reaches this; rank 1 never does
    """))
    proc, elapsed = run_mpi(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                             "addopts=", str(tmp_path)], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out
    assert elapsed < HANG_LIMIT_S - 5, f"took {elapsed:.0f}s: the job hung"
    assert "[rank 1 of 2] call FAILED" in out and "only rank 1 fails" in out, out
