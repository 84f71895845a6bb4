"""``mpitrainrun`` / ``python -m mpitrain.run``: the flags, checked into one settings object.

    mpitrainrun -np 8 -H a:4,b:4 python -m mpitrain --checkpoint-dir ck --resume-if-exists ...

Everything after the launcher's own flags is the command every rank runs. Bad input (no hosts,
slots < 1, an unknown launcher, a discovery script that fails or prints something else, -np
outside [--min-np, --max-np]) is one line and exit code 2, before anything is launched.
Inside a Slurm allocation without -H, --hostfile or a discovery script, the hosts and slots
are the allocation's (run/slurm.py), so -np defaults to its task count.
``mpitrainrun --check-build`` launches nothing: it runs ``python -m mpitrain.info`` (what this
installation has) in a child process: the launcher itself never initialises MPI.
"""
import argparse
import os
import shlex
import subprocess
import sys

from mpitrain.run import engines, slurm
from mpitrain.run.hosts import LaunchError, discover, parse_hosts, read_hostfile
from mpitrain.run.supervisor import Supervisor

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise LaunchError(message)


def build_parser():
    p = _Parser(prog="mpitrainrun", allow_abbrev=False,
                description="Run COMMAND on N ranks through the MPI launcher (MPICH's mpiexec, "
                            "Open MPI's mpirun or Slurm's srun) and restart it when it fails.",
                epilog="Exit codes: 0 done; 2 bad launcher input; 3 fewer usable slots than "
                       "--min-np after a failure; 32 preempted (a checkpoint was written); "
                       "otherwise the job's last exit code.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                   help="ranks to start (default: the slots of -H / --hostfile / discovery)")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="hosts and their slots, e.g. a:4,b:4 (default: this machine)")
    p.add_argument("--hostfile", metavar="FILE",
                   help="one host per line: host:slots, 'host slots=N' or host")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="a command printing host:slots lines, run before every launch")
    p.add_argument("--min-np", type=int, metavar="N",
                   help="fewest ranks to relaunch with after hosts were lost (default: -np)")
    p.add_argument("--max-np", type=int, metavar="N",
                   help="most ranks to launch (default: -np)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="relaunches after failures (default: 0)")
    p.add_argument("--blacklist-after", type=int, default=2, metavar="K",
                   help="leave a host out after it failed K times (default: 2)")
    p.add_argument("--restart-delay", type=float, default=1.0, metavar="SECONDS",
                   help="wait before the first restart, doubled each time up to 60 (default: 1)")
    p.add_argument("--restart-on-preempt", action="store_true",
                   help="relaunch a job whose ranks were preempted (exit 32); not counted as a "
                        "failure")
    p.add_argument("--launcher", default="auto", choices=engines.LAUNCHERS,
                   help="the MPI launcher (default auto: srun inside a Slurm allocation, else "
                        "what --mpiexec is)")
    p.add_argument("--mpiexec", default=None, metavar="PATH",
                   help="mpiexec/mpirun to run (default: the one beside this Python, else PATH)")
    p.add_argument("--mpi-args", default="", metavar="'ARGS'",
                   help="extra arguments for the launcher, e.g. '-launcher fork'")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=VALUE]",
                   help="pass VAR to every rank (every MPITRAIN_* variable is passed anyway)")
    p.add_argument("--verbose", action="store_true", help="print every command it runs")
    p.add_argument("--check-build", action="store_true",
                   help="print what this installation has (python -m mpitrain.info) and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...")
    return p


def parse(argv, environ):
    """(settings, environ for the ranks) from ``argv``; LaunchError on bad input."""
    s = build_parser().parse_args(argv)
    if s.check_build:
        return s, dict(environ)
    if not s.command:
        raise LaunchError("no command to run (mpitrainrun -np N COMMAND ...)")
    if s.hosts is not None and s.hostfile is not None:
        raise LaunchError("give -H or --hostfile, not both")
    if s.host_discovery_script and (s.hosts is not None or s.hostfile is not None):
        raise LaunchError("--host-discovery-script replaces -H / --hostfile; give one of them")
    s.hosts = (parse_hosts(s.hosts) if s.hosts is not None
               else read_hostfile(s.hostfile) if s.hostfile is not None else None)
    if (s.hosts is None and not s.host_discovery_script
            and engines.in_slurm(s.launcher, environ)):
        s.hosts = slurm.allocation(environ)       # None outside an allocation
    found = discover(s.host_discovery_script) if s.host_discovery_script else s.hosts
    slots = None if found is None else sum(n for _, n in found)
    if s.np is None:
        if found is None:
            raise LaunchError("give -np N (or hosts: -H, --hostfile, --host-discovery-script)")
        s.np = min(s.max_np or slots, slots)
    s.min_np = s.np if s.min_np is None else s.min_np
    s.max_np = s.np if s.max_np is None else s.max_np
    for flag, value, low in (("-np", s.np, 1), ("--min-np", s.min_np, 1),
                             ("--max-np", s.max_np, 1), ("--max-restarts", s.max_restarts, 0),
                             ("--blacklist-after", s.blacklist_after, 1),
                             ("--restart-delay", s.restart_delay, 0)):
        if value < low:
            raise LaunchError(f"{flag} {value}: must be >= {low}")
    if not s.min_np <= s.np <= s.max_np:
        raise LaunchError(f"-np {s.np} must lie in [--min-np {s.min_np}, --max-np {s.max_np}]")
    if slots is not None and slots < s.min_np:
        raise LaunchError(f"{slots} slot(s) on {len(found)} host(s), fewer than --min-np "
                          f"{s.min_np}")
    try:
        s.mpi_args = shlex.split(s.mpi_args)
    except ValueError as exc:
        raise LaunchError(f"--mpi-args {s.mpi_args!r}: {exc}") from None
    env = dict(environ)               # the ranks' environment: this one and the -x values
    names = []
    for item in s.export:
        name, eq, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum():
            raise LaunchError(f"-x {item!r}: expected VAR or VAR=VALUE")
        if eq:
            env[name] = value
        elif name not in env:
            raise LaunchError(f"-x {name}: not set in this environment (or give -x "
                              f"{name}=VALUE)")
        names.append(name)
    s.export = names
    s.mpiexec = s.mpiexec or engines.default_mpiexec()
    return s, env


def main(argv=None, environ=None):
    """Console-script entry point; returns the exit code (see the parser's epilog)."""
    environ = os.environ if environ is None else environ
    try:
        settings, env = parse(sys.argv[1:] if argv is None else argv, environ)
        if settings.check_build:
            return check_build(env)
        engine = engines.detect(settings.launcher, settings.mpiexec, env)
        supervisor = Supervisor(settings, engine, env)
    except LaunchError as exc:
        print(f"mpitrainrun: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return supervisor.run()


def check_build(environ):
    """``--check-build``: ``python -m mpitrain.info`` alone, its exit code."""
    return subprocess.call([sys.executable, "-m", "mpitrain.info"], env=environ)


def console():
    """The ``mpitrainrun`` console script."""
    sys.exit(main())


__all__ = ["build_parser", "parse", "main", "check_build", "console", "EXIT_USAGE"]
