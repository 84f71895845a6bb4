"""Where Open MPI's mpirun behaves differently from MPICH's mpiexec, pinned (MPIEXEC must be
Open MPI's mpirun: ``make test-openmpi``; skipped under any other launcher).

- Ctrl-C: hydra passes SIGINT to the ranks (one ``interrupted at step`` line, exit 130);
  mpirun sends them SIGTERM, which they take as a preemption: a checkpoint at the next step
  and one ``preempted (SIGTERM)`` line; mpirun's own exit code is then not 32.
- mpitrainrun forwards a stop signal to mpirun as SIGUSR1 (mpirun would kill the ranks on
  SIGTERM): the ranks checkpoint and the launcher exits 32.
- 8- and 16-bit integer sums: Open MPI 4.1's vectorised reductions (its op/avx component)
  saturate instead of wrapping around, so our allreduce takes its own ring for them.
- A rank's error line comes with mpirun's boxed help texts unless quiet
  (OMPI_MCA_orte_execute_quiet=1, which make test-openmpi sets).
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.launch import MPIEXEC, child_env, open_mpi

pytestmark = pytest.mark.skipif(not open_mpi(), reason=f"{MPIEXEC} is not Open MPI's mpirun")
SMALL = ["--dataset", "synthetic", "--synthetic-samples", "512", "--hidden", "8",
         "--batch-size", "16", "--no-progress", "--steps", "100000", "--eval-every", "16",
         "--checkpoint-dir", "ck", "--checkpoint-every", "16"]
LIMIT_S = 120


def interrupt_after_step_32(cmd, cwd, sig):
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 32:"):
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def preempted_line(err):
    lines = [x for x in err.splitlines() if x.startswith("mpitrain: preempted")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.mark.timeout(LIMIT_S + 30)
def test_ctrl_c_reaches_the_ranks_as_sigterm_and_they_checkpoint(tmp_path):
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain", *SMALL]
    code, err = interrupt_after_step_32(cmd, tmp_path, signal.SIGINT)
    line = preempted_line(err)
    assert line.startswith("mpitrain: preempted (SIGTERM) after step "), line
    step = int(line.split()[5].rstrip(";"))
    assert (tmp_path / "ck" / f"ckpt-{step:08d}.npz").exists(), sorted((tmp_path / "ck").iterdir())
    assert code not in (0, 124), code             # mpirun's exit code, not the ranks' 32


@pytest.mark.timeout(LIMIT_S + 30)
def test_mpitrainrun_stops_open_mpi_ranks_with_sigusr1_and_exits_32(tmp_path):
    cmd = [sys.executable, "-m", "mpitrain.run", "--mpiexec", MPIEXEC, "-np", "2",
           sys.executable, "-m", "mpitrain", *SMALL]
    code, err = interrupt_after_step_32(cmd, tmp_path, signal.SIGTERM)
    assert code == 32, err[-2000:]
    assert preempted_line(err).startswith("mpitrain: preempted (SIGUSR1) after step "), err


@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16"])
def test_small_integer_sums_wrap_around_as_in_c(tmp_path, dtype):
    script = tmp_path / "wrap.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from mpi4py import MPI
        import mpitrain as mt
        mt.init()
        info = np.iinfo("{dtype}")
        x = np.full(64, info.max - 1, "{dtype}")            # 2 ranks: 2 max - 2 overflows
        want = (x.astype(np.int64) * mt.size()).astype("{dtype}")   # modular, as C
        got = mt.allreduce(x, op=mt.Sum)
        assert np.array_equal(got, want), (got[:4], want[:4])
        raw = x.copy()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)
        print("MPI_Allreduce wraps" if np.array_equal(raw, want) else "MPI_Allreduce saturates")
    """))
    env = child_env(MPITRAIN_ALLREDUCE="mpi")
    p = subprocess.run(["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", "2", sys.executable,
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
