"""The launcher's fault matrix: mpitrainrun restarts a job that lost a rank, blacklists a host
that keeps failing, stops below --min-np, resumes past a damaged checkpoint and restarts a job
the stall watchdog ended.

Faults hit an exact step (tests/support/faults.py), so nothing here depends on timing. Hosts
are emulated on this machine (MPICH's fork launcher with two names for it, ../MULTINODE.md):
localhost holds ranks 0-1, 127.0.0.1 ranks 2-3. Every job runs under ``timeout``.

The jobs train --deterministic at one global batch (--global-batch-size 16, 8 micro-shards), so
a job that lost ranks and went on at another N must still save the bytes of an uninterrupted
run, computed once at N=2.
"""
import json
import random
import re
import subprocess
import sys

import pytest

from tests.support.launch import (MPIEXEC, REPO, assert_bitwise, child_env, load_npz, open_mpi,
                                  saved_parameters)

FAULTS = str(REPO / "tests" / "support" / "faults.py")
BASE = ["--dataset", "synthetic", "--synthetic-samples", "128", "--hidden", "16",
        "--no-progress", "--seed", "5", "--momentum", "0.9", "--deterministic",
        "--global-batch-size", "16", "--steps", "24"]
HOSTS = ["-H", "localhost:2,127.0.0.1:2", "--mpi-args", "-launcher fork"]
EVERY = 4
hydra_hosts = pytest.mark.skipif(open_mpi(), reason="hosts emulated with MPICH's fork launcher "
                                 "(real hosts: tests/cluster)")
LIMIT_S = 240


def launcher(*flags, program, cwd, env=None):
    """``mpitrainrun FLAGS python faults.py BASE PROGRAM`` under ``timeout``."""
    cmd = ["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", "mpitrain.run",
           "--mpiexec", MPIEXEC, "--restart-delay", "0.2", *flags,
           sys.executable, FAULTS, *BASE, *program]
    p = subprocess.run(cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True,
                       text=True, timeout=LIMIT_S + 30)
    assert p.returncode != 124, f"timed out: {cmd}\n{p.stderr[-3000:]}"
    return p


def ckpt_flags(folder):
    return ["--checkpoint-dir", str(folder), "--checkpoint-every", str(EVERY),
            "--resume-if-exists"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The parameters of the run none of the faults touched."""
    return saved_parameters(2, BASE, tmp_path_factory.mktemp("full"), LIMIT_S)


def summary(path):
    return json.loads(path.read_text().splitlines()[-1])


def resumed_at(stdout):
    return [int(s) for s in re.findall(r"mpitrain: resumed from \S+ at step (\d+)", stdout)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_at_a_random_step_finishes_with_little_lost_work(tmp_path, seed, uninterrupted):
    """Three seeded runs (a step and a rank each); every one must end as the uninterrupted
    run did, having lost less than one checkpoint interval of steps."""
    rng = random.Random(seed)
    step, rank = rng.randint(1, 22), rng.randint(0, 1)
    ck = tmp_path / "ck"
    fault = dict(FAULT="kill", FAULT_RANK=str(rank), FAULT_STEP=str(step))
    p = launcher("-np", "2", "--max-restarts", "2",
                 program=[*ckpt_flags(ck), "--save", "out.npz", "--metrics-json", "m.jsonl"],
                 cwd=tmp_path, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 1 of 2" in p.stderr
    start = (resumed_at(p.stdout) or [0])[-1]       # none: killed before the first checkpoint
    assert 0 <= step - start < EVERY, (step, start)
    assert summary(tmp_path / "m.jsonl")["steps"] == 24
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@hydra_hosts
def test_losing_a_host_goes_on_at_half_the_ranks_with_the_same_bytes(tmp_path, uninterrupted):
    ck = tmp_path / "ck"
    fault = dict(FAULT="kill", FAULT_HOST="127.0.0.1", FAULT_STEP="9")
    p = launcher(*HOSTS, "--min-np", "2", "--max-restarts", "1", "--blacklist-after", "1",
                 program=[*ckpt_flags(ck), "--save", "out.npz", "--metrics-json", "m.jsonl"],
                 cwd=tmp_path, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mpitrainrun: blacklisting host 127.0.0.1 after 1 failure(s)" in p.stderr
    assert "mpitrainrun: launch 1: 2 rank(s) on localhost:2" in p.stderr
    assert resumed_at(p.stdout) == [8]
    assert summary(tmp_path / "m.jsonl")["ranks"] == 2
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@hydra_hosts
def test_a_host_that_keeps_failing_is_blacklisted(tmp_path, uninterrupted):
    """Ranks 2 and 3 raise at step 6 on every launch: two failures blacklist 127.0.0.1."""
    ck = tmp_path / "ck"
    fault = dict(FAULT="raise", FAULT_HOST="127.0.0.1", FAULT_STEP="6", FAULT_LAUNCH="any")
    p = launcher(*HOSTS, "--min-np", "2", "--max-restarts", "3", "--blacklist-after", "2",
                 program=[*ckpt_flags(ck), "--save", "out.npz"], cwd=tmp_path, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("injected fault at step 6") >= 2
    assert "mpitrainrun: blacklisting host 127.0.0.1 after 2 failure(s)" in p.stderr
    assert "mpitrainrun: launch 2: 2 rank(s) on localhost:2" in p.stderr
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


@hydra_hosts
def test_below_min_np_the_launcher_stops_with_one_line(tmp_path):
    fault = dict(FAULT="raise", FAULT_HOST="127.0.0.1", FAULT_STEP="2", FAULT_LAUNCH="any")
    p = launcher(*HOSTS, "--max-restarts", "3", "--blacklist-after", "1",
                 program=ckpt_flags(tmp_path / "ck"), cwd=tmp_path, env=fault)
    assert p.returncode == 3, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "mpitrainrun: stopping: 2 usable slot(s) on 1 host(s), fewer than --min-np 4 "
        "(blacklisted: 127.0.0.1)")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, uninterrupted):
    ck = tmp_path / "ck"
    fault = dict(FAULT="kill", FAULT_RANK="1", FAULT_STEP="10")
    p = launcher("-np", "2", program=ckpt_flags(ck), cwd=tmp_path, env=fault)
    assert p.returncode != 0 and "giving up" in p.stderr
    newest = ck / "ckpt-00000008.npz"
    newest.write_bytes(newest.read_bytes()[:1000])        # truncated, as by a full disk
    p = launcher("-np", "2", program=[*ckpt_flags(ck), "--save", "out.npz"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    warning = [ln for ln in p.stderr.splitlines() if ln.startswith("mpitrain: warning: skip")]
    assert len(warning) == 1 and "ckpt-00000008.npz" in warning[0], p.stderr[-3000:]
    assert resumed_at(p.stdout) == [4]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))


def test_a_stalled_rank_is_aborted_and_the_job_restarted(tmp_path, uninterrupted):
    """Rank 1 sleeps at step 5 instead of stepping; rank 0's watchdog ends the job after
    MPITRAIN_STALL_SHUTDOWN seconds, and the relaunch finishes it."""
    ck = tmp_path / "ck"
    fault = dict(FAULT="stall", FAULT_RANK="1", FAULT_STEP="5", FAULT_SLEEP_S="200",
                 MPITRAIN_STALL_SHUTDOWN="20")
    p = launcher("-np", "2", "--max-restarts", "1",
                 program=[*ckpt_flags(ck), "--save", "out.npz"], cwd=tmp_path, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "aborting the job (MPITRAIN_STALL_SHUTDOWN)" in p.stderr
    assert "restart 1 of 1" in p.stderr and resumed_at(p.stdout) == [4]
    assert_bitwise(uninterrupted, load_npz(tmp_path / "out.npz"))
