"""A Slurm cluster on the namespace hosts (tests/support/netns_hosts.py): one ``slurmctld`` in
the root namespace, one ``slurmd`` in every host's namespace, munge for their credentials.

``SlurmCluster(cluster)`` writes a key, a ``slurm.conf`` and the daemons' folders into one
temporary folder, starts ``munged`` (its own socket there), ``slurmctld`` (listening on the
bridge's address) and one ``slurmd -N hostK`` per host, and waits until every node is idle.
Each ``slurmd`` enters only its host's network namespace (``nsenter --net``) and a UTS
namespace with the host's name: ``ip netns exec`` would mount a fresh /sys without the cgroup
hierarchies that slurmd insists on finding. Jobs run as root with proctrack/pgid and no task
plugin, since the namespaces share one kernel and one cgroup tree. A requeued job waits for
the credentials of its last run to expire (cred_expire: 10 s here, Slurm's default 120 s).

``env()`` is what a client (sbatch, srun, scontrol) and the jobs need: SLURM_CONF and the
cluster's own variables. ``close()`` stops every daemon and removes the folder; the daemons of
a cluster whose creator died are stopped by the next ``SlurmCluster``.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support import netns_hosts

PREFIX = "mts"
START_TIMEOUT_S = 60
CONF = """\
ClusterName=mpitrain
SlurmctldHost={controller}({address})
SlurmctldPort={port}
SlurmdPort={port_d}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
JobRequeue=1
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class SlurmError(RuntimeError):
    """The Slurm daemons would not start, or a job did not reach the state waited for."""


def unavailable():
    """None when Slurm and munge are installed, else one line saying what is missing."""
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "nsenter")
               if shutil.which(p) is None]
    if missing:
        return f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return netns_hosts.unavailable()


def _kill_where(matches):
    """SIGKILL every process whose command line ``matches(text)`` holds for."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if matches(argv):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def sweep():
    """Stop the daemons of clusters whose creating process is gone (their folder in argv)."""
    own = re.compile(rf"/{PREFIX}(\d+)-")

    def orphaned(argv):
        m = own.search(argv)
        return bool(m) and not netns_hosts.alive(int(m.group(1)))
    _kill_where(orphaned)


class SlurmCluster:
    """Slurm on ``cluster``'s hosts, ``cpus`` cores each; see the module docstring."""

    def __init__(self, cluster, cpus=2):
        why = unavailable()
        if why:
            raise SlurmError(why)
        sweep()
        self.cluster = cluster
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.conf = self.dir / "slurm.conf"
        self.daemons = []
        try:
            self._start(cpus)
        except BaseException:
            self.close()
            raise

    def _start(self, cpus):
        for sub in ("state", "log", *(f"spool/{h}" for h in self.cluster.names)):
            (self.dir / sub).mkdir(parents=True)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._run(["munged", f"--key-file={key}", f"--socket={self.dir}/munge.sock",
                   f"--pid-file={self.dir}/munged.pid", f"--seed-file={self.dir}/munge.seed",
                   f"--log-file={self.dir}/log/munged.log", "--force"])
        port = 20000 + os.getpid() % 20000
        nodes = "\n".join(f"NodeName={h} NodeAddr={self.cluster.address(h)} CPUs={cpus} "
                          f"State=UNKNOWN" for h in self.cluster.names)
        self.conf.write_text(CONF.format(
            controller=socket.gethostname().split(".")[0],
            address=f"{self.cluster.subnet}.254", port=port, port_d=port + 1, dir=self.dir,
            nodes=nodes, names=",".join(self.cluster.names)))
        self._run(["slurmctld", "-f", str(self.conf)])
        for host in self.cluster.names:
            ns = f"/run/netns/{self.cluster.namespace(host)}"
            self._run(["nsenter", f"--net={ns}", "unshare", "--uts", "sh", "-c",
                       'hostname "$0" && exec slurmd -f "$1" -N "$0"', host, str(self.conf)])
        self.wait_nodes("idle")

    def _run(self, argv):
        p = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise SlurmError(f"{argv[0]}: exit {p.returncode}: {p.stderr.strip()[-500:]}"
                             f"\n{self.logs()}")

    def env(self, **extra):
        """The environment of a Slurm client in the root namespace (the test)."""
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def logs(self, tail=20):
        """The last lines of every daemon's log, for a failure message."""
        out = []
        for log in sorted((self.dir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"== {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def command(self, *argv, check=True, timeout_s=60):
        """Run a Slurm client (``scontrol``, ``squeue``, ``scancel``...); its stdout."""
        p = subprocess.run(argv, env=self.env(), capture_output=True, text=True,
                           timeout=timeout_s)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def nodes(self):
        """{node: state} as sinfo reports it (idle, alloc, mix, drain, down...)."""
        out = self.command("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state, timeout_s=START_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                now = self.nodes()
            except SlurmError:
                now = {}
            if len(now) == len(self.cluster.names) and all(
                    s.rstrip("*~#") == state for s in now.values()):
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes {now}, not all {state} after {timeout_s} s\n"
                                 f"{self.logs()}")
            time.sleep(0.5)

    def sbatch(self, *args, env=None, cwd=None):
        """``sbatch --parsable ARGS``: the job id."""
        p = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd,
                           env=dict(env or os.environ, SLURM_CONF=str(self.conf)),
                           capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout.strip().split(";")[0]

    def job(self, job_id):
        """``scontrol show job``'s fields of ``job_id`` as a dict (JobState, ExitCode,
        Restarts, NodeList, ...)."""
        out = self.command("scontrol", "-o", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id, until, timeout_s):
        """Poll the job until ``until(fields)`` holds; its fields. SlurmError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                self.command("scancel", job_id, check=False)
                raise SlurmError(f"job {job_id}: {fields.get('JobState')} "
                                 f"(reason {fields.get('Reason')}) after {timeout_s} s\n"
                                 f"{self.logs()}")
            time.sleep(0.5)

    def close(self):
        """Stop every daemon and job of this cluster and remove its folder (idempotent)."""
        if (self.dir / "slurmctld.pid").exists():
            self.command("scancel", "--user", "root", "--full", check=False, timeout_s=20)
        own = str(self.dir)                 # in every daemon's command line
        _kill_where(lambda argv: own in argv)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
