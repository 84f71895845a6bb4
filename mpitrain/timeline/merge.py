"""Rank 0's half of a timeline: every rank's events on one time axis, written atomically."""
import json

from mpitrain.runtime import atomic


def merge(payloads):
    """Chrome-trace document from the ranks' payloads, each shifted onto the earliest origin."""
    if not payloads:
        raise ValueError("timeline merge needs at least one rank's events")
    origin = min(p["origin_wall_us"] for p in payloads)
    events = []
    for p in sorted(payloads, key=lambda p: p["rank"]):
        shift = p["origin_wall_us"] - origin
        for ev in p["events"]:
            if "ts" in ev:
                ev = dict(ev, ts=round(ev["ts"] + shift, 3))
            events.append(ev)
    dropped = {str(p["rank"]): p["dropped"] for p in payloads if p["dropped"]}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "mpitrain.timeline", "ranks": len(payloads),
                          "dropped_events": dropped}}


def write_trace(path, doc):
    """Write ``doc`` as JSON to ``path`` atomically (see atomic.py): on any failure ``path`` is
    left as it was."""
    atomic.write(path, lambda f: json.dump(doc, f, separators=(",", ":")), mode="w",
                 prefix=".timeline-", suffix=".tmp")
