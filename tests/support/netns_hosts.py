"""Hosts on one machine: Linux network namespaces joined by a bridge, with a shapeable link.

``Cluster(2)`` builds hosts ``host1``, ``host2``, ...: each is a network namespace with its own
``eth0`` (a veth pair whose other end sits on a bridge in the root namespace) and, for every
process launched into it, its own hostname (a UTS namespace). The root namespace holds the
bridge's address, which MPICH's mpiexec gives its proxies to call back to (``-iface``).

Launching: hydra's ssh launcher with ``-launcher-exec`` pointing at a tiny wrapper written per
cluster (``hostexec HOST COMMAND``: ``ip netns exec`` into the host's namespace, ``unshare
--uts`` and ``hostname HOST``, then the command), so ``mpiexec -hosts host1:2,host2:2`` starts
one proxy per host exactly as ssh would, and MPI sees two nodes: ranks on one host talk over
shared memory, ranks on two hosts over TCP through the hosts' ``eth0``. No sshd is needed.

One thing differs from real hosts: the namespaces share one kernel, so UCX (MPICH's default
network module) would see one machine and carry inter-host messages through shared memory.
``env()`` restricts UCX to TCP (and libfabric to ``eth0``) so that inter-host traffic takes the
link, as it must on real hosts; intra-host traffic still uses MPICH's own shared memory.

Shaping: ``shape(rate)`` puts a token bucket (tc ``tbf``) on every host's ``eth0`` egress, so
both directions of every inter-host path run at ``rate``; ``delay`` adds netem's delay where
the kernel has netem (else ClusterError). ``tx_bytes(host)`` reads a host's ``eth0``
counter: what crossed the link.

Everything is removed on ``close()`` / leaving the ``with`` block, also when a test fails; a
cluster whose creator died (pid in the names) is swept by the next ``Cluster``.
``python -m tests.support.netns_hosts up|down`` builds or removes one for a benchmark by hand.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support import launch

PREFIX = "mtn"                 # every name this module creates starts with it (+ the pid)
WRAPPER = """#!/bin/sh
# ssh-like launcher for the hosts of {tag}: hostexec [-options] HOST COMMAND...
while [ "${{1#-}}" != "$1" ]; do shift; done
case "$1" in
{cases}
  *) echo "hostexec: no host $1 in this cluster ({names})" >&2; exit 255 ;;
esac
host=$1; shift
if [ -e "{folder}/$host.down" ]; then
  echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255
fi
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$*"' "$host" "$@"
"""


class ClusterError(RuntimeError):
    """The machine cannot build the hosts (not root, no namespaces, no iproute2)."""


def _ip(*args, check=True):
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep():
    """Remove the namespaces and bridges of clusters whose creating process is gone."""
    own = re.compile(rf"^{PREFIX}(\d+)")
    for name in _ip("netns", "list", check=False).stdout.split():
        m = own.match(name)
        if m and not alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
    links = json.loads(_ip("-j", "link", "show", "type", "bridge", check=False).stdout or "[]")
    for link in links:
        m = own.match(link.get("ifname", ""))
        if m and not alive(int(m.group(1))):
            _ip("link", "del", link["ifname"], check=False)


def unavailable():
    """None when this machine can build hosts, else one line saying why not."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "no iproute2 / util-linux (ip, unshare) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{os.getpid()}probe"
    p = _ip("netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"this machine forbids network namespaces ({p.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """``hosts`` namespace hosts on one bridge; see the module docstring."""

    def __init__(self, hosts=2):
        why = unavailable()
        if why:
            raise ClusterError(why)
        sweep()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = [f"host{i + 1}" for i in range(hosts)]
        self.bridge = f"{self.tag}b"
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.wrapper = self._dir / "hostexec"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, host):
        return f"{self.tag}-{host}"

    def address(self, host):
        return f"{self.subnet}.{self.names.index(host) + 1}"

    def _build(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.names):
            ns, veth = self.namespace(host), f"{self.tag}h{i + 1}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        cases = "\n".join(f"  {h}) ns={self.namespace(h)} ;;" for h in self.names)
        self.wrapper.write_text(WRAPPER.format(tag=self.tag, cases=cases, folder=self._dir,
                                               names=" ".join(self.names)))
        self.wrapper.chmod(0o755)

    def mpi_args(self):
        """MPICH mpiexec's arguments that launch into these hosts."""
        return ["-launcher", "ssh", "-launcher-exec", str(self.wrapper), "-iface", self.bridge]

    def openmpi_args(self):
        """Open MPI mpirun's arguments that launch into these hosts: the wrapper as its ssh,
        its daemons' control traffic over the bridge, the ranks' messages over eth0 (TCP)."""
        return ["--mca", "plm_rsh_agent", str(self.wrapper),
                "--mca", "oob_tcp_if_include", f"{self.bridge},eth0",
                "--mca", "btl", "self,vader,tcp", "--mca", "pml", "ob1",
                "--mca", "btl_tcp_if_include", "eth0"]

    @staticmethod
    def env():
        """Variables the ranks need so that inter-host messages take the link (docstring)."""
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_TCP_IFACE": "eth0",
                "FI_PROVIDER": "tcp"}

    def shape(self, rate=None, delay=None):
        """Every host's eth0 egress at ``rate`` (tc's spelling, e.g. '1gbit'), plus netem
        ``delay`` (e.g. '100us') where the kernel has it; ``shape()`` removes the shaping."""
        for host in self.names:
            tc = ["ip", "netns", "exec", self.namespace(host), "tc", "qdisc"]
            subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True)
            if delay is not None:
                spec = ["netem", "delay", delay] + (["rate", rate] if rate else [])
            elif rate is not None:
                # a burst of 64 KiB lets one TCP segment train through at line rate; the
                # queue of 100 ms never drops at the rates the tests use
                spec = ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
            else:
                continue
            p = subprocess.run([*tc, "add", "dev", "eth0", "root", *spec],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise ClusterError(f"tc {' '.join(spec)} on {host}: {p.stderr.strip()}")

    def tx_bytes(self, host):
        """Bytes ``host`` has sent on its eth0 so far."""
        out = _ip("-j", "-s", "-n", self.namespace(host), "link", "show", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def launch(self, hosts, n, argv, env=None, timeout_s=120, cwd=None):
        """``mpiexec -hosts HOSTS -n n ARGV`` into these hosts, under ``timeout``, with the
        test environment (tests/support/launch.py), ``env()`` and ``env``; the
        CompletedProcess (text output captured)."""
        cmd = ["timeout", "-k", "5", str(timeout_s), launch.MPIEXEC, *self.mpi_args(),
               "-hosts", hosts, "-n", str(n), *argv]
        child = launch.child_env(**self.env(), **(env or {}))
        child["PYTHONPATH"] = os.pathsep.join([str(launch.REPO), child.get("PYTHONPATH", "")])
        return subprocess.run(cmd, cwd=cwd, env=child, capture_output=True, text=True,
                              timeout=timeout_s + 30)

    def kill(self, host, sig=9):
        """Signal every process inside ``host`` (a host that dies)."""
        pids = _ip("netns", "pids", self.namespace(host), check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def down(self, host):
        """``host`` dies: every process in it killed, its link cut, and launching into it
        fails as ssh to a dead host does (exit 255, ssh's one line); ``up(host)`` revives it."""
        (self._dir / f"{host}.down").touch()
        _ip("-n", self.namespace(host), "link", "set", "eth0", "down")
        return self.kill(host)

    def up(self, host):
        (self._dir / f"{host}.down").unlink(missing_ok=True)
        _ip("-n", self.namespace(host), "link", "set", "eth0", "up")

    def close(self):
        """Remove every namespace, veth, bridge and file of this cluster (idempotent)."""
        for host in self.names:
            self.kill(host)
            _ip("netns", "del", self.namespace(host), check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _main(argv):
    """``up N`` prints the mpiexec arguments and the environment for N hosts, then keeps them
    until Enter or Ctrl-C; ``down`` sweeps every cluster whose creator is gone."""
    if argv[:1] == ["down"]:
        sweep()
        return 0
    if argv[:1] != ["up"]:
        print("usage: python -m tests.support.netns_hosts up [HOSTS] | down", file=sys.stderr)
        return 2
    with Cluster(int(argv[1]) if len(argv) > 1 else 2) as c:
        env = " ".join(f"{k}={v}" for k, v in c.env().items())
        print(f"{env} mpiexec {' '.join(c.mpi_args())} -hosts {','.join(c.names)} ...",
              flush=True)
        try:
            input()
        except (EOFError, KeyboardInterrupt):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
