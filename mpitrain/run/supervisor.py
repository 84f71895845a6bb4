"""The restart loop: launch the job, watch it, and launch it again when it fails.

    attempt 0, 1, ...:  hosts (discovery, or -H/--hostfile) minus the blacklist
                        -> n = min(--max-np, their slots), refused below --min-np
                        -> the engine's command with MPITRAIN_RESTART_COUNT=attempt (plus
                           SLURM_RESTART_COUNT: a requeued job resumes as a restart does)
                        -> run it, passing its output through and reading who failed
    exit 0              done
    exit 2 (bad input)  done, exit 2: a usage error, which a restart cannot mend
    exit 32 (preempted) done, exit 32 -- unless --restart-on-preempt and the signal reached a
                        rank rather than this launcher; not counted as a failure
    anything else       a failure: the hosts named in the failure report get a strike (one
                        too many: blacklisted), then a restart after a backoff (--restart-delay,
                        doubled each time, at most MAX_DELAY_S), until --max-restarts is spent.
                        With several hosts, each is first probed with one rank of ``true``
                        (in parallel, PROBE_TIMEOUT_S): where some cannot run it, they alone
                        get the strike -- a host that died whole (no word from it, its link
                        gone) leaves the ranks on the others to crash, and the failure
                        report then names those survivors

Every launch gets MPITRAIN_CHECKPOINT_PROBE, a file that a job which reads its checkpoints
creates (mt.checkpoint.load_latest, python -m mpitrain with --checkpoint-dir:
train/checkpoint.py's ``note_resumable``); at the first restart of a job that did not, one line
says that it starts over (a relaunched ``python -m mpitrain`` with --checkpoint-dir resumes
without --resume-if-exists).

A stop signal to the launcher (SIGTERM, SIGUSR1, SIGINT, SIGHUP) is forwarded to the job -- the
ranks write a checkpoint at the next step and exit 32 -- and ends the loop. Open MPI's mpirun
kills the ranks on SIGTERM, so it is sent SIGUSR1 instead (the default --preempt-signals has
it); so is srun, which kills the job step on SIGTERM and forwards SIGUSR1 to the tasks. The
job runs in a session of its own, so a Ctrl-C at the terminal reaches it once, through
here. Its life is tied to this launcher's: should the launcher die without a word (SIGKILL, out
of memory), the kernel sends the MPI launcher SIGTERM (Linux's PR_SET_PDEATHSIG), which
forwards it to the ranks, as a stop signal would be -- a job is never left training
unsupervised, to race a launcher started again on its checkpoint folder (which the job's lock
refuses meanwhile, runtime/folder_lock.py).
"""
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mpitrain.run import engines, slurm
from mpitrain.run.hosts import Blacklist, LaunchError, discover, placement, take

EXIT_USAGE = 2               # train/cli.py's (and argparse's): bad input, one line
EXIT_PREEMPTED = 32          # train/cli.py's: every rank stopped after the same checkpoint
EXIT_BELOW_MIN = 3           # fewer usable slots than --min-np
MAX_DELAY_S = 60.0
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
TAIL_LINES = 400             # output lines kept per launch to find who failed
PROBE_TIMEOUT_S = 30         # a host that cannot start one rank of `true` in this is down


class Supervisor:
    """One mpitrainrun: ``settings`` (cli.py's parsed arguments), ``env`` for the ranks."""

    def __init__(self, settings, engine, env, out=None, err=None):
        self.s, self.engine, self.env = settings, engine, env
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.blacklist = Blacklist(settings.blacklist_after)
        self.job = None
        self.stopped = None        # the signal that reached this launcher, or None
        self.probe = None          # the file a job that reads its checkpoints creates
        self.requeues = slurm.requeues(env)   # a requeued Slurm job is a relaunch too

    def say(self, text):
        print(f"mpitrainrun: {text}", file=self.err, flush=True)

    def hosts(self):
        """This attempt's hosts (None: wherever the launcher puts ranks) and rank count."""
        s = self.s
        found = discover(s.host_discovery_script) if s.host_discovery_script else s.hosts
        if found is None:
            return None, s.np
        usable = self.blacklist.usable(found)
        slots = sum(n for _, n in usable)
        n = min(s.max_np, slots)
        if n < s.min_np:
            left = ", ".join(h for h, _ in found if h in self.blacklist)
            raise BelowMinimum(f"{slots} usable slot(s) on {len(usable)} host(s), fewer than "
                               f"--min-np {s.min_np}" + (f" (blacklisted: {left})" if left
                                                         else ""))
        return take(usable, n), n

    def run(self):
        """The whole supervised job; its exit code."""
        s, restarts, failures, delay = self.s, 0, 0, self.s.restart_delay
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        probe_dir = tempfile.TemporaryDirectory(prefix="mpitrainrun-")
        self.probe = os.path.join(probe_dir.name, "resumable")
        try:
            while True:
                try:
                    hosts, n = self.hosts()
                except BelowMinimum as exc:
                    if restarts == 0:
                        raise LaunchError(str(exc)) from None
                    self.say(f"stopping: {exc}")
                    return EXIT_BELOW_MIN
                code, lines = self.launch(hosts, n, restarts)
                if code == 0 or self.stopped is not None:
                    return code
                if code == EXIT_USAGE:
                    self.say("the job exited 2, bad input: a restart cannot mend it, so it is "
                             "not restarted")
                    return code
                if code == EXIT_PREEMPTED:
                    if not s.restart_on_preempt:
                        self.say("the job was preempted (exit 32); --restart-on-preempt "
                                 "restarts it")
                        return code
                    self.say("the job was preempted (exit 32): restarting it")
                    restarts += 1       # not a failure: no strike, no backoff, no budget
                    delay = s.restart_delay
                    continue
                self.strike(lines, hosts, n)
                if failures >= s.max_restarts:
                    self.say(f"giving up: the job failed with exit code {code}"
                             + (f" after {failures} restart(s) (--max-restarts "
                                f"{s.max_restarts})" if s.max_restarts else
                                " (--max-restarts 0: no restarts)"))
                    return code
                restarts, failures = restarts + 1, failures + 1
                self.say(f"the job failed with exit code {code}; restart {failures} of "
                         f"{s.max_restarts} in {delay:g} s")
                if failures == 1 and not os.path.exists(self.probe):
                    self.say("the job read no checkpoint (mt.checkpoint.load_latest, or "
                             "python -m mpitrain --checkpoint-dir): the restart begins "
                             "from the start")
                if self._sleep(delay):
                    return code
                delay = min(MAX_DELAY_S, delay * 2)
        except LaunchError as exc:          # a discovery script that broke between launches
            self.say(f"error: {exc}")
            return 2
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            probe_dir.cleanup()

    def strike(self, lines, hosts, n):
        """Count a failure against the hosts the failure report names."""
        if hosts is None:
            return
        blamed, ranks = engines.blame(lines, placement(hosts, n))
        down = self.unreachable(hosts) if len(hosts) > 1 else []
        if down:
            self.say(f"{', '.join(down)} cannot start a rank: "
                     f"{'it is' if len(down) == 1 else 'they are'} taken for the failure")
            blamed = down
        for host in blamed:
            if self.blacklist.fail(host):
                self.say(f"blacklisting host {host} after {self.s.blacklist_after} failure(s)")
        if self.s.verbose and (blamed or ranks):
            self.say(f"failed: ranks {ranks or '?'} on hosts {blamed or '?'}")

    def unreachable(self, hosts):
        """The ``hosts`` where the launcher cannot start one rank of ``true``."""
        def starts(host):
            argv = engines.command(self.engine, 1, [(host, 1)], ["true"], self.s.mpi_args,
                                   (), self.s.mpiexec)
            try:
                return subprocess.run(argv, env=self.env, capture_output=True,
                                      timeout=PROBE_TIMEOUT_S).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False

        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            ok = list(pool.map(starts, [host for host, _ in hosts]))
        return [host for (host, _), up in zip(hosts, ok) if not up]

    def launch(self, hosts, n, restarts):
        """Run one launch to its end: (exit code, the last output lines)."""
        s = self.s
        argv = engines.command(self.engine, n, hosts, s.command, s.mpi_args,
                               engines.exported_names(self.env, s.export), s.mpiexec)
        env = dict(self.env, MPITRAIN_RESTART_COUNT=str(restarts + self.requeues))
        if self.probe is not None:
            env["MPITRAIN_CHECKPOINT_PROBE"] = self.probe
        if s.verbose or restarts:
            where = f" on {engines.spell(hosts)}" if hosts else ""
            self.say(f"launch {restarts}: {n} rank(s){where}")
        if s.verbose:
            self.say("running: " + " ".join(_quote(a) for a in argv))
        try:
            self.job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=_dies_with(os.getpid()))
        except OSError as exc:
            raise LaunchError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        lines = []
        pumps = [threading.Thread(target=_pump, args=(pipe, sink, lines), daemon=True)
                 for pipe, sink in ((self.job.stdout, self.out), (self.job.stderr, self.err))]
        for pump in pumps:
            pump.start()
        code = self.job.wait()
        for pump in pumps:
            pump.join()
        self.job = None
        return (128 - code if code < 0 else code), lines

    def _forward(self, signum, frame):
        """A stop signal to the launcher: pass it to the job and stop restarting."""
        self.stopped = signum
        job = self.job
        if job is None:
            return
        try:
            job.send_signal(engines.forwarded(self.engine, signum))
        except OSError:
            pass

    def _sleep(self, seconds):
        """Back off; True if a stop signal came meanwhile."""
        end = time.monotonic() + seconds
        while self.stopped is None and time.monotonic() < end:
            time.sleep(min(0.1, end - time.monotonic()))
        return self.stopped is not None


PR_SET_PDEATHSIG = 1          # <linux/prctl.h>


def _dies_with(parent):
    """The ``preexec_fn`` tying a child to ``parent`` (this launcher): SIGTERM when it dies.
    Linux only (prctl); elsewhere None, and the job outlives a launcher killed with SIGKILL."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def tie():                       # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:   # the launcher died before the tie held
            os.kill(os.getpid(), signal.SIGTERM)
    return tie


class BelowMinimum(Exception):
    """Fewer usable slots than --min-np."""


def _pump(pipe, sink, lines):
    """Copy the job's output through, keeping the last TAIL_LINES lines."""
    for raw in iter(pipe.readline, b""):
        text = raw.decode(errors="replace")
        sink.write(text)
        sink.flush()
        lines.append(text.rstrip("\n"))
        if len(lines) > TAIL_LINES:
            del lines[:len(lines) - TAIL_LINES]
    pipe.close()


def _quote(arg):
    return arg if arg and all(c.isalnum() or c in "-_./:=,@%+" for c in arg) else repr(arg)


__all__ = ["Supervisor", "EXIT_PREEMPTED", "EXIT_BELOW_MIN"]
