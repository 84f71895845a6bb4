"""mpitrainrun inside a Slurm allocation, without Slurm: the hosts and slots it reads from the
allocation's variables, and a requeued job counted as a relaunch."""
import signal

import pytest

from mpitrain.run import cli, engines, slurm
from mpitrain.run.hosts import LaunchError
from mpitrain.run.supervisor import Supervisor


@pytest.mark.parametrize("nodelist, names", [
    ("node1", ["node1"]),
    ("host[1-2]", ["host1", "host2"]),
    ("n[01-03,7]x,m", ["n01x", "n02x", "n03x", "n7x", "m"]),
    ("gpu[8-10],cpu[1-2]", ["gpu8", "gpu9", "gpu10", "cpu1", "cpu2"]),
    ("r[1-2]c[1-2]", ["r1c1", "r1c2", "r2c1", "r2c2"]),
])
def test_hostlist_expressions(nodelist, names):
    assert slurm.expand(nodelist) == names


@pytest.mark.parametrize("bad", ["n[1-2", "n]1[", "n[3-1]", "n[a-b]"])
def test_bad_hostlists_are_one_line(bad):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        slurm.expand(bad)


def test_tasks_per_node():
    assert slurm.counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        slurm.counts("2x3")


def test_allocation_and_requeues():
    env = {"SLURM_JOB_NODELIST": "host[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm.allocation(env) == [("host1", 2), ("host2", 2), ("host3", 1)]
    assert slurm.allocation({}) is None
    with pytest.raises(LaunchError, match="gives 1 node"):
        slurm.allocation(dict(env, SLURM_TASKS_PER_NODE="4"))
    assert slurm.requeues({}) == 0 and slurm.requeues({"SLURM_RESTART_COUNT": "2"}) == 2


def allocation(tmp_path):
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "host[1-2]",
            "SLURM_TASKS_PER_NODE": "2(x2)", "PATH": str(tmp_path)}


def test_inside_an_allocation_the_hosts_and_np_are_its_own(tmp_path):
    env = allocation(tmp_path)
    s, _ = cli.parse(["python", "t.py"], env)
    assert s.hosts == [("host1", 2), ("host2", 2)] and s.np == 4
    s, _ = cli.parse(["-np", "2", "python", "t.py"], env)
    assert s.hosts == [("host1", 2), ("host2", 2)] and s.np == 2
    s, _ = cli.parse(["-H", "host2:1", "python", "t.py"], env)     # -H wins
    assert s.hosts == [("host2", 1)]
    s, _ = cli.parse(["--launcher", "mpich", "-np", "2", "python", "t.py"], env)
    assert s.hosts is None                              # not srun: not the allocation's hosts


def test_a_requeued_job_is_launched_as_a_relaunch(tmp_path):
    """SLURM_RESTART_COUNT=1: the first launch already has MPITRAIN_RESTART_COUNT=1, so
    python -m mpitrain --checkpoint-dir resumes (train/cli.py) without --resume-if-exists."""
    env = dict(allocation(tmp_path), SLURM_RESTART_COUNT="1")
    seen = tmp_path / "seen"
    srun = tmp_path / "srun"
    srun.write_text(f"#!/bin/sh\necho $MPITRAIN_RESTART_COUNT > {seen}\n")
    s, env = cli.parse(["true"], env)
    assert Supervisor(s, "slurm", env).run() == 0
    assert seen.read_text().strip() == "1"


def test_a_bad_restart_count_is_one_line_and_exit_2(tmp_path, capsys):
    env = dict(allocation(tmp_path), SLURM_RESTART_COUNT="x")
    assert cli.main(["true"], env) == 2
    assert "SLURM_RESTART_COUNT 'x': not a count" in capsys.readouterr().err


def test_srun_killing_the_rest_of_the_step_is_not_their_failure():
    """srun's report as seen when host2's task 2 was killed with kill -9: the tasks of host1
    that srun then ended itself (--kill-on-bad-exit) are not blamed."""
    report = ["srun: error: host2: tasks 2-3: Killed",
              "srun: launch/slurm: _step_signal: Terminating StepId=5.0",
              "slurmstepd-host1: error: *** STEP 5.0 ON host1 CANCELLED AT 2026-12-02 ***",
              "srun: error: host1: tasks 0-1: Killed"]
    where = {0: "host1", 1: "host1", 2: "host2", 3: "host2"}
    assert engines.blame(report, where) == (["host2"], [2])


def test_srun_gets_sigusr1_for_a_stop_signal():
    """srun ends the job step on SIGTERM ("forcing job termination") but forwards SIGUSR1."""
    assert engines.forwarded("slurm", signal.SIGTERM) == signal.SIGUSR1
    assert engines.forwarded("openmpi", signal.SIGTERM) == signal.SIGUSR1
    assert engines.forwarded("mpich", signal.SIGTERM) == signal.SIGTERM
    assert engines.forwarded("slurm", signal.SIGINT) == signal.SIGINT
