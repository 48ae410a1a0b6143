"""Elastic Horovod: a run's membership epochs and its resets, each epoch analyzed on its own.

Each file records the memberships its worker saw (:mod:`hvtrace.record.elastic`): the first in
its header, each later one in its status, with, after a reset, what the worker saw of it (its
rank and the size before, the step it had reached, the step of the last commit, whether the
state was restored to it, when its last step ended and when it went on). :func:`epochs` merges
them into the run's epochs: a generation, its first step and the step after its last, the size,
and its workers (stable ids: the file keys) with their rank and host in it.

:func:`attach` adds to an :class:`~hvtrace.analysis.model.Analysis` of a run with more than one
epoch:

- ``membership``: the epochs, each with its own analysis: :func:`hvtrace.analysis.summary.analyze`
  of that step range and those workers only (one definition of every metric): median step time,
  comm/compute, the stragglers named in it;
- a ``reset`` finding per change (first among the findings after hangs and divergences): when,
  the size before and after, the workers (and their ranks and hosts) that left or joined, the
  steps replayed from the last commit and how long training stood still (``stall_s``: the
  longest time a worker of both epochs spent between the end of its last step before the reset
  and its first step after it), and the time lost (``lost_s``: the stall plus the replayed steps
  at the median step time of the epoch before).

Nothing in a file is trusted: every number is checked, names are cut to a length, a record that
does not check is left out (and said so in the problems).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Final

from hvtrace.analysis.model import Analysis, Finding
from hvtrace.units import printable

#: Longest host name kept.
MAX_HOST_CHARS: Final = 256
#: Most workers kept per epoch, and most epochs.
MAX_WORKERS: Final = 100_000
MAX_EPOCHS: Final = 1000
#: Most epochs analyzed on their own (each is a pass over its files); the others are listed.
MAX_ANALYZED_EPOCHS: Final = 64


def _int(x: Any, lo: int = 0, hi: int = 2**62) -> int | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    v = int(x)
    return v if lo <= v <= hi else None


def _members(raw: Any) -> list[dict[str, Any]] | None:
    if not isinstance(raw, list) or len(raw) > MAX_WORKERS:
        return None
    out = []
    for m in raw:
        if not isinstance(m, list) or len(m) < 3:
            return None
        w, r = _int(m[0]), _int(m[1])
        if w is None or r is None:
            return None
        host = str(m[2])[:MAX_HOST_CHARS]
        hvd_host = str(m[3])[:MAX_HOST_CHARS] if len(m) > 3 and m[3] is not None else host
        out.append({"worker": w, "rank": r, "host": host, "horovod_host": hvd_host})
    return sorted(out, key=lambda m: m["rank"])


def _record(raw: Any) -> dict[str, Any] | None:
    """A membership record, checked; None if it does not check."""
    if not isinstance(raw, dict):
        return None
    gen, start, size = _int(raw.get("gen")), _int(raw.get("start_step")), _int(raw.get("size"))
    members = _members(raw.get("members"))
    if gen is None or start is None or size is None or members is None or size != len(members):
        return None
    reset = raw.get("reset")
    return {
        "gen": gen,
        "start_step": start,
        "size": size,
        "members": members,
        "reset": reset if isinstance(reset, dict) else None,
    }


def epochs(run: Any) -> tuple[list[dict[str, Any]], dict[int, list[tuple[int, dict]]], list[str]]:
    """The run's membership epochs (generation order), the reset records per generation
    (``(worker, record)``), and problems (records that did not check). An epoch: ``gen``,
    ``start_step``, ``stop_step`` (the next epoch's start; for the last, one after the last step
    its workers recorded), ``size``, ``workers`` (``worker``, ``rank``, ``host``), ``hosts``."""
    by_gen: dict[int, dict[str, Any]] = {}
    resets: dict[int, list[tuple[int, dict]]] = {}
    problems: list[str] = []
    for w, f in sorted(run.files.items()):
        raws = [f.header.get("membership")] if f.header.get("membership") is not None else []
        raws += list(getattr(f, "membership", []) or [])
        for raw in raws:
            rec = _record(raw)
            if rec is None:
                problems.append(f"{f.path}: a membership record does not check; left out")
                continue
            prev = by_gen.setdefault(rec["gen"], rec)
            if prev is not rec and prev["members"] != rec["members"]:
                problems.append(
                    f"{f.path}: its membership {rec['gen']} differs from another file's; "
                    "the first one read is used"
                )
            if rec["reset"] is not None:
                r = dict(
                    rec["reset"],
                    at_ns=raw.get("at_ns"),
                    mono_anchor_ns=f.header.get("mono_anchor_ns"),
                    wall_anchor_ns=f.header.get("wall_anchor_ns"),
                )
                resets.setdefault(rec["gen"], []).append((int(w), r))
    out = []
    for gen in sorted(by_gen)[:MAX_EPOCHS]:
        rec = by_gen[gen]
        out.append(
            {
                "gen": gen,
                "start_step": rec["start_step"],
                "stop_step": None,
                "size": rec["size"],
                "workers": rec["members"],
                "hosts": sorted({m["horovod_host"] for m in rec["members"]}),
            }
        )
    for e, nxt in itertools.pairwise(out):
        e["stop_step"] = nxt["start_step"]
    if out:
        last = out[-1]
        ids = {m["worker"] for m in last["workers"]}
        # a file's last_step is its step counter at its last flush: the next step's number
        steps = [int(f.last_step) for w, f in run.files.items() if w in ids]
        last["stop_step"] = max([*steps, last["start_step"] + 1])
    return out, resets, problems


def _seconds(ns: Any) -> float | None:
    v = _int(ns, -(2**62))
    return round(v / 1e9, 3) if v is not None else None


def _wall_ns(r: dict[str, Any]) -> int | None:
    """When a worker saw the reset begin (its interruption, else the end of its last step), on
    the wall clock (its header's anchors)."""
    t = _int(r.get("interrupted_ns"))
    t = t if t is not None else _int(r.get("last_step_end_ns"))
    mono, wall = _int(r.get("mono_anchor_ns")), _int(r.get("wall_anchor_ns"))
    if t is None or mono is None or wall is None:
        return None
    return wall + t - mono


def reset_findings(
    eps: list[dict[str, Any]],
    resets: dict[int, list[tuple[int, dict]]],
    step_ms: dict[int, float] | None = None,
    run_start_wall_ns: int | None = None,
) -> list[Finding]:
    """One ``reset`` finding per change of membership (see the module doc). ``step_ms``: the
    median step time per generation (for the time the replayed steps cost);
    ``run_start_wall_ns``: the run's start on the wall clock (for ``at_s``, seconds into it)."""
    out = []
    for before, after in itertools.pairwise(eps):
        b = {m["worker"]: m for m in before["workers"]}
        a = {m["worker"]: m for m in after["workers"]}
        left = [b[w] for w in sorted(b) if w not in a]
        joined = [a[w] for w in sorted(a) if w not in b]
        recs = [r for _w, r in resets.get(after["gen"], [])]
        replayed = max((_int(r.get("replayed_steps")) or 0 for r in recs), default=0)
        restored = any(r.get("restored") is True for r in recs)
        stalls = []
        for r in recs:
            t0, t1 = _int(r.get("last_step_end_ns")), _int(r.get("at_ns"))
            if t0 is not None and t1 is not None and t1 >= t0:
                stalls.append(t1 - t0)
        stall_s = round(max(stalls) / 1e9, 3) if stalls else None
        walls = [w for w in map(_wall_ns, recs) if w is not None]
        at_wall_ns = min(walls) if walls else None
        at_s = None
        if at_wall_ns is not None and run_start_wall_ns is not None:
            at_s = round((at_wall_ns - run_start_wall_ns) / 1e9, 3)
        med = (step_ms or {}).get(before["gen"])
        lost_s = None
        if stall_s is not None:
            extra = replayed * med / 1e3 if med is not None and math.isfinite(med) else 0.0
            lost_s = round(stall_s + extra, 3)
        hosts_left = sorted(set(before["hosts"]) - set(after["hosts"]))
        hosts_joined = sorted(set(after["hosts"]) - set(before["hosts"]))
        step = after["start_step"]
        parts = [f"size {before['size']} -> {after['size']}"]
        if left:
            parts.append("lost " + ", ".join(_who(m) for m in left))
        if joined:
            parts.append("joined " + ", ".join(_who(m) for m in joined))
        cause = "a worker failed" if restored else "hosts changed"
        if at_s is not None:
            cause += f", {at_s:.1f} s into the run"
        tail = f"; {replayed} step(s) replayed from the commit at step {step - replayed}"
        if not replayed:
            tail = "; no step replayed"
        if stall_s is not None:
            tail += f"; training stood still {stall_s:.1f} s"
        if lost_s is not None and replayed:
            tail += f" (about {lost_s:.1f} s lost with the replayed steps)"
        out.append(
            Finding(
                "reset",
                "warning" if left else "info",
                f"elastic reset at step {step} ({cause}): " + "; ".join(parts) + tail,
                stall_s,
                "s",
                {
                    "step": step,
                    "gen": after["gen"],
                    "at_s": at_s,
                    "at_wall_ns": at_wall_ns,
                    "size_before": before["size"],
                    "size_after": after["size"],
                    "workers_left": [m["worker"] for m in left],
                    "workers_joined": [m["worker"] for m in joined],
                    "ranks_left": [m["rank"] for m in left],
                    "ranks_joined": [m["rank"] for m in joined],
                    "hosts_left": hosts_left,
                    "hosts_joined": hosts_joined,
                    "left": left,
                    "joined": joined,
                    "restored": restored,
                    "replayed_steps": replayed,
                    "stall_s": stall_s,
                    "lost_s": lost_s,
                },
            )
        )
    return out


def _who(m: dict[str, Any]) -> str:
    return f"worker {m['worker']} (rank {m['rank']}, host {printable(m['horovod_host'])})"


def epoch_summary(a: Analysis) -> dict[str, Any]:
    """What an epoch's own analysis says, in brief (JSON-ready)."""
    stragglers = []
    for _, v in a.stragglers.iterrows():
        stragglers.append(
            {
                "worker": int(v["rank"]),
                "host": str(v.get("host", "")),
                "phase": str(v.get("phase", "")),
                "cause": str(v.get("cause", "") or ""),
                "late_ms": _f(v.get("late_ms")),
            }
        )
    return {
        "steps_analyzed": len(a.run_steps),
        "step_ms": _f(a.run_row["step_ms"]),
        "comm_compute_ratio": _f(a.run_row["comm_compute_ratio"]),
        "comm_ms": _f(a.comm.get("comm_ms")),
        "stragglers": stragglers,
    }


def _f(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return round(v, 4) if math.isfinite(v) else None


def attach(a: Analysis, run: Any, analyze_epoch: Any, skip_steps: int = 1) -> None:
    """Add the membership epochs (each analyzed by ``analyze_epoch(sub_run, steps, skip)``) and
    the reset findings to ``a`` when the run has more than one epoch; else nothing changes."""
    from hvtrace.load import Run
    from hvtrace.selection import StepRange

    eps, resets, problems = epochs(run)
    a.problems.extend(problems)
    if len(eps) < 2:
        return
    step_ms: dict[int, float] = {}
    analyzed = 0
    for e in eps:
        ids = [m["worker"] for m in e["workers"] if m["worker"] in run.files]
        e["workers_with_file"] = ids
        start, stop = e["start_step"], e["stop_step"]
        if not ids or stop is None or stop <= start:
            e["analysis"] = {"error": "no steps recorded"}
            continue
        if analyzed >= MAX_ANALYZED_EPOCHS:
            e["analysis"] = {"error": f"not analyzed (only the first {MAX_ANALYZED_EPOCHS} are)"}
            continue
        analyzed += 1
        sub = Run(
            run.run_dir,
            run.run_id,
            len(ids),
            {w: run.files[w] for w in ids},
            None,
            [],
            frozenset(ids),
        )
        # the first step after a reset is a warm-up too (Horovod initialized again)
        skip = max(skip_steps, start + 1) if e["gen"] > 0 else skip_steps
        try:
            ea = analyze_epoch(sub, StepRange(start, stop), skip)
        except Exception as exc:  # noqa: BLE001 - one epoch's failure keeps the rest
            e["analysis"] = {"error": str(exc).splitlines()[0][:300]}
            continue
        e["analysis"] = epoch_summary(ea)
        if e["analysis"]["step_ms"] is not None:
            step_ms[e["gen"]] = e["analysis"]["step_ms"]
    a.membership = eps
    starts = [_int(f.header.get("wall_anchor_ns")) for f in run.files.values()]
    start = min((x for x in starts if x is not None), default=None)
    found = reset_findings(eps, resets, step_ms, start)
    left = {w for f in found for w in (f.data or {}).get("workers_left", [])}

    def expected(f: Finding) -> bool:
        """An ``incomplete`` finding about workers that left at a reset only (said there)."""
        stopped = (f.data or {}).get("stopped") if f.kind == "incomplete" else None
        return bool(stopped) and {s.get("rank") for s in stopped} <= left

    kept = [f for f in a.findings if not expected(f)]
    first = [f for f in kept if f.kind in ("hang", "divergence")]
    rest = [f for f in kept if f.kind not in ("hang", "divergence")]
    a.findings = first + found + rest
