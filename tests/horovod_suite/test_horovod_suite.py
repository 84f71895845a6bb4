"""Horovod's own test_torch.py against mpitrain.torch (run.py, started as ``python -m tests.horovod_suite.run``), as one
pytest test: the copy kept in upstream/ (or HOROVOD_SOURCE's checkout), the whole file in one
mpiexec job per N = 1, 2, 3 (HOROVOD_SUITE_SIZES to choose); every test it holds, except those
tests/support/horovod_scope.py lists, must pass or skip. ``make test`` runs run.py itself (test-horovod).
Run it as one process: it starts its own mpiexec jobs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)
def test_horovod_suite_passes():
    sizes = os.environ.get("HOROVOD_SUITE_SIZES", "1,2,3")
    p = subprocess.run([sys.executable, "-m", "tests.horovod_suite.run", "--one-job", "--sizes",
                        sizes], cwd=REPO, timeout=1800)
    assert p.returncode == 0, "Horovod's suite failed (the lines above)"
