"""Open MPI across the namespace hosts: its mpirun starts one daemon per host through the same
wrapper (as its ssh, ``plm_rsh_agent``), the daemons call back over the bridge and the ranks
talk TCP over eth0 (``btl_tcp_if_include``), shared memory inside a host. The collective cases
(numpy and torch) at 2 hosts x 2 ranks, under the Open MPI venv (make venv-openmpi; skipped
without it). test_allreduce.py stays out: its thousands of small allreduces take minutes when
Open MPI's polling ranks oversubscribe two cores."""
import os
import re
import subprocess

import pytest

from tests.support.launch import REPO, child_env

MPIRUN = os.environ.get("MPIRUN_OPENMPI", "/usr/bin/mpirun.openmpi")
PYTHON = os.environ.get("OPENMPI_PYTHON", str(REPO / ".venv-openmpi" / "bin" / "python"))
SUITE = ["tests/mpi/test_collectives.py",
         "tests/mpi/test_torch_collectives.py"]
LIMIT_S = 300
ROOT_AND_CORES = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                  "OMPI_MCA_rmaps_base_oversubscribe": "1"}

pytestmark = pytest.mark.skipif(not (os.access(MPIRUN, os.X_OK) and os.access(PYTHON, os.X_OK)),
                                reason=f"no Open MPI ({MPIRUN}) or its venv ({PYTHON})")


def mpirun(cluster, hosts, n, argv):
    cmd = ["timeout", "-k", "5", str(LIMIT_S), MPIRUN, *cluster.openmpi_args(),
           "--host", hosts, "-np", str(n), PYTHON, *argv]
    env = child_env(**ROOT_AND_CORES)
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=LIMIT_S + 30)


@pytest.mark.timeout(LIMIT_S + 60)
def test_open_mpi_ranks_see_two_nodes_across_the_link(cluster):
    script = ("import socket; import mpitrain as mt; mt.init(); "
              "print(f'rank {mt.rank()} {socket.gethostname()} nodes {mt.cross_size()} x "
              "{mt.local_size()}', flush=True)")
    p = mpirun(cluster, "host1:2,host2:2", 4, ["-c", script])
    assert p.returncode == 0, p.stderr[-3000:]
    found = sorted(re.findall(r"rank \d host\d nodes \d x \d", p.stdout))
    assert found == [f"rank {r} host{1 + r // 2} nodes 2 x 2" for r in range(4)], p.stdout


@pytest.mark.timeout(LIMIT_S + 60)
def test_the_collective_suite_passes_under_open_mpi_across_hosts(cluster):
    p = mpirun(cluster, "host1:2,host2:2", 4,
               ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITE])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
