"""Hierarchical allreduce on nodes that MPI itself sees (not MPITRAIN_NODE_SIZE emulation).

MPICH's launcher makes one machine two MPI nodes, with no hostfile, ssh or root: given two host
names that both mean this machine and its fork launcher (``mpiexec -launcher fork -hosts
localhost:2,127.0.0.1:2``), ``Split_type(COMM_TYPE_SHARED)`` splits the ranks and the link
between the "nodes" is TCP over loopback. With 2+2 ranks the hierarchical allreduce runs on
MPI's own nodes and must give the flat result; with 2+1 ranks the nodes differ in size, so it
stays flat and rank 0 says why, once. Skipped without MPICH's hydra launcher.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MPIEXEC = os.environ.get("MPIEXEC", ".venv/bin/mpiexec")
MPIEXEC = _MPIEXEC if os.path.isabs(_MPIEXEC) or os.sep not in _MPIEXEC else str(ROOT / _MPIEXEC)
LIMIT_S = 120


def _hydra():
    if shutil.which(MPIEXEC) is None and not Path(MPIEXEC).exists():
        return False
    try:
        out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in out.stdout + out.stderr


pytestmark = pytest.mark.skipif(not _hydra(), reason=f"no MPICH hydra mpiexec at {MPIEXEC}")

SCRIPT = textwrap.dedent("""
    import numpy as np
    import mpitrain as mt
    from mpitrain.comm import world
    mt.init()
    n, r = mt.size(), mt.rank()
    rng = np.random.default_rng(7)
    inputs = rng.integers(-1000, 1000, (n, 10007)).astype(np.int64)     # (ranks, length)
    floats = rng.standard_normal((n, 3001))                               # (ranks, length)
    exact = mt.allreduce(inputs[r], op=mt.Sum)
    average = mt.allreduce(floats[r], op=mt.Average)
    assert np.array_equal(exact, inputs.sum(axis=0)), "integer sum differs"
    assert np.allclose(average, floats.mean(axis=0), rtol=1e-12, atol=1e-12), "average differs"
    on = world.current().node_comms is not None
    print(f"rank {r}: nodes {mt.cross_size()} x {mt.local_size()} hierarchical {on}", flush=True)
""")


def _run(tmp_path, hosts, n):
    script = tmp_path / "hier.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               MPITRAIN_HIERARCHICAL_ALLREDUCE="1", MPITRAIN_ALLREDUCE="ring",
               MPITRAIN_RING_SUBCHUNK="4096",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MPITRAIN_NODE_SIZE", None)
    env.pop("MPITRAIN_LOCAL_SIZE", None)
    proc = subprocess.run(["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-launcher", "fork",
                           "-hosts", hosts, "-n", str(n), sys.executable, str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.timeout(LIMIT_S + 30)
def test_two_mpi_nodes_of_two_run_hierarchical_and_equal_the_sums(tmp_path):
    proc = _run(tmp_path, "localhost:2,127.0.0.1:2", 4)
    # hydra forwards each rank's stdout as it comes: lines of two ranks may run together
    lines = sorted(re.findall(r"rank \d: nodes \d x \d hierarchical (?:True|False)", proc.stdout))
    assert lines == [f"rank {r}: nodes 2 x 2 hierarchical True" for r in range(4)]
    assert "ignored" not in proc.stderr


@pytest.mark.timeout(LIMIT_S + 30)
def test_nodes_of_different_sizes_stay_flat_and_say_why_once(tmp_path):
    proc = _run(tmp_path, "localhost:2,127.0.0.1:1", 3)
    assert "hierarchical False" in proc.stdout and "hierarchical True" not in proc.stdout
    assert proc.stderr.count("MPITRAIN_HIERARCHICAL_ALLREDUCE=1 ignored, the allreduce stays "
                             "flat: nodes run different numbers of ranks") == 1
