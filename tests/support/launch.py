"""Launching ``python -m mpitrain``, or a user's script, under mpiexec from the e2e tests."""
import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = os.environ.get("MPIEXEC", str(REPO / ".venv" / "bin" / "mpiexec"))
# An outer launcher's variables (pytest itself may run under mpiexec): a child must not think
# it is a rank of that job. MPICH's child then fails PMI_Init; Open MPI's joins as the parent's
# rank and overwrites its shared-memory segment, so the parent's next collective crashes.
LAUNCHER = ("PMI_", "PMIX_", "MPI_LOCAL")
# Inside an Open MPI job its launcher's OMPI_* (ranks, daemon URIs, job ids) go too; outside
# one, OMPI_* are the user's settings. Open MPI's permission to run as root and to run more
# ranks than cores, and its quiet mode, are always kept (machine settings, not the job's).
OPEN_MPI_JOB = "OMPI_COMM_WORLD_RANK"
KEPT = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_rmaps_base_oversubscribe",
        "OMPI_MCA_orte_execute_quiet")
# Settings a CLI run must not inherit, so that the job sees only the flags the test gives it.
SETTINGS = ("MPITRAIN_", "OMPI_", "HYDRA_")
ONE_THREAD = dict(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


@functools.lru_cache(maxsize=None)
def open_mpi():
    """Whether MPIEXEC is Open MPI's mpirun (else MPICH's hydra, or another)."""
    try:
        out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(name in out.stdout + out.stderr for name in ("Open MPI", "OpenRTE", "PRRTE"))


def child_env(settings=False, **extra):
    """os.environ without the launcher's variables (and without MPITRAIN_*/Open MPI/Hydra
    settings unless ``settings``), one BLAS/Numba thread per rank, then ``extra``."""
    drop = LAUNCHER + (("OMPI_",) if OPEN_MPI_JOB in os.environ else ())
    drop += () if settings else SETTINGS
    env = {k: v for k, v in os.environ.items() if k.startswith(KEPT) or not k.startswith(drop)}
    env.update(ONE_THREAD, **extra)
    return env


def load_npz(path):
    """Every array of an .npz file (e.g. ``--save``), by name."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def assert_bitwise(a, b):
    """Two dicts of arrays (load_npz's) hold the same names, dtypes and bytes."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def saved_parameters(n, args, cwd, timeout_s=240):
    """The parameters ``python -m mpitrain *args`` at ``n`` ranks ends on (``--save``), by
    name: e.g. the uninterrupted run that a run with faults must equal."""
    run_mpitrain(n, [*args, "--save", "full.npz"], cwd, timeout_s=timeout_s)
    return load_npz(Path(cwd) / "full.npz")


def run_mpitrain(n, args, cwd, ok=True, timeout_s=120, env=None):
    """``mpiexec -n n python -m mpitrain *args`` in ``cwd`` under ``timeout`` (a hung job is
    killed, never left behind), with ``env`` (a dict) added to the environment; the
    CompletedProcess, asserted successful unless ``ok`` is False."""
    cmd = ["timeout", "-k", "5", str(timeout_s), MPIEXEC, "-n", str(n), sys.executable, "-m",
           "mpitrain", *args]
    p = subprocess.run(cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True,
                       text=True, timeout=timeout_s + 30)
    if ok:
        assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    return p
