"""``python -m mpitrain.timeline TRACE.json``: per rank, where the time went."""
import json
import sys


def summarize(doc):
    """{rank: [(name, count, total_ms, share of the rank's span extent)]}, largest total first.
    Nested spans (an allreduce inside "update") count in both; shares need not add up to 1."""
    by_rank = {}
    for ev in doc.get("traceEvents", []):
        if ev.get("ph") == "X":
            by_rank.setdefault(ev["pid"], []).append(ev)
    out = {}
    for rank, evs in sorted(by_rank.items()):
        extent = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
        totals = {}
        for e in evs:
            count, dur = totals.get(e["name"], (0, 0.0))
            totals[e["name"]] = (count + 1, dur + e["dur"])
        rows = [(name, c, d / 1e3, d / extent if extent > 0 else 0.0)
                for name, (c, d) in totals.items()]
        out[rank] = sorted(rows, key=lambda r: -r[2])
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m mpitrain.timeline TRACE.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"timeline: {argv[0]}: {e}", file=sys.stderr)
        return 2
    for rank, rows in summarize(doc).items():
        print(f"rank {rank}: {'span':<24} {'count':>6} {'total ms':>10} {'share':>6}")
        for name, count, total_ms, share in rows:
            print(f"        {name:<24} {count:>6} {total_ms:>10.2f} {100 * share:>5.1f}%")
    return 0

