"""Run code under other comm settings: ``mt.init(settings=...)``, never patched module globals.

    with comm_settings(algorithm="ring", ring_subchunk_bytes=40):
        mt.allreduce(x)                 # every collective in here takes the ring

Collective: every rank enters and leaves together (shutdown and init are collective), as tests
under mpiexec do anyway. On leaving, mpitrain is re-initialised with the settings it had.
"""
import contextlib
import dataclasses

import mpitrain as mt
from mpitrain.comm import world


@contextlib.contextmanager
def comm_settings(**overrides):
    before = world.current()
    comm, saved = before.comm, before.settings
    mt.shutdown()
    mt.init(comm, threads=None, settings=dataclasses.replace(saved, **overrides))
    try:
        yield world.current()
    finally:
        mt.shutdown()
        mt.init(comm, threads=None, settings=saved)


@contextlib.contextmanager
def settings_stack():
    """``use(**overrides)``: comm_settings entered for the rest of a test (the fixture form)."""
    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(comm_settings(**overrides))
