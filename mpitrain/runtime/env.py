"""The one reader of the ``MPITRAIN_*`` variables: one grammar for all of them.

Every module that reads a variable declares its name here (``declare``), next to where it reads
it, so the list cannot drift from the readers, and reads it with one of the typed readers below;
nothing else in mpitrain looks at ``os.environ`` for an ``MPITRAIN_*`` name. Each reader takes
the variable's name, the value to use when it is unset or blank, and an optional ``environ``
mapping (tests); a value it cannot read is a one-line ``ValueError`` naming the variable and the
value. The grammar:

    flag      1/0, true/false, yes/no, on/off, in any case, spaces around allowed
    integer   an int (``minimum``: the least one accepted)
    number    a float (``minimum`` likewise)
    choice    one of ``choices``, in any case (returned in lower case)
    text      the value as given

``mt.init()`` asks ``unknown()`` once, and rank 0 prints one line per variable of the
environment that nobody declared, with the closest known name: a misspelled
``MPITRAIN_BATCHSIZE`` would otherwise be ignored without a word.
"""
import difflib
import os

PREFIX = "MPITRAIN_"
_known = set()
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


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


def snapshot(names=None, environ=None):
    """name -> the text of each of ``names`` (default: every declared variable), None when unset
    or blank: what ranks compare to learn they were started alike."""
    return {name: text(name, None, environ) for name in (known() if names is None else names)}


def text(name, default=None, environ=None):
    """The variable as given; ``default`` when it is unset or blank."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value is not None and value.strip() else default


def flag(name, default, environ=None):
    """A boolean: 1/0, true/false, yes/no or on/off, in any case."""
    value = text(name, None, environ)
    if value is None:
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def integer(name, default, minimum=None, environ=None):
    """An int, at least ``minimum`` when one is given."""
    return _number(name, default, minimum, environ, int, "an integer")


def number(name, default, minimum=None, environ=None):
    """A float, at least ``minimum`` when one is given."""
    return _number(name, default, minimum, environ, float, "a number")


def choice(name, default, choices, environ=None):
    """One of ``choices`` (lower-case words), in any case."""
    value = text(name, None, environ)
    if value is None:
        return default
    if value.strip().lower() not in choices:
        *rest, last = choices
        raise ValueError(f"{name}={value!r}: expected {', '.join(rest)} or {last}")
    return value.strip().lower()


def _number(name, default, minimum, environ, kind, what):
    value = text(name, None, environ)
    if value is None:
        return default
    try:
        parsed = kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not {what}") from None
    if minimum is not None and not parsed >= minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return parsed
