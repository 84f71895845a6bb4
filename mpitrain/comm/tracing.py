"""``mt.start_timeline(path)`` / ``mt.stop_timeline()``: the timeline switched on and off while a
job runs (Horovod's names), besides ``--timeline`` / ``MPITRAIN_TIMELINE`` for a whole CLI run.

The file is the flag's (mpitrain/timeline/): every rank records its own spans from ``start_timeline``
on; ``stop_timeline`` gathers them and rank 0 alone writes one merged Chrome trace to rank 0's
``path``, atomically. So events appear only between the two calls, and each call is collective:
every rank calls it, in the same order as its other collectives, between training steps (not
while ``backward_hook``'s averages are in flight: the comm thread owns MPI then).

    mt.start_timeline("trace.json")     # every rank; recording from here
    for step in ...: ...                # spans of the optimizer, buckets, collectives
    mt.stop_timeline()                  # every rank; rank 0 writes trace.json

``start_timeline`` while one is recording (a previous start, or ``--timeline``) or with a path
rank 0 cannot write is an error on every rank (agreed before anything starts).
``stop_timeline`` without a recording timeline does nothing.
"""
import os

from mpitrain import timeline
from mpitrain.comm import world
from mpitrain.comm.kinds import Kind


def start_timeline(file_path, mark_cycles=False):
    """Start recording every rank's spans into a timeline that ``stop_timeline`` writes to
    ``file_path`` (rank 0's). mark_cycles: an instant "cycle" event at each gradient
    averaging round. Collective; returns the Timeline."""
    state = world.current()
    error = None
    active = timeline.current()
    if active.enabled:
        error = (f"a timeline is already recording to {active.path}; "
                 f"call mt.stop_timeline() first")
    elif not isinstance(file_path, (str, os.PathLike)) or not str(file_path).strip():
        error = f"expected a file path, got {file_path!r}"
    elif state.rank == 0:                 # the one rank that writes: its path must take a file
        error = _unwritable(os.fspath(file_path))
    # one agreement: an error on any rank is raised on every rank, and none starts recording
    state.agreement(Kind.START_TIMELINE, {"mark_cycles": bool(mark_cycles)},
                    error=None if error is None else f"start_timeline: {error}")
    return timeline.activate(timeline.Timeline(os.fspath(file_path), state.rank,
                                               mark_cycles=mark_cycles))


def stop_timeline():
    """Stop recording; rank 0 writes every rank's events, merged, to the path given to
    ``start_timeline``. Collective; returns that path on rank 0, None elsewhere (and None on
    every rank when no timeline was recording)."""
    active = timeline.current()
    if not active.enabled:
        return None
    try:
        return active.close(world.comm())
    finally:
        timeline.activate(None)


def _unwritable(path):
    """Why rank 0 could not write ``path``, or None."""
    if os.path.isdir(path):
        return f"{path} is a folder, expected a file path"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"cannot write into {folder}"
    return None
