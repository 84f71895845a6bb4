"""The timeline (runtime layer): Chrome-trace spans recorded per rank (events.py), merged by rank 0
(merge.py), summarised by ``python -m mpitrain.timeline TRACE.json`` (summary.py)."""
from mpitrain.timeline.events import Timeline, activate, current
from mpitrain.timeline.merge import merge, write_trace
from mpitrain.timeline.summary import summarize

__all__ = ["Timeline", "activate", "current", "merge", "write_trace", "summarize"]
