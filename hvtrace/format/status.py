"""The records a batch status carries besides its counters, and how statuses merge.

The writer attaches a JSON status to every record batch (:data:`hvtrace.format.schema.
BATCH_STATUS_KEY`); a Parquet file's footer holds the statuses of its stream merged. Besides
counters, a status carries lists of records that the recorder's parts append and that a reader
merges batch by batch, each kind by its own rule (nothing in a trace file is trusted: a record
that is not the shape its rule expects is dropped):

- ``membership``: Elastic Horovod's membership, one record per generation
  (:mod:`hvtrace.record.elastic`);
- ``live``: live straggler verdicts (:mod:`hvtrace.record.live`), and :func:`live_line`, the line
  each is logged and reported as;
- ``tcp``: connection counters (:mod:`hvtrace.record.netstat`), cumulative: the later sample wins;
- ``stall``: allreduces waited on past the stall threshold (:mod:`hvtrace.record.stall`).

This module is the format's: the recorder and the reader both use it, and it imports neither.
"""

from __future__ import annotations

from typing import Any, Final

#: Most membership records kept per file (a flapping job cannot grow the status without bound).
MAX_RECORDS: Final = 1000
#: Most live events kept per file (a flapping rank cannot grow the status without bound).
MAX_EVENTS: Final = 1000


def merge_membership(old: Any, new: Any) -> list[dict[str, Any]]:
    """Merge the ``membership`` records of batch statuses, in order, once each (by generation);
    anything that is not a dict with an integer ``gen`` is dropped."""
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for x in (old, new):
        for e in x if isinstance(x, list) else []:
            if not isinstance(e, dict):
                continue
            try:
                gen = int(e.get("gen"))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                continue
            if gen in seen or len(out) >= MAX_RECORDS:
                continue
            seen.add(gen)
            out.append(e)
    return out


def merge_live(old: Any, new: Any) -> list[dict[str, Any]]:
    """Merge the ``live`` records of batch statuses, in order, once each (by event, rank and
    window); anything that is not a dict with those is dropped."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for x in (old, new):
        for e in x if isinstance(x, list) else []:
            if not isinstance(e, dict):
                continue
            key = tuple(str(e.get(k)) for k in ("event", "rank", "host", "first_step"))
            if key in seen or len(out) >= MAX_EVENTS:
                continue
            seen.add(key)
            out.append(e)
    return out


def live_line(e: dict[str, Any]) -> str:
    """The log line of a live verdict."""
    if e["event"] == "lockstep":  # ranks out of lockstep: the message says it all
        return f"hvtrace: {e['message']}"
    steps = f"steps {e['first_step']}-{e['last_step']}"
    if e["event"] == "contended":
        share = e.get("work_share")
        how = (
            f": its ranks wait for a CPU {share:.0%} of their time outside synchronize"
            if share is not None
            else ""
        )
        return f"hvtrace: host {e['host']} is short of CPU over {steps}{how} (no rank named)"
    if e["event"] == "uncontended":
        return f"hvtrace: host {e['host']} no longer short of CPU over {steps}"
    who = f"rank {e['rank']} (host {e['host']})"
    if e["event"] == "recovered":
        return f"hvtrace: {who} no longer late over {steps}"
    cause = e.get("cause")
    if cause == "speed":  # the same work slower: its processor, not its work
        cause = "speed (slower in every phase, the update too: its processor, not its work)"
    why = e["phase"] + (f", {cause}" if cause else "")
    share = e.get("step_share")
    tail = f"; ~{share:.0%} of step time" if share is not None else ""
    now = "now " if e["event"] == "changed" else ""
    return f"hvtrace: {who} {now}late {e['late_ms']:.1f} ms/step over {steps}: {why}{tail}"


def merge_connections(old: Any, new: Any) -> list[dict[str, Any]]:
    """Merge two ``tcp`` lists of batch statuses: per connection (local, peer), the later sample
    wins (the counters are cumulative). Entries that are not dicts with both addresses are
    dropped here; the analyzer checks the values."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for lst in (old, new):
        if not isinstance(lst, list):
            continue
        for c in lst:
            if (
                isinstance(c, dict)
                and isinstance(c.get("local"), str)
                and isinstance(c.get("peer"), str)
            ):
                merged[(c["local"], c["peer"])] = c
    return list(merged.values())


def merge_stalls(old: Any, new: Any) -> list[dict[str, Any]]:
    """Merge the ``stall`` records of batch statuses: the latest per (step, micro) wins (it has
    waited longest). ``new`` may be one record or a list; anything else is dropped."""
    merged: dict[tuple[Any, Any], dict[str, Any]] = {}
    for x in (old, new):
        for rec in x if isinstance(x, list) else [x]:
            if isinstance(rec, dict) and "step" in rec:
                key = (rec.get("step"), rec.get("micro"), str(rec.get("collective")))
                merged[key] = rec
    return list(merged.values())
