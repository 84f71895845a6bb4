"""What a Slurm allocation tells mpitrainrun: its hosts and slots, and how often it was requeued.

Inside ``sbatch``/``salloc`` Slurm describes the allocation in the environment:

    SLURM_JOB_NODELIST    host[1-2],gpu07      a hostlist expression: the nodes
    SLURM_TASKS_PER_NODE  2(x2),1              tasks per node, run-length encoded, in node order
    SLURM_RESTART_COUNT   1                    times the job was requeued (absent: never)

``allocation`` reads the first two as hosts ``[(name, slots)]``, so that mpitrainrun knows
where its ranks run -- which host a failed rank was on, which to leave out after it failed
(srun's ``--nodelist``) -- without ``-H``. ``requeues`` reads the third: a requeued job is a
relaunch, and resumes from its checkpoints as a restart does.
"""
import re

from mpitrain.run.hosts import LaunchError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split(text, where):
    """Split at the commas outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise LaunchError(f"{where}: unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"{where}: unbalanced brackets in {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def expand(nodelist, where="SLURM_JOB_NODELIST"):
    """A hostlist expression -> host names in order: 'n[01-03,7]x,m' -> n01x n02x n03x n7x m
    (zero padding kept, as Slurm writes it; several bracket groups multiply out)."""
    names = []
    for part in _split(nodelist.strip(), where):
        m = re.search(r"\[([^\]]*)\]", part)
        if not m:
            names.append(part)
            continue
        head, tail = part[:m.start()], part[m.end():]
        for item in m.group(1).split(","):
            r = _RANGE.match(item)
            if not r or (r.group(2) and int(r.group(2)) < int(r.group(1))):
                raise LaunchError(f"{where}: {item!r} in {part!r} is not a range of numbers")
            low, high = r.group(1), r.group(2) or r.group(1)
            for i in range(int(low), int(high) + 1):
                names.extend(expand(f"{head}{i:0{len(low)}d}{tail}", where))
    return names


def counts(text, where="SLURM_TASKS_PER_NODE"):
    """'2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for item in text.strip().split(","):
        m = _COUNT.match(item.strip())
        if not m:
            raise LaunchError(f"{where}: {item!r} in {text!r} is not N or N(xK)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def allocation(environ):
    """The allocation's hosts [(name, slots)], or None outside one (no SLURM_JOB_NODELIST)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand(nodelist)
    per_node = environ.get("SLURM_TASKS_PER_NODE")
    slots = counts(per_node) if per_node else [1] * len(names)
    if len(slots) != len(names):
        raise LaunchError(f"SLURM_TASKS_PER_NODE {per_node!r} gives {len(slots)} node(s), "
                          f"SLURM_JOB_NODELIST {nodelist!r} {len(names)}")
    return [(name, n) for name, n in zip(names, slots) if n > 0]


def requeues(environ):
    """How many times Slurm requeued this job (0 when it never did, or outside Slurm)."""
    text = environ.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    if not text.isdigit():
        raise LaunchError(f"SLURM_RESTART_COUNT {text!r}: not a count")
    return int(text)
