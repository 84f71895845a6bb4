"""Slurm for real on the namespace hosts (tests/support/slurm_hosts.py): docs/launching.md's
sbatch script, run as a user runs it, through a whole run, preemptions (of the batch shell,
of every task, by the time limit's warning), a dead task and a drained node. Every run ends
on the bytes of an uninterrupted one (--deterministic at one global batch;
tests/support/faults.py stalls or kills at exact steps)."""
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.support import slurm_hosts
from tests.support.launch import REPO, assert_bitwise, child_env, load_npz, saved_parameters

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--seed", "5", "--momentum", "0.9", "--deterministic",
        "--global-batch-size", "16", "--steps", "24"]
ARGS = [*BASE, "--checkpoint-every", "4", "--save", "out.npz"]
LIMIT_S = 240
SETTLE_S = 20
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def page_script():
    """The sbatch script of docs/launching.md ("Slurm"), the block this file runs."""
    text = (REPO / "docs" / "launching.md").read_text()
    m = re.search(r"<!-- runs in tests/cluster/test_slurm.py -->\n```bash\n(.*?)```", text,
                  re.S)
    assert m, "docs/launching.md lost its sbatch script"
    return m.group(1)


@pytest.fixture(scope="module")
def slurm(cluster):
    why = slurm_hosts.unavailable()
    if why:
        pytest.skip(f"no Slurm: {why}")
    with slurm_hosts.SlurmCluster(cluster) as s:
        yield s


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return saved_parameters(2, BASE, tmp_path_factory.mktemp("full"), LIMIT_S)


def submit(slurm, cwd, *sbatch_args, script=None, env=None):
    """sbatch the page's script (``python -m mpitrain`` run through the fault wrapper) with
    ARGS after it, from ``cwd``; the job id."""
    text = (script or page_script()).replace("python -m mpitrain ", f"{sys.executable} "
                                             f"{FAULTS} ")
    path = Path(cwd) / "train.sh"
    path.write_text(text)
    child = child_env(**slurm.cluster.env(), **(env or {}))
    child["PYTHONPATH"] = str(REPO)
    child["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), child["PATH"]])
    return slurm.sbatch("--output", str(Path(cwd) / "job.out"), *sbatch_args, str(path),
                        *ARGS, env=child, cwd=cwd)


def output(cwd):
    path = Path(cwd) / "job.out"
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def finished(slurm, job, cwd, timeout_s=LIMIT_S):
    """Wait for the job's last run to end; its fields, asserted COMPLETED with exit 0. A run
    that requeues itself can show an ended state while Slurm requeues it: an end other than
    COMPLETED counts once it has held SETTLE_S."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(1.0, deadline - time.monotonic())
        fields = slurm.wait(job, lambda f: f["JobState"] in DONE, left)
        if fields["JobState"] == "COMPLETED" or time.monotonic() > deadline:
            break
        time.sleep(SETTLE_S)
        again = slurm.job(job)
        if (again["JobState"], again["Restarts"]) == (fields["JobState"], fields["Restarts"]):
            break
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        f"{fields['JobState']} {fields['ExitCode']}\n{output(cwd)[-4000:]}")
    return fields


def first_checkpoint(cwd, timeout_s=LIMIT_S):
    """Wait until the run has written a checkpoint (it is past step 4)."""
    deadline = time.monotonic() + timeout_s
    while not list((Path(cwd) / "ck").glob("ckpt-*.npz")):
        assert time.monotonic() < deadline, f"no checkpoint\n{output(cwd)[-3000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(LIMIT_S + 60)
def test_the_page_script_trains_on_the_allocation(slurm, tmp_path, uninterrupted):
    job = submit(slurm, tmp_path)
    fields = finished(slurm, job, tmp_path)
    assert fields["NodeList"] == "host[1-2]" and fields["Restarts"] == "0"
    assert "over 4 rank(s)" in output(tmp_path), output(tmp_path)[-3000:]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


# Stalled for 20 s after step 6 on the first run only: the signal comes before the stall ends.
STALL = dict(FAULT="stall", FAULT_RANK="all", FAULT_STEP="6", FAULT_SLEEP_S="20")


@pytest.mark.timeout(LIMIT_S + 60)
@pytest.mark.parametrize("who", [["--batch"], []], ids=["batch-shell", "every-task"])
def test_scancel_signal_term_checkpoints_requeues_and_resumes(slurm, tmp_path, uninterrupted,
                                                              who):
    job = submit(slurm, tmp_path, env=STALL)
    first_checkpoint(tmp_path)
    slurm.command("scancel", *who, "--signal=TERM", job)
    fields = finished(slurm, job, tmp_path)
    out = output(tmp_path)
    assert fields["Restarts"] == "1", out[-3000:]
    # the signal comes at step 5 to 7 (the first checkpoint is of step 4; the stall is before
    # step 7), and every rank stops after the same step
    m = re.search(r"mpitrain: preempted \(SIG(TERM|USR1)\) after step (\d+)", out)
    assert m and 5 <= int(m.group(2)) <= 7, out[-3000:]
    step = int(m.group(2))
    assert f"resumed from ck/ckpt-{step:08d}.npz at step {step}" in out, out[-3000:]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@pytest.mark.timeout(LIMIT_S + 180)
def test_the_time_limit_warning_signal_b_term(slurm, tmp_path, uninterrupted):
    """--time=3 --signal=B:TERM@120: Slurm signals the batch shell 30 to 60 s into the run
    (its controller looks every 30 s, and signals when the warning time falls before its next
    look) while the first run crawls (4 s a step: it would need 90 s), long before the limit;
    the requeued run goes at full speed and is done before its own warning could come."""
    slow = dict(FAULT="slow", FAULT_RANK="all", FAULT_STEP="2", FAULT_SLEEP_S="4")
    job = submit(slurm, tmp_path, "--time=3", "--signal=B:TERM@120", env=slow)
    fields = finished(slurm, job, tmp_path, timeout_s=LIMIT_S + 120)
    out = output(tmp_path)
    assert int(fields["Restarts"]) >= 1, out[-3000:]
    assert "mpitrain: preempted (SIGUSR1)" in out, out[-3000:]
    assert "mpitrain: relaunch 1 (mpitrainrun): resuming from the newest checkpoint" in out
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


KILL_SCRIPT = """#!/bin/bash
#SBATCH --nodes 2 --ntasks-per-node 2
exec mpitrainrun --min-np 2 --max-restarts 1 --blacklist-after 1 --restart-delay 0.2 \\
    --mpi-args=--mpi=pmi2 python -m mpitrain --checkpoint-dir ck "$@"
"""


@pytest.mark.timeout(LIMIT_S + 60)
def test_a_task_killed_srun_ends_the_step_and_host2_is_left_out(slurm, tmp_path,
                                                                uninterrupted):
    kill = dict(FAULT="kill", FAULT_HOST="host2", FAULT_STEP="9")
    job = submit(slurm, tmp_path, script=KILL_SCRIPT, env=kill)
    finished(slurm, job, tmp_path)
    out = output(tmp_path)
    assert re.search(r"srun: error: host2: tasks? [\d-]+: Killed", out), out[-3000:]
    assert "mpitrainrun: blacklisting host host2 after 1 failure(s)" in out, out[-3000:]
    assert "mpitrainrun: launch 1: 2 rank(s) on host1:2" in out, out[-3000:]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@pytest.mark.timeout(2 * LIMIT_S + 60)
def test_a_node_drained_mid_job(slurm, tmp_path, uninterrupted):
    """host2 drained while the job runs on both hosts: Slurm lets the job finish there (it
    ends bitwise), then takes no new work to host2; the next job (--nodes 1-2) gets host1
    alone, and mpitrainrun runs the 2 ranks of that allocation, again to the same bytes."""
    stall = dict(STALL, FAULT_SLEEP_S="8")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    job = submit(slurm, first, env=stall)
    first_checkpoint(first)
    try:
        slurm.command("scontrol", "update", "NodeName=host2", "State=DRAIN",
                      "Reason=maintenance")
        assert slurm.nodes()["host2"].startswith("drng"), slurm.nodes()   # draining
        fields = finished(slurm, job, first)
        assert fields["NodeList"] == "host[1-2]" and "over 4 rank(s)" in output(first)
        assert_bitwise(uninterrupted, load_npz(first / "out.npz"))
        assert slurm.nodes()["host2"].startswith("drain"), slurm.nodes()
        fields = finished(slurm, submit(slurm, second, "--nodes", "1-2"), second)
    finally:
        slurm.command("scontrol", "update", "NodeName=host2", "State=RESUME", check=False)
    assert fields["NodeList"] == "host1" and "over 2 rank(s)" in output(second), \
        output(second)[-3000:]
    assert_bitwise(uninterrupted, load_npz(second / "out.npz"))
