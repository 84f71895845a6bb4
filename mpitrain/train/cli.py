"""Command line of ``mpirun -np N python -m mpitrain``: flags -> Config -> setup.run.

One flag per Config field, generated from the field metadata in config.py, so the flag, the
``MPITRAIN_<NAME>`` variable and the default can never disagree. Flags only override what they
name (argparse.SUPPRESS), which gives the layering defaults < env < flags.

Bad input is a ``UsageError`` (or the data layer's ``DataError``): every rank reaches it from the
same config (or from a value agreed across ranks in setup.py), rank 0 alone prints one line, and
every rank exits with code 2 -- no traceback from N ranks, no MPI Abort, no file written. The
flags and variables themselves are agreed too (``parse_everywhere``): a rank launched with a bad
one, alone, does not leave the others waiting for it in MPI. A file
that cannot be written mid-run (a full disk) is the same on every rank too: one line, exit code
1. A stop signal (--preempt-signals: SIGTERM, SIGUSR1) is one line on rank 0 after the next step
and its checkpoint, exit code 32 on every rank (EXIT_PREEMPTED: not a failure; the launcher
restarts it with --restart-on-preempt). Ctrl-C is one line on rank 0 with the step reached and
the last checkpoint, exit code 130, and the process ends without MPI_Finalize (``finish``): a
rank the signal did not reach may still wait in a collective, and the launcher ends it. During
the steps SIGINT is a step flag (train/preempt.py), so every rank stops after the same step,
whichever ranks it reached, and waits for rank 0's line before it exits.
"""
import argparse
import os
import sys

from mpitrain.runtime import env
from mpitrain.runtime.errors import DataError, Interrupted, OutputError, Preempted, UsageError
from mpitrain.train import config as cfg
from mpitrain.train.flag_types import field_type, parse_value

EXIT_USAGE = 2
EXIT_OUTPUT = 1
EXIT_INTERRUPTED = 130      # 128 + SIGINT, as a shell reports Ctrl-C
# One bit: MPICH's mpiexec reports the OR of the ranks' codes, so a failure's code (1, 2, 9,
# 130, ...) ORed in still shows; 32 alone means every rank stopped after the same checkpoint.
EXIT_PREEMPTED = 32


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse would print usage + message on every rank; we want one line on rank 0.
        # Our converters already name the flag, so drop argparse's "argument --x: " prefix.
        if message.startswith("argument --") and ": --" in message:
            message = message.split(": ", 1)[1]
        raise UsageError(message)

    def print_help(self, file=None):
        if _rank() == 0:
            super().print_help(file)


def build_parser():
    parser = _Parser(prog="python -m mpitrain",
                     description="Data-parallel training over MPI "
                                 "(mpirun -np N python -m mpitrain [flags]). Every flag can also "
                                 "be set as MPITRAIN_<FLAG_NAME> in the environment; flags win.",
                     argument_default=argparse.SUPPRESS)
    fields = {f.name: f for f in cfg.fields()}
    for section, title, names in cfg.SECTIONS:
        group = parser.add_argument_group(f"{section}: {title}")
        for name in names:
            _add_flag(group, fields[name])
    return parser


def _add_flag(parser, f):
    """The flag of Config field ``f`` (and its off flag, e.g. --no-progress)."""
    flag = "--" + f.name.replace("_", "-")
    kind = field_type(f)
    help_text = f"{f.metadata['help']} [env {cfg.env_name(f.name)}]"
    if kind is bool:
        off = f.metadata.get("off_flag")
        on_help = f"the default: {help_text}" if f.default else help_text
        parser.add_argument(flag, dest=f.name, action="store_true", help=on_help)
        if off:  # e.g. --no-progress; the last of the two flags wins
            off_flag = "--" + off.replace("_", "-")
            parser.add_argument(off_flag, dest=f.name, action="store_false",
                                help=f"turn {flag} off [env {cfg.env_name(off)}=1]"
                                if f.default else f"undo {flag} (the default)")
    else:
        default = f.default if f.default is not None else "-"
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        choices = f.metadata.get("choices")
        if choices:                             # the choices, or a path after a prefix
            choices = (*choices, *(f"{p}PATH" for p in f.metadata["path_prefixes"]))
        metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
        parser.add_argument(flag, dest=f.name, type=_typed(f), metavar=metavar,
                            help=f"{help_text} (default: {default})")


def _typed(f):
    def convert(text):
        try:
            return parse_value(f, text, "--" + f.name.replace("_", "-"))
        except UsageError as exc:  # argparse only keeps the text of an ArgumentTypeError
            raise argparse.ArgumentTypeError(str(exc))
    convert.__name__ = f.name  # argparse names the type in its own messages
    return convert


def parse(argv=None, environ=None):
    """Config from defaults < environment < ``argv`` (default sys.argv[1:]), validated. A job
    that mpitrainrun relaunched (MPITRAIN_RESTART_COUNT > 0) with a --checkpoint-dir resumes
    from it as with --resume-if-exists: the relaunch continues the run the failure cut."""
    config = cfg.from_env(environ)
    flags = vars(build_parser().parse_args(argv))
    config = config.replace(**flags).validate()
    # train/checkpoint.py's restart_count(), read here without importing MPI
    relaunch = env.integer("MPITRAIN_RESTART_COUNT", 0, minimum=0, environ=environ)
    if config.checkpoint_dir and not config.resuming and relaunch > 0:
        config = config.replace(resume_if_exists=True)
        if _rank() == 0:
            print(f"mpitrain: relaunch {relaunch} (mpitrainrun): resuming from the newest "
                  f"checkpoint in {config.checkpoint_dir}", flush=True)
    return config


def _rank():
    """This process's rank, without starting MPI if nothing has yet."""
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except ImportError:
        pass
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def parse_everywhere(argv=None):
    """``parse(argv)`` on every rank of the job, the outcome agreed: a bad flag or
    ``MPITRAIN_*`` value on some ranks only (an MPMD launch, one host's environment) is the same
    UsageError on every rank, naming those ranks, and ``--help`` on any rank is its exit on
    every rank. Parsed alone, such a rank would end while the others wait for it in their first
    collective for ever."""
    from mpitrain import comm
    try:
        config, outcome = parse(argv), None
    except UsageError as exc:
        config, outcome = None, ("error", str(exc))
    except SystemExit as exc:                       # --help
        config, outcome = None, ("exit", exc.code)
    try:
        comm.init(threads=None)                     # the budget is config.threads (setup.py)
    except (ValueError, comm.CollectiveError) as exc:
        raise UsageError(str(exc)) from None
    every = comm.allgather_object(outcome) if comm.size() > 1 else [outcome]
    failed = [(r, o[1]) for r, o in enumerate(every) if o is not None and o[0] == "error"]
    if failed:
        message = failed[0][1]
        if len(failed) < len(every):
            ranks = [r for r, m in failed if m == message]
            message += f" (on rank{'s' if len(ranks) > 1 else ''} {ranks} of {len(every)})"
        raise UsageError(message)
    exits = [o[1] for o in every if o is not None]
    if exits:
        raise SystemExit(exits[0])
    return config


def run_cli(argv=None):
    """Parse and train; bad input, an unwritable output and Ctrl-C are one line on rank 0 and
    exit codes EXIT_USAGE, EXIT_OUTPUT and EXIT_INTERRUPTED (returned, not raised)."""
    from mpitrain.train.setup import run
    try:
        run(parse_everywhere(argv))
    except (UsageError, DataError) as exc:
        return _fail(f"mpitrain: error: {exc}", EXIT_USAGE)
    except OutputError as exc:
        return _fail(f"mpitrain: error: {exc}", EXIT_OUTPUT)
    except Interrupted as exc:
        code = _fail(f"mpitrain: {exc}", EXIT_INTERRUPTED)
        if exc.agreed:      # the other ranks wait for rank 0's line before any of them exits
            _wait_for_every_rank()
        return code
    except Preempted as exc:
        return _fail(f"mpitrain: {exc}", EXIT_PREEMPTED)
    except KeyboardInterrupt:                   # while parsing or importing
        return _fail("mpitrain: interrupted while starting", EXIT_INTERRUPTED)
    except SystemExit as exc:  # --help: printed on rank 0, exit code 0 everywhere
        return exc.code
    return 0


def _fail(line, code):
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    return code


def _wait_for_every_rank():
    from mpitrain import comm
    try:
        comm.barrier()
    except comm.CollectiveError:        # a rank already gone: the launcher ends the job
        pass


def finish(code):
    """End the process with ``code``. After Ctrl-C without MPI_Finalize: a rank the signal did
    not reach may wait in a collective for ever, and finalising would wait for it; a process
    that exits without it makes the launcher end the job."""
    if code == EXIT_INTERRUPTED:
        from mpitrain import comm
        comm.exit_now(code)
    sys.exit(code)


def main(argv=None):
    """Console-script entry point (``mpitrain ...``); same as ``python -m mpitrain``."""
    from mpitrain import comm
    comm.install_abort_hook()
    finish(run_cli(argv))


__all__ = ["build_parser", "parse", "parse_everywhere", "main", "run_cli", "finish", "EXIT_USAGE", "EXIT_OUTPUT",
           "EXIT_INTERRUPTED", "EXIT_PREEMPTED"]
