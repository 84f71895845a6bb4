"""Bad input on some ranks only: an MPMD launch (``mpiexec -n 1 A : -n 1 B``) where one rank's
flags or ``MPITRAIN_*`` variables do not parse. That rank must not end alone while the others
wait for it in MPI: every rank exits 2, and rank 0 prints the one line, naming the ranks.

Every job runs under ``timeout -k 5 120`` (exit 124 or 137: it hung).
"""
import subprocess
import sys

import pytest

from tests.support.launch import MPIEXEC, child_env

FLAGS = ["-m", "mpitrain", "--dataset", "synthetic", "--synthetic-samples", "64", "--hidden",
         "8", "--steps", "2", "--no-progress"]


def mpmd(good, bad_env=(), bad_flags=()):
    """``good`` ranks with FLAGS, then one rank with ``bad_env`` (-env NAME VALUE) and
    ``bad_flags`` added; the CompletedProcess."""
    env_args = [a for name, value in bad_env for a in ("-env", name, value)]
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", str(good), sys.executable, *FLAGS, ":",
           "-n", "1", *env_args, sys.executable, *FLAGS, *bad_flags]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode not in (124, 137), f"hung: {cmd}\n{proc.stderr[-2000:]}"
    return proc


@pytest.mark.parametrize("good", [1, 2])
def test_a_bad_variable_on_one_rank_is_one_line_exit_2(good):
    p = mpmd(good, bad_env=[("MPITRAIN_BATCH_SIZE", "abc")])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("mpitrain: error: MPITRAIN_BATCH_SIZE='abc'"), lines
    assert lines[0].endswith(f"(on rank [{good}] of {good + 1})"), lines


@pytest.mark.parametrize("good", [1, 2])
def test_an_unknown_flag_on_one_rank_is_one_line_exit_2(good):
    p = mpmd(good, bad_flags=["--bogus-flag"])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert lines == [f"mpitrain: error: unrecognized arguments: --bogus-flag (on rank [{good}] "
                     f"of {good + 1})"], p.stderr


def test_help_on_one_rank_ends_every_rank():
    p = mpmd(1, bad_flags=["--help"])
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "mpitrain: 2 rank(s)" not in p.stdout          # nobody trained
