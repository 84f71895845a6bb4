"""Optional dependencies of the benchmark scripts, checked so that a missing one never costs a run.

    pip install 'mpitrain[bench]'       # matplotlib, for the PNGs

Two cases, one rule each:
- something the user asked for by name (``allreduce.py --plot``, ``step.py --torch``): checked
  before the first measurement; missing -> one line and exit 2, nothing measured or written
  (``require``, or ``require_or_exit`` where one process decides);
- a PNG drawn as a side product of ``--out`` (``scaling.py``, ``perfmodel.py``): the JSON and
  markdown are written first, and a missing matplotlib skips only the PNG, with one line saying
  so (``can_plot``), exit 0 -- a sweep of many minutes is not lost to a plotting library.

Everything else the scripts import (NumPy, Numba, mpi4py, tqdm) is a hard dependency of mpitrain.
"""
import importlib
import sys

__all__ = ["missing", "require", "require_or_exit", "fail", "can_plot", "INSTALL"]

INSTALL = {"matplotlib": "pip install 'mpitrain[bench]'", "torch": "pip install torch"}


def missing(module):
    """None when `module` imports here, else how to install it."""
    try:
        importlib.import_module(module)
    except ImportError:
        return INSTALL.get(module, f"pip install {module}")
    return None


def require(module, what):
    """None, or the one-line error for `what` (e.g. "--plot") when `module` is missing."""
    how = missing(module)
    return None if how is None else f"{what} needs {module}, which is not installed ({how})"


def require_or_exit(module, what, prog):
    """``require``'s line through ``fail`` when `module` is missing."""
    error = require(module, what)
    if error:
        fail(prog, error)


def fail(prog, message):
    """A prerequisite is missing: ``prog: error: message`` on stderr and exit 2, nothing
    measured."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def can_plot(png):
    """True when matplotlib imports; else print (stderr) that `png` was skipped, and False."""
    how = missing("matplotlib")
    if how is None:
        return True
    print(f"matplotlib not installed: skipped {png} ({how})", file=sys.stderr, flush=True)
    return False
