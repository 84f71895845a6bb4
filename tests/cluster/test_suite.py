"""The collective test suite (tests/mpi) across two namespace hosts: 2 hosts x 1 rank (every
message on the link), 2 x 2 (shared memory inside a host, TCP between), and 2 x 2 with the
hierarchical allreduce on, so that every allreduce the suite makes runs on MPI's own nodes
(there without the two files that check the settings are their defaults: test_errors.py and
test_hierarchical.py, which switches hierarchical on and off itself, on the same real nodes)."""
import sys

import pytest

LIMIT_S = 300
SUITE = ["tests/mpi/test_collectives.py", "tests/mpi/test_allreduce.py",
         "tests/mpi/test_errors.py", "tests/mpi/test_hierarchical.py",
         "tests/mpi/test_torch_collectives.py"]

SETTINGS_DEFAULTS = ("test_errors.py", "test_hierarchical.py")


@pytest.mark.timeout(LIMIT_S + 60)
@pytest.mark.parametrize("hosts, n, hierarchical", [("host1:1,host2:1", 2, "0"),
                                                    ("host1:2,host2:2", 4, "0"),
                                                    ("host1:2,host2:2", 4, "1")],
                         ids=["2x1", "2x2", "2x2-hierarchical"])
def test_the_collective_suite_passes_across_hosts(cluster, hosts, n, hierarchical):
    suite = [f for f in SUITE if hierarchical == "0" or not f.endswith(SETTINGS_DEFAULTS)]
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *suite]
    p = cluster.launch(hosts, n, argv, env={"MPITRAIN_HIERARCHICAL_ALLREDUCE": hierarchical},
                       timeout_s=LIMIT_S)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
