"""The MPI launchers mpitrainrun drives -- MPICH's hydra ``mpiexec``, Open MPI's ``mpirun``,
Slurm's ``srun`` -- their command lines, and what their failure reports say about who failed.

    mpich    mpiexec -n N [-hosts a:4,b:4] [MPI_ARGS] COMMAND
             hydra passes the whole environment to every rank (its -genvall default)
    openmpi  mpirun -np N [--host a:4,b:4] -x MPITRAIN_... -x VAR [MPI_ARGS] COMMAND
             Open MPI passes only the variables named with -x: every MPITRAIN_* one and the
             -x names are listed
    slurm    srun --ntasks N [--nodes K --nodelist a,b --distribution block] --export ALL
             --kill-on-bad-exit=1 [MPI_ARGS] COMMAND          (inside an allocation)

``detect`` picks one for ``--launcher auto``: slurm inside a Slurm allocation (SLURM_JOB_ID set
and srun found), else whatever ``mpiexec --version`` says it is.
"""
import os
import re
import shutil
import signal
import subprocess
import sys

from mpitrain.run.hosts import LaunchError, spell

ENGINES = ("mpich", "openmpi", "slurm")
LAUNCHERS = ("auto",) + ENGINES
PREFIX = "MPITRAIN_"
# srun's report of a failed task, and its line when it goes on to end the rest of the step
# (--kill-on-bad-exit): what it reports after that line is its own doing
SRUN_FAILED = re.compile(r"^srun: error: ([^:\s]+): tasks? (\d+)")
SRUN_AFTERMATH = re.compile(r"^srun: (launch/slurm: _step_signal: Terminating|Job step aborted|"
                            r"forcing job termination)")
# Who failed, read from the launcher's and the ranks' output: (pattern, group of the host,
# group of the rank); either may be None.
BLAME = (
    (re.compile(r"PID \d+ RUNNING AT (\S+)"), 1, None),                    # hydra, a signal
    (re.compile(r"\(rank (\d+) in comm \d+\)"), None, 1),                  # MPICH, MPI_Abort
    (re.compile(r"^\[rank (\d+)\] uncaught exception"), None, 1),          # the abort hook
    (re.compile(r"missing ranks \[(\d+)"), None, 1),                       # the stall watchdog
    (re.compile(r"process rank (\d+) with PID \d+ on node (\S+)"), 2, 1),  # Open MPI
    (SRUN_FAILED, 1, 2),                                                   # Slurm
    (re.compile(r"^ssh: connect to host (\S+) port \d+"), 1, None),        # a host down
    (re.compile(r"^ssh: Could not resolve hostname ([^:\s]+)"), 1, None),   # a host gone
)


def default_mpiexec():
    """The mpiexec beside this Python (the ``mpich`` wheel's in a venv), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def detect(launcher, mpiexec, environ):
    """The engine of ``--launcher`` (auto: see the module docstring); LaunchError if none."""
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if in_slurm(launcher, environ):
        return "slurm"
    if launcher != "auto":
        return launcher
    if not mpiexec:
        raise LaunchError("no mpiexec found (install the mpich wheel: pip install mpich, or "
                          "give --mpiexec PATH)")
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"--mpiexec {mpiexec}: cannot run it ({exc})") from None
    return kind_of(out.stdout + out.stderr, mpiexec)


def in_slurm(launcher, environ):
    """Whether ``--launcher`` means srun: slurm, or auto inside an allocation with srun."""
    return launcher == "slurm" or (launcher == "auto" and bool(environ.get("SLURM_JOB_ID"))
                                   and shutil.which("srun", path=environ.get("PATH")) is not None)


def kind_of(version_text, mpiexec="mpiexec"):
    """'mpich' or 'openmpi' from ``mpiexec --version``'s text; LaunchError for anything else."""
    if "HYDRA" in version_text or "MPICH" in version_text:
        return "mpich"
    if "Open MPI" in version_text or "OpenRTE" in version_text or "PRRTE" in version_text:
        return "openmpi"
    first = (version_text.strip().splitlines() or ["no output"])[0]
    raise LaunchError(f"{mpiexec} is neither MPICH's nor Open MPI's ({first!r}); give "
                      f"--launcher mpich|openmpi|slurm")


def command(engine, n, hosts, program, mpi_args=(), exported=(), mpiexec="mpiexec"):
    """The argv that starts ``n`` ranks of ``program`` (a list) on ``hosts`` ([(name, slots)]
    or None: wherever the launcher puts them). ``exported``: variable names the ranks must
    see (Open MPI's -x; the others pass the whole environment)."""
    if engine == "mpich":
        where = ["-hosts", spell(hosts)] if hosts else []
        return [mpiexec, "-n", str(n), *where, *mpi_args, *program]
    if engine == "openmpi":
        where = ["--host", spell(hosts)] if hosts else []
        names = [arg for name in exported for arg in ("-x", name)]
        return [mpiexec, "-np", str(n), *where, *names, *mpi_args, *program]
    if engine == "slurm":
        where = []
        if hosts:
            where = ["--nodes", str(len(hosts)), "--nodelist",
                     ",".join(name for name, _ in hosts), "--distribution", "block"]
        return ["srun", "--ntasks", str(n), *where, "--export", "ALL",
                "--kill-on-bad-exit=1", *mpi_args, *program]
    raise LaunchError(f"unknown launcher {engine!r}")


def forwarded(engine, signum):
    """The signal to pass the launcher for a stop signal ``signum``: SIGUSR1 for SIGTERM where
    the launcher would kill the ranks on SIGTERM instead of forwarding it (Open MPI's mpirun;
    srun, which ends the job step) and forwards SIGUSR1 to them."""
    if engine in ("openmpi", "slurm") and signum == signal.SIGTERM:
        return signal.SIGUSR1
    return signum


def exported_names(environ, extra):
    """Every MPITRAIN_* variable of ``environ`` and the ``extra`` names, sorted, once each."""
    return sorted({k for k in environ if k.startswith(PREFIX)} | set(extra))


def blame(lines, ranks_to_hosts):
    """(hosts, ranks) named as failed in the launcher's and ranks' output ``lines``; a rank's
    host comes from ``ranks_to_hosts`` (the placement of the launch). srun reports the tasks
    it killed itself, after the first failure (--kill-on-bad-exit), as failed too: its
    reports after its own SRUN_AFTERMATH line do not count."""
    hosts, ranks = [], []
    aftermath = False
    for line in lines:
        aftermath = aftermath or bool(SRUN_AFTERMATH.search(line))
        for pattern, host_group, rank_group in BLAME:
            if aftermath and pattern is SRUN_FAILED:
                continue
            m = pattern.search(line)
            if not m:
                continue
            rank = int(m.group(rank_group)) if rank_group else None
            host = m.group(host_group) if host_group else ranks_to_hosts.get(rank)
            if rank is not None and rank not in ranks:
                ranks.append(rank)
            if host is not None and host not in hosts:
                hosts.append(host)
    return hosts, ranks
