"""What a new user meets first: never hang, never drift, one line per mistake.

Each test launches ``mpiexec`` (or python) itself under a hard ``timeout``: exit code 124 would
mean a hung job that had to be killed.
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.launch import MPIEXEC, REPO, child_env, open_mpi, run_mpitrain

SMALL = ["--dataset", "synthetic", "--synthetic-samples", "512", "--hidden", "8",
         "--batch-size", "16", "--no-progress"]


def launch(argv, cwd, timeout_s=90, env=None, **kw):
    """``timeout mpiexec argv...``; the CompletedProcess."""
    return subprocess.run(["timeout", "-k", "5", str(timeout_s), MPIEXEC, *argv], cwd=cwd,
                          env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout_s + 30, **kw)


def lines(text):
    return [line for line in text.splitlines() if line.strip()]


# -- never hang ----------------------------------------------------------------------------------
OWN_SCRIPT = """
import numpy as np
import mpitrain as mt

mt.init()
mt.allreduce(np.ones(3), name="warm-up")
if mt.rank() == {bad}:
    open("/nonexistent/folder/checkpoint.npz", "wb")     # FileNotFoundError on one rank
mt.allreduce(np.ones(3), name="train_accuracy")          # the others wait here
print("unreachable on every rank")
"""


@pytest.mark.parametrize("n", [2, 3])
def test_an_exception_on_one_rank_of_an_own_script_ends_the_job(tmp_path, n):
    bad = n - 1
    (tmp_path / "port.py").write_text(OWN_SCRIPT.format(bad=bad))
    t0 = time.monotonic()
    p = launch(["-n", str(n), sys.executable, "port.py"], tmp_path, timeout_s=60)
    took = time.monotonic() - t0
    assert p.returncode not in (0, 124, 137), (p.returncode, p.stderr[-2000:])
    assert f"[rank {bad}] uncaught exception" in p.stderr and "FileNotFoundError" in p.stderr
    assert "unreachable" not in p.stdout
    assert took < 45, f"{took:.0f} s: the job waited instead of ending"


def test_init_installs_the_abort_hook_unless_told_not_to(tmp_path):
    script = textwrap.dedent("""
        import sys
        import mpitrain as mt
        before = sys.excepthook
        mt.init(abort_on_exception=sys.argv[1] == "on")
        print("installed" if getattr(sys.excepthook, "_mpitrain_abort", False) else
              "untouched" if sys.excepthook is before else "other")
    """)
    out = [subprocess.run([sys.executable, "-c", script, flag], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=120).stdout.strip()
           for flag in ("on", "off")]
    assert out == ["installed", "untouched"]


# -- never drift ---------------------------------------------------------------------------------
def test_ranks_with_different_hyper_parameters_are_one_line_and_exit_2(tmp_path):
    python = [sys.executable, "-m", "mpitrain", *SMALL, "--steps", "3"]
    p = launch(["-n", "1", *python, "--lr", "0.05", ":", "-n", "1", *python, "--lr", "0.1"],
               tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines(p.stderr) == ["mpitrain: error: ranks were started with different settings: "
                               "--lr: 0.05 on ranks [0], 0.1 on ranks [1]"], p.stderr


def test_a_different_batch_size_per_rank_is_one_line_not_a_traceback(tmp_path):
    python = [sys.executable, "-m", "mpitrain", *SMALL, "--steps", "3"]
    p = launch(["-n", "2", *python, ":", "-n", "1", *python, "--batch-size", "8"], tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    (line,) = lines(p.stderr)
    assert "--batch-size: 16 on ranks [0, 1], 8 on ranks [2]" in line, line


def test_an_mpitrain_variable_that_differs_across_ranks_is_refused(tmp_path):
    python = [sys.executable, "-m", "mpitrain", *SMALL, "--steps", "3"]
    p = launch(["-n", "1", "env", f"MPITRAIN_DATA={tmp_path}", *python, ":", "-n", "1", *python],
               tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    (line,) = lines(p.stderr)
    assert f"MPITRAIN_DATA: '{tmp_path}' on ranks [0], None on ranks [1]" in line, line


def test_a_misspelled_variable_is_one_warning_with_the_closest_name(tmp_path):
    env = child_env(MPITRAIN_BATCHSIZE="32")
    p = launch(["-n", "2", sys.executable, "-m", "mpitrain", *SMALL, "--steps", "2"], tmp_path,
               env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert lines(p.stderr) == ["mpitrain: warning: MPITRAIN_BATCHSIZE is not an mpitrain "
                               "setting and is ignored; did you mean MPITRAIN_BATCH_SIZE?"]


def test_an_own_script_hears_of_a_misspelled_variable_too(tmp_path):
    env = child_env(MPITRAIN_HIERARCHICAL_ALLREDUC="1")
    p = launch(["-n", "2", sys.executable, "-c", "import mpitrain as mt; mt.init()"], tmp_path,
               env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert lines(p.stderr) == ["mpitrain: warning: MPITRAIN_HIERARCHICAL_ALLREDUC is not an "
                               "mpitrain setting and is ignored; did you mean "
                               "MPITRAIN_HIERARCHICAL_ALLREDUCE?"]


# -- one line per mistake ------------------------------------------------------------------------
# MPI_Init first (the shared-memory transport makes files larger than the limit), then a limit
# on the size of every file this process writes: a disk that fills up mid-run.
FULL_DISK = """
import resource, runpy, sys
from mpi4py import MPI
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
runpy.run_module("mpitrain", run_name="__main__", alter_sys=True)
"""


def test_a_full_disk_mid_run_is_one_line_and_keeps_what_was_written(tmp_path):
    (tmp_path / "full_disk.py").write_text(FULL_DISK)
    p = launch(["-n", "2", sys.executable, "full_disk.py", "60000", *SMALL, "--epochs", "40",
                "--eval-every", "1", "--checkpoint-dir", "ck", "--checkpoint-every", "16",
                "--metrics-json", "m.jsonl"], tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert lines(p.stderr) == ["mpitrain: error: cannot write --metrics-json m.jsonl: "
                               "File too large"]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) > 100 and records[-1]["step"] > 100     # no torn last line
    from mpitrain import checkpoint as ckpt
    found = ckpt.list_checkpoints(tmp_path / "ck")
    assert len(found) == 3 and all(ckpt.load(path).step == step for step, path in found)


def test_a_checkpoint_that_does_not_fit_on_disk_is_one_line_and_no_partial_file(tmp_path):
    (tmp_path / "full_disk.py").write_text(FULL_DISK)
    p = launch(["-n", "2", sys.executable, "full_disk.py", "40000", *SMALL, "--epochs", "2",
                "--checkpoint-dir", "ck", "--checkpoint-every", "16"], tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert lines(p.stderr) == ["mpitrain: error: cannot write a checkpoint into ck: "
                               "File too large"]
    assert os.listdir(tmp_path / "ck") == []


@pytest.mark.skipif(open_mpi(), reason="Open MPI's mpirun turns Ctrl-C into SIGTERM for the "
                    "ranks: tests/e2e/test_openmpi.py")
def test_ctrl_c_is_one_line_with_the_step_and_the_last_checkpoint(tmp_path):
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", *SMALL, "--steps", "100000",
           "--eval-every", "16", "--checkpoint-dir", "ck", "--checkpoint-every", "16"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:                     # training runs: evaluation lines come
            if line.startswith("step 32:"):
                break
        proc.send_signal(signal.SIGINT)             # the launcher passes Ctrl-C to every rank
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:                     # never leave a job behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    (line,) = [x for x in lines(err) if not x.startswith("[mpiexec@")]
    assert line.startswith("mpitrain: interrupted at step "), line
    assert line.endswith(" in ck (--resume continues from it)"), line
    step, last = int(line.split()[4].rstrip(";")), int(line.split()[10])
    assert step >= 32 and last % 16 == 0 and step - 16 <= last <= step, line


def test_resume_from_a_folder_that_does_not_exist_is_refused(tmp_path):
    p = run_mpitrain(2, [*SMALL, "--steps", "3", "--checkpoint-dir", "typo", "--resume"],
                     tmp_path, ok=False)
    assert p.returncode == 2
    (line,) = lines(p.stderr)
    assert "--resume: --checkpoint-dir typo does not exist" in line
    assert not (tmp_path / "typo").exists()


def test_resume_if_exists_starts_fresh_then_resumes(tmp_path):
    flags = [*SMALL, "--checkpoint-dir", "ck", "--resume-if-exists"]
    first = run_mpitrain(2, [*flags, "--steps", "3"], tmp_path)
    assert "no checkpoint in ck; starting at step 0" in first.stdout
    second = run_mpitrain(2, [*flags, "--steps", "5"], tmp_path)
    assert "at step 3" in second.stdout


def test_keep_checkpoints(tmp_path):
    run_mpitrain(1, [*SMALL, "--steps", "6", "--checkpoint-dir", "ck", "--checkpoint-every", "1",
                     "--keep-checkpoints", "2"], tmp_path)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-00000005.npz", "ckpt-00000006.npz"]


def test_a_batch_that_drops_much_of_the_data_says_so(tmp_path):
    p = run_mpitrain(2, [*SMALL, "--batch-size", "200", "--epochs", "1"], tmp_path)
    assert lines(p.stderr) == ["mpitrain: warning: a global batch of 400 samples leaves 112 of "
                               "the 512 training samples (22%) untrained every epoch; --uneven "
                               "trains them too"]
    quiet = run_mpitrain(2, [*SMALL, "--epochs", "1"], tmp_path)        # 512 = 16 x 32
    assert lines(quiet.stderr) == []


# -- the first five minutes ----------------------------------------------------------------------
def test_a_clone_named_mpitrain_beside_the_script_is_the_package(tmp_path):
    (tmp_path / "mpitrain").symlink_to(REPO, target_is_directory=True)
    (tmp_path / "train.py").write_text("import mpitrain as mt\nmt.init()\n"
                                       "print('ok', mt.size(), hasattr(mt, 'allreduce'))\n")
    env = child_env()
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok 1 True", p.stderr[-2000:]


def test_a_log_gets_no_progress_bar_and_the_resolved_thread_count(tmp_path):
    args = [a for a in SMALL if a != "--no-progress"]
    p = run_mpitrain(2, [*args, "--epochs", "1"], tmp_path)
    assert "\r" not in p.stderr and lines(p.stderr) == []         # stderr is a pipe here
    assert "step 16: test accuracy" in p.stdout                   # the evaluation line
    assert re.search(r"\bthreads=1\b", p.stdout) and "threads=0" not in p.stdout
    assert "1 thread(s)" in p.stdout
