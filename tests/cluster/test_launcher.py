"""mpitrainrun across two namespace hosts: ``-H host1:2,host2:2`` trains as one job of 4, and
when host2's ranks die (kill -9 at an exact step, tests/support/faults.py) or the whole host
goes (every process in its namespace killed, hydra's proxy included), the launcher blacklists
host2 and finishes on host1 alone, from the last checkpoint, with the bytes of an uninterrupted
run (--deterministic at one global batch)."""
import subprocess
import sys
import threading
import time

import pytest

from tests.support.launch import (MPIEXEC, REPO, assert_bitwise, child_env, load_npz,
                                  saved_parameters)

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--seed", "5", "--momentum", "0.9", "--deterministic",
        "--global-batch-size", "16", "--steps", "24"]
LIMIT_S = 240


def launcher(cluster, *flags, program, cwd, env=None):
    """``mpitrainrun -H host1:2,host2:2 FLAGS python faults.py BASE PROGRAM`` into the hosts."""
    cmd = ["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", "mpitrain.run",
           "--mpiexec", MPIEXEC, "--restart-delay", "0.2", "-H", "host1:2,host2:2",
           "--mpi-args", " ".join(cluster.mpi_args()), *flags,
           sys.executable, FAULTS, *BASE, *program]
    p = subprocess.Popen(cmd, cwd=cwd, env=child_env(**cluster.env(), **(env or {})),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return cmd, p


def finish(cmd, p):
    out, err = p.communicate(timeout=LIMIT_S + 30)
    assert p.returncode != 124, f"timed out: {cmd}\n{err[-3000:]}"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The parameters of the run none of the faults touched."""
    return saved_parameters(2, BASE, tmp_path_factory.mktemp("full"), LIMIT_S)


PROGRAM = ["--checkpoint-dir", "ck", "--checkpoint-every", "4", "--save", "out.npz"]
AFTER_LOSS = ["--min-np", "2", "--max-restarts", "1", "--blacklist-after", "1"]


@pytest.mark.timeout(LIMIT_S + 60)
def test_four_ranks_on_two_hosts_train_as_one_job(cluster, tmp_path, uninterrupted):
    cmd, p = launcher(cluster, program=PROGRAM, cwd=tmp_path)
    p = finish(cmd, p)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "over 4 rank(s)" in p.stdout, p.stdout[-2000:]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@pytest.mark.timeout(LIMIT_S + 60)
def test_kill_9_of_one_hosts_ranks_goes_on_on_the_other(cluster, tmp_path, uninterrupted):
    fault = dict(FAULT="kill", FAULT_HOST="host2", FAULT_STEP="9")
    cmd, p = launcher(cluster, *AFTER_LOSS, program=PROGRAM, cwd=tmp_path, env=fault)
    p = finish(cmd, p)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mpitrainrun: blacklisting host host2 after 1 failure(s)" in p.stderr, p.stderr
    assert "mpitrainrun: launch 1: 2 rank(s) on host1:2" in p.stderr
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@pytest.mark.timeout(LIMIT_S + 60)
def test_a_host_that_dies_whole_is_left_out(cluster, tmp_path, uninterrupted):
    """host2 dies once the first checkpoint exists: every process in it (hydra's proxy and
    the ranks) killed, its link cut. Nothing from host2 reaches mpiexec, and host1's ranks
    crash for the lost peers, so the failure report names host1: the launcher must probe the
    hosts and leave host2 out instead."""
    slow = dict(FAULT="stall", FAULT_RANK="all", FAULT_STEP="6", FAULT_SLEEP_S="2",
                FAULT_LAUNCH="0")
    cmd, p = launcher(cluster, *AFTER_LOSS, program=PROGRAM, cwd=tmp_path, env=slow)
    killed = []

    def kill_host2_after_the_first_checkpoint():
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline and p.poll() is None:
            if list((tmp_path / "ck").glob("ckpt-*.npz")):
                killed.append(cluster.down("host2"))
                return
            time.sleep(0.05)

    t = threading.Thread(target=kill_host2_after_the_first_checkpoint, daemon=True)
    t.start()
    p = finish(cmd, p)
    t.join(5)
    cluster.up("host2")
    assert killed and killed[0] > 0, "host2 was never killed"
    assert p.returncode == 0, p.stderr[-3000:]
    probed = "mpitrainrun: host2 cannot start a rank: it is taken for the failure"
    assert probed in p.stderr, p.stderr
    assert "mpitrainrun: blacklisting host host2 after 1 failure(s)" in p.stderr, p.stderr
    assert "blacklisting host host1" not in p.stderr, p.stderr
    assert "mpitrainrun: launch 1: 2 rank(s) on host1:2" in p.stderr, p.stderr
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))
