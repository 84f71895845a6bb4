"""The ``MPITRAIN_*`` variables mpitrain knows, and a warning for the ones it does not.

Every module that reads a variable declares its name here (``declare``), next to where it reads
it, so the list cannot drift from the readers. ``mt.init()`` asks ``unknown()`` once, and rank 0
prints one line per variable of the environment that nobody declared, with the closest known
name: a misspelled ``MPITRAIN_BATCHSIZE`` would otherwise be ignored without a word.
"""
import difflib
import os

PREFIX = "MPITRAIN_"
_known = set()


def declare(*names):
    """Record variables some module reads (``MPITRAIN_`` names only)."""
    for name in names:
        if not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not an {PREFIX}* variable")
        _known.add(name)


def known():
    """Every declared variable, sorted."""
    return sorted(_known)


def unknown(environ=None):
    """One line per ``MPITRAIN_*`` variable of ``environ`` that no module reads, naming the
    closest known variable when one is close."""
    environ = os.environ if environ is None else environ
    lines = []
    for name in sorted(k for k in environ if k.startswith(PREFIX) and k not in _known):
        close = difflib.get_close_matches(name, _known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"mpitrain: warning: {name} is not an mpitrain setting and is ignored{hint}")
    return lines
