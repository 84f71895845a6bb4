"""pytest under mpiexec: all ranks run the same tests, rank 0 alone reports, no rank hangs.

- Ranks other than 0 unregister pytest's terminal reporter, so the output is one normal report
  (rank 0's), not N interleaved ones.
- A failure (or collection error) on any rank prints that rank's report tagged with its rank
  number to stderr and calls MPI.COMM_WORLD.Abort(1): the other ranks are probably blocked in a
  collective the failing rank will never join, and the job must end now with a non-zero status
  rather than at the CI timeout.
- As one process (plain ``pytest tests/mpi``) this is ordinary pytest: N=1 must pass too.
Tests must make the same collective calls in the same order on every rank (same parameters, same
skips; hypothesis with derandomize=True).
"""
import sys

import pytest
from mpi4py import MPI

import mpitrain as mt
from tests.support.comm import settings_stack

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()


@pytest.hookimpl(trylast=True)   # after pytest's own configure has registered the reporter
def pytest_configure(config):
    if RANK != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def _abort_on_failure(report, what):
    if not report.failed:
        return
    sys.stderr.write(f"\n[rank {RANK} of {SIZE}] {what} FAILED: {report.nodeid}\n"
                     f"{report.longreprtext}\n")
    sys.stderr.flush()
    if SIZE > 1:
        MPI.COMM_WORLD.Abort(1)


def pytest_runtest_logreport(report):
    _abort_on_failure(report, report.when)


def pytest_collectreport(report):
    _abort_on_failure(report, "collection")


@pytest.fixture(scope="session", autouse=True)
def mpitrain_world():
    mt.init()
    yield
    mt.barrier()


@pytest.fixture
def use_settings():
    """``use_settings(algorithm="ring", ...)``: the rest of the test runs under those comm
    settings (mt.init(settings=...)); the previous ones come back afterwards."""
    with settings_stack() as use:
        yield use
