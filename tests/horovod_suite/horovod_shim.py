"""A pytest plugin that runs Horovod's own ``test/parallel/test_torch.py`` against mpitrain.torch.

Loaded with ``-p horovod_shim`` (run.py puts this folder on ``PYTHONPATH``), before the test
module is imported, it makes the few imports of Horovod's test file resolve here:

- ``import horovod.torch as hvd`` is ``mpitrain.torch`` itself, not a copy: what the suite tests
  is our module as users import it;
- ``horovod.runner.util.threads.in_thread``, which Horovod's ``test/utils/common.py`` imports
  (the torch tests never call it), is the same small daemon-thread helper;
- ``mock`` and ``cloudpickle``, which common.py imports for its launcher and Spark helpers
  (unused by the torch tests), are ``unittest.mock`` and ``pickle`` when not installed.

One change to what the suite sees: ``torch.optim.Optimizer.__subclasses__()`` leaves out
``torch.optim.Muon``. The suite wraps every optimizer class it finds there with the same
arguments, and Muon (added to torch after the suite was written) refuses the 1-D bias
parameters of its models, in Horovod as in mpitrain.

In a job that runs the whole file (run.py --one-job, ``make test``), as in tests/mpi: the
tests tests/support/horovod_scope.py lists for this number of ranks are marked skipped with the reason,
ranks other than 0 print no report, and a failure on any rank prints that rank's report and
aborts the job (the other ranks may be waiting in a collective the failing rank will never
join).
"""
import os
import pickle
import sys
import threading
import types
import unittest.mock

import pytest
import torch
from mpi4py import MPI

import mpitrain.torch
from tests.support.horovod_scope import why_not

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Horovod's helper: ``target(*args)`` on a started daemon thread; the thread."""
    def run():
        try:
            target(*args)
        except BaseException:     # noqa: BLE001 - Horovod's silent mode swallows the error
            if not silent:
                raise
    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _install():
    horovod = _module("horovod", torch=mpitrain.torch)
    sys.modules["horovod.torch"] = mpitrain.torch
    threads = _module("horovod.runner.util.threads", in_thread=in_thread)
    util = _module("horovod.runner.util", threads=threads)
    horovod.runner = _module("horovod.runner", util=util)
    for name, standin in (("mock", unittest.mock), ("cloudpickle", pickle)):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = standin

    muon = getattr(torch.optim, "Muon", None)
    if muon is not None:
        def subclasses(cls):
            return [c for c in type.__subclasses__(cls) if c is not muon]
        torch.optim.Optimizer.__subclasses__ = classmethod(subclasses)


_install()


@pytest.hookimpl(trylast=True)   # after pytest's own configure has registered the reporter
def pytest_configure(config):
    if RANK != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_collection_modifyitems(config, items):
    """The tests out of scope at this number of ranks are skipped, naming why
    (tests/support/horovod_scope.py)."""
    for item in items:
        why = why_not(item.name, SIZE)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"out of scope for mpitrain: {why}"))


def pytest_runtest_logreport(report):
    """With HOROVOD_SUITE_RESULTS set, each rank appends ``<outcome> <test id>`` for each phase
    to ``<that folder>/rank<r>.txt``: run.py reads the verdict of every rank from there (under
    mpiexec the ranks' terminal reports interleave). A failure on any rank aborts the job."""
    folder = os.environ.get("HOROVOD_SUITE_RESULTS")
    if folder and not (report.when != "call" and report.passed):
        with open(os.path.join(folder, f"rank{RANK}.txt"), "a") as f:
            f.write(f"{report.outcome} {report.when} {report.nodeid}\n")
    _abort_on_failure(report, report.when)


def pytest_collectreport(report):
    _abort_on_failure(report, "collection")


def _abort_on_failure(report, what):
    if not report.failed or SIZE == 1:
        return
    sys.stderr.write(f"\n[rank {RANK} of {SIZE}] {what} FAILED: {report.nodeid}\n"
                     f"{report.longreprtext}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
