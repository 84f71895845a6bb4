"""Hosts and their slots: ``-H a:4,b:4``, ``--hostfile F``, ``--host-discovery-script S``, and
the blacklist of hosts that failed too often.

A host is ``(name, slots)``: ``slots`` ranks may run there. Every source reads the same two
spellings -- ``name:slots`` (Horovod, MPICH's ``-hosts``) and ``name slots=N`` (Open MPI's
hostfile) -- and a bare ``name`` is one slot. Bad input is a ``LaunchError``: one line, exit
code 2 (no hosts, slots < 1, a discovery script that fails or prints something else).
"""
import re
import subprocess

from mpitrain.runtime.errors import UsageError

DISCOVERY_TIMEOUT_S = 60
_HOST = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)(?::(\S+)|\s+slots\s*=\s*(\S+))?$")


class LaunchError(UsageError):
    """Bad launcher input: one line, exit code 2."""


def parse_entry(text, where):
    """``'a:4'`` / ``'a slots=4'`` / ``'a'`` -> ('a', 4); LaunchError naming ``where``."""
    m = _HOST.match(text.strip())
    if not m:
        raise LaunchError(f"{where}: {text.strip()!r} is not a host (expected host:slots, "
                          f"host slots=N or host)")
    name, slots = m.group(1), m.group(2) or m.group(3)
    try:
        slots = 1 if slots is None else int(slots)
    except ValueError:
        raise LaunchError(f"{where}: {text.strip()!r}: slots must be an integer") from None
    if slots < 1:
        raise LaunchError(f"{where}: {text.strip()!r}: slots must be >= 1")
    return name, slots


def merge(entries, where):
    """[(name, slots)] in first-seen order, a host named twice getting the sum of its slots;
    LaunchError when there is none."""
    hosts = {}
    for name, slots in entries:
        hosts[name] = hosts.get(name, 0) + slots
    if not hosts:
        raise LaunchError(f"{where}: no hosts")
    return list(hosts.items())


def parse_hosts(text):
    """``-H a:4,b:4`` -> [('a', 4), ('b', 4)]."""
    parts = [p for p in text.split(",") if p.strip()]
    return merge([parse_entry(p, f"-H {text}") for p in parts], f"-H {text!r}")


def parse_lines(text, where):
    """One host per line; blank lines and ``#`` comments are skipped."""
    entries = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries.append(parse_entry(line, where))
    return merge(entries, where)


def read_hostfile(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: {exc.strerror or exc}") from None
    return parse_lines(text, f"--hostfile {path}")


def discover(script, timeout_s=DISCOVERY_TIMEOUT_S):
    """Run ``script`` (a shell command) and read its ``host:slots`` lines (Horovod elastic's
    protocol). It runs before every launch, so a host that leaves or joins is seen at the next
    restart."""
    where = f"--host-discovery-script {script}"
    try:
        p = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{where}: no answer in {timeout_s} s") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchError(f"{where}: exit code {p.returncode} ({last})")
    return parse_lines(p.stdout, where)


class Blacklist:
    """Failures per host; a host with ``after`` failures is left out of every later launch."""

    def __init__(self, after):
        self.after, self.failures = after, {}

    def fail(self, host):
        """Count a failure of ``host``; True when that puts it on the blacklist."""
        self.failures[host] = self.failures.get(host, 0) + 1
        return self.failures[host] == self.after

    def __contains__(self, host):
        return self.failures.get(host, 0) >= self.after

    def usable(self, hosts):
        return [(name, slots) for name, slots in hosts if name not in self]


def placement(hosts, n):
    """The host of each of ``n`` ranks when slots are filled in order (MPICH's and Open MPI's
    default mapping): rank -> host name."""
    order = [name for name, slots in hosts for _ in range(slots)]
    return {rank: order[rank] for rank in range(min(n, len(order)))}


def take(hosts, n):
    """The first ``n`` slots of ``hosts``, as hosts: what a launch of ``n`` ranks uses."""
    used, left = [], n
    for name, slots in hosts:
        if left <= 0:
            break
        used.append((name, min(slots, left)))
        left -= slots
    return used


def spell(hosts):
    """[('a', 4), ('b', 4)] -> 'a:4,b:4'."""
    return ",".join(f"{name}:{slots}" for name, slots in hosts)
