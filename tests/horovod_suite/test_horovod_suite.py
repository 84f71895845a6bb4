"""Horovod's own test_torch.py against mpitrain.torch (run.py, started as a program), as one
pytest test: skipped unless HOROVOD_SOURCE names a horovod/horovod checkout; otherwise every
test Horovod's file holds, except those run.py lists as out of scope, must pass or skip at
N = 2 and 3 (HOROVOD_SUITE_SIZES to choose; at N = 1 the process-set tests add an empty set,
which mpitrain refuses). Run it as one process: it starts its own mpiexec jobs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "run.py"


@pytest.mark.skipif(not os.environ.get("HOROVOD_SOURCE"),
                    reason="HOROVOD_SOURCE (a horovod/horovod checkout) is not set")
def test_horovod_suite_passes():
    sizes = os.environ.get("HOROVOD_SUITE_SIZES", "2,3")
    p = subprocess.run([sys.executable, str(RUN), "--sizes", sizes], timeout=7200)
    assert p.returncode == 0, "Horovod's suite failed (the lines above)"
